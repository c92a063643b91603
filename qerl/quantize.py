"""The decoder linears of a causal LM: which they are, quantizing them, and what the base then weighs.

- the layout: ``DECODER_LINEAR_PATHS`` (q/k/v/o/gate/up/down, Qwen2/Qwen3/Llama-style), the groups
  that share one NVFP4 per-tensor scale, and the check that a model has exactly these;
- quantization, layer by layer: NVFP4 (``NVFP4WeightTensor``) or the QLoRA baseline's NF4
  (bitsandbytes ``Linear4bit``);
- accounting: the frozen base's bytes (quantized weights at their packed size) and parameter counts.

Quantization walks the decoder layers one at a time: move layer i to the target device, replace
q/k/v/o/gate/up/down weights with ``NVFP4WeightTensor`` there. So the accelerator never holds more
than one 16-bit layer plus the already-quantized ones. Embeddings, norms and lm_head stay 16-bit (as
in QeRL and vLLM's NVFP4). q/k/v share one per-tensor scale and gate/up another, because vLLM fuses
them into one GEMM with a single global scale (research/vllm.md §1.2): the export is then lossless.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from qerl.nvfp4 import NVFP4WeightTensor, check_finite, global_scale_for

# Where each decoder linear sits in a layer (Qwen2/Qwen3/Llama-style): exactly these are quantized and
# adapted, and check_decoder_linears refuses a layer with any other weight matrix.
DECODER_LINEAR_PATHS = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}
DECODER_LINEARS = tuple(DECODER_LINEAR_PATHS)
# Projections that vLLM fuses into one GEMM and that must therefore share a per-tensor scale.
SHARED_SCALE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a HF causal LM (``model.model.layers`` for Qwen2/Llama-style)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `.model.layers`; only decoder-only HF LMs are supported")
    return layers


def _layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Short name -> the ``nn.Linear`` at its ``DECODER_LINEAR_PATHS`` path in ``layer`` (absent ones
    left out). By full path: a Qwen2-MoE's ``mlp.shared_expert.gate_proj`` is not ``mlp.gate_proj``."""
    modules = dict(layer.named_modules())
    return {short: modules[path] for short, path in DECODER_LINEAR_PATHS.items()
            if isinstance(modules.get(path), nn.Linear)}


def check_decoder_linears(model: nn.Module) -> None:
    """Every decoder layer must hold all of ``DECODER_LINEAR_PATHS`` as ``nn.Linear`` and no other
    weight matrix: fused projections (Phi-3's ``qkv_proj`` / ``gate_up_proj``) or mixture-of-experts
    (Qwen2-MoE's router and 3-D expert weights) would be quantized and adapted only in part, silently
    (the 4-bit arms then hold 16-bit attention or experts, without LoRA)."""
    allowed = {f"{path}.weight" for path in DECODER_LINEAR_PATHS.values()}
    for i, layer in enumerate(decoder_layers(model)):
        have = _layer_linears(layer)
        missing = [name for name in DECODER_LINEARS if name not in have]
        others = [name for name, p in layer.named_parameters() if p.dim() >= 2 and name not in allowed]
        if missing or others:
            problems = [f"no {', '.join(missing)} linear(s)"] if missing else []
            if others:
                more = f" and {len(others) - 3} more" if len(others) > 3 else ""
                problems.append(f"weights qerl would leave 16-bit without LoRA ({', '.join(others[:3])}{more})")
            raise ValueError(f"{type(model).__name__} layer {i} has {' and '.join(problems)}: qerl supports decoders "
                             "with separate self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj linears only "
                             "(Qwen2/Qwen3/Llama-style; no fused projections, no mixture-of-experts)")


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next((name for name, mod in model.named_modules() if mod is module), "")


@torch.no_grad()
def quantize_decoder_linears(model: nn.Module, device: str | torch.device = "cpu") -> int:
    """Replace every decoder linear weight by an ``NVFP4WeightTensor``, one layer at a time on
    ``device``; the rest of the model is moved to ``device`` afterwards. Returns the count.
    A weight with inf / NaN is a ValueError naming the linear (it would make its whole group NaN)."""
    count = 0
    layers = decoder_layers(model)
    prefix = _module_name(model, layers)
    for i, layer in enumerate(layers):
        layer.to(device)
        linears = _layer_linears(layer)
        names = {short: f"{prefix}.{i}.{DECODER_LINEAR_PATHS[short]}".lstrip(".") for short in linears}
        shared = {}
        for group in SHARED_SCALE_GROUPS:
            if all(g in linears for g in group):
                scale = global_scale_for(*(linears[g].weight for g in group), names=[names[g] for g in group])
                shared.update({g: scale for g in group})
        for short, mod in linears.items():
            qweight = NVFP4WeightTensor.from_float(mod.weight.data, shared.get(short), name=names[short])
            mod.weight = nn.Parameter(qweight, requires_grad=False)
            count += 1
    model.to(device)
    return count


@torch.no_grad()
def quantize_decoder_linears_nf4(model: nn.Module, device: str | torch.device = "cpu") -> int:
    """The QLoRA baseline: replace decoder linears by bitsandbytes ``Linear4bit`` (NF4, blocks of 64,
    double-quantized absmax as in QLoRA and the paper), one layer at a time on ``device``.

    bitsandbytes (>= 0.45) runs NF4 on CPU and CUDA, so the same baseline works in CPU tests and on
    the H200; torchao's NF4Tensor is not wrapped by peft's LoRA dispatch, bitsandbytes' is."""
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ModuleNotFoundError("quantization: nf4 needs bitsandbytes (pip install 'qerl[qlora]')") from err
    count = 0
    layers = decoder_layers(model)
    prefix = _module_name(model, layers)
    for i, layer in enumerate(layers):
        for short, mod in _layer_linears(layer).items():
            # a NaN / inf would become its block's absmax, and with double quantization the offset of
            # every block: the whole linear decodes to NaN (refused, as the nvfp4 arm refuses it)
            check_finite(mod.weight.data, f"{prefix}.{i}.{DECODER_LINEAR_PATHS[short]}".lstrip("."))
            q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                  compute_dtype=mod.weight.dtype, quant_type="nf4", compress_statistics=True,
                                  device="meta")
            q.weight = bnb.nn.Params4bit(mod.weight.data.to("cpu"), requires_grad=False, quant_type="nf4",
                                         compress_statistics=True)
            if mod.bias is not None:
                q.bias = nn.Parameter(mod.bias.data.clone(), requires_grad=False)
            q = q.to(device)  # Params4bit quantizes on the move
            # bitsandbytes >= 0.50 on AVX512-BF16 CPUs repacks an eval-mode weight for a no-autograd
            # gemv the first time it runs without grad (our rollouts) and keeps it packed: the
            # training forward after it then fails (or would get no input gradient). Keep the
            # autograd path: the CPU is for tests here.
            q.support_avx512bf16_for_cpu = False
            setattr(layer.get_submodule(DECODER_LINEAR_PATHS[short].rsplit(".", 1)[0]), short, q)
            count += 1
    model.to(device)
    return count


def is_lora_parameter(name: str) -> bool:
    """Whether a parameter name is a peft LoRA adapter weight (``lora_A`` / ``lora_B`` / ``lora_embedding_*``)."""
    return "lora_" in name


def base_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the frozen base: decoder linears (packed when NVFP4) and everything else."""
    linear, other = 0, 0
    seen = set()
    for name, p in model.named_parameters():
        if is_lora_parameter(name) or id(p) in seen:
            continue
        seen.add(id(p))
        if isinstance(p, NVFP4WeightTensor):
            linear += p.packed_nbytes()
        elif type(p).__name__ == "Params4bit":  # NF4 codes + its (double-quantized) absmax state
            state = getattr(p, "quant_state", None)
            extra = 0 if state is None else sum(t.numel() * t.element_size() for t in _quant_state_tensors(state))
            linear += p.numel() * p.element_size() + extra
        elif name.replace(".base_layer.", ".").rsplit(".", 2)[-2] in DECODER_LINEARS:  # not a wrapped lm_head
            linear += p.numel() * p.element_size()
        else:
            other += p.numel() * p.element_size()
    return {"decoder_linears": linear, "other": other, "total": linear + other}


def _quant_state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.absmax]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _logical_numel(p: torch.Tensor) -> int:
    """Elements a parameter stands for: a quantized bitsandbytes ``Params4bit`` holds N*K/2 packed
    bytes, its ``quant_state.shape`` the logical [N, K] (an NVFP4 weight already presents [N, K])."""
    state = getattr(p, "quant_state", None) if type(p).__name__ == "Params4bit" else None
    return math.prod(state.shape) if state is not None else p.numel()


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Trainable and total parameter counts (an NVFP4 or NF4 weight counts its logical N*K elements)."""
    trainable = sum(_logical_numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(_logical_numel(p) for p in model.parameters())
    return {"trainable": trainable, "total": total}
