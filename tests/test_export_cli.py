"""The export CLI around the adapter it loads and the folder it writes: trained fp32 norms survive a
16-bit base, unreadable adapters and odd --out paths are one-line errors, and a tokenizer's extra
files do not block the next --overwrite. (The formats themselves: test_export.py.)"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl.export import ADAPTER_SUBDIR, TRAINABLE_NORMS_FILE, export_adapter, load_adapter
from qerl.export_cli import main
from qerl.lora_forward import compute_in_activation_dtype
from qerl.model import LoraSettings, load_policy

SEED = 1
BASE = {"model": "tiny-qwen2", "dtype": "bf16", "seed": SEED, "quantization": "nvfp4"}


def _ids(seed=0, shape=(2, 12)):
    return torch.randint(4, 100, shape, generator=torch.Generator().manual_seed(seed))


def _bf16_run_adapter(out: Path) -> tuple[torch.nn.Module, Path]:
    """(policy, its adapter dir) of a bf16 NVFP4 run whose fp32 norm masters moved by 1e-3, as a few
    AdamW steps at lr ~1e-5..1e-4 move them: far below bf16's spacing near 1 (2^-7)."""
    policy, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8, trainable_norms=True),
                            dtype="bf16", seed=SEED)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif p.requires_grad and "lora_" not in name:
                p.add_(1e-3)
    return policy, export_adapter(policy, out, base=BASE)


def test_trained_fp32_norms_survive_a_bf16_base(tmp_path):
    """The CLI loads the adapter onto a fresh bf16 base: its norms must stay the fp32 values trained,
    in the re-exported adapter, in a --dtype fp32 dense export and in the served model's logits."""
    policy, adapter = _bf16_run_adapter(tmp_path / "adapter")
    src = load_file(adapter / TRAINABLE_NORMS_FILE)
    assert src and all(t.dtype == torch.float32 for t in src.values())
    out = main(["--model", "tiny-qwen2", "--adapter", str(adapter), "--out", str(tmp_path / "nvfp4")])
    again = load_file(out / ADAPTER_SUBDIR / TRAINABLE_NORMS_FILE)
    assert again.keys() == src.keys() and all(torch.equal(again[k], src[k]) for k in src)
    dense = main(["--model", "tiny-qwen2", "--format", "bf16", "--from-trained-base", "--dtype", "fp32",
                  "--adapter", str(adapter), "--out", str(tmp_path / "fp32")])
    weights = load_file(dense / "model.safetensors")
    assert all(torch.equal(weights[k], src[k]) for k in src)
    # served on the bf16 base as the trainer computed: the same logits, not those of rounded norms
    served = load_adapter(load_policy("tiny-qwen2", "nvfp4", None, dtype="bf16", seed=SEED)[0], adapter)
    compute_in_activation_dtype(served)
    with torch.no_grad():
        logits = served(_ids()).logits
        assert logits.dtype == torch.bfloat16 and torch.equal(logits, policy(_ids()).logits)


def test_a_trained_base_export_keeps_the_runs_base_norms_for_the_base_passes(tmp_path):
    """A --from-trained-base export of a run with trainable norms holds the trained norms in its weights
    (`vllm serve` with the adapter, which cannot carry norms, gives the trained model) and was recorded
    as the base the adapter trained on: a policy loaded there with the adapter took those trained norms
    as its base ones, so its KL reference and adapter-off evaluation ran on trained norms (2e-3 off in
    the logits). The base's own norms travel beside the weights and come back as the base ones."""
    from qerl.adapter import load_adapter_into
    from qerl.norms import BASE_NORMS_FILE, base_model_only

    policy, adapter = _bf16_run_adapter(tmp_path / "adapter")
    argv = ["--model", "tiny-qwen2", "--format", "bf16", "--from-trained-base", "--dtype", "fp32",
            "--adapter", str(adapter), "--out", str(tmp_path / "home"), "--overwrite"]
    dense = main(argv)
    trained = load_file(adapter / TRAINABLE_NORMS_FILE)
    weights = load_file(dense / "model.safetensors")
    assert all(torch.equal(weights[k], trained[k]) for k in trained)  # served: the trained norms
    assert (dense / BASE_NORMS_FILE).is_file() and main(argv) == dense  # (an export's own file for --overwrite)

    home, _ = load_policy(str(dense), "bf16", LoraSettings(rank=4, alpha=8, trainable_norms=True), dtype="fp32")
    load_adapter_into(home, dense / ADAPTER_SUBDIR)
    base = {k: v.float() for k, v in policy.qerl_base_norms.items()}  # the run's untrained bf16 norms
    assert home.qerl_base_norms.keys() == base.keys()
    assert all(torch.equal(home.qerl_base_norms[k], base[k]) for k in base)
    params = dict(home.named_parameters())
    assert not any(torch.equal(params[k], base[k]) for k in base)  # the policy itself: trained
    with base_model_only(home):
        assert all(torch.equal(params[k], base[k]) for k in base)
    # without the adapter's trained norms nothing is restored (the folder's norms are the base then)
    plain, _ = load_policy(str(dense), "bf16", LoraSettings(rank=4, alpha=8), dtype="fp32")
    assert not getattr(plain, "qerl_base_norms", None)


def test_overwrite_replaces_the_named_chat_templates_an_export_wrote(tmp_path):
    """transformers 5 saves a tokenizer with named chat templates as chat_template.jinja plus
    additional_chat_templates/<name>.jinja: the export's own folder, which the next --overwrite replaces."""
    from qerl.tiny import CHATML_TEMPLATE, build_tiny_model, build_tiny_tokenizer

    src = tmp_path / "src"
    build_tiny_model("qwen2", seed=SEED, dtype=torch.bfloat16).save_pretrained(src)
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = {"default": CHATML_TEMPLATE, "tool_use": CHATML_TEMPLATE + "{# tools #}"}
    tokenizer.save_pretrained(src)
    assert (src / "additional_chat_templates").is_dir()
    argv = ["--model", str(src), "--format", "bf16", "--out", str(tmp_path / "out"), "--overwrite"]
    main(argv)
    assert (tmp_path / "out" / "additional_chat_templates" / "tool_use.jinja").is_file()
    main(argv)  # (refused before as "files no export writes (additional_chat_templates)")
    assert (tmp_path / "out" / "additional_chat_templates" / "tool_use.jinja").is_file()


def test_overwrite_refuses_what_no_export_wrote_inside_its_folders_and_links(tmp_path, capsys):
    """--overwrite removed a whole adapter/ folder, a run's notes and checkpoints in it included, and a
    top-level README.md (no export writes one); a symbolic link named adapter failed in rmtree after the
    earlier export's files were gone. Each is refused before anything is touched, naming the entry."""
    out = tmp_path / "out"
    argv = ["--model", "tiny-qwen2", "--format", "bf16", "--out", str(out), "--overwrite"]
    main(argv)
    (out / "adapter").mkdir()
    (out / "adapter" / "README.md").write_text("peft's model card")  # what peft writes there: replaced
    main(argv)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("precious")
    cases = [("adapter/notes.txt", lambda: (out / "adapter").mkdir() or (out / "adapter" / "notes.txt").write_text("x")),
             ("adapter/runs", lambda: (out / "adapter" / "runs").mkdir(parents=True)),
             ("README.md", lambda: (out / "README.md").write_text("# my card")),
             ("adapter", lambda: (out / "adapter").symlink_to(elsewhere, target_is_directory=True))]
    for entry, make in cases:
        make()
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        with pytest.raises(SystemExit):
            main(argv)
        assert f"holds files no export writes ({entry})" in capsys.readouterr().err
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing removed
        target = out / entry.split("/")[0]
        target.unlink() if target.is_symlink() or target.is_file() else shutil.rmtree(target)
    assert (elsewhere / "keep.txt").read_text() == "precious"
    main(argv)  # the clean export again


@pytest.mark.parametrize("overwrite", [False, True])
def test_out_that_is_a_file_has_its_own_message(tmp_path, capsys, overwrite):
    """--overwrite replaces an earlier export folder, never a file: the error must not suggest it."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        main(["--model", "tiny-qwen2", "--out", str(tmp_path / "file"), *(["--overwrite"] if overwrite else [])])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--out {tmp_path / 'file'} is a file: give a folder" in last and "not empty" not in last
    assert (tmp_path / "file").read_text() == "x"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """A readable adapter with trained norms (to copy and break)."""
    return _bf16_run_adapter(tmp_path_factory.mktemp("good") / "adapter")[1]


def _broken_copy(adapter: Path, out: Path, how: str) -> Path:
    """``adapter`` copied to ``out`` with its LoRA tensors missing, or one of its files corrupt."""
    import shutil

    shutil.copytree(adapter, out)
    if how == "missing":
        (out / "adapter_model.safetensors").unlink()
    elif how == "adapter_config.json":
        (out / how).write_text("{bad json")
    else:  # a header length far past the end of the file, as a truncated download leaves it
        (out / how).write_bytes(b"\xff" * 8 + b"{}")
    return out


_BROKEN = [("missing", "adapter_config.json but no adapter_model.safetensors or adapter_model.bin beside it"),
           ("adapter_model.safetensors", "adapter_model.safetensors: unreadable ("),
           (TRAINABLE_NORMS_FILE, f"{TRAINABLE_NORMS_FILE}: unreadable ("),
           ("adapter_config.json", "adapter_config.json: unreadable (Expecting property name")]


@pytest.mark.parametrize("how, problem", _BROKEN, ids=["missing", "corrupt-lora", "corrupt-norms", "corrupt-config"])
def test_cli_names_a_missing_or_unreadable_adapter_file(tmp_path, capsys, monkeypatch, adapter_dir, how, problem):
    """No traceback and no hub lookup (peft takes a folder without adapter_model.* for a repo id): one
    error line naming the file; a missing one is found before the model loads."""
    import qerl.export_cli

    broken = _broken_copy(adapter_dir, tmp_path / "adapter", how)
    if how == "missing":
        monkeypatch.setattr(qerl.export_cli, "load_policy", lambda *a, **k: pytest.fail("loaded before checking"))
    with pytest.raises(SystemExit) as exc:
        main(["--model", "tiny-qwen2", "--adapter", str(broken), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and "Repo id" not in err
    last = err.strip().splitlines()[-1]
    assert f"error: --adapter {broken}" in last or f"error: cannot load --adapter {broken}" in last
    assert problem in last, last
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how, problem", _BROKEN, ids=["missing", "corrupt-lora", "corrupt-norms", "corrupt-config"])
def test_policy_refuses_a_missing_or_unreadable_adapter_file(tmp_path, adapter_dir, how, problem):
    """model.adapter_path (training, evaluation) goes through the same checks: a ValueError naming the file."""
    from qerl.adapter import check_adapter_dir, load_adapter_into

    broken = _broken_copy(adapter_dir, tmp_path / "adapter", how)
    policy, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8, trainable_norms=True),
                            dtype="bf16", seed=SEED)
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        check_adapter_dir(broken)  # (checkpointing checks model.adapter_path so before the model loads)
        load_adapter_into(policy, broken)


@pytest.mark.parametrize("device, problem", [
    ("tpu", "--device tpu: not a device (cpu, cuda or cuda:N)"),
    ("cuda:x", "--device cuda:x: not a device"),
    ("meta", "--device meta: the export runs on cpu or cuda[:N], not meta"),  # (a torch device: shapes, no weights)
    ("mps", "--device mps: the export runs on cpu or cuda[:N], not mps"),
])
def test_a_device_the_export_cannot_use_is_one_line_before_loading(tmp_path, capsys, monkeypatch, device, problem):
    import qerl.export_cli

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before --device was checked")
    monkeypatch.setattr(qerl.export_cli, "load_policy", never)
    with pytest.raises(SystemExit) as code:
        main(["--model", "tiny-qwen2", "--out", str(tmp_path / "o8"), "--device", device])
    assert code.value.code == 2
    assert problem in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "o8").exists()
