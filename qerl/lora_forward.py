"""LoRA computed in the activations' dtype: fp32 adapter weights, bf16 matmuls, one fused add.

peft keeps the adapters of a bf16 model in fp32 (right: an AdamW step at lr 1e-5 is below bf16's
spacing and would round away) and therefore runs every adapted linear in fp32 too: the activation
cast to fp32, two fp32 GEMMs (SIMT FFMA: no tensor cores without TF32), ``* scaling`` and ``+`` over
the fp32 ``[tokens, N]`` output and a cast back -- in backward the same again. On a Qwen2.5-7B-shaped
model (LoRA r32 on every linear, 4096 tokens, gradient checkpointing) those elementwise kernels were
~45% of a training step's GPU time on the H200 (``benchmarks/train_step.py --profile``).

:func:`compute_in_activation_dtype` swaps each adapted linear's class for a subclass whose forward
is ``base(x) + dropout(x) A'^T (s B)'^T`` with ``'`` a cast to x's dtype: two tensor-core GEMMs, the
add fused into cuBLAS' epilogue (``addmm``); the casts' backward returns fp32 gradients to the fp32
weights, so the optimizer is unchanged (what bf16 autocast does, as TRL and verl train). The same
:func:`plus_lora` is what the embedded engine runs while generating (``qerl.rollout.fast_linears``),
so trainer and sampler compute the adapter alike. Where x already has the adapters' dtype (fp32
models, the CPU quickstart) or the module is not plain LoRA (merged, disabled, several adapters,
DoRA and other variants, a bias on B, peft's mixed-batch ``adapter_names``), peft's own forward runs.
A class swap rather than an instance ``forward``: the generation contexts set and delete instance
forwards of their own, and the parameters, their names and ``isinstance`` checks stay peft's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def plus_lora(result: torch.Tensor, x: torch.Tensor, A: torch.Tensor, sB: torch.Tensor) -> torch.Tensor:
    """``result + (x A^T) sB^T`` in two GEMMs, the add fused into cuBLAS' epilogue (``addmm``)."""
    h = F.linear(x if x.dtype == A.dtype else x.to(A.dtype), A)  # (..., r)
    flat = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]).to(result.dtype),
                       sB.t().to(result.dtype))                  # (.to: no-ops when the dtypes agree)
    return flat.view(result.shape)


def plain_adapter(module: nn.Module) -> str | None:
    """The name of the one plain LoRA adapter active in ``module`` (a peft LoRA linear), or None when
    it runs none (disabled, none active here) or anything else (merged, several adapters, a variant
    such as DoRA, a bias on B, a non-linear A)."""
    if getattr(module, "merged", False) or module.disable_adapters:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if (name in getattr(module, "lora_variant", {}) or not isinstance(module.lora_A[name], nn.Linear)
            or module.lora_B[name].bias is not None):
        return None
    return name


def scaled_adapter(module: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A (r, K), scaling * B (N, r))`` of adapter ``name``: what :func:`plus_lora` multiplies by,
    in training (cast per call) and in generation (cast once), so both compute alike."""
    return module.lora_A[name].weight, module.lora_B[name].weight * module.scaling[name]


def _forward_in_activation_dtype(self, x: torch.Tensor, *args, peft_forward, **kwargs) -> torch.Tensor:
    """peft's LoRA ``forward`` with the adapter's matmuls in ``x.dtype`` (see the module docstring)."""
    name = None if (args or kwargs) else plain_adapter(self)
    if name is None or x.dtype == self.lora_A[name].weight.dtype:
        return peft_forward(self, x, *args, **kwargs)
    A, sB = scaled_adapter(self, name)                                    # (r, K), (N, r) fp32
    return plus_lora(self.base_layer(x), self.lora_dropout[name](x), A.to(x.dtype), sB.to(x.dtype))


_CLASSES: dict[type, type] = {}  # peft class -> its subclass with the forward above


def _new_in_activation_dtype(peft_class: type) -> nn.Module:
    cls = _in_activation_dtype_class(peft_class)
    return cls.__new__(cls)


def _in_activation_dtype_class(cls: type) -> type:
    """The subclass of peft's ``cls`` with the forward above. Both methods hold ``cls`` itself (not
    ``type(self)``), so a further subclass -- FSDP2 and parametrizations make one -- still reaches
    peft's forward and pickles by peft's class."""
    if cls not in _CLASSES:
        peft_forward = cls.forward

        def forward(self, x, *args, **kwargs):
            return _forward_in_activation_dtype(self, x, *args, peft_forward=peft_forward, **kwargs)

        def __reduce_ex__(self, protocol):
            """Pickle (``torch.save(model)``, spawned workers) as peft's class plus a note to swap
            it back: the generated class has no importable name of its own."""
            reduced = object.__reduce_ex__(self, protocol)      # (copyreg.__newobj__, (cls,), state, ...)
            return (_new_in_activation_dtype, (cls,)) + tuple(reduced[2:])

        _CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": forward, "__reduce_ex__": __reduce_ex__, "__module__": __name__,
            "__doc__": f"peft's {cls.__qualname__} with the adapter computed in the activations' dtype."})
    return _CLASSES[cls]


def is_swapped(module: nn.Module) -> bool:
    return isinstance(module, tuple(_CLASSES.values()))


def compute_in_activation_dtype(model: nn.Module) -> int:
    """Give every peft LoRA linear of ``model`` the forward above; returns how many got it."""
    n = 0
    for module in model.modules():
        if (hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")
                and not is_swapped(module) and isinstance(module.base_layer, nn.Linear)):
            module.__class__ = _in_activation_dtype_class(type(module))
            n += 1
    return n
