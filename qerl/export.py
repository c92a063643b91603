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
``trainable_norms`` is on, the untrained ones then beside them in ``qerl_base_norms/`` from the CLI;
AQN noise lives outside the weights and is never exported).

CLI: ``python -m qerl.export --model tiny-qwen2 --format nvfp4 --out DIR [--adapter PATH]``
(``qerl.export_cli``: its arguments, checks and the base an adapter trained on).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from qerl.adapter import (  # noqa: F401  (the adapter half of the export, re-exported here)
    BASE_FILE, TRAINABLE_NORMS_FILE, _hf_model, _is_adapter, _is_peft, adapter_from_checkpoint, check_adapter_dir,
    checkpoint_base, export_adapter, hf_name, load_adapter, load_adapter_into, read_base, same_model,
)
from qerl.model import _parse_dtype
from qerl.nvfp4 import BLOCK_SIZE, NVFP4WeightTensor
from qerl.quantize import SHARED_SCALE_GROUPS

log = logging.getLogger(__name__)

# The compressed-tensors release whose NVFP4A16 output we mirror (the one vLLM 0.25 pins).
CT_FORMAT_VERSION = "0.17.0"
NVFP4_FORMAT = "nvfp4-pack-quantized"
ADAPTER_SUBDIR = "adapter"
MAX_SHARD_BYTES = 5 * 2**30

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
    ``qerl.quantize`` quantizes each group with one shared scale."""
    for prefix in scales:
        parent, short = prefix.rpartition(".")[::2]
        for group in SHARED_SCALE_GROUPS:
            if short != group[0]:
                continue
            vals = [scales.get(f"{parent}.{g}") for g in group]
            if all(v is not None for v in vals) and not all(torch.equal(vals[0], v) for v in vals[1:]):
                raise ValueError(f"{parent}.{{{','.join(group)}}} have different per-tensor scales; vLLM fuses them "
                                 "with one (max) scale: quantize them with a shared one (qerl.quantize does)")


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
                quantization_config: dict | None, with_adapter: bool) -> None:
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
    if with_adapter and _is_peft(model):
        export_adapter(model, out / ADAPTER_SUBDIR)


_TOKENIZER_PROBE = "What is 6 + 6?\nThe answer is \\boxed{12}.  Done"


def warn_if_auto_tokenizer_differs(tokenizer: PreTrainedTokenizerBase, out: Path) -> bool:
    """Warn (and return True) when ``AutoTokenizer.from_pretrained(out)`` encodes text differently from
    ``tokenizer``: transformers 5 rebuilds a Qwen2 model's tokenizer as its own class from the vocab and
    merges alone, which keeps a real Qwen tokenizer intact but drops the spaces and newlines of a
    tokenizer with another pipeline (qerl's tiny test models); ``PreTrainedTokenizerFast`` reads
    tokenizer.json as written (qerl's ``load_tokenizer`` does so for such folders)."""
    from transformers import AutoTokenizer

    try:
        reloaded = AutoTokenizer.from_pretrained(str(out))
        same = reloaded(_TOKENIZER_PROBE)["input_ids"] == tokenizer(_TOKENIZER_PROBE)["input_ids"]
    except Exception as err:  # a loader that fails here fails for the user too: say so, keep the export
        log.warning("AutoTokenizer.from_pretrained(%s) fails (%s: %s); PreTrainedTokenizerFast.from_pretrained "
                    "reads its tokenizer.json as written", out, type(err).__name__, err)
        return True
    if not same:
        log.warning("AutoTokenizer.from_pretrained(%s) builds a %s that encodes text differently from the tokenizer "
                    "trained with (%s): load it with PreTrainedTokenizerFast.from_pretrained(%s) (qerl's load_tokenizer does)", out, type(reloaded).__name__, type(tokenizer).__name__, out)
    return not same


def export_nvfp4(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
                 dtype: str | torch.dtype = "bf16", max_shard_bytes: int = MAX_SHARD_BYTES,
                 with_adapter: bool = True) -> Path:
    """Write a compressed-tensors NVFP4A16 checkpoint of ``model`` (plain HF or peft-wrapped; its
    decoder linears must hold ``NVFP4WeightTensor``). Other tensors are cast to ``dtype`` (16-bit).
    Every ``nn.Linear`` left unquantized (``lm_head``) is listed in ``ignore``. A peft model's adapter
    goes to ``<out>/adapter`` unless ``with_adapter=False`` (the vLLM engine pushes it from memory).
    Returns ``out_dir``."""
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
    _write_rest(model, tokenizer, out, dtype, nvfp4a16_quantization_config(ignore), with_adapter)
    log.info("exported %d NVFP4 linears (+%d other tensors) to %s", len(scales), len(entries) - 3 * len(scales), out)
    return out


def export_bf16(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
                dtype: str | torch.dtype = "bf16", max_shard_bytes: int = MAX_SHARD_BYTES,
                with_adapter: bool = True) -> Path:
    """Write a dense checkpoint in ``dtype`` (NVFP4 / NF4 weights dequantized, no
    ``quantization_config``); a peft model's adapter goes to ``<out>/adapter`` unless
    ``with_adapter=False``. Returns ``out_dir``."""
    dtype, out = _parse_dtype(dtype), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = {
        name: _dequantized(t, dtype) if isinstance(t, NVFP4WeightTensor) or hasattr(t, "quant_state") else _dense(t, dtype)
        for name, t in base_tensors(model)
    }
    _write_safetensors(entries, out, max_shard_bytes)
    _write_rest(model, tokenizer, out, dtype, None, with_adapter)
    log.info("exported %d dense tensors (%s) to %s", len(entries), dtype, out)
    return out


if __name__ == "__main__":  # the command line is qerl.export_cli's (imported here only: it imports this module)
    from qerl.export_cli import main

    main()

