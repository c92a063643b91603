"""NVFP4 weights: a torchao-style tensor subclass and the linear that runs on it.

Format (NVIDIA FP4, as in vLLM / compressed-tensors / torchao):

    W[n, k] = e2m1(code[n, k]) * float(scale[n, k // 16]) * per_tensor_scale

- ``qdata``  uint8 ``[N, K/2]``: two 4-bit e2m1 codes per byte, element 2j in the LOW nibble.
  Codes decode to ``[0, .5, 1, 1.5, 2, 3, 4, 6]`` with bit 3 as the sign.
- ``scale``  float8_e4m3fn ``[N, K/16]``: one block scale per 16 consecutive elements of a row.
- ``per_tensor_scale`` fp32 0-d: multiplies every block scale. It is mandatory in practice: LLM
  weights (std ~0.02) have block amaxes below e4m3's 2^-6 floor, so without it they lose precision
  or flush to zero. q/k/v (and gate/up) may share one per-tensor scale because vLLM fuses them.

That is 4.5 bits per weight. Quantization reuses torchao's ``nvfp4_quantize`` so our codes and
scales are bit-identical to torchao's ``NVFP4Tensor`` (the test oracle); we keep our own subclass
because torchao's dispatches at aten level after autograd decomposition (its backward arrives as
``mm(grad, W.t().t())``) and forces swizzled scales, which would leave no clean place for Hopper
kernels. Ours intercepts ``F.linear`` in ``__torch_function__`` and routes it to one autograd
function, ``NVFP4Linear``: on CPU it dequantizes and multiplies (the reference); on CUDA it calls
the Triton W4A16 kernels in ``kernels/``. The weight is frozen: only the input gets a gradient.

Subclassing ``torchao.utils.TorchAOBaseTensor`` gives flatten/unflatten (torch.compile), detach /
clone / copy_ (state_dict load), and makes peft wrap such linears as ``TorchaoLoraLinear``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.utils import TorchAOBaseTensor

aten = torch.ops.aten
BLOCK_SIZE = 16
# Which implementation NVFP4Linear uses on CUDA: "auto" (Triton kernels when importable, else the
# dequantize reference) or "reference" (always dequantize; for debugging and A/B checks).
_CUDA_BACKEND = "auto"


def set_cuda_backend(name: str) -> None:
    """Choose the CUDA path of the NVFP4 linear: ``"auto"`` (Triton kernels) or ``"reference"``."""
    global _CUDA_BACKEND
    if name not in ("auto", "reference"):
        raise ValueError(f"unknown NVFP4 CUDA backend {name!r}; use 'auto' or 'reference'")
    _CUDA_BACKEND = name


def check_finite(weight: torch.Tensor, name: str = "") -> None:
    """Refuse a weight holding inf or NaN: e2m1 has no code for them, and its amax would become the
    per-tensor scale of the whole tensor (and of its fused q/k/v or gate/up group), all NaN then.
    ``name`` (e.g. the linear's module name) starts the error message."""
    if not torch.isfinite(weight).all():
        n_inf, n_nan = int(torch.isinf(weight).sum()), int(torch.isnan(weight).sum())
        where = f"{name}: " if name else ""
        raise ValueError(f"{where}weight has non-finite values ({n_inf} inf, {n_nan} nan): cannot quantize")


def global_scale_for(*weights: torch.Tensor, names: Sequence[str] = ()) -> torch.Tensor:
    """The fp32 per-tensor scale shared by ``weights``: amax / (448 * 6), so the largest block
    scale lands on e4m3's maximum. Pass q, k and v (or gate and up) together to share one;
    ``names`` label them in the error a non-finite weight raises (see :func:`check_finite`)."""
    amaxes = torch.stack([w.detach().abs().amax().float() for w in weights])
    if not torch.isfinite(amaxes).all():  # amax propagates NaN: only then find and count the culprit
        for w, name in zip(weights, names or [""] * len(weights)):
            check_finite(w, name)
    amax = amaxes.amax()
    # An all-zero group would give scale 0 (NaN codes): any positive amax decodes zeros exactly, so
    # use 1. A positive amax below ~8e-36 gives a scale whose reciprocal, the exported
    # weight_global_scale, overflows to inf: such a group is raised to `_SMALLEST_AMAX` (its largest
    # block scale then sits below e4m3's maximum instead of at it; values that small are zeros anyway).
    amax = torch.where(amax > 0, amax.clamp(min=_SMALLEST_AMAX), torch.ones_like(amax))
    return per_tensor_amax_to_scale(amax)


# ~3.2e-35: per_tensor_amax_to_scale divides by 448 * 6; 4x above the amax whose 1 / scale overflows
_SMALLEST_AMAX = 4 * 448.0 * 6.0 / torch.finfo(torch.float32).max


def dequantize_nvfp4(
    qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Decode ``[N, K/2]`` packed codes into a dense ``[N, K]`` weight of ``dtype`` (computed in fp32).
    Each byte becomes its two values in one table lookup (torchao's decode of all 256 bytes, made once
    per device): the same numbers as unpacking and decoding every nibble, ~9x faster on the CPU."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    if torch.compiler.is_compiling():  # a cached table is a constant torch.compile cannot trace
        values = f4_unpacked_to_f32(unpack_uint4(qdata.contiguous()))
    else:
        values = F.embedding(qdata.int(), _byte_values(qdata.device))  # int32 indices: half the long temporary
    values = values.view(n, k // BLOCK_SIZE, BLOCK_SIZE)
    block_scales = scale.float() * per_tensor_scale.float()  # (N, K/16)
    return (values * block_scales.unsqueeze(-1)).view(n, k).to(dtype)


_BYTE_VALUES: dict[torch.device, torch.Tensor] = {}


def _byte_values(device: torch.device) -> torch.Tensor:
    """fp32 ``[256, 2]``: the two e2m1 values packed in each byte (low nibble first)."""
    table = _BYTE_VALUES.get(device)
    if table is None:
        every_byte = torch.arange(256, dtype=torch.uint8).view(256, 1)
        table = _BYTE_VALUES[device] = f4_unpacked_to_f32(unpack_uint4(every_byte)).view(256, 2).to(device)
    return table


_KERNELS = None  # this repository's kernels/ package, once loaded


def load_kernels():
    """This repository's ``kernels/`` package (imported lazily: CPU machines need no Triton).

    Hugging Face's ``kernels`` (the hub-kernels package transformers and bitsandbytes use) has the
    same top-level name and wins wherever the repository root is not first on ``sys.path``; then
    ours is loaded from its own path as ``qerl_kernels`` and theirs is left alone."""
    global _KERNELS
    if _KERNELS is None:
        try:
            import kernels as found
        except ImportError:
            found = None
        if not hasattr(found, "nvfp4_linear_forward"):
            root = Path(__file__).resolve().parent.parent / "kernels"
            found = sys.modules.get("qerl_kernels")
            if found is None:
                spec = importlib.util.spec_from_file_location(
                    "qerl_kernels", root / "__init__.py", submodule_search_locations=[str(root)])
                found = importlib.util.module_from_spec(spec)
                sys.modules["qerl_kernels"] = found  # before running it: its relative imports look here
                spec.loader.exec_module(found)
        _KERNELS = found
    return _KERNELS


_KERNELS_ON: dict[torch.device, bool] = {}  # device -> kernels usable there (asked once: ~10 us a call)


def _use_kernels(x: torch.Tensor) -> bool:
    if not x.is_cuda or _CUDA_BACKEND == "reference":
        return False
    if x.device not in _KERNELS_ON:
        _KERNELS_ON[x.device] = load_kernels().is_available(x.device)
    return _KERNELS_ON[x.device]


class NVFP4Linear(torch.autograd.Function):
    """``y = x @ W.T + b`` with W in NVFP4. Saves only the packed weight for backward (never a
    dequantized copy) and returns a gradient for ``x`` (and ``b``) only: the base is frozen."""

    @staticmethod
    def forward(ctx, x, qdata, scale, per_tensor_scale, bias):
        ctx.save_for_backward(qdata, scale, per_tensor_scale)
        ctx.has_bias = bias is not None
        x2d = x.reshape(-1, x.shape[-1])  # (M, K)
        if _use_kernels(x2d):
            y2d = load_kernels().nvfp4_linear_forward(x2d.contiguous(), qdata, scale, per_tensor_scale)  # (M, N)
            if bias is not None:
                y2d = y2d + bias
        else:
            y2d = F.linear(x2d, dequantize_nvfp4(qdata, scale, per_tensor_scale, x.dtype), bias)
        return y2d.view(*x.shape[:-1], qdata.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        qdata, scale, per_tensor_scale = ctx.saved_tensors
        g2d = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            if _use_kernels(g2d):
                gx2d = load_kernels().nvfp4_linear_grad_input(g2d.contiguous(), qdata, scale, per_tensor_scale)
            else:
                gx2d = g2d @ dequantize_nvfp4(qdata, scale, per_tensor_scale, g2d.dtype)  # (M, K)
            grad_x = gx2d.view(*grad_out.shape[:-1], gx2d.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_bias = g2d.sum(0)
        return grad_x, None, None, None, grad_bias


class NVFP4WeightTensor(TorchAOBaseTensor):
    """A frozen ``[N, K]`` linear weight stored as NVFP4 (see the module docstring).

    Args:
        qdata: packed e2m1 codes, uint8 ``[N, K/2]``, even element in the low nibble.
        scale: float8_e4m3fn block scales ``[N, K/16]``.
        per_tensor_scale: fp32 0-d tensor multiplying every block scale.
        orig_dtype: the dtype the tensor presents (and dequantizes to by default), e.g. bf16.
    """

    tensor_data_names = ["qdata", "scale", "per_tensor_scale"]
    tensor_attribute_names = ["orig_dtype"]

    def __new__(cls, qdata, scale, per_tensor_scale, orig_dtype):
        n, k_half = qdata.shape
        return torch.Tensor._make_wrapper_subclass(
            cls, (n, k_half * 2), dtype=orig_dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata, scale, per_tensor_scale, orig_dtype):
        self.qdata = qdata
        self.scale = scale
        self.per_tensor_scale = per_tensor_scale
        self.orig_dtype = orig_dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, per_tensor_scale: torch.Tensor | None = None,
                   name: str = "") -> "NVFP4WeightTensor":
        """Quantize a float ``[N, K]`` weight (K % 16 == 0). ``per_tensor_scale`` defaults to this
        weight's own ``amax / 2688``; pass ``global_scale_for(q, k, v)`` to share one across a group.
        A weight with inf / NaN is a ValueError that starts with ``name`` (see :func:`check_finite`)."""
        if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
            raise ValueError(f"{name + ': ' if name else ''}NVFP4 needs a 2-D weight with K divisible by 16, got shape "
                             f"{tuple(weight.shape)} (quantization: bf16 or nf4 runs such a model)")
        orig_dtype = weight.dtype
        # torchao rejects fp16 input; its math runs in fp32 anyway.
        w = weight.detach()
        w = (w if w.dtype in (torch.bfloat16, torch.float32) else w.float()).contiguous()
        if per_tensor_scale is None:
            pts = global_scale_for(w, names=[name])
        else:
            check_finite(w, name)  # its codes would be NaN even under a finite shared scale
            pts = per_tensor_scale
        # its own copy: q/k/v share the value, not the storage (a later copy_ into one must not rescale the others)
        pts = pts.detach().to(device=w.device, dtype=torch.float32).reshape(()).clone()
        scale, qdata = nvfp4_quantize(w, BLOCK_SIZE, pts)
        return cls(qdata, scale, pts, orig_dtype)

    def dequantize(self, output_dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nvfp4(self.qdata, self.scale, self.per_tensor_scale, output_dtype or self.orig_dtype)

    def packed_nbytes(self) -> int:
        """Bytes actually stored: codes + block scales + the per-tensor scale (≈ 4.5 bits/weight)."""
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scale, self.per_tensor_scale))

    def __repr__(self) -> str:
        return f"NVFP4WeightTensor(shape={tuple(self.shape)}, dtype={self.orig_dtype}, device={self.device})"


implements = NVFP4WeightTensor.implements
implements_torch_function = NVFP4WeightTensor.implements_torch_function


def _linear_arguments(input, weight, bias=None):  # noqa: A002  (F.linear's own parameter names)
    return input, weight, bias


@implements_torch_function(F.linear)
def _linear(func, types, args, kwargs):
    x, weight, bias = _linear_arguments(*args, **(kwargs or {}))  # any of them may come by keyword
    return NVFP4Linear.apply(x, weight.qdata, weight.scale, weight.per_tensor_scale, bias)


@implements(aten._to_copy.default)
def _to_copy(func, types, args, kwargs):
    """``.to(device)`` moves the packed tensors; ``.to(dtype)`` changes only the presented dtype
    (the codes stay NVFP4), so ``model.to(torch.bfloat16)`` cannot silently dequantize anything.
    Either way a copy, as ``_to_copy`` promises: an alias would see the other's later ``copy_``."""
    w = args[0]
    device = kwargs.get("device") or w.device
    dtype = kwargs.get("dtype") or w.orig_dtype
    move = lambda t: t.to(device=device, copy=True)  # noqa: E731
    return NVFP4WeightTensor(move(w.qdata), move(w.scale), move(w.per_tensor_scale), dtype)


@implements(aten.copy_.default)
def _copy_(func, types, args, kwargs):
    """``load_state_dict``'s in-place load: an NVFP4 weight of the same shapes copies its codes and
    scales; a dense tensor (a 16-bit checkpoint) is refused in one line rather than failing inside torchao."""
    dst, src = args[0], args[1]
    if not isinstance(src, NVFP4WeightTensor):
        raise TypeError(f"cannot copy a dense {src.dtype} tensor of shape {tuple(src.shape)} into an NVFP4 weight: "
                        "the base is frozen in NVFP4; load a 16-bit checkpoint with qerl.model.load_policy "
                        "(quantization: nvfp4 quantizes it), or NVFP4WeightTensor.from_float(weight)")
    if (dst.qdata.shape, dst.scale.shape) != (src.qdata.shape, src.scale.shape):
        raise ValueError(f"NVFP4 copy_: shape {tuple(src.shape)} into {tuple(dst.shape)}")
    for name in ("qdata", "scale", "per_tensor_scale"):
        getattr(dst, name).copy_(getattr(src, name))
    return dst


@implements([aten.mm.default, aten.addmm.default, aten.matmul.default, aten.t.default, aten.linear.default])
def _refuse(func, types, args, kwargs):
    # Anything but F.linear would bypass NVFP4Linear (and on CUDA, the kernels): fail loudly.
    raise NotImplementedError(
        f"NVFP4WeightTensor supports F.linear only (got {func}); call .dequantize() for a dense copy"
    )


torch.serialization.add_safe_globals([NVFP4WeightTensor])
