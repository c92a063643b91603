"""Evaluation: pass@k estimator, the metric, `train.py validate`, and the three quantization arms."""

import itertools
import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_cli import fast_args, scalars  # noqa: E402

from lightning_modules.evaluation import problem_seeds  # noqa: E402
from qerl.metrics import PassAtK, pass_at_k  # noqa: E402
from qerl.rewards import MathAccuracy  # noqa: E402
from train import main  # noqa: E402


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_equals_brute_force_enumeration(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_metric_over_hand_made_completions():
    score = MathAccuracy()
    gold = ["0.5", "1000", "7"]
    greedy = [r"so \boxed{\frac{1}{2}}", r"\boxed{1,000}", r"\boxed{8}"]  # right, right, wrong
    sampled = [[r"\boxed{0.5}", r"\boxed{2}", r"\boxed{1/2}", r"\boxed{3}"],   # 2 of 4
               [r"\boxed{10}", r"\boxed{100}", r"\boxed{1}", r"\boxed{0}"],     # 0 of 4
               [r"\boxed{7}", r"\boxed{7}", r"\boxed{7}", r"\boxed{7}"]]       # 4 of 4
    metric = PassAtK(k=2)
    greedy_ok = torch.tensor(score(greedy, gold))
    sampled_ok = torch.tensor(score([t for row in sampled for t in row], [g for g in gold for _ in range(4)])).view(3, 4)
    metric.update(greedy_ok, sampled_ok)
    out = {k: float(v) for k, v in metric.compute().items()}
    assert out["pass@1"] == pytest.approx(2 / 3)
    assert out["mean@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    # pass@2 with n=4: c=2 -> 1 - C(2,2)/C(4,2) = 5/6; c=0 -> 0; c=4 -> 1
    assert out["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)


def test_pass_at_1_stays_greedy_and_pass_k_from_more_samples():
    greedy_ok = torch.tensor([1, 1, 0])
    one = PassAtK(k=1)  # one sample: sampled pass@1 would be mean@1, it must not replace greedy pass@1
    one.update(greedy_ok, torch.tensor([[0], [0], [1]]))
    out = {k: float(v) for k, v in one.compute().items()}
    assert out == {"pass@1": pytest.approx(2 / 3), "mean@1": pytest.approx(1 / 3)}
    many = PassAtK(k=4, pass_k=[2, 4])
    many.update(greedy_ok, torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]))
    out = {k: float(v) for k, v in many.compute().items()}
    # n = 4: c = 2 -> pass@2 = 5/6, pass@4 = 1; c = 0 -> 0; c = 3 -> pass@2 = 1 - 0 = 1, pass@4 = 1
    assert out["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3) and out["pass@4"] == pytest.approx(2 / 3)
    assert out["pass@1"] == pytest.approx(2 / 3) and out["mean@4"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    with pytest.raises(ValueError, match="2 <= k <= samples"):
        PassAtK(k=4, pass_k=[8])
    with pytest.raises(ValueError, match=r"samples \(0\); got k = \[4\]"):
        PassAtK(k=0, pass_k=[4])  # asked for pass@4 without samples: an error, not a missing row
    assert PassAtK(k=0, pass_k=[1]).pass_k == []  # pass@1 is the greedy one anyway
    for bad in ([0], [-2], [0, 2]):  # dropped without a word before
        with pytest.raises(ValueError, match=r"pass@k needs 2 <= k <= samples \(4\); got k = \[-?[02]"):
            PassAtK(k=4, pass_k=bad)


@pytest.mark.parametrize("correct, answers, expected", [
    ([1, 1, 0, 0, 0], ["0.5", "\\frac{1}{2}", "3", "3", "4"], 0.5),  # the right spellings are one vote: 2 vs 2 -> coin
    ([1, 1, 0, 0, 0], ["0.5", "1/2", "3", "4", "5"], 1.0),  # 2 vs 1 each
    ([1, 0, 0, 0], ["2", "3", " 3", "3 "], 0.0),  # blanks do not split a wrong answer
    ([1, 0, 0, 0], ["2", None, None, ""], 1.0),  # no answer is no vote
    ([1, 1, 0, 0, 0, 0], ["2", "2", "3", "3", "4", "4"], 1 / 3),  # a three-way tie
    ([0, 0], ["3", "4"], 0.0),
    ([1, 1], ["2", "2"], 1.0),
    ([1, 0, 0], ["5", "1,000", "$1000"], 0.0),  # one wrong value however written: 2 votes beat 1
    ([1, 0, 0], ["5", "0.5", "\\frac{1}{2}"], 0.0),
    ([1, 0, 0], ["5", "2, 100", "2100"], 1 / 3),  # a pair is not a number: a three-way tie
])
def test_majority_vote(correct, answers, expected):
    from qerl.metrics import majority_vote

    assert majority_vote(correct, answers) == pytest.approx(expected)


def test_maj_at_n_from_records_and_the_metric():
    """maj@n needs n >= 2 and every row's sampled answers (older reports without them: no maj@n)."""
    from lightning_modules.evaluation import metrics_from_records

    rows = [{"index": 0, "correct": True, "sampled_correct": [1, 0, 0], "sampled_extracted": ["7", "8", "8"]},
            {"index": 1, "correct": False, "sampled_correct": [1, 1, 0], "sampled_extracted": ["7", "7.0", "9"]}]
    assert metrics_from_records(rows, samples=3, pass_k=None)["maj@3"] == pytest.approx(0.5)
    assert "maj@3" not in metrics_from_records([{**r, "sampled_extracted": None} for r in rows], samples=3, pass_k=None)
    one = [{"index": 0, "correct": True, "sampled_correct": [1], "sampled_extracted": ["7"]}]
    assert "maj@1" not in metrics_from_records(one, samples=1, pass_k=None)


def test_results_table_shows_a_metric_a_set_lacks_as_a_dash():
    """A set whose rows have no sampled answers (or no rows) has no maj@n: its cell was a KeyError."""
    from lightning_modules.evaluation import metrics_from_records, results_table

    rows = [{"index": 0, "correct": True, "sampled_correct": [1, 0], "sampled_extracted": ["7", "8"]}]
    table = results_table({"a": metrics_from_records(rows, samples=2, pass_k=[2]),
                           "b": metrics_from_records([], samples=2, pass_k=[2])})
    assert table[0] == "| dataset | problems | pass@1 | mean@2 | maj@2 | pass@2 |"
    assert table[2] == "| a | 1 | 100.0% | 50.0% | 50.0% | 100.0% |"
    assert table[3].startswith("| b | 0 | ") and "| - |" in table[3]


def test_merge_records_of_ranks_keeps_each_problem_once_in_order():
    from lightning_modules.evaluation import merge_records

    row = lambda i, correct: {"index": i, "prompt": f"p{i}", "gold": "1", "correct": correct}  # noqa: E731
    # DistributedSampler over 5 problems, 2 ranks: rank 0 gets 0, 2, 4; rank 1 gets 1, 3 and 0 again (padding)
    parts = [{"gsm8k": [row(0, True), row(2, False), row(4, True)]},
             {"gsm8k": [row(1, False), row(3, True), row(0, True)]}]
    merged = merge_records(parts)["gsm8k"]
    assert [r["index"] for r in merged] == [0, 1, 2, 3, 4] and [r["correct"] for r in merged] == [True, False, False, True, True]


def test_metrics_count_each_problem_once_under_ddp_padding():
    """The logged metrics come from the merged records: the padded repeat of problem 0 (correct)
    would make pass@1 4/6 on the ranks' summed shards; it is 3/5, as the report's rows say."""
    from lightning_modules.evaluation import merge_records, metrics_from_records

    row = lambda i, ok, sampled: {"index": i, "prompt": f"p{i}", "gold": "1", "correct": ok,  # noqa: E731
                                  "sampled_correct": sampled}
    parts = [{"g": [row(0, True, [1, 1]), row(2, False, [0, 0]), row(4, True, [1, 0])]},
             {"g": [row(1, False, [0, 1]), row(3, True, [1, 1]), row(0, True, [1, 1])]}]
    out = metrics_from_records(merge_records(parts)["g"], samples=2, pass_k=[2])
    assert out["problems"] == 5 and out["pass@1"] == pytest.approx(3 / 5)
    assert out["mean@2"] == pytest.approx((1 + 0 + 0.5 + 0.5 + 1) / 5)
    assert out["pass@2"] == pytest.approx(4 / 5)
    greedy_only = metrics_from_records([row(7, False, None)], samples=0, pass_k=None)
    assert greedy_only == {"pass@1": 0.0, "problems": 1}
    # summed and divided in float64: the report's digits are the fractions', not float32 noise
    thirds = metrics_from_records([row(0, True, [1, 0, 0])], samples=3, pass_k=[2])
    assert thirds["mean@3"] == 1 / 3 and thirds["pass@2"] == 2 / 3


def test_validate_on_quickstart_logs_pass_at_1_and_writes_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli = main(["validate", *fast_args(tmp_path, 2)])
    # one row per set on stdout (Lightning's table listed every set's metrics under every dataloader)
    out = capsys.readouterr().out
    assert "| dataset | problems | pass@1 | mean@2 | maj@2 | pass@2 |" in out and "| arithmetic | 8 |" in out
    assert "Validate metric" not in out
    # the advice of Lightning's that does not apply here is silenced in validate too (DDP's sampler
    # warning: the gathered records count each problem once), as in fit
    for message in ("Using `DistributedSampler` with the dataloaders. During `trainer.validate()`, it is ...",
                    "The 'val_dataloader' does not have many workers which may be a bottleneck."):
        assert any(f[0] == "ignore" and f[1] is not None and f[1].match(message) for f in warnings.filters), message
    logged = cli.trainer.callback_metrics
    for key in ("val/arithmetic/pass@1", "val/arithmetic/mean@2", "val/arithmetic/maj@2", "val/arithmetic/pass@2"):
        assert key in logged and math.isfinite(float(logged[key]))
    assert cli.model.noisy_norms is None or not cli.model.noisy_norms.active
    report = json.loads(next(Path(cli.trainer.log_dir).glob("eval/val_step0.json")).read_text())
    assert report["metrics"]["arithmetic"]["problems"] == 8
    assert len(report["completions"]["arithmetic"]) == 8
    # every sampled completion is in the report with its finish reason, and the header has what drew them
    assert report["seed"] == 0 and report["pass_k"] is None and report["samples"] == 2
    for r in report["completions"]["arithmetic"]:
        assert len(r["sampled_completions"]) == len(r["sampled_finish"]) == len(r["sampled_correct"]) == 2
        assert all(isinstance(t, str) for t in r["sampled_completions"]) and set(r["sampled_finish"]) <= {"stop", "length"}
    md = (Path(cli.trainer.log_dir) / "eval" / "val_step0.md").read_text()
    assert md.count("| arithmetic | 8 |") == 1 and "untrained adapter" in md.splitlines()[0]
    assert md.splitlines()[0].endswith("from n = 2 samples at T = 0.6, top-p 0.95, seed 0")  # what drew them


def test_claim_unused_path_creates_what_it_returns(tmp_path):
    from lightning_modules.evaluation import claim_unused_path

    stem = str(tmp_path / "val_step0")
    assert [claim_unused_path(stem, ".json") for _ in range(3)] == [stem, stem + "-1", stem + "-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["val_step0-1.json", "val_step0-2.json", "val_step0.json"]
    adapter = str(tmp_path / "adapter")
    assert [claim_unused_path(adapter, directory=True) for _ in range(2)] == [adapter, adapter + "-1"]
    assert (tmp_path / "adapter-1").is_dir()


def test_runs_without_a_logger_keep_each_others_reports_and_adapters(tmp_path, monkeypatch):
    """No logger: log_dir is the working directory for every run; a second run adds ``-1`` names."""
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="evaluates an untrained adapter"):  # said on the console too
        main(["validate", *fast_args(tmp_path, 2), "--trainer.logger=false", "--model.eval.use_adapter=true"])
    main(["validate", *fast_args(tmp_path, 2), "--trainer.logger=false", "--model.eval.use_adapter=false"])
    first, second = (tmp_path / "eval" / "val_step0.md").read_text(), (tmp_path / "eval" / "val_step0-1.md").read_text()
    assert "untrained adapter" in first and "no adapter (base model)" in second
    assert json.loads((tmp_path / "eval" / "val_step0-1.json").read_text())["use_adapter"] is False
    for run in range(2):
        main(["fit", *fast_args(tmp_path / f"run{run}", 1), "--trainer.logger=false"])
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter-1" / "adapter_config.json").is_file()
    # config.yaml is the validate runs' own --config; each of the 4 runs saved its config beside it
    configs = sorted(p.name for p in tmp_path.glob("config*.yaml"))
    assert configs == ["config-1.yaml", "config-2.yaml", "config-3.yaml", "config-4.yaml", "config.yaml"]
    assert "run1" in (tmp_path / "config-4.yaml").read_text() and "run1" not in (tmp_path / "config-3.yaml").read_text()


def test_sampled_evaluation_is_the_same_at_any_batch_size(tmp_path, monkeypatch):
    """Problem i draws its samples from (eval.seed, dataset, i): another evaluation batch size (or
    number of GPUs) samples the same completions; another eval.seed draws others."""
    from qerl.rollout.hf import HFEngine

    monkeypatch.chdir(tmp_path)
    original, sampled = HFEngine.generate, []

    def generate(self, prompt_ids, n, sampling, seed):
        out = original(self, prompt_ids, n, sampling, seed)
        if sampling.temperature > 0:  # evaluation's sampled call: per prompt, its n completions
            sampled.extend((tuple(p), tuple(map(tuple, out.completion_ids[i * n: (i + 1) * n])))
                           for i, p in enumerate(prompt_ids))
        return out

    monkeypatch.setattr(HFEngine, "generate", generate)

    def samples(name, *extra):
        sampled.clear()
        main(["validate", *fast_args(tmp_path / name, 2, extra=("--model.eval.max_new_tokens", "6", *extra))])
        return dict(sampled)

    by_8 = samples("a")
    assert len(by_8) == 8 and any(len(set(c)) > 1 for c in by_8.values())  # 8 problems, distinct samples
    assert samples("b", "--data.val_prompts_per_batch", "3") == by_8
    assert samples("c", "--model.eval.seed", "1") != by_8
    assert problem_seeds(0, "gsm8k", {"indices": [5], "prompts": ["p"]}) != problem_seeds(0, "math500", {"indices": [5], "prompts": ["p"]})
    # a custom data module without indices (each None, or none at all): each problem its own seed, from its text
    no_index = problem_seeds(0, "set", {"indices": [None, None], "prompts": ["a", "b"]})
    assert no_index[0] != no_index[1] and no_index == problem_seeds(0, "set", {"prompts": ["a", "b"]})


def _record_eval_generations(monkeypatch) -> list[dict]:
    """Wrap the embedded engine's decode of a chunk: per call, was AQN noise active and was LoRA on?"""
    from peft.tuners.lora import LoraLayer

    from qerl.rollout.hf import HFEngine

    seen, original = [], HFEngine._generate_chunk

    def generate_chunk(self, prompts, sampling, row_keys, static=None):
        model = self.model
        lora = [m for m in model.modules() if isinstance(m, LoraLayer)]
        norms = [m for m in model.modules() if hasattr(m, "aqn_active")]
        seen.append({"noise": any(m.aqn_active for m in norms), "noisy_norms": len(norms),
                     "sigma": max((float(m.aqn_noise.abs().max()) for m in norms), default=0.0),
                     "lora_on": bool(lora) and not any(m.disable_adapters for m in lora)})
        return original(self, prompts, sampling, row_keys, static)

    monkeypatch.setattr(HFEngine, "_generate_chunk", generate_chunk)
    return seen


def test_periodic_validation_during_fit_reaches_tensorboard_without_noise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = _record_eval_generations(monkeypatch)
    cli = main(["fit", *fast_args(tmp_path, 4), "--trainer.val_check_interval=2", "--model.loss.updates_per_rollout=2",
                "--trainer.num_sanity_val_steps=1"])  # Lightning's sanity check first: not a report
    values, acc = scalars(f"{tmp_path}/logs")
    # x-axis = optimizer steps: 2 rollout batches of 2 updates each, validation after the second
    steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in ("train/reward", "aqn/sigma", "val/arithmetic/pass@1")}
    assert steps == {"train/reward": [0, 2], "aqn/sigma": [0, 2], "val/arithmetic/pass@1": [4]}
    assert sorted(p.name for p in (Path(cli.trainer.log_dir) / "eval").iterdir()) == ["val_step4.json", "val_step4.md"]
    assert values["train/lr"][0] == pytest.approx(1e-3)  # the LR the first update used (peak, no warmup)
    evals = [g for g in seen if not g["noise"]]
    train_rollouts = [g for g in seen if g["noise"]]
    assert train_rollouts, "AQN should be on for the training rollouts of steps >= 1"
    # validation ran after step 2 with noise of the last draw in place, but never active
    assert len(evals) >= 2 and all(g["noisy_norms"] > 0 and g["sigma"] > 0 for g in evals[-2:])
    assert cli.model.noisy_norms.sigma > 0


def test_test_stage_and_base_model_evaluation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = _record_eval_generations(monkeypatch)
    cli = main(["test", *fast_args(tmp_path / "a", 2), "--model.eval.use_adapter=false"])
    assert math.isfinite(float(cli.trainer.callback_metrics["test/arithmetic/pass@1"]))
    assert seen and not any(g["lora_on"] for g in seen)  # the "before" row: adapter off
    report = Path(cli.trainer.log_dir) / "eval" / "test_step0.md"
    assert "no adapter (base model)" in report.read_text()
    seen.clear()
    main(["test", *fast_args(tmp_path / "b", 2)])
    assert seen and all(g["lora_on"] for g in seen)
    with pytest.raises(ValueError, match="needs evaluation sets: set data.test_sources"):
        main(["test", *fast_args(tmp_path / "c", 2), "--data.test_sources=null"])


@pytest.mark.parametrize("quantization", ["nf4", "nvfp4", "bf16"])
def test_each_quantization_arm_trains_two_steps(quantization, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes") if quantization == "nf4" else None
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", *fast_args(tmp_path, 2), f"--model.quantization={quantization}", "--model.dtype=bf16"])
    values, _ = scalars(f"{tmp_path}/logs")
    assert len(values["train/loss"]) == 2 and all(math.isfinite(v) for v in values["train/loss"])
    trainable = {n: p for n, p in cli.model.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # peft starts every lora_B at zero: an arm whose updates never reached the adapter stays there
    assert any(p.detach().abs().max() > 0 for n, p in trainable.items() if "lora_B" in n), quantization


def test_validate_with_adapter_path_loads_the_trained_adapter_and_norms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trained = main(["fit", *fast_args(tmp_path / "fit", 2), "--model.lora.trainable_norms=true"])
    adapter = Path(trained.trainer.log_dir) / "adapter"
    assert (adapter / "trainable_norms.safetensors").exists()
    evaluated = main(["validate", *fast_args(tmp_path / "val", 2), "--model.lora.trainable_norms=true",
                      f"--model.adapter_path={adapter}"])
    want = dict(trained.model.model.named_parameters())
    got = dict(evaluated.model.model.named_parameters())
    checked = [n for n, p in want.items() if p.requires_grad]
    assert any("layernorm" in n for n in checked) and any("lora_B" in n for n in checked)
    for name in checked:
        assert torch.equal(got[name], want[name]), name
    # the adapter records its base (qerl_base.json): another seed of the tiny model is refused before
    # anything loads, another quantization arm or dtype is a warning
    with pytest.raises(ValueError, match="was trained on tiny-qwen2 of seed 0, this run builds seed 5"):
        main(["validate", *fast_args(tmp_path / "val2", 2), "--model.lora.trainable_norms=true",
              f"--model.adapter_path={adapter}", "--model.seed=5"])
    with pytest.warns(UserWarning, match=r"was trained on another base \(quantization nvfp4 \(this run: bf16\)\)"):
        main(["validate", *fast_args(tmp_path / "val3", 2), "--model.lora.trainable_norms=true",
              f"--model.adapter_path={adapter}", "--model.quantization=bf16"])
    # ... but not on a --from-trained-base export of its own base (the NVFP4 weights, dequantized)
    from qerl.export_cli import main as export_main

    dtype = yaml.safe_load(Path(fast_args(tmp_path / "val3", 2)[1]).read_text())["model"]["dtype"]
    dense = export_main(["--model", "tiny-qwen2", "--format", "bf16", "--from-trained-base", "--dtype", dtype,
                         "--adapter", str(adapter), "--out", str(tmp_path / "dense")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["validate", *fast_args(tmp_path / "val5", 2), "--model.lora.trainable_norms=true",
              f"--model.model={dense}", "--model.quantization=bf16", f"--model.adapter_path={dense / 'adapter'}"])
    assert not [w for w in caught if "another base" in str(w.message)]
    # a plain peft adapter (no qerl_base.json): peft's base_model_name_or_path is what it says of its base
    import shutil

    plain = Path(shutil.copytree(adapter, tmp_path / "plain_adapter"))
    (plain / "qerl_base.json").unlink()
    with pytest.warns(UserWarning, match=r"was trained on tiny-qwen2 \(its adapter_config.json; no qerl_base.json\), "
                                         r"this run's model is tiny-llama"):
        main(["validate", *fast_args(tmp_path / "val6", 2), "--model.lora.trainable_norms=true",
              f"--model.adapter_path={plain}", "--model.model=tiny-llama"])
    # the usual mix-ups -- the run folder, a Lightning checkpoint -- are named before the model loads
    import lightning_modules.qerl_module as qerl_module

    monkeypatch.setattr(qerl_module, "load_policy", lambda *a, **k: pytest.fail("loaded before checking the path"))
    (tmp_path / "last.ckpt").write_bytes(b"")
    for path, hint in ((adapter.parent, r"did you mean .*adapter\?"), (tmp_path / "last.ckpt", "--ckpt_path"),
                       (tmp_path / "nowhere", "no such directory")):
        with pytest.raises(ValueError, match=f"no adapter_config.json there .*{hint}"):
            main(["validate", *fast_args(tmp_path / "val4", 2), f"--model.adapter_path={path}"])


def test_report_columns_in_reading_order():
    """The markdown table: pass@1 (greedy) first, then mean@n, then pass@k by k, not as text."""
    from lightning_modules.evaluation import _column_order

    assert sorted(["pass@16", "mean@16", "pass@2", "maj@16", "pass@1", "pass@4"], key=_column_order) == [
        "pass@1", "mean@16", "maj@16", "pass@2", "pass@4", "pass@16"]


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(top_p=float("nan")), dict(temperature=1e-40)],
                         ids=["temperature-nan", "temperature-inf", "top_p-nan", "temperature-tiny"])
def test_non_finite_eval_settings_fail_at_construction(bad):
    """`temperature < 0` is false for NaN: it failed only at the first validation, after training steps."""
    from lightning_modules.evaluation import EvalSettings

    with pytest.raises(ValueError, match=f"model.eval.{next(iter(bad))} must be"):
        EvalSettings(**bad)


def test_greedy_samples_are_refused():
    """temperature 0 with samples > 0 decoded n copies of the greedy completion (mean@n = pass@k = pass@1)."""
    from lightning_modules.evaluation import EvalSettings

    with pytest.raises(ValueError, match="temperature 0 makes each of the 4 samples the greedy completion"):
        EvalSettings(samples=4, temperature=0.0)
    assert EvalSettings(samples=0, temperature=0.0).samples == 0


def test_majority_vote_counts_one_wrong_value_however_written():
    from qerl.metrics import majority_vote

    # gold 8: the wrong -5 (three spellings) outvotes the two right samples
    assert majority_vote([1, 1, 0, 0, 0], ["8", "8", "-5", "- 5", "\u22125"]) == 0.0
    # gold 1: (2,100) and 2100 are two wrong answers of 2 and 1 votes: a tie with the right one
    assert majority_vote([1, 1, 0, 0, 0], ["1", "1", "(2,100)", "2100", "(2,100)"]) == 0.5
    # gold 2\\pi: "2 pi" and 2 are two wrong answers, no tie with the right one
    assert majority_vote([1, 1, 0, 0], ["2\\pi", "2\\pi", "2 pi", "2"]) == 1.0


def test_evaluation_scores_with_the_training_rewards_accuracy():
    """The val/ accuracy means what train/rewards/accuracy means: the configured MathAccuracy
    (an answer_tag recipe scores <answer> spans, not boxes), found inside a WeightedSum; without
    one, the default, warned once."""
    from types import SimpleNamespace

    from callbacks import RolloutCallback
    from lightning_modules.evaluation import EvaluationMixin
    from qerl.rewards import FormatReward, MathAccuracy, TagFormatReward, WeightedSum

    tagged = MathAccuracy(answer_tag=True)
    probe = EvaluationMixin()
    probe.trainer = SimpleNamespace(callbacks=[RolloutCallback(reward=WeightedSum([TagFormatReward(), tagged], [0.2, 2.0]))])
    scorer = probe._eval_scorer()
    assert scorer is tagged
    texts = ["<think>2+4=6</think> <answer>6</answer>", "<think>so the result is \\boxed{6}</think>"]
    assert scorer(texts, ["6", "6"]) == [1.0, 0.0]
    assert scorer.scored_answer(texts[1]) is None  # (the vote of a sample follows its score: none here)

    probe.trainer = SimpleNamespace(callbacks=[RolloutCallback(reward=FormatReward())])
    with pytest.warns(UserWarning, match="holds no qerl.rewards.MathAccuracy"):
        default = probe._eval_scorer()
    assert isinstance(default, MathAccuracy) and not default.answer_tag
    probe.trainer = SimpleNamespace(callbacks=[])  # no RolloutCallback (validate of a bare config): the default
    assert isinstance(probe._eval_scorer(), MathAccuracy)


def test_vote_key_merges_spellings_of_one_number_only():
    from qerl.metrics import vote_key

    for spellings in (["1,000", "$1000", "1000.0", "1\\,000", "\\(1000\\)"],
                      ["0.5", ".5", "\\frac{1}{2}", "\\dfrac12", "1/2", "\\left(\\frac{1}{2}\\right)"],
                      ["-\\frac{1}{2}", "\\frac{-1}{2}", "-1/2", "-0.5"]):
        assert len({vote_key(a) for a in spellings}) == 1, spellings
    assert len({vote_key(a) for a in ["2, 100", "2100", "(1,2)", "x+1", "10\\%", "1/0"]}) == 6
    assert vote_key(None) == vote_key("") == vote_key("  ") == ""
    assert vote_key(" x + 1 ") == "x+1"
    # as the grader scores them: a Unicode minus, a percent sign and unit words change no value...
    for spellings in (["-5", "- 5", "\u22125", "-5.0"], ["5", "5\\%", "5%", "\\text{5 apples}", "5 apples."]):
        assert len({vote_key(a) for a in spellings}) == 1, spellings
    # ...while a tuple or interval is no number: (2,100) is not 2100, [1, 2] not 12; 2x is not 2
    assert len({vote_key(a) for a in ["(2,100)", "2100", "[1, 2]", "12", "2x", "2"]}) == 6
    # unit words only where the grader reads them as units: 3 million is not 3, 2 pi not 2
    assert len({vote_key(a) for a in ["3 million", "3", "2 pi", "2", "5 squared", "5"]}) == 6
    long = "\\frac" + "1" * 20_000 + "x"  # adversarial: returned as text at once, no backtracking
    assert vote_key(long) == long


def test_evaluations_embedded_engine_takes_the_rollout_callbacks_engine_options(tmp_path, monkeypatch):
    """validate builds its own embedded engine (eval.max_batch_size) with the RolloutCallback's
    cuda_graphs / hf_adapter_dtype / hf_fused_ops, not HFEngine's defaults."""
    from qerl.rollout.hf import HFEngine

    monkeypatch.chdir(tmp_path)
    args = fast_args(tmp_path, 2, extra=("--model.eval.max_batch_size", "3"))
    cfg = yaml.safe_load(Path(args[1]).read_text())
    rollout = next(cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("RolloutCallback"))
    rollout["init_args"].update(cuda_graphs=False, hf_adapter_dtype="stored", hf_fused_ops=False, max_batch_size=7)
    Path(args[1]).write_text(yaml.safe_dump(cfg))
    made, original = [], HFEngine.for_model.__func__

    def for_model(cls, model, tokenizer, max_batch_size=64, **options):
        made.append((max_batch_size, options))
        return original(cls, model, tokenizer, max_batch_size, **options)

    monkeypatch.setattr(HFEngine, "for_model", classmethod(for_model))
    main(["validate", *args])
    assert made == [(3, dict(cuda_graphs=False, adapter_dtype="stored", fused_ops=False, fused_projections=False))]


def test_a_wrong_latex_answer_is_one_vote_however_written():
    """maj@n: the right samples are one vote (the grader matched each); a wrong LaTeX answer written
    three ways must be one vote too, or a split wrong majority lets the right minority win."""
    from qerl.metrics import majority_vote, vote_key

    for spellings in (["\\dfrac{\\pi}{2}", "\\frac{\\pi}{2}", "\\frac\\pi2", "\\tfrac{\\pi}2"],
                      ["\\sqrt2", "\\sqrt{2}", "\\sqrt 2"], ["\\left(3,4\\right)", "(3, 4)"],
                      ["\\frac{\\sqrt3}2", "\\frac{\\sqrt{3}}{2}"]):
        assert len({vote_key(a) for a in spellings}) == 1, spellings
    wrong = ["\\dfrac{\\pi}{2}", "\\frac{\\pi}{2}", "\\frac\\pi2"]
    assert majority_vote([1, 1, 0, 0, 0], ["\\frac{\\pi}{3}"] * 2 + wrong) == 0.0
    # an argument without braces is one character, as LaTeX reads it: \frac123 is 1/2 then 3, not 12/3
    assert vote_key("\\frac123") != vote_key("4") and vote_key("\\frac{12}{3}") == vote_key("4")
    assert vote_key("\\frac12") == vote_key("0.5") and vote_key("\\frac{12}5") == vote_key("2.4")


def test_the_report_says_how_many_rows_of_a_set_were_not_evaluated(tmp_path, monkeypatch):
    """A malformed row is skipped (logged with its line) and the score is over the rest: the report
    says so beside it, so that 3 problems of a 5-row file is not read as the whole file."""
    monkeypatch.chdir(tmp_path)
    rows = [json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) for i in range(3)]
    (tmp_path / "set.jsonl").write_text("\n".join([rows[0], "{not json", rows[1], '{"question": "q"}', rows[2]]) + "\n")
    cli = main(["validate", *fast_args(tmp_path, 2, extra=("--data.val_sources", json.dumps({"mine": "set.jsonl"})))])
    report = json.loads(next(Path(cli.trainer.log_dir).glob("eval/val_step0.json")).read_text())
    assert report["metrics"]["mine"]["problems"] == 3 and report["rows_left_out"] == {"mine": 2}
    md = next(Path(cli.trainer.log_dir).glob("eval/val_step0.md")).read_text()
    assert "mine: 2 rows of its source not evaluated" in md
    clean = main(["validate", *fast_args(tmp_path / "quick", 2)])  # nothing left out: nothing said
    assert json.loads(next(Path(clean.trainer.log_dir).glob("eval/val_step0.json")).read_text())["rows_left_out"] == {}
