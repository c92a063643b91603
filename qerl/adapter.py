"""The LoRA adapter on disk: written in peft format (plus ``trainable_norms.safetensors`` when the
norms train), taken out of a training checkpoint, and loaded back, into a fresh base (serving) or into
a policy built from a config (``model.adapter_path``: settings and tensors must match).

The base an adapter was trained on (``qerl_base.json``) is recorded by ``qerl/base_record.py``.

Names: peft's wrapping (``base_model.model.``, ``.base_layer``, ``.original_module``) is stripped
to the HF names the base checkpoints and vLLM use (:func:`hf_name`).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from qerl.base_record import (  # noqa: F401 (re-exported: the base record's home is qerl/base_record.py)
    BASE_FILE, BASE_KEYS, DEQUANTIZED_BASE_FILE, _write_base, checkpoint_base, is_dequantized_base, read_base,
    read_dequantized_base, read_peft_base, same_model, trained_seed, write_dequantized_base)
from qerl.model import LoraSettings, lora_config, non_finite_tensors, peft_wrapping_quietly
from qerl.norms import PEFT_PREFIX, hold_norm_in_fp32

TRAINABLE_NORMS_FILE = "trainable_norms.safetensors"
# The LoRA tensors beside adapter_config.json, in the order peft looks for them; without either, peft
# takes the folder for a Hugging Face hub id (a network error, or "Repo id must be in the form ...").
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# What reading a corrupt or truncated adapter file raises (torch.load of a broken .bin: RuntimeError,
# EOFError or UnpicklingError): made a one-line ValueError naming the file (_unreadable).
_READ_ERRORS = (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError)


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if _is_peft(model) else model


def hf_name(name: str) -> str:
    """A parameter/module name with peft's wrapping removed: ``base_model.model.`` prefix,
    ``.base_layer`` and ``.original_module`` (peft keeps the untouched weights there), and
    ``.modules_to_save.<adapter>`` (the trained copy of the same module)."""
    out, skip = [], False
    for part in name.removeprefix(PEFT_PREFIX).split("."):
        if skip:  # the adapter name after `modules_to_save`
            skip = False
        elif part == "modules_to_save":
            skip = True
        elif part not in ("base_layer", "original_module"):
            out.append(part)
    return ".".join(out)


def _is_adapter(name: str) -> bool:
    parts = name.split(".")
    return any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts


def export_adapter(peft_model: nn.Module, out_dir: str | Path, base: dict | None = None) -> Path:
    """peft ``save_pretrained`` of the adapter (``adapter_model.safetensors`` +
    ``adapter_config.json``); trainable non-LoRA parameters (the RMSNorm scales of
    ``trainable_norms``) go to ``trainable_norms.safetensors`` under their HF names. ``base``:
    the base it was trained on ({"model", "dtype", "seed", "quantization"}), recorded in ``qerl_base.json`` and as
    peft's ``base_model_name_or_path`` (which a model built in code leaves empty)."""
    if not _is_peft(peft_model):
        raise ValueError("export_adapter needs a peft model")
    trainable = {n: p.detach() for n, p in peft_model.named_parameters() if p.requires_grad}
    refuse_non_finite(trainable, "the adapter", "trainable tensors", "nothing written")
    out = Path(out_dir)
    if base and base.get("model"):
        for config in peft_model.peft_config.values():
            config.base_model_name_or_path = config.base_model_name_or_path or str(base["model"])
    # (the adapter holds no embedding layers: "auto" would look the base up on the hub to check its vocabulary)
    peft_model.save_pretrained(out, save_embedding_layers=False)
    _write_base(out, base)
    norms = {hf_name(n): p.detach().cpu().contiguous() for n, p in peft_model.named_parameters()
             if p.requires_grad and not _is_adapter(n)}
    _write_trainable_norms(out, norms)
    return out


def refuse_non_finite(tensors: dict, what: str, kind: str, then: str) -> None:
    """One line, ``<what> holds non-finite weights (<n> of <m> <kind>, e.g. <name>): <then>``, when
    any of ``tensors`` holds a NaN or an inf."""
    if bad := non_finite_tensors(tensors):
        raise ValueError(f"{what} holds non-finite weights ({len(bad)} of {len(tensors)} {kind}, e.g. {bad[0]}): {then}")


def _write_trainable_norms(out: Path, norms: dict[str, torch.Tensor]) -> None:
    """``trainable_norms.safetensors`` beside an adapter, or none (an earlier run's file removed)."""
    (out / TRAINABLE_NORMS_FILE).unlink(missing_ok=True)
    if norms:
        save_file(norms, str(out / TRAINABLE_NORMS_FILE), metadata={"format": "pt"})


def _load_checkpoint(ckpt_path: str | Path) -> dict:
    """A training checkpoint's dict, checked to have dict ``state_dict`` and ``hyper_parameters``:
    an empty file or another pickle is a ValueError naming the file, not a traceback further on."""
    try:
        ckpt = torch.load(str(ckpt_path), map_location="cpu", weights_only=False)  # Lightning's own pickle
    except EOFError as err:  # pickle's bare "Ran out of input"
        raise ValueError(f"{ckpt_path}: empty or truncated file") from err
    if not isinstance(ckpt, dict):
        raise ValueError(f"{ckpt_path}: holds a {type(ckpt).__name__}, not a checkpoint dict")
    for key in ("state_dict", "hyper_parameters"):
        if key not in ckpt:  # without hyper-parameters the LoRA rank/alpha would be guessed
            raise ValueError(f"{ckpt_path}: no {key!r} (not a qerl training checkpoint?)")
        if not isinstance(ckpt[key] or {}, dict):
            raise ValueError(f"{ckpt_path}: its {key!r} is a {type(ckpt[key]).__name__}, not a dict")
    return ckpt


def _checkpoint_label(ckpt_path) -> str:
    return "the checkpoint" if isinstance(ckpt_path, dict) else str(ckpt_path)


def adapter_from_checkpoint(ckpt_path: str | Path | dict, out_dir: str | Path) -> Path:
    """The adapter of a training checkpoint (``.ckpt``: the trainable tensors and the module's
    hyper-parameters), written as :func:`export_adapter` writes it at the end of a run, without loading
    the base model: to serve or evaluate any step of a run, also one that did not finish.
    ``ckpt_path`` may also be the checkpoint :func:`_load_checkpoint` already read."""
    ckpt = ckpt_path if isinstance(ckpt_path, dict) else _load_checkpoint(ckpt_path)
    what = _checkpoint_label(ckpt_path)  # (not a read dict's whole repr)
    hp, state = ckpt["hyper_parameters"] or {}, ckpt["state_dict"] or {}
    lora = hp.get("lora") or {}
    settings = lora if isinstance(lora, LoraSettings) else LoraSettings(**lora)
    adapter, norms = {}, {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{what}: state_dict[{key!r}] is not a tensor ({type(tensor).__name__})")
        name = key[len("model."):] if key.startswith("model.") else key  # QeRLModule.model
        if _is_adapter(name):  # peft's own naming on save: the adapter name ("default") dropped
            adapter[name.replace(".default", "")] = tensor.contiguous()
        else:
            norms[hf_name(name)] = tensor.contiguous()
    if not adapter:
        raise ValueError(f"{what}: no LoRA tensors in its state_dict (not a qerl training checkpoint?)")
    refuse_non_finite(state, what, "trainable tensors", "saved after its run diverged: take an earlier checkpoint")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora_config(settings, hp.get("model")).save_pretrained(str(out))
    save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_trainable_norms(out, norms)
    _write_base(out, checkpoint_base(ckpt))
    return out


def _check_lora_fits(model: nn.Module, saved: dict[str, torch.Tensor], name: str = "the adapter") -> None:
    """ValueError naming the first LoRA tensor of ``saved`` (peft's file naming) that does not fit
    ``model``, i.e. an adapter trained on another base: peft stops at a wider base's linears with a
    size-mismatch traceback, and drops the tensors of a deeper base's extra layers without a word."""
    modules = dict(_hf_model(model).named_modules())
    for key, tensor in saved.items():
        path, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            continue  # DoRA magnitudes, embedding LoRA: not qerl's, peft checks them
        linear = getattr(modules.get(path), "base_layer", modules.get(path))  # the model may be peft-wrapped
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} has LoRA for {path}, a linear the model lacks: "
                             "it was trained on another base model")
        # lora_A is [r, in_features], lora_B [out_features, r]
        have, want, what = ((tensor.shape[1], linear.in_features, "inputs") if kind == "A.weight"
                            else (tensor.shape[0], linear.out_features, "outputs"))
        if have != want:
            raise ValueError(f"{name} has LoRA for {path} with {have} {what}, the model's linear has {want}: "
                             "it was trained on another base model")


def _unreadable(path: Path, err: Exception) -> ValueError:
    """A one-line ValueError naming the adapter file that could not be read, and why."""
    return ValueError(f"{path}: unreadable ({' '.join(str(err).split()) or type(err).__name__})")


def _read_adapter_weights(adapter_dir: Path, device: str) -> dict[str, torch.Tensor]:
    """peft's ``load_peft_weights`` of an adapter directory the caller has checked (``check_adapter_dir``:
    never a hub lookup), a corrupt or truncated file a ValueError naming it."""
    from peft.utils import load_peft_weights

    try:
        weights = load_peft_weights(str(adapter_dir), device=device)
    except _READ_ERRORS as err:
        path = next(adapter_dir / f for f in ADAPTER_WEIGHT_FILES if (adapter_dir / f).is_file())
        raise _unreadable(path, err) from err
    refuse_non_finite(weights, str(adapter_dir), "LoRA tensors", "written after a run diverged?")
    return weights


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Inverse of :func:`export_adapter`: wrap ``model`` with the saved adapter and load the
    trainable norms (marked trainable again, so a re-export writes them too). An adapter whose
    LoRA tensors do not fit ``model``, or a directory that is not a readable adapter, is a ValueError
    (:func:`_check_lora_fits`, :func:`check_adapter_dir`)."""
    from peft import PeftModel

    check_adapter_dir(adapter_dir)
    _check_lora_fits(model, _read_adapter_weights(Path(adapter_dir), device="cpu"))
    with peft_wrapping_quietly():
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    _load_trainable_norms(peft_model, adapter_dir)
    return peft_model


def load_adapter_into(peft_model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Like :func:`load_adapter` for a model that already carries a LoRA of the same shape (the
    policy built from a config): copy the saved LoRA weights and trainable norms into it.

    The saved ``adapter_config.json`` must match the model's LoRA (rank, alpha, target modules, and
    rsLoRA / DoRA, which also change the update) and the file must hold exactly the model's LoRA
    tensors, in its linears' shapes: otherwise a ValueError in one line, before anything is copied. A
    different alpha or a subset of the trained modules would otherwise load silently and give other logits."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    adapter_dir = Path(adapter_dir)
    _check_adapter_config(peft_model, adapter_dir)  # (check_adapter_dir first)
    device = str(next(peft_model.parameters()).device)
    saved = _read_adapter_weights(adapter_dir, device)
    # same naming as the file (no adapter name) and, as export_adapter writes it, no embedding layers: with
    # lm_head or embed_tokens targeted, peft's "auto" would also expect their frozen base weights
    expected = set(get_peft_model_state_dict(peft_model, save_embedding_layers=False))
    extra, missing = sorted(set(saved) - expected), sorted(expected - set(saved))
    if extra:
        raise ValueError(f"adapter {adapter_dir} has {len(extra)} LoRA tensors the model has no slot for "
                         f"(e.g. {extra[0]}): set model.lora to match the adapter_config.json there")
    if missing:
        raise ValueError(f"adapter {adapter_dir} lacks {len(missing)} LoRA tensors of the model "
                         f"(e.g. {missing[0]}): set model.lora to match the adapter_config.json there")
    _check_lora_fits(peft_model, saved, f"adapter {adapter_dir}")
    result = set_peft_model_state_dict(peft_model, saved)
    if result.unexpected_keys:  # the key check above should make this unreachable
        raise ValueError(f"adapter {adapter_dir}: the model has no slot for {len(result.unexpected_keys)} "
                         f"tensors (e.g. {result.unexpected_keys[0]})")
    _load_trainable_norms(peft_model, adapter_dir)
    return peft_model


# adapter_config.json key -> (model.lora setting it comes from, default when absent from the file)
_LORA_CONFIG_KEYS = {"r": ("rank", None), "lora_alpha": ("alpha", None), "target_modules": ("target_modules", None),
                     "use_rslora": ("use_rslora", False), "use_dora": ("use_dora", False)}


def _target_modules(value):
    """A list/set of module-name suffixes as a sorted list; a regex string as is."""
    return value if value is None or isinstance(value, str) else sorted(value)


def check_adapter_dir(adapter_dir: str | Path) -> None:
    """A one-line ValueError unless ``adapter_dir`` is a peft adapter directory (``adapter_config.json``
    and the LoRA tensors beside it), with a hint for the usual mix-ups: a Lightning ``.ckpt`` (that is
    ``--ckpt_path``) or a run folder holding ``adapter/``."""
    adapter_dir = Path(adapter_dir)
    if (adapter_dir / "adapter_config.json").is_file():
        if not any((adapter_dir / name).is_file() for name in ADAPTER_WEIGHT_FILES):
            raise ValueError(f"adapter {adapter_dir}: adapter_config.json but no {' or '.join(ADAPTER_WEIGHT_FILES)} "
                             "beside it (copied in part, or a save that did not finish?)")
        _adapter_settings(adapter_dir)  # readable JSON (peft's own read is a JSONDecodeError without the file)
        return
    hint = "a peft adapter directory, as training writes to <log_dir>/adapter"
    if adapter_dir.is_file():
        hint = ("a file, not an adapter directory: resume or evaluate a Lightning checkpoint with --ckpt_path"
                if adapter_dir.suffix == ".ckpt" else "a file, not an adapter directory")
    elif not adapter_dir.exists():
        hint = "no such directory"
    elif (adapter_dir / "adapter" / "adapter_config.json").is_file():
        hint = f"did you mean {adapter_dir / 'adapter'}?"
    raise ValueError(f"adapter {adapter_dir}: no adapter_config.json there ({hint})")


def _adapter_settings(adapter_dir: Path) -> dict:
    """``adapter_dir/adapter_config.json`` as a dict; a ValueError naming the file when it is not one."""
    config_file = adapter_dir / "adapter_config.json"
    try:
        saved = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:  # (JSONDecodeError is a ValueError without the file's name)
        raise ValueError(f"adapter {adapter_dir}: adapter_config.json: unreadable ({err})") from err
    if not isinstance(saved, dict):
        raise ValueError(f"adapter {adapter_dir}: adapter_config.json: not a JSON object of LoRA settings")
    return saved


def _check_adapter_config(peft_model: nn.Module, adapter_dir: Path) -> None:
    """ValueError naming every LoRA setting where ``adapter_dir/adapter_config.json`` and the model differ."""
    check_adapter_dir(adapter_dir)
    saved = _adapter_settings(adapter_dir)
    if not _is_peft(peft_model) or "default" not in getattr(peft_model, "peft_config", {}):
        raise ValueError(f"adapter {adapter_dir}: the model has no LoRA to load it into (set model.lora)")
    config = peft_model.peft_config["default"]
    trained, model = [], []
    for key, (setting, default) in _LORA_CONFIG_KEYS.items():
        want, have = saved.get(key, default), getattr(config, key, default)
        if key == "target_modules":
            want, have = _target_modules(want), _target_modules(have)
        if want != have:
            trained.append(f"lora.{setting}={want}")
            model.append(f"{setting}={have}")
    # trained norms need the model's fp32 masters and base values (qerl.model.add_lora): refuse them
    # in a policy without, and a norm-less adapter in one whose norms would then train from scratch
    want, have = (adapter_dir / TRAINABLE_NORMS_FILE).exists(), bool(getattr(peft_model, "qerl_base_norms", None))
    if want != have:
        trained.append(f"lora.trainable_norms={want}")
        model.append(f"trainable_norms={have}")
    if trained:
        raise ValueError(f"adapter {adapter_dir} was trained with {', '.join(trained)}; the model has "
                         f"{', '.join(model)}: set model.lora to match")


def _load_trainable_norms(peft_model: nn.Module, adapter_dir: str | Path) -> None:
    """The adapter's trained norm scales, held as the policy holds them (fp32 masters, trainable:
    :func:`qerl.norms.hold_norm_in_fp32`). Copied into a 16-bit base's norms instead, the fp32 values
    would round back to the untrained ones (a few lr-1e-5 steps move a scale by far less than bf16's
    2^-7 spacing near 1), and a re-export or ``--dtype fp32`` export would write those."""
    norms_file = Path(adapter_dir) / TRAINABLE_NORMS_FILE
    if not norms_file.exists():
        return
    try:
        norms = load_file(str(norms_file))
    except _READ_ERRORS as err:
        raise _unreadable(norms_file, err) from err
    refuse_non_finite(norms, str(norms_file), "norm scales", "written after a run diverged?")
    base = peft_model.get_base_model()
    params = dict(base.named_parameters())
    unexpected = [name for name in norms if name not in params]
    if unexpected:
        raise ValueError(f"{norms_file} has tensors the model lacks: {unexpected[:5]}")
    for name, value in norms.items():
        if value.shape != params[name].shape:
            raise ValueError(f"{norms_file}: {name} has shape {list(value.shape)}, the model's "
                             f"{list(params[name].shape)}: it was trained on another base model")
    for name, value in norms.items():
        hold_norm_in_fp32(base, name, value)
