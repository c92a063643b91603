"""Evaluation hooks of QeRLModule: pass@1 (greedy) and mean@n / maj@n / pass@k (sampled) per dataset.

Used by ``python train.py validate|test --config X`` and by periodic validation during ``fit``
(``trainer.val_check_interval``). Completions come from the RolloutCallback's engine: the colocated
vLLM when training rolls out in vLLM (the same instance; ``eval.engine: hf`` opts out), else the
embedded engine (the policy's own kernels, static cache + CUDA graphs on GPU), and are scored by
the training reward's ``MathAccuracy`` with its settings (``answer_tag``, ``boxed_only``, ...; the
accuracy alone, without format terms), maj@n voting on the answers it scores. AQN noise is off (the AQNCallback disables it
for validation and test). Per run and stage, a JSON with every completion and a markdown table of
the metrics are written to ``<log_dir>/eval/<stage>_step<global_step>.{json,md}``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn

from qerl.metrics import PassAtK, majority_vote
from qerl.norms import base_model_only
from qerl.rewards import MathAccuracy, accuracy_reward
from qerl.rollout import SamplingSettings
from qerl.rollout.base import check_temperature_top_p, derive_seed
from qerl.seeding import check_seed
from qerl.settings_checks import require_numbers


def claim_unused_path(stem: str, suffix: str = "", directory: bool = False) -> str:
    """``stem``, or ``stem-1``, ``stem-2``...: the first whose ``stem + suffix`` file (or, with
    ``directory``, folder) this call creates, empty, so two runs writing to one folder (no logger: the
    working directory) keep both results, even at the same moment (creation is exclusive)."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    n = 0
    while True:
        candidate = stem if n == 0 else f"{stem}-{n}"
        try:
            if directory:
                os.mkdir(candidate)
            else:
                open(candidate + suffix, "x").close()
            return candidate
        except FileExistsError:
            n += 1


@dataclass
class EvalSettings:
    """Evaluation (validate / test / periodic validation during fit). AQN noise is never applied.

    Args:
        samples: sampled completions per problem, n, for mean@n, maj@n (n >= 2) and pass@k (0 = greedy
            pass@1 only).
        pass_k: the k of the reported pass@k, 2 <= k <= samples (default: [samples]); unbiased
            estimator from n samples. ``pass@1`` is always the greedy accuracy.
        temperature: sampling temperature of those samples (the paper evaluates at 0.6).
        top_p: nucleus mass of those samples (paper: 0.95).
        max_new_tokens: completion cap for every evaluation completion.
        use_adapter: False evaluates the base model alone (the "before" row of a table).
        max_batch_size: sequences decoded together by the embedded engine.
        seed: seed of the sampled completions. Problem i of a dataset draws its samples from
            (seed, dataset, i), at any batch size or number of GPUs, in every evaluation of a run and
            in every run (paired samples when comparing checkpoints or arms; identical where the
            logits are, i.e. up to bf16 rounding that differs between batch shapes).
        engine: rollout (the RolloutCallback's engine: vLLM when training rolls out in vLLM, the
            embedded engine otherwise or without a RolloutCallback) or hf (always the embedded engine).
    """

    samples: int = 0
    pass_k: list[int] | None = None
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 1024
    use_adapter: bool = True
    max_batch_size: int = 64
    seed: int = 0
    engine: Literal["rollout", "hf"] = "rollout"

    def __post_init__(self) -> None:  # fails at start, not at the first validation
        require_numbers(self, "model.eval")
        if self.samples < 0 or self.max_new_tokens < 1 or self.max_batch_size < 1:
            raise ValueError("model.eval.samples must be >= 0, max_new_tokens and max_batch_size >= 1")
        check_temperature_top_p(self.temperature, self.top_p, "model.eval")  # (NaN fails: at start, not
        # at the first validation after the training steps before it)
        if self.temperature == 0 and self.samples > 0:  # n copies of the greedy completion, decoded n times
            raise ValueError(f"model.eval.temperature 0 makes each of the {self.samples} samples the greedy completion "
                             "(pass@1 already is it): set eval.samples 0, or a temperature > 0 (the paper's 0.6)")
        PassAtK(self.samples, self.pass_k)  # a bad pass_k: its own message
        check_seed(self.seed, "model.eval.seed")


def problem_seeds(seed: int, dataset: str, batch: dict) -> list[int]:
    """One sampling seed per problem of an evaluation batch, from (seed, dataset, the problem's index
    in its set), so a problem's samples do not depend on the batch or the rank that decodes it.
    A problem without an index (a custom data module) falls back to its prompt text."""
    indices = batch.get("indices") or [None] * len(batch["prompts"])
    return [derive_seed(seed, "eval", dataset, prompt if index is None else index)
            for index, prompt in zip(indices, batch["prompts"])]


def gather_records(records: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Under DDP each rank evaluated a shard: every rank's completion records, each problem once
    (the distributed sampler repeats a few to even out the shards), in dataset order. A collective:
    every rank calls it. Without a process group, ``records`` as they are."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return records
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, records)
    return merge_records(parts)


def merge_records(parts: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """Per dataset, the rows of all parts, a problem (by ``index``, else prompt + gold) once, by index."""
    merged = {}
    for name in parts[0]:
        rows, seen = [], set()
        for part in parts:
            for row in part[name]:
                key = row["index"] if row["index"] is not None else (row["prompt"], row["gold"])
                if key not in seen:
                    seen.add(key)
                    rows.append(row)
        merged[name] = sorted(rows, key=lambda r: -1 if r["index"] is None else r["index"])
    return merged


def metrics_from_records(rows: list[dict], samples: int, pass_k) -> dict[str, float]:
    """pass@1 (greedy), mean@n and pass@k of one dataset from its records, each problem counted once
    (under DDP the gathered, deduplicated rows: a metric summed over the ranks' shards would count the
    problems the distributed sampler repeats to even them out twice), plus ``problems``."""
    metric = PassAtK(samples, pass_k, sync_on_compute=False)  # the rows are already every rank's
    if rows:
        greedy = torch.tensor([float(r["correct"]) for r in rows])  # (P,)
        sampled = torch.tensor([r["sampled_correct"] for r in rows]).float() if samples > 0 else None  # (P, n)
        votes = None  # (P,) maj@n, from the rows that kept their samples' answers
        if samples > 1 and all(r.get("sampled_extracted") is not None for r in rows):
            votes = torch.tensor([majority_vote(r["sampled_correct"], r["sampled_extracted"]) for r in rows])
        metric.update(greedy, sampled, votes)
    values = {k: float(v) for k, v in metric.compute().items()}
    values["problems"] = len(rows)
    return values


def _column_order(metric: str) -> tuple:
    """pass@1 (greedy) first, then mean@n, maj@n, then pass@k by k (pass@2 before pass@16)."""
    name, _, k = metric.partition("@")
    rank = 0 if metric == "pass@1" else {"mean": 1, "maj": 2, "pass": 3}.get(name, 4)
    return (rank, int(k) if k.isdigit() else 0, metric)


def results_table(results: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: one per dataset, its problem count and metrics (in `_column_order`) as percentages;
    a metric a set does not have (an empty set has no sampled ones) shows as `-`."""
    keys = sorted({k for v in results.values() for k in v if k != "problems"}, key=_column_order)
    lines = [f"| dataset | problems | {' | '.join(keys)} |", "|---|---|" + "---|" * len(keys)]
    for name, values in results.items():
        cells = [f"{100 * values[k]:.1f}%" if k in values else "-" for k in keys]
        lines.append(f"| {name} | {values.get('problems', 0)} | " + " | ".join(cells) + " |")
    return lines


class EvaluationMixin:
    """validation_step / test_step for ``QeRLModule`` (expects ``model``, ``tokenizer``, ``eval_settings``)."""

    def _rollout_callback(self):
        """The trainer's RolloutCallback (found by its engine hook), or None."""
        return next((cb for cb in self.trainer.callbacks if hasattr(cb, "ensure_engine")), None)

    def _eval_engine(self):
        """The engine that evaluates, chosen and synced at the start of each evaluation: the
        RolloutCallback's vLLM engine when training rolls out in vLLM (one vLLM per process) unless
        ``eval.engine: hf``; else an embedded engine of its own batch size (CUDA graphs as the
        RolloutCallback sets them). Synced with the clean policy: AQN is off now, so the norm
        scales are the plain weights."""
        rollout_cb = self._rollout_callback()
        if self.eval_settings.engine == "rollout" and getattr(rollout_cb, "engine_name", "hf") == "vllm":
            engine = rollout_cb.ensure_engine(self.trainer, self)  # validate / test: made here
        else:
            if getattr(self, "_evaluation_engine", None) is None:
                from qerl.rollout.hf import HFEngine

                options = rollout_cb.hf_engine_options() if hasattr(rollout_cb, "hf_engine_options") else {}
                self._evaluation_engine = HFEngine.for_model(
                    self.model, self.tokenizer, self.eval_settings.max_batch_size, **options)
            engine = self._evaluation_engine
        use_adapter = self.eval_settings.use_adapter
        # adapter off: the base model, trained norms (trainable_norms) included, also for vLLM's copy
        with base_model_only(self.model) if not use_adapter else contextlib.nullcontext():
            scales = self.noisy_norms.effective_scales() if self.noisy_norms is not None else None
            engine.sync(self.model, scales, adapter=use_adapter)
        return engine

    def _dataset_names(self, stage: str) -> list[str]:
        dm = getattr(self.trainer, "datamodule", None)
        names = getattr(dm, "val_names" if stage == "val" else "test_names", None)
        return list(names) if names else ["default"]

    def _start_eval(self, stage: str) -> None:
        label = self._adapter_label()
        if label.startswith("untrained") and not getattr(self, "_said_untrained", False):
            self._said_untrained = True  # validate / test with neither --ckpt_path nor model.adapter_path
            rank_zero_warn(f"{stage}: no --ckpt_path or model.adapter_path, so this evaluates an {label}")
        self._evaluation_scorer = self._eval_scorer()
        self._evaluating_engine = self._eval_engine()  # synced once per evaluation
        self._engine_awake = contextlib.ExitStack()  # vLLM: no sleep between batches, once after
        self._engine_awake.enter_context(self._evaluating_engine.awake())
        self._eval_records = {name: [] for name in self._dataset_names(stage)}

    def _eval_scorer(self) -> MathAccuracy:
        """The training reward's ``MathAccuracy`` (so ``val/`` accuracy means what ``train/rewards/accuracy``
        means: an ``answer_tag`` recipe is not scored on boxes); a default one, warned once, when the
        reward has none or there is no RolloutCallback."""
        rollout_cb = self._rollout_callback()
        found = accuracy_reward(getattr(rollout_cb, "reward", None))
        if found is None:
            found = MathAccuracy()
            if rollout_cb is not None and not getattr(self, "_said_default_scorer", False):
                self._said_default_scorer = True
                rank_zero_warn(f"evaluation: the training reward ({type(rollout_cb.reward).__name__}) holds no "
                               "qerl.rewards.MathAccuracy; evaluation scores with MathAccuracy()'s defaults")
        return found

    def _eval_step(self, batch: dict, batch_idx: int, dataloader_idx: int, stage: str) -> None:
        s, tok = self.eval_settings, self.tokenizer
        name = list(self._eval_records)[dataloader_idx]
        engine, scorer = self._evaluating_engine, self._evaluation_scorer
        greedy = engine.generate(batch["prompt_ids"], 1, SamplingSettings(0.0, 1.0, 0, s.max_new_tokens), 0)
        sampled = None
        if s.samples > 0:
            sampling = SamplingSettings(s.temperature, s.top_p, 0, s.max_new_tokens)
            sampled = engine.generate(batch["prompt_ids"], s.samples, sampling, problem_seeds(s.seed, name, batch))
        answers = list(batch["answers"])
        greedy_text = tok.batch_decode(greedy.completion_ids, skip_special_tokens=True)
        greedy_ok = torch.tensor(scorer(greedy_text, answers))  # (P,)
        sampled_ok = sampled_answers = None
        if sampled is not None:
            texts = tok.batch_decode(sampled.completion_ids, skip_special_tokens=True)
            sampled_ok = torch.tensor(scorer(texts, [a for a in answers for _ in range(s.samples)])).view(-1, s.samples)
            sampled_answers = [scorer.scored_answer(t) for t in texts]  # (P * n,): maj@n's votes, what was scored
        for i, text in enumerate(greedy_text):
            self._eval_records[name].append({
                "index": batch["indices"][i] if "indices" in batch else None, "prompt": batch["prompts"][i],
                "gold": answers[i], "completion": text, "extracted": scorer.scored_answer(text),
                "correct": bool(greedy_ok[i]), "finish": greedy.finish_reasons[i],
                "sampled_correct": None if sampled_ok is None else sampled_ok[i].tolist(),
                "sampled_extracted": None if sampled_answers is None else sampled_answers[i * s.samples:(i + 1) * s.samples],
                "sampled_completions": None if sampled is None else texts[i * s.samples:(i + 1) * s.samples],
                "sampled_finish": None if sampled is None else sampled.finish_reasons[i * s.samples:(i + 1) * s.samples],
            })

    def _evaluated_step(self) -> int:
        """The optimizer step of the evaluated weights: the trainer's during fit; in validate / test
        with ``--ckpt_path`` the checkpoint's (Lightning restores no loop state there: global_step is 0)."""
        loaded = getattr(self, "checkpoint_step", None)
        if self.trainer.state.fn != "fit" and loaded is not None:
            return int(loaded)
        return self.trainer.global_step

    def _end_eval(self, stage: str) -> None:
        self._engine_awake.close()
        step = self._evaluated_step()
        self.log("step", float(step), on_step=False, on_epoch=True, batch_size=1)  # x-axis: optimizer steps
        self._eval_records = gather_records(self._eval_records)
        results = {}
        for name, rows in self._eval_records.items():
            values = metrics_from_records(rows, self.eval_settings.samples, self.eval_settings.pass_k)
            results[name] = values
            for key, value in values.items():
                if key != "problems":
                    self.log(f"{stage}/{name}/{key}", value, on_step=False, on_epoch=True, batch_size=1)
        if not self.trainer.sanity_checking:  # a few batches before fit: not a step-0 evaluation
            self._write_eval_report(stage, results, step)
        if getattr(self, "print_eval_table", False) and self.trainer.is_global_zero:
            # (validate / test: instead of Lightning's table, which lists every set under every dataloader)
            print(f"{stage} at step {step} ({self._adapter_label()}):\n" + "\n".join(results_table(results)))

    def _adapter_label(self) -> str:
        """Which LoRA weights ran, for the report's header (the step alone does not tell a fresh LoRA
        from a loaded adapter: both evaluate at step 0)."""
        if not self.eval_settings.use_adapter:
            return "no adapter (base model)"
        if self.trainer.state.fn == "fit":
            return "adapter being trained"
        if self.trainer.ckpt_path:
            return f"adapter from {self.trainer.ckpt_path}"
        if getattr(self, "adapter_path", None):
            return f"adapter from {self.adapter_path}"
        return "untrained adapter (LoRA B = 0: the base model's outputs)"

    def _write_eval_report(self, stage: str, results: dict, step: int) -> None:
        log_dir = getattr(self.trainer, "log_dir", None)
        if not log_dir or not self.trainer.is_global_zero:
            return
        stem = claim_unused_path(os.path.join(log_dir, "eval", f"{stage}_step{step}"), ".json")  # (.md beside it)
        s = self.eval_settings
        dm = getattr(self.trainer, "datamodule", None)
        left_out = {name: dm.rows_left_out(stage, name) for name in results} if hasattr(dm, "rows_left_out") else {}
        left_out = {name: n for name, n in left_out.items() if n}  # (a score over fewer problems than the file has)
        with open(stem + ".json", "w") as f:
            json.dump({"stage": stage, "global_step": step, "ckpt_path": self.trainer.ckpt_path, "model": self.model_name,
                       "quantization": self.quantization, "use_adapter": s.use_adapter,
                       "max_new_tokens": s.max_new_tokens, "samples": s.samples, "temperature": s.temperature,
                       "top_p": s.top_p, "seed": s.seed, "pass_k": s.pass_k,
                       "adapter_path": getattr(self, "adapter_path", None), "metrics": results,
                       "rows_left_out": left_out,
                       "completions": self._eval_records}, f, indent=1)
        lines = results_table(results) + [f"\n{name}: {n} rows of its source not evaluated (malformed, or prompts over "
                                           "data.max_eval_prompt_length; the log names them)" for name, n in left_out.items()]
        with open(stem + ".md", "w") as f:
            sampled = (f", mean@n, maj@n and pass@k from n = {s.samples} samples at T = {s.temperature}, top-p {s.top_p}, "
                       f"seed {s.seed}" if s.samples > 0 else " (no sampled completions: eval.samples 0)")
            f.write(f"{self.model_name} ({self.quantization}, {self._adapter_label()}), "
                    f"step {step}; pass@1 is greedy{sampled}\n\n" + "\n".join(lines) + "\n")

    # Lightning hooks
    def on_validation_epoch_start(self) -> None:
        self._start_eval("val")

    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, batch_idx, dataloader_idx, "val")

    def on_validation_epoch_end(self) -> None:
        self._end_eval("val")

    def on_test_epoch_start(self) -> None:
        self._start_eval("test")

    def test_step(self, batch, batch_idx, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, batch_idx, dataloader_idx, "test")

    def on_test_epoch_end(self) -> None:
        self._end_eval("test")
