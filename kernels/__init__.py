"""Triton kernels for NVFP4 weight x bf16/fp16 activation linears on Hopper.

Public API (called by ``qerl/nvfp4.py``'s autograd function for CUDA tensors; bias is added outside):

* ``nvfp4_linear_forward(x[M, K], qdata, scale, per_tensor_scale, out=None) -> y[M, N]``
* ``nvfp4_linear_grad_input(grad_out[M, N], qdata, scale, per_tensor_scale, out=None) -> gx[M, K]``
* ``nvfp4_dequantize(qdata, scale, per_tensor_scale, dtype=torch.bfloat16) -> W[N, K]``
* ``is_available(device) -> bool``

Weight format: ``qdata`` uint8 [N, K/2] (low nibble = even k), ``scale`` float8_e4m3fn [N, K/16],
``per_tensor_scale`` fp32 0-d. x / grad_out may have leading batch dims (flattened); outputs are in
the activation dtype with fp32 accumulation. Triton is imported lazily so ``import kernels``
works on a machine without it. Design notes: ``kernels/nvfp4_w4a16.py`` (Triton),
``kernels/nvfp4_skinny.py`` (CUDA, decode), ``kernels/nvfp4_wgmma.py`` (CUDA, 17-128 tokens),
measurements: ``kernels/NOTES.md``; which one runs per shape: ``kernels/_launch.py``.
"""

import logging

import torch

__all__ = ["is_available", "nvfp4_linear_forward", "nvfp4_linear_grad_input", "nvfp4_dequantize"]


def is_available(device=None) -> bool:
    """True if the Triton kernels can run on ``device`` (CUDA, sm_89+ for e4m3, triton importable)."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError as err:  # said once: every NVFP4 linear then dequantizes + matmuls
        if not _SAID_NO_TRITON:
            _SAID_NO_TRITON.append(True)
            logging.getLogger("qerl.kernels").warning(
                "triton cannot be imported (%s): NVFP4 linears on CUDA dequantize and use cuBLAS", err)
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 9)


_SAID_NO_TRITON: list = []


def _check(a, qdata, scale, per_tensor_scale, red_dim, out=None):
    if qdata.dtype != torch.uint8 or qdata.dim() != 2:
        raise ValueError(f"qdata must be uint8 [N, K/2], got {qdata.dtype} {tuple(qdata.shape)}")
    N, K = qdata.shape[0], qdata.shape[1] * 2
    # (uint8: e4m3 bits; another 1-byte float, e5m2, would decode as e4m3 here but not on the CPU path)
    if K % 16 or tuple(scale.shape) != (N, K // 16) or scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"scale must be e4m3 [N, K/16] = [{N}, {K // 16}], got {scale.dtype} {tuple(scale.shape)}")
    if not a.device == qdata.device == scale.device == per_tensor_scale.device:
        raise ValueError(f"activation, qdata, scale and per_tensor_scale on different devices: {a.device}, "
                         f"{qdata.device}, {scale.device}, {per_tensor_scale.device}")
    if not (qdata.is_contiguous() and scale.is_contiguous()):
        raise ValueError("qdata and scale must be contiguous")
    want = K if red_dim == "K" else N
    if a.shape[-1] != want:
        raise ValueError(f"activation last dim {a.shape[-1]} != {red_dim}={want}")
    if per_tensor_scale.numel() != 1:
        raise ValueError("per_tensor_scale must have one element")
    if out is not None:
        check_out(out, a, N if red_dim == "K" else K)


def check_out(out, a, cols) -> None:
    """``out`` as the kernels write it: every row of ``a``'s leading shape x ``cols``, in ``a``'s dtype
    and device, at unit last stride (also what ``_launch`` asks of the 2-D view it gets)."""
    want = (*a.shape[:-1], cols)
    if tuple(out.shape) != want or out.dtype != a.dtype or out.device != a.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {a.dtype} {list(want)} on {a.device} with unit last stride, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}, strides {out.stride()}")


def nvfp4_linear_forward(x, qdata, scale, per_tensor_scale, out=None):
    """y = x @ W^T with W = e2m1(qdata) * scale * per_tensor_scale; y in x.dtype."""
    from . import _launch
    _check(x, qdata, scale, per_tensor_scale, "K", out)
    lead = x.shape[:-1]
    y = _launch.linear_forward(x.reshape(-1, x.shape[-1]), qdata, scale, per_tensor_scale,
                               out=None if out is None else out.view(-1, qdata.shape[0]))
    return y.view(*lead, qdata.shape[0])


def nvfp4_linear_grad_input(grad_out, qdata, scale, per_tensor_scale, out=None):
    """gx = grad_out @ W (reduction over N, across the block-scale groups); gx in grad_out.dtype."""
    from . import _launch
    _check(grad_out, qdata, scale, per_tensor_scale, "N", out)
    lead = grad_out.shape[:-1]
    K = qdata.shape[1] * 2
    gx = _launch.linear_grad_input(grad_out.reshape(-1, grad_out.shape[-1]), qdata, scale,
                                   per_tensor_scale, out=None if out is None else out.view(-1, K))
    return gx.view(*lead, K)


def nvfp4_dequantize(qdata, scale, per_tensor_scale, dtype=torch.bfloat16):
    """W[N, K] in ``dtype`` (one Triton pass; used by the large-M path)."""
    from . import _launch
    return _launch.dequantize(qdata, scale, per_tensor_scale, dtype)
