"""Export a policy for serving: an NVFP4A16 compressed-tensors checkpoint (what vLLM loads for the
rollouts and for evaluation), a dense 16-bit checkpoint (the baseline), and the LoRA adapter.

Everything is written by hand (safetensors + ``config.json``) instead of ``save_pretrained``, so it
also works for GGUF-loaded models, which transformers refuses to serialize (DESIGN.md).

NVFP4 layout (compressed-tensors ``nvfp4-pack-quantized``, research/vllm.md §1.2), per quantized
linear ``<m>`` with weight ``[N, K]``:

- ``<m>.weight_packed``       uint8 ``[N, K/2]``, element 2j in the low nibble (= our ``qdata``);
- ``<m>.weight_scale``        float8_e4m3fn ``[N, K/16]``, row-major block scales (= our ``scale``);
- ``<m>.weight_global_scale`` fp32 ``[1]``, a *divisor*: ``2688 / amax = 1 / per_tensor_scale``.

Everything else (embeddings, norms, lm_head, biases) stays under its HF name in 16 bits. A peft
model exports its base (``base_layer`` weights, prefixes stripped, no ``lora_`` tensors) plus the
adapter in ``<out>/adapter``. Norms are written as they currently are in the model (trained, when
``trainable_norms`` is on; AQN noise lives outside the weights and is never exported).

CLI: ``python -m qerl.export --model tiny-qwen2 --format nvfp4 --out DIR [--adapter PATH]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerBase

from qerl.model import SHARED_SCALE_GROUPS, LoraSettings, _parse_dtype, load_policy, lora_config
from qerl.nvfp4 import BLOCK_SIZE, NVFP4WeightTensor

log = logging.getLogger(__name__)

# The compressed-tensors release whose NVFP4A16 output we mirror (the one vLLM 0.25 pins).
CT_FORMAT_VERSION = "0.17.0"
NVFP4_FORMAT = "nvfp4-pack-quantized"
ADAPTER_SUBDIR = "adapter"
TRAINABLE_NORMS_FILE = "trainable_norms.safetensors"
MAX_SHARD_BYTES = 5 * 2**30
_PEFT_PREFIX = "base_model.model."

# (bytes on disk, function producing the CPU tensor): tensors are materialized one shard at a time.
Entry = tuple[int, Callable[[], torch.Tensor]]


def nvfp4a16_quantization_config(ignore: list[str] | None = None) -> dict:
    """The ``quantization_config`` compressed-tensors writes for preset NVFP4A16 (vllm.md §1.2)."""
    weights = {
        "actorder": None, "block_structure": None, "dynamic": False, "group_size": BLOCK_SIZE,
        "num_bits": 4, "observer": "memoryless_minmax", "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": True,
        "type": "float", "zp_dtype": None,
    }
    group = {"format": NVFP4_FORMAT, "input_activations": None, "output_activations": None,
             "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group}, "format": NVFP4_FORMAT, "global_compression_ratio": None,
        "ignore": list(ignore if ignore is not None else ["lm_head"]), "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}, "transform_config": {}, "version": CT_FORMAT_VERSION,
    }


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if _is_peft(model) else model


def hf_name(name: str) -> str:
    """A parameter/module name with peft's wrapping removed: ``base_model.model.`` prefix,
    ``.base_layer`` and ``.original_module`` (peft keeps the untouched weights there)."""
    name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
    return ".".join(p for p in name.split(".") if p not in ("base_layer", "original_module"))


def _is_adapter(name: str) -> bool:
    parts = name.split(".")
    return any(p.startswith("lora_") for p in parts) or "modules_to_save" in parts


def base_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` for every parameter and persistent buffer of the (peft-free) base.
    A tied tensor (e.g. ``lm_head`` = ``embed_tokens``) is yielded once, under its first name."""
    seen: set[int] = set()
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        if _is_adapter(mod_name):
            continue
        persistent = [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for local, t in [*module._parameters.items(), *persistent]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            name = hf_name(f"{mod_name}.{local}" if mod_name else local)
            if name in names:
                raise ValueError(f"two tensors map to the exported name {name!r}")
            names.add(name)
            yield name, t


def _dense(t: torch.Tensor, dtype: torch.dtype) -> Entry:
    """A plain tensor, floats cast to ``dtype`` (integer buffers kept as they are)."""
    out_dtype = dtype if t.is_floating_point() else t.dtype
    return t.numel() * out_dtype.itemsize, lambda: t.detach().to("cpu", out_dtype).contiguous()


def _dequantized(t: torch.Tensor, dtype: torch.dtype) -> Entry:
    """A quantized weight (NVFP4, or bitsandbytes NF4 of the QLoRA arm) decoded to dense ``dtype``."""
    if isinstance(t, NVFP4WeightTensor):
        make = lambda: t.dequantize(dtype).cpu().contiguous()  # noqa: E731
        return t.numel() * dtype.itemsize, make
    from bitsandbytes.functional import dequantize_4bit

    state = t.quant_state
    return state.shape.numel() * dtype.itemsize, lambda: dequantize_4bit(t.data, state).to("cpu", dtype).contiguous()


def _linear_names(model: nn.Module) -> set[str]:
    return {hf_name(n) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _is_adapter(n)}


def _check_shared_scales(scales: dict[str, torch.Tensor]) -> None:
    """vLLM fuses q/k/v and gate/up into one GEMM with one global scale (the max over the shards),
    so a group whose scales differ would decode its other shards scaled by g_i / g_max: refuse.
    ``qerl.model`` quantizes each group with one shared scale."""
    for prefix in scales:
        parent, short = prefix.rpartition(".")[::2]
        for group in SHARED_SCALE_GROUPS:
            if short != group[0]:
                continue
            vals = [scales.get(f"{parent}.{g}") for g in group]
            if all(v is not None for v in vals) and not all(torch.equal(vals[0], v) for v in vals[1:]):
                raise ValueError(f"{parent}.{{{','.join(group)}}} have different per-tensor scales; vLLM fuses them "
                                 "with one (max) scale: quantize them with a shared one (qerl.model does)")


def _write_safetensors(entries: dict[str, Entry], out: Path, max_shard_bytes: int) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index when larger than
    ``max_shard_bytes``; stale weight files from an earlier export in ``out`` are removed first."""
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, Entry]] = [{}]
    size = 0
    for name, entry in entries.items():
        if shards[-1] and size + entry[0] > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = entry
        size += entry[0]
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({k: make() for k, (_, make) in shards[0].items()}, str(out / "model.safetensors"), metadata=meta)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: make() for k, (_, make) in shard.items()}, str(out / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(n for n, _ in entries.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_rest(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out: Path, dtype: torch.dtype,
                quantization_config: dict | None) -> None:
    """config.json (any loader's ``quantization_config`` replaced), generation config, tokenizer, adapter."""
    hf = _hf_model(model)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # e.g. the GGUF loader's
    config["architectures"] = [type(hf).__name__]
    config["dtype"] = str(dtype).removeprefix("torch.")
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(hf, "generation_config", None) is not None:
        hf.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if _is_peft(model):
        export_adapter(model, out / ADAPTER_SUBDIR)


def export_nvfp4(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
                 dtype: str | torch.dtype = "bf16", max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a compressed-tensors NVFP4A16 checkpoint of ``model`` (plain HF or peft-wrapped; its
    decoder linears must hold ``NVFP4WeightTensor``). Other tensors are cast to ``dtype`` (16-bit).
    Every ``nn.Linear`` left unquantized (``lm_head``) is listed in ``ignore``. Returns ``out_dir``."""
    dtype, out = _parse_dtype(dtype), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries: dict[str, Entry] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in base_tensors(model):
        prefix, leaf = name.rpartition(".")[::2]
        if not isinstance(t, NVFP4WeightTensor):
            if hasattr(t, "quant_state"):
                raise ValueError(f"{name} is bitsandbytes-quantized: export it with export_bf16 instead")
            entries[name] = _dense(t, dtype)
            continue
        if leaf != "weight":
            raise ValueError(f"NVFP4 tensor {name!r} is not a linear weight")
        pts = t.per_tensor_scale.detach().float().cpu().reshape(1)
        scales[prefix] = pts
        entries[f"{prefix}.weight_packed"] = _dense(t.qdata, dtype)  # uint8: kept as is
        entries[f"{prefix}.weight_scale"] = (t.scale.numel(), lambda s=t.scale: s.detach().cpu().contiguous())
        entries[f"{prefix}.weight_global_scale"] = (4, lambda p=pts: torch.reciprocal(p))
    if not scales:
        raise ValueError("the model has no NVFP4 weights: load it with quantization 'nvfp4' first")
    _check_shared_scales(scales)
    ignore = sorted(_linear_names(model) - set(scales))
    _write_safetensors(entries, out, max_shard_bytes)
    _write_rest(model, tokenizer, out, dtype, nvfp4a16_quantization_config(ignore))
    log.info("exported %d NVFP4 linears (+%d other tensors) to %s", len(scales), len(entries) - 3 * len(scales), out)
    return out


def export_bf16(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
                dtype: str | torch.dtype = "bf16", max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write a dense checkpoint in ``dtype`` (NVFP4 / NF4 weights dequantized, no
    ``quantization_config``); a peft model's adapter goes to ``<out>/adapter``. Returns ``out_dir``."""
    dtype, out = _parse_dtype(dtype), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = {
        name: _dequantized(t, dtype) if isinstance(t, NVFP4WeightTensor) or hasattr(t, "quant_state") else _dense(t, dtype)
        for name, t in base_tensors(model)
    }
    _write_safetensors(entries, out, max_shard_bytes)
    _write_rest(model, tokenizer, out, dtype, None)
    log.info("exported %d dense tensors (%s) to %s", len(entries), dtype, out)
    return out


def export_adapter(peft_model: nn.Module, out_dir: str | Path) -> Path:
    """peft ``save_pretrained`` of the adapter (``adapter_model.safetensors`` +
    ``adapter_config.json``); trainable non-LoRA parameters (the RMSNorm scales of
    ``trainable_norms``) go to ``trainable_norms.safetensors`` under their HF names."""
    if not _is_peft(peft_model):
        raise ValueError("export_adapter needs a peft model")
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    norms = {hf_name(n): p.detach().cpu().contiguous() for n, p in peft_model.named_parameters()
             if p.requires_grad and not _is_adapter(n)}
    _write_trainable_norms(out, norms)
    return out


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


def adapter_from_checkpoint(ckpt_path: str | Path, out_dir: str | Path) -> Path:
    """The adapter of a training checkpoint (``.ckpt``: the trainable tensors and the module's
    hyper-parameters), written as :func:`export_adapter` writes it at the end of a run, without loading
    the base model: to serve or evaluate any step of a run, also one that did not finish."""
    ckpt = _load_checkpoint(ckpt_path)
    hp, state = ckpt["hyper_parameters"] or {}, ckpt["state_dict"] or {}
    lora = hp.get("lora") or {}
    settings = lora if isinstance(lora, LoraSettings) else LoraSettings(**lora)
    adapter, norms = {}, {}
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{ckpt_path}: state_dict[{key!r}] is not a tensor ({type(tensor).__name__})")
        name = key[len("model."):] if key.startswith("model.") else key  # QeRLModule.model
        if _is_adapter(name):  # peft's own naming on save: the adapter name ("default") dropped
            adapter[name.replace(".default", "")] = tensor.contiguous()
        else:
            norms[hf_name(name)] = tensor.contiguous()
    if not adapter:
        raise ValueError(f"{ckpt_path}: no LoRA tensors in its state_dict (not a qerl training checkpoint?)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lora_config(settings, hp.get("model")).save_pretrained(str(out))
    save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_trainable_norms(out, norms)
    return out


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Inverse of :func:`export_adapter`: wrap ``model`` with the saved adapter and load the
    trainable norms (marked trainable again, so a re-export writes them too)."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    _load_trainable_norms(peft_model, adapter_dir)
    return peft_model


def load_adapter_into(peft_model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Like :func:`load_adapter` for a model that already carries a LoRA of the same shape (the
    policy built from a config): copy the saved LoRA weights and trainable norms into it.

    The saved ``adapter_config.json`` must match the model's LoRA (rank, alpha, target modules, and
    rsLoRA / DoRA, which also change the update) and the file must hold exactly the model's LoRA
    tensors: otherwise a ValueError in one line, before anything is copied. A different alpha or a
    subset of the trained modules would otherwise load silently and give other logits."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from peft.utils import load_peft_weights

    adapter_dir = Path(adapter_dir)
    _check_adapter_config(peft_model, adapter_dir)
    device = str(next(peft_model.parameters()).device)
    saved = load_peft_weights(str(adapter_dir), device=device)
    expected = set(get_peft_model_state_dict(peft_model))  # same naming as the file (no adapter name)
    extra, missing = sorted(set(saved) - expected), sorted(expected - set(saved))
    if extra:
        raise ValueError(f"adapter {adapter_dir} has {len(extra)} LoRA tensors the model has no slot for "
                         f"(e.g. {extra[0]}): set model.lora to match the adapter_config.json there")
    if missing:
        raise ValueError(f"adapter {adapter_dir} lacks {len(missing)} LoRA tensors of the model "
                         f"(e.g. {missing[0]}): set model.lora to match the adapter_config.json there")
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


def _check_adapter_config(peft_model: nn.Module, adapter_dir: Path) -> None:
    """ValueError naming every LoRA setting where ``adapter_dir/adapter_config.json`` and the model differ."""
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"adapter {adapter_dir}: no adapter_config.json there (a peft adapter directory)")
    saved = json.loads(config_file.read_text())
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
    norms_file = Path(adapter_dir) / TRAINABLE_NORMS_FILE
    if not norms_file.exists():
        return
    norms = load_file(str(norms_file))
    base = peft_model.get_base_model()
    unexpected = base.load_state_dict(norms, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"{norms_file} has tensors the model lacks: {unexpected[:5]}")
    for name in norms:
        base.get_parameter(name).requires_grad_(True)


_CLI_EPILOG = """\
writes into --out: config.json (+ quantization_config for nvfp4), model.safetensors (or shards +
index), generation_config.json, the tokenizer, and with --adapter: adapter/ (peft adapter_model.
safetensors + adapter_config.json, plus trainable_norms.safetensors when norms were trained).
--adapter may also be a training checkpoint (.ckpt, e.g. checkpoints/<run>/last.ckpt); --format adapter
writes only its adapter into --out (no --model needed, nothing loaded but the checkpoint).

examples:
  python -m qerl.export --model Qwen/Qwen2.5-7B-Instruct --format nvfp4 --out exports/q7b-nvfp4 --device cuda
  python -m qerl.export --model Qwen/Qwen2.5-7B-Instruct --adapter logs/run/version_0/adapter --out exports/rl
  vllm serve exports/rl --enable-lora --lora-modules policy=exports/rl/adapter
  python -m qerl.export --format adapter --adapter checkpoints/run/last.ckpt --out exports/rl-step600
"""


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before minutes of loading, an output that would clobber the input or an earlier export."""
    out = Path(args.out).expanduser().resolve()
    is_ckpt = str(args.adapter or "").endswith(".ckpt")
    if args.format == "adapter" and not is_ckpt:
        parser.error("--format adapter converts a training checkpoint: pass --adapter PATH.ckpt")
    if args.format != "adapter" and not args.model:
        parser.error("--model is required (unless --format adapter)")
    if is_ckpt and not Path(args.adapter).is_file():
        parser.error(f"--adapter {args.adapter}: no such checkpoint file")
    model_path = Path(args.model).expanduser() if args.model else None
    if model_path is not None and model_path.exists() and model_path.resolve() in (out, *out.parents):
        parser.error(f"--out {args.out} would overwrite the model being exported ({args.model})")
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not args.overwrite):
        parser.error(f"--out {args.out} exists and is not empty (pass --overwrite to replace an earlier export)")
    if args.adapter and not is_ckpt and not (Path(args.adapter) / "adapter_config.json").is_file():
        parser.error(f"--adapter {args.adapter}: no adapter_config.json there (a peft adapter directory)")
    if args.adapter and args.format == "bf16" and not args.from_nvfp4:
        log.warning("--format bf16 --adapter: the adapter was trained on the NVFP4 base; --from-nvfp4 exports "
                    "that base (dequantized) instead of the original 16-bit weights")


def _checkpoint_adapter(parser: argparse.ArgumentParser, ckpt: str, out: str | Path) -> Path:
    """:func:`adapter_from_checkpoint` with an unreadable or foreign checkpoint as a one-line CLI error."""
    try:
        return adapter_from_checkpoint(ckpt, out)
    except (OSError, RuntimeError, ValueError, TypeError, KeyError, pickle.UnpicklingError) as err:
        parser.error(f"cannot read the adapter of --adapter {ckpt}: {err}")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m qerl.export", description=__doc__.split("\n\n")[0],
                                     epilog=_CLI_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="tiny-qwen2 | tiny-llama | model dir | HF id | .gguf")
    parser.add_argument("--format", choices=["nvfp4", "bf16", "adapter"], default="nvfp4",
                        help="adapter: only the adapter of the --adapter checkpoint")
    parser.add_argument("--out", required=True, help="output directory (new or empty, or see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace the export already in --out")
    parser.add_argument("--adapter", default=None,
                        help="peft adapter dir (written by export_adapter / save_pretrained) or a training .ckpt")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="dtype of the 16-bit tensors")
    parser.add_argument("--device", default="cpu", help="where to quantize (cuda is faster for big models)")
    parser.add_argument("--from-nvfp4", action="store_true",
                        help="with --format bf16: export the dequantized NVFP4 weights instead of the originals")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny random models")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _check_paths(parser, args)
    if args.format == "adapter":
        out = _checkpoint_adapter(parser, args.adapter, args.out)
        print(out)
        return out
    quantization = "nvfp4" if args.format == "nvfp4" or args.from_nvfp4 else "bf16"
    try:
        model, tokenizer = load_policy(args.model, quantization, None, dtype=args.dtype, device=args.device,
                                       seed=args.seed)
    except (OSError, ValueError) as err:  # unknown model path / id, unreadable GGUF
        parser.error(f"cannot load --model {args.model}: {err}")
    if args.adapter and str(args.adapter).endswith(".ckpt"):
        with tempfile.TemporaryDirectory() as tmp:
            model = load_adapter(model, _checkpoint_adapter(parser, args.adapter, tmp))
    elif args.adapter:
        model = load_adapter(model, args.adapter)
    shutil.rmtree(Path(args.out) / ADAPTER_SUBDIR, ignore_errors=True)  # never leave an earlier run's adapter
    export = export_nvfp4 if args.format == "nvfp4" else export_bf16
    out = export(model, tokenizer, args.out, dtype=args.dtype)
    print(out)
    return out


if __name__ == "__main__":
    main()
