"""RolloutCallback: before each training step, sync the policy into the engine, sample G completions
per prompt, score them, and attach a ``Rollout`` to the batch.

Order inside ``on_train_batch_start``: AQN sets σ for this step (if an ``AQNCallback`` is present,
whatever its position in the callback list) → ``engine.sync`` (LoRA + noisy norm scales) →
``engine.generate`` → decode → reward → optional DAPO overlong shaping → optional DAPO dynamic
sampling (drop groups whose rewards are all equal, refill with fresh prompts up to a cap) →
``batch["rollout"]``. Every ``log_completions_every_n_steps`` a markdown table of a few prompts,
completions, extracted answers and rewards goes to TensorBoard's Text tab (``completions``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import time
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from qerl.losses import groups_with_signal, overlong_penalty
from qerl.rewards import MathAccuracy, RewardFunction, accuracy_reward, extract_answer
from qerl.rollout import Rollout, RolloutEngine, SamplingSettings, pad_left, pad_right, stop_token_ids
from qerl.rollout.hf import HFEngine, check_adapter_dtype
from qerl.rollout.vllm import VLLMSettings  # settings only: vllm itself is imported when the engine starts
from qerl.rollout.vllm_conversions import check_vllm_temperature
from qerl.seeding import resolve_seed, warn_if_seed_changed


def generation_seed(seed: int, step: int, round_: int, rank: int = 0) -> int:
    """Seed of one ``generate`` call: step ``step``, refill round ``round_`` (< 16), DDP rank ``rank``.

    Each rank gets its own stream: with one seed for all, the ranks' samples would share their
    random draws (correlated across the global batch); rank 0 keeps the single-process seed."""
    return (seed * 1_000_003 + step) * 16 + round_ + (int(rank) << 40)


def min_over_ranks(trainer, value: int, device) -> int:
    """The smallest ``value`` over the data-parallel ranks (``value`` itself in one process)."""
    if getattr(trainer, "world_size", 1) <= 1:
        return value
    reduced = trainer.strategy.reduce(torch.tensor([value], device=device), reduce_op=torch.distributed.ReduceOp.MIN)
    return int(reduced.item())


def every_rank_items(trainer, items: list) -> list:
    """``items`` of every data-parallel rank, concatenated (``items`` itself in one process)."""
    if getattr(trainer, "world_size", 1) <= 1:
        return items
    parts: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def batch_reaches_multiple(step: int, steps_per_batch: int, every: int) -> bool:
    """Whether a rollout batch starting at optimizer step ``step`` and taking ``steps_per_batch`` steps
    (``updates_per_rollout``) covers a multiple of ``every``: per-N-steps events then fire once per N
    optimizer steps whatever K is (``step % every == 0`` alone skips multiples that fall between batches)."""
    return (-step) % every < steps_per_batch


class RolloutCallback(L.Callback):
    """Generates and scores the rollout of every training step.

    Args:
        reward: the reward function (a ``qerl.rewards`` class by ``class_path``; default math-verify accuracy).
        group_size: completions sampled per prompt (G >= 2: the advantages compare them).
        sampling: temperature, top-p, top-k, min-p, max_new_tokens.
        engine: hf (the training model itself, works on CPU) or vllm (colocated; GPU).
        max_batch_size: sequences decoded together by the hf engine.
        cuda_graphs: hf engine on CUDA: decode from a static KV cache with the one-token step
            replayed as a CUDA graph (13-19x faster at batch 1-8); false = one eager forward per token.
        hf_adapter_dtype: hf engine: ``model`` runs the LoRA adapters on copies in the model's
            dtype while generating (as vLLM does; much faster on a bf16 model), the arithmetic the
            trainer uses with ``model.lora.compute_dtype: model`` (the default); ``stored`` through
            the trainer's own forward as it is (with ``compute_dtype: stored``: peft's fp32). Either
            way the sampler's log-probs equal the trainer's up to kernel rounding, except for
            ``compute_dtype: stored`` with ``model`` here (see ``qerl.rollout.hf.HFEngine``).
        hf_fused_ops: hf engine on CUDA, while generating: RMSNorm, rotary embedding and SiLU-mul as
            one Triton kernel each (``qerl.fused_ops``), and q/k/v and gate/up as one linear
            each (``qerl.rollout.fast_linears``); false = transformers' eager ops and linears.
        dynamic_sampling: DAPO: drop groups whose rewards (before overlong shaping) are all equal and
            refill from fresh prompts.
        max_refill_rounds: at most this many extra generation rounds per step for dynamic sampling.
        overlong_buffer: DAPO soft overlong punishment over the last this-many tokens (0 = off).
        overlong_penalty: the penalty reached at max_new_tokens.
        log_completions_every_n_steps: write the completions table every this many optimizer steps (at
            the rollout batch whose updates include a multiple of it; 0 = never).
        num_completions_to_log: rows in that table.
        seed: base seed of the sampler (combined with the global step); null: the run's ``seed_everything``.
        vllm: settings of the vllm engine (GPU memory share, LoRA slot rank, sleep mode, export
            directory...; see ``qerl.rollout.vllm.VLLMSettings``); ignored by the hf engine.
    """

    def __init__(
        self,
        reward: RewardFunction | None = None,
        group_size: int = 8,
        sampling: SamplingSettings | None = None,
        engine: Literal["hf", "vllm"] = "hf",
        max_batch_size: int = 64,
        cuda_graphs: bool = True,
        hf_adapter_dtype: Literal["model", "stored"] = "model",
        hf_fused_ops: bool = True,
        dynamic_sampling: bool = False,
        max_refill_rounds: int = 2,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        log_completions_every_n_steps: int = 10,
        num_completions_to_log: int = 4,
        seed: int | None = None,
        vllm: VLLMSettings | None = None,
    ):
        if group_size < 2:  # one completion per prompt: every group-relative advantage is 0
            raise ValueError(f"RolloutCallback: group_size must be >= 2 (GRPO compares the completions of a prompt; "
                             f"with {group_size} every advantage is 0), got {group_size}")
        if max_batch_size < 1 or not 0 <= max_refill_rounds <= 15:
            raise ValueError(f"RolloutCallback: max_batch_size must be >= 1 and max_refill_rounds in 0..15, got "
                             f"{max_batch_size} and {max_refill_rounds}")
        if log_completions_every_n_steps < 0 or num_completions_to_log < 0:  # (-1 logged a header, or never)
            raise ValueError(f"RolloutCallback: log_completions_every_n_steps and num_completions_to_log must be >= 0 "
                             f"(0: no table), got {log_completions_every_n_steps} and {num_completions_to_log}")
        sampling = sampling or SamplingSettings()
        if sampling.temperature == 0:  # greedy: the G completions of a prompt are one, every advantage 0
            raise ValueError("RolloutCallback: sampling.temperature must be > 0 for training (0 is greedy: the "
                             "group's completions would all be the same); greedy evaluation is model.eval's")
        if not 0 <= overlong_buffer <= sampling.max_new_tokens:
            raise ValueError(f"RolloutCallback: overlong_buffer must be in [0, sampling.max_new_tokens="
                             f"{sampling.max_new_tokens}], got {overlong_buffer}")
        if not (overlong_penalty >= 0 and math.isfinite(overlong_penalty)):  # NaN skipped every update; < 0 pays length
            raise ValueError(f"RolloutCallback: overlong_penalty must be >= 0 and finite, got {overlong_penalty}")
        self.reward = reward or MathAccuracy()
        self.group_size = group_size
        self.sampling = sampling
        self.engine_name = engine
        self.max_batch_size = max_batch_size
        self.cuda_graphs = cuda_graphs
        check_adapter_dtype(hf_adapter_dtype, "RolloutCallback: hf_adapter_dtype")   # at config time
        self.hf_adapter_dtype = hf_adapter_dtype
        self.hf_fused_ops = hf_fused_ops
        self.dynamic_sampling = dynamic_sampling
        self.max_refill_rounds = max_refill_rounds
        self.overlong_buffer = overlong_buffer
        self.overlong_penalty = overlong_penalty
        self.log_every = log_completions_every_n_steps
        self.num_to_log = num_completions_to_log
        self.seed = resolve_seed(seed, "RolloutCallback.seed")
        self.vllm = vllm or VLLMSettings()
        self.engine: RolloutEngine | None = None  # never an nn.Module attribute: not moved, not checkpointed

    def hf_engine_options(self) -> dict:
        """``HFEngine.for_model``'s options as set here (evaluation's own embedded engine uses them too)."""
        return dict(cuda_graphs=self.cuda_graphs, adapter_dtype=self.hf_adapter_dtype,
                    fused_ops=self.hf_fused_ops, fused_projections=self.hf_fused_ops)

    def make_engine(self, pl_module) -> RolloutEngine:
        tok = pl_module.tokenizer
        if self.engine_name == "hf":
            return HFEngine.for_model(pl_module.model, tok, self.max_batch_size, **self.hf_engine_options())
        if self.engine_name == "vllm":
            from qerl.rollout.vllm import VLLMEngine

            return VLLMEngine(stop_token_ids(tok, pl_module.model), self.vllm, tokenizer=tok, seed=self.seed)
        raise ValueError(f"unknown rollout engine {self.engine_name!r}; use 'hf' or 'vllm'")

    def on_fit_start(self, trainer, pl_module) -> None:
        self.ensure_engine(trainer, pl_module)

    def ensure_engine(self, trainer, pl_module) -> RolloutEngine:
        """The engine, created on first use (fit start, or an evaluation that runs in it): never at
        import or ``--print_config``."""
        if self.engine_name == "vllm":
            self._check_vllm_setup(trainer, pl_module)
        if self.engine is None:
            self.engine = self.make_engine(pl_module)
        return self.engine

    def _check_vllm_setup(self, trainer, pl_module) -> None:
        """Fail at fit start, not at the first rollout (or evaluation) after minutes of loading, when
        vLLM is missing or the longest prompt + max_new_tokens cannot fit its context."""
        if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
            raise ModuleNotFoundError("rollout engine 'vllm' needs vLLM (CUDA): pip install -e '.[vllm]' "
                                      "(or use engine: hf)")
        evaluation = getattr(pl_module, "eval_settings", None)
        check_vllm_temperature(self.sampling.temperature, "RolloutCallback.sampling.temperature")
        if evaluation is not None and evaluation.engine == "rollout" and evaluation.samples > 0:
            check_vllm_temperature(evaluation.temperature, "model.eval.temperature")
        data, limit = trainer.datamodule, self.vllm.max_model_len
        if limit is None or data is None:
            return
        # (prompt length, what it is, new tokens, their setting): training prompts are capped by
        # data.max_prompt_length; evaluation ones are measured (the val sets are loaded by now)
        checks = [(getattr(data, "max_prompt_length", None), "data.max_prompt_length",
                   self.sampling.max_new_tokens, "sampling.max_new_tokens")]
        if evaluation is not None and evaluation.engine == "rollout" and hasattr(data, "longest_prompt"):
            checks.append((data.longest_prompt("eval"), "the longest val prompt",  # evaluation runs in this vLLM
                           evaluation.max_new_tokens, "model.eval.max_new_tokens"))
        for longest, what, count, name in checks:
            if longest and longest + count > limit:
                raise ValueError(f"{what} ({longest} tokens) + {name}={count} exceeds vllm.max_model_len={limit}: "
                                 "raise vllm.max_model_len, or lower the other two (data.max_eval_prompt_length "
                                 "caps evaluation prompts)")

    def rollout_settings(self) -> dict:
        """What shapes the completions a step learns from (saved with checkpoints, compared on resume)."""
        return {"reward": type(self.reward).__name__, "group_size": self.group_size,
                "sampling": dataclasses.asdict(self.sampling), "engine": self.engine_name,
                "dynamic_sampling": self.dynamic_sampling, "max_refill_rounds": self.max_refill_rounds,
                "overlong_buffer": self.overlong_buffer, "overlong_penalty": self.overlong_penalty}

    def state_dict(self) -> dict:
        return {"seed": self.seed, "settings": self.rollout_settings()}

    def load_state_dict(self, state_dict: dict) -> None:
        warn_if_seed_changed("RolloutCallback (the sampler)", state_dict.get("seed"), self.seed)
        saved, now = dict(state_dict.get("settings") or {}), self.rollout_settings()
        if isinstance(saved.get("sampling"), dict):  # a setting added since that checkpoint: at its default
            saved["sampling"] = {**dataclasses.asdict(SamplingSettings()), **saved["sampling"]}
        changed = {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}
        if changed:  # the config runs (as for the model's settings); the curves change meaning here
            rank_zero_warn(f"RolloutCallback: resumed with other rollout settings than the checkpoint's "
                           f"(checkpoint -> now): {changed}")

    # ------------------------------------------------------------------ the rollout
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for cb in trainer.callbacks:  # AQN decides this step's noise before anything is generated
            if hasattr(cb, "prepare_step"):
                cb.prepare_step(trainer, pl_module)
        step = trainer.global_step
        prompt_ids, prompts, answers = list(batch["prompt_ids"]), list(batch["prompts"]), list(batch["answers"])
        sources = list(batch.get("sources") or [""] * len(prompt_ids))  # (per-source reward curves)
        target_groups = len(prompt_ids)
        in_step = set(zip(sources, batch.get("indices") or []))  # (source, index): refills pass over these
        if self.dynamic_sampling and self.max_refill_rounds > 0:  # (on every rank alike: a collective)
            in_step = set(every_rank_items(trainer, sorted(in_step)))  # DDP: the step is every rank's batch
        t0 = time.perf_counter()
        norm_scales = pl_module.noisy_norms.effective_scales() if pl_module.noisy_norms is not None else None
        self.engine.sync(pl_module.model, norm_scales)
        timings = {"sync": time.perf_counter() - t0, "generate": 0.0, "reward": 0.0}
        for part, seconds in self.engine.last_sync.items():  # vllm: start / adapter / norms
            timings[f"sync/{part}"] = seconds

        with self.engine.awake():  # vLLM: one sleep after the refill rounds, not one per round (~6 s at 7B)
            kept, dropped = self._sample_groups(prompt_ids, prompts, answers, sources, pl_module, step, 0, timings)
            for round_ in range(1, self.max_refill_rounds + 1):
                if not self.dynamic_sampling or len(kept) >= target_groups:
                    break
                extra = self._draw_extra_prompts(trainer, target_groups, step * 100 + round_, in_step)
                if extra is None:
                    break
                more, more_dropped = self._sample_groups(*extra, pl_module, step, round_, timings)
                kept += more
                dropped += more_dropped
            t_sleep = time.perf_counter()
        if "generate/sleep" in timings:  # the engine slept on leaving the block: part of generating
            slept = time.perf_counter() - t_sleep
            timings["generate"] += slept
            timings["generate/sleep"] += slept
        # every generated group's task reward (before the filter, without the overlong shaping),
        # completion lengths and truncation flags
        generated = kept + dropped
        sampled_reward = float(torch.cat([g["task_rewards"] for g in generated]).mean())
        all_lengths = torch.tensor([len(c) for g in generated for c in g["completion_ids"]])
        all_truncated = torch.cat([g["truncated"] for g in generated])
        if self.dynamic_sampling:
            if not kept:  # no task signal anywhere: train on the original batch (advantages 0, or only
                # the overlong penalty's length signal when shaping is on)
                kept, dropped = dropped[:target_groups], dropped[target_groups:]
            kept, dropped = kept[:target_groups], dropped + kept[target_groups:]  # a refill's surplus too
            # DDP: every rank must train on as many groups (the same number of micro-batches, i.e.
            # of gradient all-reduces, else the ranks hang); a rank that kept more drops its surplus.
            n = min_over_ranks(trainer, len(kept), pl_module.device)
            kept, dropped = kept[:n], dropped + kept[n:]
        batch["rollout"] = self._to_rollout(kept, len(dropped) if self.dynamic_sampling else 0, pl_module, timings)
        batch["rollout"].sampled_reward = sampled_reward
        task_rewards = torch.cat([g["task_rewards"] for g in generated])  # (every generated group x G,)
        batch["rollout"].sampled_frac_zero_std = float(1.0 - groups_with_signal(task_rewards, self.group_size).float().mean())
        if self.dynamic_sampling:
            batch["rollout"].all_lengths, batch["rollout"].all_truncated = all_lengths, all_truncated
        steps_per_batch = getattr(getattr(pl_module, "loss_settings", None), "updates_per_rollout", 1)
        if self.log_every > 0 and self.num_to_log > 0 and batch_reaches_multiple(step, steps_per_batch, self.log_every):
            self._log_table(trainer, batch["rollout"], step)

    def _sample_groups(self, prompt_ids, prompts, answers, sources, pl_module, step, round_, timings):
        """Generate G completions per prompt and score them; returns (kept groups, dropped groups)."""
        G, tok = self.group_size, pl_module.tokenizer
        t0 = time.perf_counter()
        seed = generation_seed(self.seed, step, round_, pl_module.global_rank)
        gen = self.engine.generate(prompt_ids, G, self.sampling, seed=seed)
        timings["generate"] += time.perf_counter() - t0
        for part, seconds in gen.timings.items():  # vllm: wake / generate / sleep inside generate
            if part != "generate":
                timings[f"generate/{part}"] = timings.get(f"generate/{part}", 0.0) + seconds
        t0 = time.perf_counter()
        texts = tok.batch_decode(gen.completion_ids, skip_special_tokens=True)
        gold = [a for a in answers for _ in range(G)]
        rewards = torch.tensor(self.reward(texts, gold), dtype=torch.float32)  # (B*G,)
        components = {k: torch.tensor(v, dtype=torch.float32) for k, v in self.reward.last_components.items()}
        truncated = torch.tensor([r == "length" for r in gen.finish_reasons])
        task_rewards = rewards  # DAPO filters groups on these: length shaping alone is no learning signal
        if self.overlong_buffer > 0:
            lengths = torch.tensor([len(c) for c in gen.completion_ids])
            penalty = overlong_penalty(lengths, self.sampling.max_new_tokens, self.overlong_buffer, self.overlong_penalty)
            rewards = rewards + penalty
            components["overlong"] = penalty
        timings["reward"] += time.perf_counter() - t0
        signal = groups_with_signal(task_rewards, G) if self.dynamic_sampling else torch.ones(len(prompt_ids), dtype=torch.bool)
        kept, dropped = [], []
        for b in range(len(prompt_ids)):
            rows = slice(b * G, (b + 1) * G)
            group = dict(prompt_ids=prompt_ids[b], prompt=prompts[b], answer=answers[b], source=sources[b],
                         completion_ids=gen.completion_ids[rows], logprobs=gen.sampler_logprobs[rows],
                         texts=texts[rows], rewards=rewards[rows], task_rewards=task_rewards[rows], truncated=truncated[rows],
                         components={k: v[rows] for k, v in components.items()})
            (kept if bool(signal[b]) else dropped).append(group)
        return kept, dropped

    @staticmethod
    def _draw_extra_prompts(trainer, num_prompts: int, seed: int, in_step: set):
        """A refill's prompts, none of ``in_step`` while the data allows; adds theirs to it."""
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "draw_extra"):
            return None
        extra = dm.draw_extra(num_prompts, seed, exclude=in_step)
        sources = list(extra.get("sources") or [""] * len(extra["prompt_ids"]))  # (as the batch's)
        in_step.update(zip(sources, extra.get("indices") or []))
        return list(extra["prompt_ids"]), list(extra["prompts"]), list(extra["answers"]), sources

    def _to_rollout(self, groups, num_dropped, pl_module, timings) -> Rollout:
        G, tok = self.group_size, pl_module.tokenizer
        prompt_rows = [g["prompt_ids"] for g in groups for _ in range(G)]
        completions = [c for g in groups for c in g["completion_ids"]]
        prompt_ids, prompt_mask = pad_left(prompt_rows, tok.pad_token_id)
        completion_ids, completion_mask = pad_right(completions, tok.pad_token_id)
        sampler_logprobs, _ = pad_right([lp for g in groups for lp in g["logprobs"]], 0.0, dtype=torch.float32)
        names = groups[0]["components"].keys()
        return Rollout(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=completion_ids, completion_mask=completion_mask,
            sampler_logprobs=sampler_logprobs,
            rewards=torch.cat([g["rewards"] for g in groups]),
            reward_components={k: torch.cat([g["components"][k] for g in groups]) for k in names},
            truncated=torch.cat([g["truncated"] for g in groups]),
            group_size=G, temperature=self.sampling.temperature, max_new_tokens=self.sampling.max_new_tokens,
            prompts=[g["prompt"] for g in groups for _ in range(G)],
            completions=[t for g in groups for t in g["texts"]],
            answers=[g["answer"] for g in groups for _ in range(G)],
            sources=[g["source"] for g in groups for _ in range(G)],
            timings=timings, num_groups_dropped=num_dropped,
        )

    def _log_table(self, trainer, rollout: Rollout, step: int) -> None:
        if not trainer.is_global_zero:
            return
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if logger is None:
            return
        # the answer the accuracy reward compared with the gold, where there is one; else a best guess
        scorer = accuracy_reward(self.reward)
        extracted = scorer.scored_answer if scorer is not None else extract_answer
        rows = ["| prompt | completion | extracted | gold | reward |", "|---|---|---|---|---|"]
        for i in range(0, min(len(rollout.completions), self.num_to_log * self.group_size), self.group_size):
            rows.append(f"| {table_cell(rollout.prompts[i])} | {table_cell(rollout.completions[i])} | "
                        f"{table_cell(extracted(rollout.completions[i]) or '')} | {table_cell(rollout.answers[i])} | "
                        f"{float(rollout.rewards[i]):.3f} |")
        logger.experiment.add_text("completions", "\n".join(rows), global_step=step)


def table_cell(value, limit: int = 1000) -> str:
    """``value`` as one cell of a markdown table row in TensorBoard's text tab: backslashes escaped
    first (MATH's ``\\|x\\|`` left a ``\\|`` that ended the cell), then pipes, and every line break
    (also ``\\r``, which ended the row) as ``<br>``; cut at ``limit`` characters."""
    text = str(value)[:limit]
    text = text.replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", "<br>").replace("\r", "<br>").replace("\n", "<br>")
