"""The user's job end to end: `train.py fit --config configs/quickstart.yaml`, TensorBoard, resume."""

import glob
import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from qerl.nvfp4 import NVFP4WeightTensor
from qerl.rewards import RewardFunction
from train import main

QUICKSTART = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")
REQUIRED_SCALARS = [
    "train/reward", "train/reward_sampled", "train/reward_std", "train/frac_reward_zero_std", "train/entropy", "train/kl",
    "train/loss", "train/clip_ratio/low", "train/clip_ratio/high", "train/is_ratio/mean",
    "train/completion_length/mean", "train/completion_length/max", "train/clipped_ratio",
    "train/grad_norm", "train/lr", "train/rewards/accuracy", "train/rewards/format",
    "aqn/sigma", "aqn/stage", "aqn/fraction_changed", "time/generate", "time/train",
]


def fast_args(tmp_path, steps, extra=(), schedule="cosine"):
    """The quickstart YAML, shortened (fewer prompts and tokens), with output under tmp_path. With
    ``schedule="constant"`` neither the LR nor the AQN noise depends on ``max_steps`` (the AQN stages
    are laid out over 20 steps), so "2 steps + resume to 4" and "4 steps" run the same schedule."""
    cfg = yaml.safe_load(Path(QUICKSTART).read_text())
    cfg["trainer"].update(max_steps=steps, enable_progress_bar=False)
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = f"{tmp_path}/logs"
    for cb in cfg["trainer"]["callbacks"]:
        args = cb.setdefault("init_args", {})
        if cb["class_path"].endswith("ModelCheckpoint"):
            args.update(dirpath=f"{tmp_path}/ckpt", every_n_train_steps=1)
        if cb["class_path"].endswith("AQNCallback") and schedule == "constant":
            args["controller"].setdefault("init_args", {})["max_steps"] = 20
        if cb["class_path"].endswith("RolloutCallback"):
            args["sampling"]["max_new_tokens"] = 12
            args.update(overlong_buffer=12, log_completions_every_n_steps=1)
    cfg["data"]["prompts_per_step"] = 2
    cfg["model"]["optimizer"]["schedule"] = schedule
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    path = Path(tmp_path) / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path), *extra]


def scalars(log_dir):
    files = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    assert files, f"no event file under {log_dir}"
    acc = EventAccumulator(files[0])
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def test_quickstart_cli_logs_every_scalar_and_trains_only_lora(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(fast_args(tmp_path, 3), run=False)
    cli.model.configure_model()
    before = {n: (p.qdata.clone() if isinstance(p, NVFP4WeightTensor) else p.detach().clone())
              for n, p in cli.model.model.named_parameters()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    values, acc = scalars(f"{tmp_path}/logs")
    for name in REQUIRED_SCALARS:
        assert name in values, f"missing scalar {name}"
        assert all(math.isfinite(v) for v in values[name]), (name, values[name])
    assert len(values["train/reward"]) == 3
    assert "completions/text_summary" in acc.Tags()["tensors"]  # the completions table
    # the quickstart's exponential schedule: stage 0 noise-free, then sigma_start, decaying
    assert values["aqn/sigma"][0] == 0.0 and values["aqn/sigma"][1] == pytest.approx(1e-2)
    assert values["aqn/sigma"][2] < values["aqn/sigma"][1]
    # the AQN state monitor saw every step's entropy and reward (the closed-loop controllers' input)
    aqn = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "AQNCallback")
    assert aqn.monitor.entropies == pytest.approx(values["train/entropy"], rel=1e-6)
    assert len(aqn.monitor.rewards) == 3

    changed_lora = 0
    for n, p in cli.model.model.named_parameters():
        now = p.qdata if isinstance(p, NVFP4WeightTensor) else p.detach()
        if "lora_" in n:
            changed_lora += int(not torch.equal(now, before[n]))
        else:
            assert torch.equal(now, before[n]), f"frozen weight changed: {n}"
    assert changed_lora > 0
    assert (Path(cli.trainer.log_dir) / "adapter" / "adapter_config.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [[], ["--model.lora.trainable_norms=true"]], ids=["lora", "lora+norms"])
def test_gpu_quickstart_cli(tmp_path, monkeypatch, extra):
    """The quickstart on one GPU in bf16: NVFP4 kernels, the hf engine's CUDA graphs, packed GQA
    attention and fused ops while generating, AQN noise on: every scalar finite, LoRA trained
    (and with trainable norms: their fp32 master weights through the fused norm, bf16 activations)."""
    monkeypatch.chdir(tmp_path)
    # Lightning's sanity validation first: the engine's first generation (its fused q/k/v, gate/up
    # buffers, static cache and graphs) is an evaluation's, and training must still run after it
    cli = main(["fit", *fast_args(tmp_path, 3, ["--trainer.accelerator=gpu", "--trainer.devices=1",
                                                 "--model.dtype=bf16", "--trainer.num_sanity_val_steps=1", *extra])])
    values, _ = scalars(f"{tmp_path}/logs")
    for name in REQUIRED_SCALARS:
        assert name in values and all(math.isfinite(v) for v in values[name]), (name, values.get(name))
    assert max(values["aqn/sigma"]) > 0 and len(values["train/reward"]) == 3
    lora_b = [p for n, p in cli.model.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)
    norms = [p for n, p in cli.model.model.named_parameters() if p.requires_grad and "layernorm" in n]
    assert bool(norms) == bool(extra) and all(p.dtype == torch.float32 for p in norms)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpoint_holds_only_trainable_params_and_resume_matches_straight_run(dropout, tmp_path, monkeypatch):
    """With LoRA dropout the global generator matters too: the checkpoint carries it."""
    monkeypatch.chdir(tmp_path)
    # A constant LR and AQN stages over a fixed 20 steps: the cosine schedule and the stages span
    # max_steps, which differs between a 2-step and a 4-step run by design.
    extra = [f"--model.lora.dropout={dropout}"]
    straight = main(["fit", *fast_args(tmp_path / "a", 4, extra, schedule="constant")])
    final_straight = {n: p.detach().clone() for n, p in straight.model.model.named_parameters() if p.requires_grad}

    main(["fit", *fast_args(tmp_path / "b", 2, extra, schedule="constant")])
    ckpt = torch.load(tmp_path / "b" / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["state_dict"] and all("lora_" in k for k in ckpt["state_dict"])
    assert ckpt["global_step"] == 2
    resumed = main(["fit", *fast_args(tmp_path / "b", 4, [*extra, "--ckpt_path", "last"], schedule="constant")])
    assert resumed.trainer.global_step == 4
    for n, p in resumed.model.model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p, final_straight[n], atol=1e-6), (n, (p - final_straight[n]).abs().max())


def test_trainable_norms_resume_from_a_one_group_checkpoint_matches_straight_run(tmp_path, monkeypatch):
    """Checkpoints written before the norm scales got their own undecayed AdamW group hold one
    param group: resuming one (made here by merging a new checkpoint's groups back) still equals
    the straight run, every tensor with its own moments."""
    monkeypatch.chdir(tmp_path)
    extra = ["--model.lora.trainable_norms=true"]
    straight = main(["fit", *fast_args(tmp_path / "a", 4, extra, schedule="constant")])
    main(["fit", *fast_args(tmp_path / "b", 2, extra, schedule="constant")])
    path = tmp_path / "b" / "ckpt" / "last.ckpt"
    ckpt = torch.load(path, weights_only=False)
    state = ckpt["optimizer_states"][0]
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.1, 0.0]  # LoRA decays, norms do not
    flags = [v.dim() >= 2 for v in ckpt["state_dict"].values()]  # the trainable tensors, in model order
    order = [i for i, d in enumerate(flags) if d] + [i for i, d in enumerate(flags) if not d]
    group = {k: v for k, v in state["param_groups"][0].items() if k != "decay"}
    ckpt["optimizer_states"] = [{"state": {i: state["state"][order.index(i)] for i in range(len(flags))},
                                 "param_groups": [{**group, "params": list(range(len(flags)))}]}]
    torch.save(ckpt, path)
    with pytest.warns(UserWarning, match="decayed the trainable norm scales"):
        resumed = main(["fit", *fast_args(tmp_path / "b", 4, [*extra, "--ckpt_path", "last"], schedule="constant")])
    want = {n: p for n, p in straight.model.model.named_parameters() if p.requires_grad}
    assert any("layernorm" in n for n in want)
    for n, p in resumed.model.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, want[n]), (n, (p - want[n]).abs().max())


# Pinned on the 2-core CPU dev box (torch 2.13 CPU). Tolerance: 1e-3 relative (1e-9 absolute),
# room for BLAS summation-order differences between CPUs; any change to sampling, the loss, the
# advantages, NVFP4 numerics or AQN shows up far above that.
# seed 2: every step has groups with a signal (some completions stop early); AQN's 5 stages over 3
# steps: sigma 0, 1e-2 (stage 1), 1.36e-3 (stage 3) -- re-pinned when the stages became equal-length
EXPECTED_THREE_STEPS = {
    "train/reward": [-0.8854166865348816, -0.8645833134651184, -0.6979166269302368],
    "train/loss": [0.0, 2.699717879295349e-05, 0.00011290609836578369],  # on-policy surrogate ~0 + 0.01 * k3 KL
    "train/entropy": [4.54679536819458, 4.530700206756592, 4.53971529006958],
    "train/kl": [0.0, 0.002365635009482503, 0.005996695253998041],
    "train/grad_norm": [2.301443099975586, 1.2514948844909668, 1.3754650354385376],
}


def test_fit_without_a_rollout_callback_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = fast_args(tmp_path, 1)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    cfg["trainer"]["callbacks"] = [cb for cb in cfg["trainer"]["callbacks"] if "RolloutCallback" not in cb["class_path"]]
    Path(args[1]).write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="fit needs a callbacks.RolloutCallback in trainer.callbacks"):
        main(["fit", *args])


@pytest.mark.parametrize("arg", ["--model.model=/nowhere/model", "--data.train_source=/nowhere/train.jsonl"])
def test_a_run_failing_before_its_first_batch_leaves_no_empty_log_folder(tmp_path, monkeypatch, arg):
    """A wrong model path or data file: the error, and no logs/<name>/version_N holding an empty event
    file (an empty run in TensorBoard); the next run takes version_0."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError)):
        main(["fit", *fast_args(tmp_path, 1, [arg])])
    assert list((tmp_path / "logs" / "quickstart").iterdir()) == []


def test_three_seeded_steps_regression(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *fast_args(tmp_path, 3, ["--seed_everything", "2"])])
    values, _ = scalars(f"{tmp_path}/logs")
    got = {k: values[k] for k in EXPECTED_THREE_STEPS}
    for name, expected in EXPECTED_THREE_STEPS.items():
        # the loss is 0.01 x KL plus the surrogate, which sums group-centred advantages: at step 0 zero up
        # to fp32 rounding (measured 1e-7 to 2e-7 apart on two CPUs), so the loss is pinned absolutely
        tolerance = dict(abs=5e-7) if name == "train/loss" else dict(rel=1e-3, abs=1e-9)
        assert got[name] == pytest.approx(expected, **tolerance), (name, got[name])


def _two_token_args(tmp_path, steps, extra=()):
    """The quickstart with 1-token completions and no overlong shaping: (nearly) every completion hits
    max_new_tokens and earns no reward, so every group's rewards are equal (no signal)."""
    args = fast_args(tmp_path, steps, extra)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    rollout = next(cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("RolloutCallback"))
    rollout["init_args"].update(overlong_buffer=0)
    rollout["init_args"]["sampling"]["max_new_tokens"] = 1
    Path(args[1]).write_text(yaml.safe_dump(cfg))
    return args


def test_the_data_and_model_seeds_can_differ_with_a_logger(tmp_path, monkeypatch):
    """Both modules take a `seed`; Lightning refused to log the two under one name (a traceback at
    the start of every run with a logger that set either)."""
    monkeypatch.chdir(tmp_path)
    cli = main(["fit", *fast_args(tmp_path, 1, ["--data.seed=5", "--model.seed=3"])])
    assert cli.datamodule.seed == 5 and cli.model.seed == 3
    hparams = yaml.safe_load(next(Path(tmp_path, "logs").rglob("hparams.yaml")).read_text())
    assert hparams["seed"] == 3 and hparams["data_seed"] == 5


def test_an_r1_zero_recipe_through_the_cli(tmp_path, monkeypatch):
    """A plain-text prompt template (no chat template) with R1-style tag rewards, from a YAML."""
    monkeypatch.chdir(tmp_path)
    args = fast_args(tmp_path, 1)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    cfg["data"].update(system_prompt=None, prompt_template="User: {question} Put the answer in <answer> </answer>."
                                                           "\nAssistant: <think>")
    rollout = next(cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("RolloutCallback"))
    rollout["init_args"]["reward"] = {"class_path": "qerl.rewards.WeightedSum", "init_args": {"rewards": [
        {"class_path": "qerl.rewards.MathAccuracy", "init_args": {"answer_tag": True}},
        {"class_path": "qerl.rewards.TagFormatReward", "init_args": {"think_opened_in_prompt": True}}]}}
    Path(args[1]).write_text(yaml.safe_dump(cfg))
    cli = main(["fit", *args])
    ids = cli.datamodule.train_dataloader().__iter__().__next__()["prompt_ids"][0]
    text = cli.model.tokenizer.decode(ids)
    assert text.startswith("User: What is") and text.endswith("</answer>.\nAssistant: <think>"), text
    logged, _ = scalars(f"{tmp_path}/logs")
    assert {"train/rewards/accuracy", "train/rewards/tag_format"} <= set(logged)


def test_silent_failures_warn(tmp_path, monkeypatch):
    """A step without signal (every completion hits max_new_tokens, every group's rewards equal):
    with warn_after_steps=1 both silent-failure warnings fire."""
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning) as record:
        main(["fit", *_two_token_args(tmp_path, 1, ["--model.warn_after_steps=1"])])
    text = " | ".join(str(w.message) for w in record)
    assert "reward std has been 0 in every group for 1 rollout batches" in text, text
    assert "hit max_new_tokens for 1 rollout batches" in text, text


def test_silent_failure_streak_survives_resume(tmp_path, monkeypatch):
    """1-token completions earn no reward anywhere (every group flat): 1 step, a checkpoint, then a
    resumed second step must warn at warn_after_steps=2 (the streak counts the step before the
    checkpoint too)."""
    monkeypatch.chdir(tmp_path)
    args = _two_token_args(tmp_path, 1, ["--model.warn_after_steps=2"])
    main(["fit", *args])
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert ckpt["qerl_streaks"]["zero_std"] == 1
    with pytest.warns(UserWarning, match="reward std has been 0 in every group for 2 rollout batches"):
        main(["fit", *args, "--trainer.max_steps=2", "--ckpt_path", "last"])


@pytest.mark.parametrize("key, value, got", [("trainer", 5, "got int 5"), ("model", 5, "got int 5"),
                                             ("data", [1, 2], r"got list \[1, 2\]"),
                                             ("model", None, r"got null \(an empty section\?\)")])
@pytest.mark.parametrize("subcommand", ["fit", None])
def test_a_section_that_is_not_a_mapping_is_one_line(tmp_path, monkeypatch, key, value, got, subcommand):
    """`trainer: 5` was an AttributeError in checkpoint_dirs, `model: 5` / `data: [1, 2]` a TypeError
    deep in jsonargparse ("argument after ** must be a mapping"); with and without a subcommand."""
    monkeypatch.chdir(tmp_path)
    args = fast_args(tmp_path, 1)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    cfg[key] = value
    Path(args[1]).write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=f"the config's `{key}` section must be a mapping of its settings .*{got}"):
        main([subcommand, *args] if subcommand else args, run=subcommand is not None)


def test_a_broken_section_is_named_also_under_a_command_line_value_or_alone(tmp_path, monkeypatch):
    """`trainer: 5` with a `--trainer.max_steps` on the command line: the value replaced the section
    silently (then "fit needs a callbacks.RolloutCallback"); a file that is only `model:` was
    jsonargparse's "Unexpected config". Both name the section, from the file as written."""
    monkeypatch.chdir(tmp_path)
    args = fast_args(tmp_path, 1)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    Path(args[1]).write_text(yaml.safe_dump({**cfg, "trainer": 5}))
    with pytest.raises(ValueError, match="the config's `trainer` section must be a mapping .*got int 5"):
        main(["fit", *args, "--trainer.max_steps=1"])
    (tmp_path / "only_model.yaml").write_text("model:\n")
    with pytest.raises(ValueError, match=r"the config's `model` section must be a mapping .*got null"):
        main(["fit", "--config", str(tmp_path / "only_model.yaml")])


@pytest.mark.parametrize("text, message", [("", " is empty"), ("# a comment only\n", " is empty"),
                                           ("- model\n- data\n", ": the top level must be a mapping .*got list"),
                                           ("quickstart\n", ": the top level must be a mapping .*got str")])
def test_an_empty_or_non_mapping_config_file_is_one_line_naming_it(tmp_path, monkeypatch, capsys, text, message):
    """An empty file was jsonargparse's "Unexpected config: " (followed by nothing)."""
    import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["train.py", "fit", "--config", "run.yaml"])
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(SystemExit) as code:
        train.cli_entry()
    assert code.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and re.match(rf"error: ValueError: config file run.yaml{message}", err[0]), err


@pytest.mark.parametrize("value, ok", [("-1", False), ("4294967296", False), ("4294967295", True), ("true", True)])
def test_seed_everything_outside_numpys_range_names_its_key(tmp_path, monkeypatch, value, ok):
    """-1 was Lightning's "-1 is not in bounds, numpy accepts from 0 to 4294967295", naming no key."""
    monkeypatch.chdir(tmp_path)
    argv = fast_args(tmp_path, 1, [f"--seed_everything={value}"])
    if ok:
        main(argv, run=False)
        return
    with pytest.raises(ValueError, match=rf"^seed_everything must be an integer in \[0, 4294967295\] .*got {value}$"):
        main(argv, run=False)


def test_a_fit_that_would_never_validate_says_so(tmp_path, monkeypatch):
    """val_check_interval null: Lightning validates at an epoch's end, which the prompt stream never reaches."""
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="trainer.val_check_interval is null: .* this fit never validates"):
        main(fast_args(tmp_path, 1, ["--trainer.val_check_interval=null"]), run=False)


@pytest.mark.parametrize("option, ours", [("--trainer.gradient_clip_val=1.0", "model.optimizer.max_grad_norm"),
                                         ("--trainer.accumulate_grad_batches=4", "model.loss.micro_batch_size")])
def test_lightnings_clipping_and_accumulation_point_to_the_modules_own(tmp_path, monkeypatch, option, ours):
    """Lightning refuses both for a manually optimized module, advising automatic optimization."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"does not apply to this module .*: use {ours}"):
        main(fast_args(tmp_path, 1, [option]), run=False)
    main(fast_args(tmp_path, 1, ["--trainer.gradient_clip_val=null", "--trainer.accumulate_grad_batches=1"]), run=False)


@pytest.mark.parametrize("value", ["0", "-3", ".nan", ".inf"])
def test_a_val_check_interval_lightning_divides_by_fails_before_the_run(tmp_path, monkeypatch, value):
    """0 ran a training step, then a ZeroDivisionError from Lightning's loop."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="trainer.val_check_interval must be > 0"):
        main(["fit", *fast_args(tmp_path, 1, [f"--trainer.val_check_interval={value}"])])


@pytest.mark.parametrize("value", ["2", "00:00:10:00"])
def test_every_form_of_val_check_interval_lightning_takes_still_parses(tmp_path, monkeypatch, value):
    """Training batches (int) and a time ("DD:HH:MM:SS", a timedelta or its dict) are Lightning's (a
    float fraction of an epoch is refused by Lightning itself: the prompt stream has no epochs)."""
    monkeypatch.chdir(tmp_path)
    cli = main(fast_args(tmp_path, 1, [f"--trainer.val_check_interval={value}"]), run=False)
    assert str(cli.config.trainer.val_check_interval) == value


def test_ckpt_path_last_checks_the_file_lightning_would_load(tmp_path, monkeypatch):
    """`last` is the newest last*.ckpt of the checkpoint dirpaths (by modification time, as Lightning
    picks it): a truncated one is a one-line error for fit and validate alike, as an explicit path
    is; with none, fit starts from scratch and validate refuses."""
    import os

    from train import check_ckpt_path, last_checkpoint

    monkeypatch.chdir(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert last_checkpoint([str(a), str(b)]) is None
    with pytest.warns(UserWarning, match=r"no last\*.ckpt in .*a, .*b: this fit starts from step 0$"):
        check_ckpt_path("fit", "last", [str(a), str(b)])  # nothing saved yet: from scratch, said
    torch.save({}, b / "epoch=0-step=2.ckpt")  # save_last off: other checkpoints, named in the warning
    with pytest.warns(UserWarning, match=r"other checkpoints there \(epoch=0-step=2.ckpt\): name one"):
        check_ckpt_path("fit", "last", [str(a), str(b)])
    with pytest.warns(UserWarning, match=r"no ModelCheckpoint dirpath"):
        check_ckpt_path("fit", "last", [])
    (b / "epoch=0-step=2.ckpt").unlink()
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6", "optimizer_states": []}, a / "last.ckpt")
    good = (a / "last.ckpt").read_bytes()
    (b / "last-v1.ckpt").write_bytes(good[: len(good) // 2])  # a run killed while writing it
    (b / "lastly.txt").write_text("not a checkpoint name")
    (b / "epoch=0-step=2.ckpt").write_text("not `last`")
    os.utime(a / "last.ckpt", (1_000, 1_000))
    assert last_checkpoint([str(a), str(b)]) == str(b / "last-v1.ckpt")
    for subcommand in ("fit", "validate"):
        with pytest.raises(ValueError, match=r"--ckpt_path last \(.*last-v1.ckpt, the newest last\*.ckpt\) is not a "
                                             r"readable checkpoint \(RuntimeError: PytorchStreamReader"):
            check_ckpt_path(subcommand, "last", [str(a), str(b)])
    os.utime(b / "last-v1.ckpt", (500, 500))  # the readable one is newer: that is what resumes
    assert last_checkpoint([str(a), str(b)]) == str(a / "last.ckpt")
    check_ckpt_path("fit", "last", [str(a), str(b)])
    check_ckpt_path("validate", "last", [str(a), str(b)])
    # through the CLI: the config's ModelCheckpoint dirpath
    args = fast_args(tmp_path, 1)  # (its checkpoints go to tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "last.ckpt").write_bytes(good[:100])
    for subcommand in ("fit", "validate"):
        with pytest.raises(ValueError, match="--ckpt_path last .*ckpt/last.ckpt, the newest last.* is not a readable"):
            main([subcommand, *args, "--ckpt_path", "last"])


def test_a_diverged_run_is_one_line_naming_the_step(tmp_path, monkeypatch, capsys):
    """Every loss NaN from the start: the ten skipped updates stop the run with one line on stderr
    (exit 2), naming the step whose weights give them, and no traceback."""
    import lightning_modules.qerl_module as qerl_module
    import train

    policy_loss = qerl_module.policy_loss
    monkeypatch.setattr(qerl_module, "policy_loss",
                        lambda *a, **k: (lambda loss, m: (loss * float("nan"), m))(*policy_loss(*a, **k)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["train.py", "fit", *fast_args(tmp_path, 20)])
    with pytest.raises(SystemExit) as code:
        train.cli_entry()
    assert code.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "TrainingDiverged: training diverged: the 10 updates since step 0 all had a " \
        "non-finite loss, from the weights this run started with (step 0): check the base model" in err[0], err
    assert list((tmp_path / "logs" / "quickstart").glob("version_0/events.out.tfevents.*"))  # (its logs stay)


def test_lightning_optimizer_options_are_refused_and_old_configs_still_parse(tmp_path, monkeypatch, capsys):
    """--optimizer / --lr_scheduler (LightningCLI's auto-configured options) did nothing or failed on an
    empty parameter list: refused in one line; configs saved with them null still run."""
    import train

    monkeypatch.chdir(tmp_path)
    for option in ("--lr_scheduler=torch.optim.lr_scheduler.ConstantLR", "--optimizer=torch.optim.SGD"):
        monkeypatch.setattr("sys.argv", ["train.py", "fit", *fast_args(tmp_path, 1), option])
        with pytest.raises(SystemExit) as code:
            train.cli_entry()
        assert code.value.code == 2 and "not used here: QeRLModule builds AdamW" in capsys.readouterr().err
    args = fast_args(tmp_path, 1)
    Path(args[1]).write_text(Path(args[1]).read_text() + "optimizer: null\nlr_scheduler: null\n")
    cli = main(args, run=False)
    assert cli.config.get("optimizer") is None and cli.config.get("lr_scheduler") is None


@pytest.mark.parametrize("extra", ["callbacks.RolloutCallback", "callbacks.AQNCallback"])
def test_a_second_stateful_callback_is_one_line(tmp_path, monkeypatch, extra):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"trainer.callbacks holds 2 {extra.split('.')[1]}s: a run takes one"):
        main(["fit", *fast_args(tmp_path, 1), f"--trainer.callbacks+={extra}"])


def test_callbacks_given_as_one_mapping_parse(tmp_path, monkeypatch):
    """`trainer.callbacks:` may be one callback, not a list (the checks indexed it as a list)."""
    monkeypatch.chdir(tmp_path)
    args = fast_args(tmp_path, 1)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    cfg["trainer"]["callbacks"] = next(cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("RolloutCallback"))
    Path(args[1]).write_text(yaml.safe_dump(cfg))
    main(args, run=False)


def test_non_finite_logits_while_generating_are_one_line(tmp_path, monkeypatch, capsys):
    """AQN noise of sigma 1e38 overflows the policy: the rollout's non-finite logits are one line
    (exit 2), not a traceback."""
    import train

    monkeypatch.chdir(tmp_path)
    args = fast_args(tmp_path, 2)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    aqn = next(cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("AQNCallback"))
    aqn["init_args"]["controller"] = {"class_path": "qerl.aqn.ConstantNoise", "init_args": {"sigma": 1e38}}
    Path(args[1]).write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr("sys.argv", ["train.py", "fit", *args])
    with pytest.raises(SystemExit) as code:
        train.cli_entry()
    assert code.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "NonFiniteLogits: non-finite logits within the first" in err[0], err


@pytest.mark.parametrize("arg, message", [
    ("--model.lora.rank=null", "model.lora.rank must be an integer, got null"),
    ("--model.lora.alpha=0", "model.lora.alpha must be > 0, got 0"),
    ("--model.optimizer.max_grad_norm=null", "model.optimizer.max_grad_norm must be a number, got null"),
    ("--model.loss.kl_coef=null", "model.loss.kl_coef must be a number, got null"),
    ("--model.eval.samples=null", "model.eval.samples must be an integer, got null"),
    # seeds: negative ones were accepted (but data.seed's), a huge one overflowed in torch without a name
    ("--model.seed=-5", "model.seed must be an integer in [0, 2**63) or null"),
    ("--model.seed=99999999999999999999", "model.seed must be an integer in [0, 2**63) or null"),
    ("--model.eval.seed=-1", "model.eval.seed must be an integer in [0, 2**63), got -1"),
    ("--model.warn_after_steps=0", "model.warn_after_steps must be >= 1"),  # 0 warned on every healthy step
    ("--trainer.precision=bf16-true", "trainer.precision bf16-true: leave it at 32-true"),  # cast LoRA, lost the data position
    # ignored under the CLI (prompts were tokenized with the model's tokenizer whatever it named)
    ("--data.tokenizer_name_or_path=/nonexistent", "data.tokenizer_name_or_path ('/nonexistent') is for the data module"),
])
def test_a_null_or_empty_number_is_one_line_naming_its_key(tmp_path, monkeypatch, capsys, arg, message):
    """`null` for a number reached a comparison (`'>' not supported between NoneType and int`, or a
    TypeError inside peft) without naming the setting; other values a run cannot use likewise."""
    import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["train.py", "validate", *fast_args(tmp_path, 1, [arg])])
    with pytest.raises(SystemExit) as code:
        train.cli_entry()
    assert code.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err[-2000:]


def test_a_yaml_syntax_error_names_the_config_file(tmp_path, monkeypatch, capsys):
    import train

    bad = tmp_path / "broken.yaml"
    bad.write_text("model:\n  lr: [1, 2\n")
    monkeypatch.setattr("sys.argv", ["train.py", "fit", "--config", str(bad)])
    with pytest.raises(SystemExit) as code:
        train.cli_entry()
    err = capsys.readouterr().err
    assert code.value.code == 2 and f"in {bad}, line 2, column 7" in err and "<unicode string>" not in err, err


class GoldIsOne(RewardFunction):
    """1 for every completion of a problem whose gold answer is "1", else 0 (whatever was written)."""

    name = "gold_is_one"

    def compute(self, completions, answers):
        return [float(a == "1") for a in answers]


def test_several_training_sources_log_a_reward_curve_each(tmp_path, monkeypatch):
    """data.train_source as a list: train/reward_by_source/<name> is each source's mean reward in the
    step's batch (source "ones" scores 1, "twos" 0 by construction), beside train/reward."""
    monkeypatch.chdir(tmp_path)
    for name, gold in (("ones", 1), ("twos", 2)):
        rows = [{"question": f"What is {i} + {gold - i}?", "answer": f"#### {gold}"} for i in range(6)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli = main(fast_args(tmp_path, 4), run=False)
    cli.datamodule.train_source = [str(tmp_path / "ones.jsonl"), str(tmp_path / "twos.jsonl")]
    cli.datamodule.prompts_per_step = 1  # one set per step: the other has no point there
    rollout = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "RolloutCallback")
    rollout.reward, rollout.overlong_buffer = GoldIsOne(), 0  # (no length shaping on top)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    values, acc = scalars(f"{tmp_path}/logs")
    steps = {name: [e.step for e in acc.Scalars(f"train/reward_by_source/{name}")] for name in ("ones", "twos")}
    rewards = dict(zip([e.step for e in acc.Scalars("train/reward")], values["train/reward"]))
    assert steps["ones"] and steps["twos"] and not set(steps["ones"]) & set(steps["twos"])
    assert sorted(steps["ones"] + steps["twos"]) == sorted(rewards) == [0, 1, 2, 3]  # the optimizer steps
    assert all(rewards[s] == 1.0 for s in steps["ones"]) and all(rewards[s] == 0.0 for s in steps["twos"])
    assert set(values["train/reward_by_source/ones"]) == {1.0} and set(values["train/reward_by_source/twos"]) == {0.0}


def test_reward_by_source_reduces_sums_and_counts_over_ranks():
    """Under DDP the per-source means are sum over ranks / count over ranks (a mean of the ranks'
    means would weight a rank's few rows of a source like another's many): a fake second rank."""
    from types import SimpleNamespace

    from lightning_modules.step_metrics import StepMetricsMixin
    from qerl.rollout import Rollout

    other_rank = torch.tensor([[3.0, 0.0, 0.0], [3.0, 1.0, 0.0]], dtype=torch.float64)  # (reward sums; rows) of a, b, c

    class TwoRanks(StepMetricsMixin):
        device = torch.device("cpu")
        trainer = SimpleNamespace(datamodule=SimpleNamespace(train_source_names={"a.jsonl": "a", "b.jsonl": "b", "c.jsonl": "c"}),
                                  strategy=SimpleNamespace(reduce=lambda t, reduce_op: t + other_rank))

        def _world_size(self):
            return 2

    def rollout(rewards, sources):
        n = len(rewards)
        return Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1), torch.zeros(n, 1, dtype=torch.long),
                       torch.ones(n, 1), torch.zeros(n, 1), torch.tensor(rewards), {}, torch.zeros(n, dtype=torch.bool),
                       1, 1.0, 1, sources=sources)

    got = TwoRanks()._reward_by_source(rollout([0.0, 0.0, 0.0, 1.0], ["a.jsonl"] * 3 + ["b.jsonl"]))
    assert got == {"train/reward_by_source/a": 3 / 6, "train/reward_by_source/b": 1 / 2}  # c: no rows, no point
    # a rollout without sources (hand-made) still joins the reduction (the ranks' calls pair up): its
    # rows count for no set, the other rank's do
    assert TwoRanks()._reward_by_source(rollout([1.0], [])) == {"train/reward_by_source/a": 1.0,
                                                                "train/reward_by_source/b": 0.0}


def test_predict_is_not_offered(monkeypatch, capsys):
    """Lightning's `predict` needs a forward over batches; it failed with a MisconfigurationException."""
    import train

    monkeypatch.setattr("sys.argv", ["train.py", "predict", "--config", QUICKSTART])
    with pytest.raises(SystemExit) as code:
        train.cli_entry()
    assert code.value.code == 2 and "invalid choice: 'predict' (choose from 'fit', 'validate', 'test')" in capsys.readouterr().err


def test_a_bad_value_in_a_fresh_process_is_exactly_one_line_on_stderr(tmp_path):
    """What the user sees from a shell: besides our `error:` line, torchao's "Skipping import of cpp
    extensions" and torch 2.13's per-enum register_constant deprecation (two lines) printed on
    every run. Imported in a fresh interpreter, so the import-time messages are not hidden by an
    earlier test's import."""
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    done = subprocess.run([sys.executable, str(root / "train.py"), "fit", "--config", QUICKSTART,
                           "--model.quantization", "nvfp5"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: Parser key \"model.quantization\": Expected a typing.Literal['bf16', 'nf4', 'nvfp4']. "
        "Got value: nvfp5  (--help lists the options)"]
