"""Every YAML in configs/ parses and instantiates through LightningCLI (run=False, nothing loaded)."""

from pathlib import Path

import pytest
import yaml

from train import main

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # logs/ of a parsed-only trainer stay out of the repo
    cli = main(["--config", str(path), "--trainer.accelerator", "cpu"], run=False)
    assert cli.model.model is None  # the model is built lazily in configure_model, not at parse time
    assert cli.trainer.max_steps > 0
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert "RolloutCallback" in names
    assert any(type(lg).__name__ == "TensorBoardLogger" for lg in cli.trainer.loggers)
    # --ckpt_path last must find something: a ModelCheckpoint with save_last in a fixed directory
    ckpt = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "ModelCheckpoint" and cb.dirpath]
    assert ckpt and all(cb.save_last for cb in ckpt)
    for cb in cli.trainer.callbacks:  # every run has a resolved seed (its own or seed_everything's)
        if hasattr(cb, "seed"):
            assert isinstance(cb.seed, int)


@pytest.mark.parametrize("bad, message", [
    ("--model.loss.updates_per_rollout=0", "model.loss.updates_per_rollout must be >= 1"),
    ("--model.loss.micro_batch_size=0", "model.loss.micro_batch_size must be >= 1"),
    ("--model.loss.tis_cap=0", "model.loss.tis_cap must be >= 1"),
    ("--model.loss.tis_cap=0.5", "model.loss.tis_cap must be >= 1"),
])
def test_bad_loss_values_fail_before_anything_loads(bad, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        main(["--config", str(CONFIGS[0].parent / "quickstart.yaml"), bad], run=False)


def test_seed_everything_seeds_every_component(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(["--config", str(CONFIGS[0].parent / "quickstart.yaml"), "--seed_everything=7"], run=False)
    seeds = [cb.seed for cb in cli.trainer.callbacks if hasattr(cb, "seed")]
    assert seeds and all(s == 7 for s in seeds) and cli.datamodule.seed == 7


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "gsm8k_qwen2.5-7b_grpo.yaml", "bigmath_qwen2.5-7b_dapo.yaml"} <= names


def test_broken_yaml_value_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS[0].parent / "quickstart.yaml").read_text().replace("quantization: nvfp4", "quantization: int3"))
    with pytest.raises(SystemExit):
        main(["--config", str(bad)], run=False)
    assert "quantization" in capsys.readouterr().err


VLLM_CONFIGS = [p for p in CONFIGS if "engine: vllm" in p.read_text()]


@pytest.mark.parametrize("path", VLLM_CONFIGS, ids=[p.name for p in VLLM_CONFIGS])
def test_vllm_recipe_parses_without_importing_vllm(path, tmp_path, monkeypatch):
    import sys

    class ImportRecorder:  # sees every attempt to import vllm, installed or not (CI has no vLLM)
        tried: list[str] = []

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "vllm":
                self.tried.append(name)
            return None  # the normal finders go on

    for name in [m for m in sys.modules if m.split(".")[0] == "vllm"]:  # a real vLLM loaded by an earlier test
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [ImportRecorder(), *sys.meta_path])
    monkeypatch.chdir(tmp_path)
    cli = main(["--config", str(path), "--trainer.accelerator", "cpu"], run=False)
    rollout = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "RolloutCallback")
    assert rollout.engine_name == "vllm" and rollout.engine is None  # the engine starts at fit, not at parse
    assert 0 < rollout.vllm.gpu_memory_utilization <= 0.5 and rollout.vllm.sleep  # room left for training
    # the context holds the longest prompt + the longer of the training and evaluation completions
    longest = cli.datamodule.max_prompt_length
    assert rollout.vllm.max_model_len >= longest + max(rollout.sampling.max_new_tokens, cli.model.eval_settings.max_new_tokens)
    aqn = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "AQNCallback")
    assert aqn.scale_precision == "bf16"  # noise survives vLLM's bf16 norms
    assert not ImportRecorder.tried and "vllm" not in sys.modules


def test_nested_config_errors_are_one_short_line(tmp_path, capsys):
    """A class_path typo inside a callback's init_args (a union inside a union) and a bad Literal:
    one line naming the keys and the reason, not the subtype lists, alternatives and given values."""
    src = (CONFIGS[0].parent / "quickstart.yaml").read_text()
    for edit, reason in [(("qerl.aqn.ExponentialSchedule", "qerl.aqn.ExponentialSchedul"),
                          "Parser key \"controller\": Problem with given class_path 'qerl.aqn.ExponentialSchedul': "
                          "module 'qerl.aqn' has no attribute 'ExponentialSchedul'"),
                         (("quantization: nvfp4", "quantization: nvfp5"),
                          "Parser key \"model.quantization\": Expected a typing.Literal['bf16', 'nf4', 'nvfp4']. Got value: nvfp5")]:
        path = tmp_path / "bad.yaml"
        path.write_text(src.replace(*edit))
        with pytest.raises(SystemExit):
            main(["fit", "--config", str(path), "--print_config"])
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and reason in err and "Subtypes" not in err and "Given value" not in err, err


def test_print_config_shows_the_defaults_of_sections_left_out(capsys, tmp_path):
    """A recipe that leaves `model.eval` out printed (and a run's config.yaml saved) `eval: null`
    while EvalSettings' defaults ran; a saved config should say what ran."""
    full = (CONFIGS[0].parent / "gsm8k_qwen2.5-7b_grpo.yaml").read_text()
    recipe = tmp_path / "no_eval.yaml"
    recipe.write_text("".join(line for line in full.splitlines(True) if not line.startswith("  eval:")))
    assert "\n  eval:" in full and "\n  eval:" not in recipe.read_text()
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(recipe), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)["model"]
    assert printed["eval"]["max_new_tokens"] == 1024 and printed["eval"]["samples"] == 0
    for section in ("lora", "loss", "optimizer"):
        assert isinstance(printed[section], dict), section


def test_default_settings_are_not_shared_between_modules():
    """The section defaults are one instance per process: a module changing its own (as a test or a
    script may) must not change the next module's."""
    from lightning_modules.qerl_module import QeRLModule

    first, second = QeRLModule(), QeRLModule()
    first.eval_settings.engine = "hf"
    first.loss_settings.kl_coef = 0.5
    assert second.eval_settings.engine == "rollout" and second.loss_settings.kl_coef == 0.0
    assert QeRLModule().eval_settings.engine == "rollout"


def test_a_python_built_modules_hyperparameters_load_weights_only(tmp_path):
    """The default sections are dataclasses; hyper_parameters hold them as dicts, or a checkpoint of a
    module built in Python fails torch.load(weights_only=True) (what resume uses) with 'Unsupported global'."""
    import torch

    from lightning_modules.qerl_module import QeRLModule

    module = QeRLModule()
    hparams = dict(module.hparams)
    for section in ("lora", "loss", "optimizer", "eval"):  # also what loggers write (hparams.yaml: safe_load)
        assert isinstance(hparams[section], dict) and isinstance(module.hparams_initial[section], dict), section
    torch.save({"hyper_parameters": hparams}, tmp_path / "h.ckpt")
    assert torch.load(tmp_path / "h.ckpt", weights_only=True)["hyper_parameters"]["eval"]["max_new_tokens"] == 1024



def test_a_python_built_trainer_with_a_16_bit_precision_is_refused():
    """The CLI refuses trainer.precision early; a Trainer built in Python reached training (bf16-true
    cast the LoRA masters and dropped the data position from every batch)."""
    import lightning as L

    from lightning_modules.qerl_module import QeRLModule

    module = QeRLModule()
    module.trainer = L.Trainer(precision="bf16-true", logger=False, enable_checkpointing=False, accelerator="cpu")
    with pytest.raises(ValueError, match="trainer.precision bf16-true: leave it at 32-true"):
        module.configure_model()
