"""Checkpoints as users meet them: file names, resuming with a changed config, evaluating a checkpoint."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_cli import fast_args, scalars  # noqa: E402

from lightning_modules.settings import hparam_differences  # noqa: E402
from train import main  # noqa: E402


def test_checkpoint_files_are_named_by_the_optimizer_step_they_hold(tmp_path, monkeypatch):
    """Two updates per rollout: the batch that starts at step 0 ends (and saves) at step 2."""
    monkeypatch.chdir(tmp_path)
    main(["fit", *fast_args(tmp_path, 4, ["--model.loss.updates_per_rollout=2"])])
    names = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert "epoch=0-step=4.ckpt" in names and "last.ckpt" in names, names
    for path in (tmp_path / "ckpt").glob("epoch=*.ckpt"):
        step = int(path.stem.rsplit("step=", 1)[1])
        assert torch.load(path, weights_only=False)["global_step"] == step, path.name


def test_a_fresh_fit_into_a_folder_with_an_earlier_last_warns_and_keeps_every_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *fast_args(tmp_path, 3)])
    assert {p.name for p in (tmp_path / "ckpt").glob("*.ckpt")} == {  # save_top_k -1: every periodic file stays
        "epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"}
    with pytest.warns(UserWarning, match="already holds last.ckpt of an earlier run"):
        main(["fit", *fast_args(tmp_path, 1)])
    assert (tmp_path / "ckpt" / "last-v1.ckpt").exists() and (tmp_path / "ckpt" / "epoch=0-step=3.ckpt").exists()
    import warnings
    with warnings.catch_warnings(record=True) as record:  # a resume is no "earlier run"
        warnings.simplefilter("always")
        main(["fit", *fast_args(tmp_path, 4, ["--ckpt_path", str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")])])
    assert not [w for w in record if "already holds" in str(w.message)]


def test_resume_from_a_file_runs_the_config_lr_and_max_steps(tmp_path, monkeypatch):
    """A 2-step cosine run ends at lr 0. Resumed from the checkpoint *file* with lr doubled and
    max_steps 2 -> 4: the config is what runs (Lightning's CLI would restore the checkpoint's lr;
    the restored optimizer would take the first update at the old schedule's lr, 0), and both
    changes are warned."""
    monkeypatch.chdir(tmp_path)
    main(["fit", *fast_args(tmp_path, 2)])  # quickstart: lr 1e-3, cosine, no warmup
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["qerl_max_steps"] == 2
    with pytest.warns(UserWarning) as record:
        resumed = main(["fit", *fast_args(tmp_path, 4, ["--ckpt_path", str(ckpt), "--model.optimizer.lr=0.002"])])
    text = " | ".join(str(w.message) for w in record)
    assert "model.optimizer.lr: 0.002 (config) vs 0.001 (checkpoint)" in text, text
    assert "max_steps changed from 2 to 4" in text and "lr changed from 0.001 to 0.002" in text, text
    assert resumed.model.optim_settings.lr == 0.002
    values, acc = scalars(resumed.trainer.log_dir)  # the resumed run's own event file
    lrs = dict(zip((e.step for e in acc.Scalars("train/lr")), values["train/lr"]))
    assert lrs[2] == pytest.approx(0.002 * 0.5)  # cosine over 4 steps at step 2: half the new peak
    assert lrs[3] == pytest.approx(0.002 * 0.5 * (1 - 0.5 ** 0.5))  # and at step 3: 0.5 (1 + cos(3 pi / 4))


def test_resume_from_last_warns_each_changed_model_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *fast_args(tmp_path, 1)])
    with pytest.warns(UserWarning) as record:
        resumed = main(["fit", *fast_args(tmp_path, 2, ["--ckpt_path", "last", "--model.loss.kl_coef=0.5",
                                                        "--model.eval.samples=3"])])
    text = " | ".join(str(w.message) for w in record)
    assert "model.loss.kl_coef: 0.5 (config) vs 0.01 (checkpoint)" in text, text
    trained = next(str(w.message) for w in record if "other model settings" in str(w.message))
    evaluated = next(str(w.message) for w in record if "evaluates with other settings" in str(w.message))
    assert "model.eval.samples" not in trained and "model.eval.samples: 3 (config)" in evaluated, text
    assert "compute_dtype" not in text and "group_by_length" not in text, text   # no false differences
    assert resumed.model.loss_settings.kl_coef == 0.5
    # a checkpoint from before the resolved settings were saved (and before compute_dtype /
    # group_by_length existed) ran peft's fp32 LoRA in rollout order: resuming it says so
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    old = torch.load(ckpt, weights_only=False)
    assert old["qerl_settings"]["lora"]["compute_dtype"] == "model" and old["qerl_settings"]["loss"]["group_by_length"]
    del old["qerl_settings"]
    for group, key in (("lora", "compute_dtype"), ("loss", "group_by_length")):
        if isinstance(old["hyper_parameters"].get(group), dict):
            old["hyper_parameters"][group].pop(key, None)
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning) as record:
        main(["fit", *fast_args(tmp_path, 3, ["--ckpt_path", str(tmp_path / "old.ckpt")])])
    text = " | ".join(str(w.message) for w in record)
    assert "model.lora.compute_dtype: 'model' (config) vs 'stored' (checkpoint)" in text, text
    assert "model.loss.group_by_length: True (config) vs False (checkpoint)" in text, text


def test_resume_after_a_validation_step_matches_the_straight_run(tmp_path, monkeypatch):
    """Validation every 2 batches and LoRA dropout (the global RNG matters): the straight run
    validates right after the step-2 checkpoint, the resumed run does not; validation must not
    move the training RNG stream, or the resumed dropout masks differ (2.7e-3 apart before)."""
    monkeypatch.chdir(tmp_path)
    extra = ["--model.lora.dropout=0.2", "--trainer.val_check_interval=2"]
    straight = main(["fit", *fast_args(tmp_path / "a", 4, extra, schedule="constant")])
    main(["fit", *fast_args(tmp_path / "b", 2, extra, schedule="constant")])
    resumed = main(["fit", *fast_args(tmp_path / "b", 4, [*extra, "--ckpt_path", "last"], schedule="constant")])
    want = {n: p for n, p in straight.model.model.named_parameters() if p.requires_grad}
    for n, p in resumed.model.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, want[n]), (n, (p - want[n]).abs().max())


def _keep_best_by_pass1(args: list[str]) -> list[str]:
    """fast_args with its ModelCheckpoint turned into a keep-best one: it saves when a validation ends."""
    path = Path(args[1])
    cfg = yaml.safe_load(path.read_text())
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"] = {"dirpath": cb["init_args"]["dirpath"], "monitor": "val/arithmetic/pass@1", "mode": "max",
                               "save_top_k": -1, "filename": "best-{step}"}
    path.write_text(yaml.safe_dump(cfg))
    return args


def test_resume_from_a_checkpoint_saved_when_a_validation_ends_matches_the_straight_run(tmp_path, monkeypatch):
    """A keep-best ModelCheckpoint writes its file after the validation has drawn from the global
    RNG: the file must hold the training stream as the straight run continues it (2.2e-4 apart before)."""
    monkeypatch.chdir(tmp_path)
    extra = ["--model.lora.dropout=0.2", "--trainer.val_check_interval=2"]
    straight = main(["fit", *_keep_best_by_pass1(fast_args(tmp_path / "a", 4, extra, schedule="constant"))])
    ckpt = tmp_path / "a" / "ckpt" / "best-step=2.ckpt"
    resumed = main(["fit", *_keep_best_by_pass1(
        fast_args(tmp_path / "b", 4, [*extra, "--ckpt_path", str(ckpt)], schedule="constant"))])
    want = {n: p for n, p in straight.model.model.named_parameters() if p.requires_grad}
    for n, p in resumed.model.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, want[n]), (n, (p - want[n]).abs().max())


def test_resume_into_another_lora_layout_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *fast_args(tmp_path, 1)])
    # (only what is wrong is named: no "0 unexpected, e.g. []")
    with pytest.raises(ValueError, match=r"checkpoint does not fit this model \(\d+ trainable tensors missing, e\.g\. "
                                         r"[^;]*norm[^;]*\): model.model"):
        main(["fit", *fast_args(tmp_path, 2, ["--ckpt_path", "last", "--model.lora.trainable_norms=true"])])
    # another rank: the same tensor names, other shapes (load_state_dict's 28 size mismatches before)
    with pytest.raises(ValueError, match=r"\(28 of another shape, e.g. .*lora_A.*: \(8, 128\) saved, \(4, 128\) here\)"):
        main(["fit", *fast_args(tmp_path, 2, ["--ckpt_path", "last", "--model.lora.rank=4"])])
    with pytest.raises(ValueError, match="of another shape"):
        main(["validate", *fast_args(tmp_path, 2, ["--ckpt_path", "last", "--model.lora.rank=4"])])
    # another random tiny base of the same shapes: refused, not trained on
    with pytest.raises(ValueError, match="trained on tiny-qwen2, this run builds tiny-llama"):
        main(["validate", *fast_args(tmp_path, 2, ["--ckpt_path", "last", "--model.model=tiny-llama"])])
    with pytest.raises(ValueError, match="of seed 0, this run builds seed 5"):
        main(["validate", *fast_args(tmp_path, 2, ["--ckpt_path", "last", "--model.seed=5"])])
    # an adapter_path the checkpoint's LoRA would silently replace
    adapter = next(tmp_path.glob("logs/**/adapter"))  # the one the fit wrote at its end
    with pytest.raises(ValueError, match="model.adapter_path .* with a checkpoint"):
        main(["validate", *fast_args(tmp_path, 2, ["--ckpt_path", "last", f"--model.adapter_path={adapter}"])])


def test_unusable_ckpt_paths_fail_before_the_run(tmp_path, monkeypatch):
    from train import check_ckpt_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="text.ckpt is not a readable checkpoint"):
        main(["fit", *fast_args(tmp_path, 1, ["--ckpt_path", str(tmp_path / "text.ckpt")])])
    with pytest.raises(ValueError, match="is a directory"):
        check_ckpt_path("fit", str(tmp_path), [])
    with pytest.raises(ValueError, match="nope.ckpt: no such file"):  # before the model loads
        check_ckpt_path("validate", str(tmp_path / "nope.ckpt"), [])
    check_ckpt_path("fit", "s3://bucket/run/last.ckpt", [])  # a URL or a model registry: Lightning's to fetch
    check_ckpt_path("fit", "registry:qerl-policy:v3", [])
    # validate / test of `last` with nothing saved would evaluate the untrained model
    with pytest.raises(ValueError, match="no last\\*.ckpt in .*ckpt: nothing to validate"):
        main(["validate", *fast_args(tmp_path, 1, ["--ckpt_path", "last"])])
    check_ckpt_path("fit", "last", [str(tmp_path / "ckpt")])  # a fit starts from scratch instead
    with pytest.raises(ValueError, match="no ModelCheckpoint with a dirpath in the config"):
        check_ckpt_path("test", "last", [])  # Lightning would look nowhere and test the untrained model
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.ckpt")  # readable, not Lightning's
    with pytest.raises(ValueError, match="other.ckpt is not a Lightning checkpoint"):
        check_ckpt_path("validate", str(tmp_path / "other.ckpt"), [])
    # save_weights_only: validate / test take it, a resume cannot (Lightning's KeyError, a traceback)
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.6", "global_step": 2}, tmp_path / "weights.ckpt")
    check_ckpt_path("validate", str(tmp_path / "weights.ckpt"), [])
    with pytest.raises(ValueError, match="weights.ckpt holds weights only .*save_weights_only"):
        check_ckpt_path("fit", str(tmp_path / "weights.ckpt"), [])


def test_sigterm_stops_after_the_batch_and_saves_last(tmp_path, monkeypatch):
    """A scheduler's SIGTERM: Lightning stops after the current rollout batch; `last` holds it."""
    import os
    import signal

    import lightning as L
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class TermAtStep2(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.chdir(tmp_path)
    cli = main(fast_args(tmp_path, 6), run=False)
    cli.trainer.checkpoint_callback._every_n_train_steps = 100  # no periodic save: `last` comes from the SIGTERM
    cli.trainer.callbacks.append(TermAtStep2())
    with pytest.raises(SIGTERMException):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 2

    # inside fit's validation: nothing saved; the exception names the step for the CLI's message
    class TermInValidation(L.Callback):
        def on_validation_batch_end(self, trainer, *args):
            if not trainer.sanity_checking:
                os.kill(os.getpid(), signal.SIGTERM)

    cli = main(fast_args(tmp_path / "val", 6, ["--trainer.val_check_interval=2"]), run=False)
    cli.trainer.checkpoint_callback._every_n_train_steps = 100
    cli.trainer.callbacks.append(TermInValidation())
    with pytest.raises(SIGTERMException) as stopped:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not (tmp_path / "val" / "ckpt" / "last.ckpt").exists()
    assert stopped.value.qerl_validation_step == 2


def test_first_ctrl_c_stops_after_the_batch_and_saves_last(tmp_path, monkeypatch):
    """Ctrl-C in fit: the first stops after the current rollout batch with `last` saved (the
    exception says Ctrl-C, for the CLI's exit 130); a second aborts at once; the handler is removed after."""
    import os
    import signal

    import lightning as L
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class CtrlCAtStep2(L.Callback):
        def __init__(self, times):
            self.times = times

        def on_train_batch_start(self, trainer, *args):  # before the rollout: the batch still runs whole
            if trainer.global_step == 2:
                for _ in range(self.times):
                    os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.chdir(tmp_path)
    cli = main(fast_args(tmp_path, 6), run=False)
    cli.trainer.checkpoint_callback._every_n_train_steps = 100  # no periodic save: `last` comes from the Ctrl-C
    cli.trainer.callbacks.append(CtrlCAtStep2(1))
    with pytest.raises(SIGTERMException) as stopped:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert stopped.value.qerl_signal == "Ctrl-C"
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) is before

    cli = main(fast_args(tmp_path / "twice", 6), run=False)
    cli.trainer.checkpoint_callback._every_n_train_steps = 100
    cli.trainer.callbacks.append(CtrlCAtStep2(2))
    with pytest.raises(SystemExit):  # Lightning's KeyboardInterrupt path: "graceful shutdown", exit 1
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not (tmp_path / "twice" / "ckpt" / "last.ckpt").exists()
    signal.signal(signal.SIGINT, before)  # (Lightning's KeyboardInterrupt path leaves SIGINT ignored)


def test_validate_a_checkpoint_is_labelled_with_its_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["fit", *fast_args(tmp_path / "fit", 2)])
    ckpt = tmp_path / "fit" / "ckpt" / "last.ckpt"
    cli = main(["validate", *fast_args(tmp_path / "val", 2, ["--ckpt_path", str(ckpt)])])
    report = json.loads((Path(cli.trainer.log_dir) / "eval" / "val_step2.json").read_text())
    assert report["global_step"] == 2 and report["ckpt_path"] == str(ckpt)
    _, acc = scalars(f"{tmp_path}/val/logs")
    assert [e.step for e in acc.Scalars("val/arithmetic/pass@1")] == [2]
    # evaluating a checkpoint differently (other eval, loss or optimizer settings) is no difference in
    # the weights: no warning; a LoRA setting that changes how the weights compute still warns
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        main(["validate", *fast_args(tmp_path / "val2", 2, ["--ckpt_path", str(ckpt), "--model.eval.samples=3",
                                                            "--model.loss.kl_coef=0.5", "--model.optimizer.lr=0.5"])])
    assert not [w for w in record if "other model settings" in str(w.message)], [str(w.message) for w in record]
    with pytest.warns(UserWarning, match=r"model.lora.compute_dtype: 'stored' \(config\) vs 'model'"):
        main(["validate", *fast_args(tmp_path / "val3", 2, ["--ckpt_path", str(ckpt), "--model.lora.compute_dtype=stored"])])
    # another alpha is another model (alpha / rank scales the adapter): refused, as model.adapter_path does
    for sub in ("validate", "fit"):
        with pytest.raises(ValueError, match="trained with model.lora.alpha=16, this config has 4"):
            main([sub, *fast_args(tmp_path / "val4", 4, ["--ckpt_path", str(ckpt), "--model.lora.alpha=4"])])


def test_hparam_differences_compares_nested_settings():
    config = {"model": "a", "lora": {"rank": 8, "alpha": 16}, "optimizer": {"betas": (0.9, 0.99)}, "new": 1}
    saved = {"model": "a", "lora": {"rank": 4, "alpha": 16}, "optimizer": {"betas": [0.9, 0.99]}, "_instantiator": "x"}
    assert hparam_differences(config, saved) == ["model.lora.rank: 8 (config) vs 4 (checkpoint)"]


def test_settings_objects_compare_as_the_dicts_the_cli_saves():
    """A module built in Python holds dataclass settings (saved pickled as such); the CLI's hold dicts."""
    from lightning_modules.checkpointing import _plain
    from qerl.model import LoraSettings

    built = {"lora": LoraSettings(rank=4)}
    assert hparam_differences(_plain(built), _plain({"lora": LoraSettings(rank=4)})) == []
    assert hparam_differences(_plain(built), {"lora": {**vars(LoraSettings(rank=4))}}) == []
    assert hparam_differences(_plain(built), _plain({"lora": LoraSettings(rank=8)})) == ["model.lora.rank: 4 (config) vs 8 (checkpoint)"]


def test_norm_scales_get_no_weight_decay_and_old_one_group_states_still_load():
    """Trainable RMSNorm scales sit in an undecayed AdamW group (decay pulled them toward 0); a
    checkpoint's optimizer state of one group (before that) is split into the two-group layout."""
    from lightning_modules.settings import decay_flags, param_groups, split_one_group_state

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.ones(3)),
              torch.nn.Parameter(torch.randn(2, 4)), torch.nn.Parameter(torch.ones(5))]
    old = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1)  # the one-group layout
    for p in params:
        p.grad = torch.randn_like(p)
    old.step()
    new = torch.optim.AdamW(param_groups(params, 0.1), lr=0.1)
    assert [[id(p) for p in g["params"]] for g in new.param_groups] == [[id(params[0]), id(params[2])],
                                                                      [id(params[1]), id(params[3])]]
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    new.load_state_dict(split_one_group_state(old.state_dict(), decay_flags(params)))
    for p in params:  # every tensor keeps its own moments
        assert torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"])
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    # a fresh optimizer and a zero gradient: decay alone moves the matrices, never the norm scales
    fresh = torch.optim.AdamW(param_groups(params, 0.1), lr=0.1)
    for p in params:
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in params]
    fresh.step()
    assert torch.equal(params[1], before[1]) and torch.equal(params[3], before[3])
    assert not torch.equal(params[0], before[0])
    only_matrices = [params[0], params[2]]
    assert len(param_groups(only_matrices, 0.1)) == 1  # LoRA alone: one group, as before


@pytest.mark.parametrize("in_validation", [False, True])
@pytest.mark.parametrize("ctrl_c", [False, True])
def test_sigterm_message_says_what_was_saved(monkeypatch, capsys, in_validation, ctrl_c):
    """The CLI's line on a SIGTERM: `last` after a rollout batch, nothing (and how to recover the
    evaluation) inside a validation; exit 143 either way (130 and "Ctrl-C" for a first Ctrl-C)."""
    import train
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def stopped():
        err = SIGTERMException()
        if in_validation:
            err.qerl_validation_step = 10
        if ctrl_c:
            err.qerl_signal = "Ctrl-C"
        raise err
    monkeypatch.setattr(train, "main", stopped)
    monkeypatch.setattr("sys.argv", ["train.py", "fit", "--config", "x.yaml"])
    with pytest.raises(SystemExit) as code:
        train.cli_entry()
    assert code.value.code == (130 if ctrl_c else 143)
    err = capsys.readouterr().err
    assert ("stopped by Ctrl-C" if ctrl_c else "stopped by SIGTERM") in err
    if in_validation:
        assert "inside the validation at step 10: nothing saved" in err and "validate --ckpt_path" in err
    else:
        assert "after a complete rollout batch (saved as `last`" in err


def test_settings_sections_left_out_compare_as_their_defaults():
    """A config without a `model.optimizer` / `model.eval` section ran their defaults: resuming its
    checkpoint (also one whose qerl_settings predate those sections) with the defaults written out
    warns nothing; a real difference still does."""
    import warnings

    from lightning_modules.evaluation import EvalSettings
    from lightning_modules.qerl_module import QeRLModule
    from lightning_modules.settings import OptimizerSettings

    def differences(module, ckpt):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            module.on_load_checkpoint(ckpt)
        return " | ".join(str(w.message) for w in record)

    kw = dict(model="tiny-qwen2", quantization="nvfp4", dtype="fp32")
    first = QeRLModule(**kw)                                     # no optimizer / eval sections
    ckpt = {"hyper_parameters": dict(first.hparams), "qerl_settings": first._resolved_settings()}
    older = {**ckpt, "qerl_settings": {k: v for k, v in ckpt["qerl_settings"].items() if k in ("lora", "loss")}}
    for saved in (ckpt, older):
        assert differences(QeRLModule(**kw), saved) == ""
        assert differences(QeRLModule(**kw, optimizer=OptimizerSettings(), eval=EvalSettings()), saved) == ""
        text = differences(QeRLModule(**kw, optimizer=OptimizerSettings(lr=0.5)), saved)
        assert "model.optimizer.lr: 0.5 (config) vs 1e-05 (checkpoint)" in text and "model.eval" not in text, text


def test_last_holds_the_final_step_when_max_steps_is_off_the_save_interval(tmp_path, monkeypatch):
    """Saves every 2 steps, max_steps 5: `last` is step 5 (the state the run and its adapter ended
    with), not step 4 -- so `--ckpt_path last` continues from 5, and a resume that has nothing left
    to train says so."""
    monkeypatch.chdir(tmp_path)
    cli = main(fast_args(tmp_path, 5), run=False)
    cli.trainer.checkpoint_callback._every_n_train_steps = 2
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    names = {p.name for p in (tmp_path / "ckpt").glob("*.ckpt")}
    assert names == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"}, names
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 5
    assert torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=False)["global_step"] == 4
    with pytest.warns(UserWarning, match="the checkpoint is at step 5 and trainer.max_steps is 5: this fit trains nothing"):
        main(["fit", *fast_args(tmp_path, 5, ["--ckpt_path", "last"])])
