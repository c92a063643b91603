"""Norm scales as ``trainable_norms`` trains them: held as fp32 master weights, the values the run
started from (recorded next to a dense export, :data:`BASE_NORMS_FILE`), and the base model with LoRA
off and those values back (:func:`base_model_only`: the KL reference, evaluation's adapter-off row)."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn as nn

NOISY_NORM_NAMES = ("input_layernorm", "post_attention_layernorm")


def hold_norm_in_fp32(model: nn.Module, name: str, value: torch.Tensor | None = None) -> nn.Parameter:
    """Make the norm scale ``name`` of ``model`` a trainable fp32 master weight holding ``value`` (default:
    its own values), the norm's output kept in its input's dtype. The trained policy holds its norms so
    (:func:`qerl.model.add_lora`), and a base that loads trained norms must too: an AdamW step at lr 1e-5 is far
    below bf16's spacing near 1 (2^-7), and the fp32 values rounded to a bf16 base's are the untrained ones."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    p = getattr(module, leaf)
    if value is not None and p.dtype == torch.float32:
        with torch.no_grad():  # already a master (the policy's): in place, its storage as it was
            p.copy_(value)
    else:  # the same Parameter object, its data in fp32
        p.data = (p.data if value is None else value).to(p.device, torch.float32)
    p.requires_grad_(True)
    if _output_in_input_dtype not in module._forward_hooks.values():  # (once, also when loaded twice)
        module.register_forward_hook(_output_in_input_dtype)
    return p


# In a dense export of a run with ``trainable_norms``: the norm scales the run started from, under the
# base model's names. Its model.safetensors holds the trained ones (so that ``vllm serve`` with the
# adapter, which cannot carry norms, gives the trained model), and the base-model passes (KL reference,
# adapter-off evaluation) of a policy loaded there must see these instead. In a subfolder: vLLM loads
# every top-level *.safetensors of a model folder without an index as the model's weights.
BASE_NORMS_DIR = "qerl_base_norms"
BASE_NORMS_FILE = f"{BASE_NORMS_DIR}/norms.safetensors"
PEFT_PREFIX = "base_model.model."  # what peft puts before the wrapped model's parameter names


def is_norm_scale(name: str) -> bool:
    """Whether a parameter name is a norm scale ``trainable_norms`` trains (and AQN noises by default)."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[1] in NOISY_NORM_NAMES


def base_norm_scales(model: nn.Module, name_or_path: str) -> dict[str, torch.Tensor]:
    """The norm scales ``trainable_norms`` trains, as the base loaded from ``name_or_path`` had them before
    any training (a copy, under the base model's names): its folder's :data:`BASE_NORMS_FILE` when it
    has one, else ``model``'s own (peft-free) values. A file that does not fit is a ValueError."""
    own = {name: p.detach().clone() for name, p in model.named_parameters() if is_norm_scale(name)}
    path = _base_norms_file(name_or_path)
    if path is None:
        return own
    from safetensors.torch import load_file

    recorded = load_file(path)
    if sorted(recorded) != sorted(own) or any(recorded[k].shape != own[k].shape for k in own):
        raise ValueError(f"{path} does not hold this model's norm scales (written for another model?)")
    return {name: value.to(own[name].device, own[name].dtype) for name, value in recorded.items()}


def restore_base_norms(peft_model: nn.Module, name_or_path: str) -> None:
    """A policy with trainable norms loaded from a folder with a :data:`BASE_NORMS_FILE`: its base-model
    passes use those scales (``qerl_base_norms``), not the trained ones its weights hold."""
    base = getattr(peft_model, "qerl_base_norms", None)
    if not base or _base_norms_file(name_or_path) is None:
        return
    recorded = base_norm_scales(peft_model.get_base_model(), name_or_path)
    for name in base:
        base[name] = recorded[name.removeprefix(PEFT_PREFIX)].to(base[name].dtype)


def _base_norms_file(name_or_path: str) -> str | None:
    """The model folder's :data:`BASE_NORMS_FILE`, or None (no such file: a hub id, a tiny model...)."""
    path = os.path.join(os.path.expanduser(str(name_or_path)), BASE_NORMS_FILE)
    return path if os.path.isfile(path) else None


def _output_in_input_dtype(module: nn.Module, args: tuple, output):
    return output.to(args[0].dtype) if args and isinstance(output, torch.Tensor) else output


@contextlib.contextmanager
def base_model_only(model: nn.Module):
    """The base model, as the KL reference and evaluation's adapter-off row need it: LoRA disabled
    and trained norm scales (``trainable_norms``) back at their loaded values, which peft's
    ``disable_adapter`` alone leaves trained. Restored on exit."""
    base = getattr(model, "qerl_base_norms", None) or {}
    params = dict(model.named_parameters()) if base else {}
    trained = {name: params[name].data for name in base}
    with model.disable_adapter():
        try:
            for name, value in base.items():
                params[name].data = value.to(params[name].device, params[name].dtype)
            yield model
        finally:
            for name, value in trained.items():
                params[name].data = value
