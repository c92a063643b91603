"""NVFP4 weight subclass: format vs torchao, error, the linear's forward/backward, persistence."""

import copy
import io
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from qerl.nvfp4 import NVFP4WeightTensor, dequantize_nvfp4, global_scale_for

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def _linear(n=64, k=80, bias=True, std=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    w = torch.randn(n, k, generator=g) * std
    lin.weight = nn.Parameter(NVFP4WeightTensor.from_float(w), requires_grad=False)
    return lin, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 80), (48, 256), (128, 16)])
def test_codes_and_scales_match_torchao(dtype, shape):
    w = (torch.randn(*shape) * 0.02).to(dtype)
    ours = NVFP4WeightTensor.from_float(w)
    ref = NVFP4Tensor.to_nvfp4(
        w, block_size=16, per_tensor_scale=per_tensor_amax_to_scale(w.float().abs().amax()), is_swizzled_scales=False
    )
    assert ours.qdata.dtype == torch.uint8 and ours.qdata.shape == (shape[0], shape[1] // 2)
    assert ours.scale.dtype == torch.float8_e4m3fn and ours.scale.shape == (shape[0], shape[1] // 16)
    assert torch.equal(ours.qdata, ref.qdata)
    assert torch.equal(ours.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert torch.equal(ours.dequantize(torch.float32), ref.dequantize(torch.float32))


def test_dequantize_equals_torchao_decode_for_every_byte():
    """The byte-table decode against torchao's nibble unpack + e2m1 decode: all 256 bytes, both
    nibble orders, random block scales (fp8, subnormals included) -- bit-identical."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4

    g = torch.Generator().manual_seed(0)
    qdata = torch.cat([torch.arange(256, dtype=torch.uint8), torch.randint(0, 256, (3 * 256,), generator=g,
                                                                             dtype=torch.uint8)]).view(32, 32)
    scale = (torch.rand(32, 4, generator=g) * 2.0 ** torch.randint(-9, 8, (32, 4), generator=g)).to(torch.float8_e4m3fn)
    pts = torch.tensor(0.0123)
    ref = f4_unpacked_to_f32(unpack_uint4(qdata)).view(32, 4, 16) * (scale.float() * pts).unsqueeze(-1)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_nvfp4(qdata, scale, pts, dtype), ref.view(32, 64).to(dtype))


def test_nibble_order_and_code_table():
    # One row of 16 elements: element 2j must sit in the low nibble of byte j.
    values = torch.tensor([[0.5, 6.0, -1.0, 0.0, 3.0, -6.0, 1.5, 2.0, 4.0, -0.5, 1.0, -3.0, -2.0, -4.0, -1.5, 0.0]])
    q = NVFP4WeightTensor.from_float(values)
    low, high = q.qdata[0] & 0xF, q.qdata[0] >> 4
    pts = q.per_tensor_scale * q.scale.float()[0, 0]
    decoded = torch.stack([low, high], 1).flatten()
    assert torch.allclose(torch.tensor([E2M1[c] for c in decoded]) * pts, values)


@pytest.mark.parametrize("std", [1.0, 0.02, 1e-3])
def test_relative_error_on_gaussian_weights(std):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * std
    deq = NVFP4WeightTensor.from_float(w).dequantize(torch.float32)
    rel = ((deq - w).norm() / w.norm()).item()
    assert rel < 0.11, rel  # ~0.095 measured at every std thanks to the per-tensor scale


def test_shared_per_tensor_scale():
    q, k = torch.randn(64, 32), torch.randn(16, 32) * 3
    shared = global_scale_for(q, k)
    assert torch.equal(shared, per_tensor_amax_to_scale(k.abs().amax().clamp(min=q.abs().amax())))
    qq = NVFP4WeightTensor.from_float(q, shared)
    assert torch.equal(qq.per_tensor_scale, shared)
    assert ((qq.dequantize(torch.float32) - q).norm() / q.norm()) < 0.11


def test_a_tiny_weight_keeps_a_finite_exported_global_scale():
    """amax 1e-37: amax / 2688 is a denormal whose reciprocal (compressed-tensors' weight_global_scale)
    was inf. The amax is raised to ~3e-35, so 1 / scale stays finite and the values still decode."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 1e-37
    t = NVFP4WeightTensor.from_float(w)
    assert torch.isfinite(torch.reciprocal(t.per_tensor_scale)).all()
    deq, w = t.dequantize(torch.float32).double(), w.double()  # (fp32 squares of 1e-37 underflow)
    assert ((deq - w).norm() / w.norm()) < 0.11  # the largest block scale ~13 instead of 448: still e4m3-exact
    ordinary = torch.randn(64, 32)  # untouched above the floor
    assert torch.equal(global_scale_for(ordinary), per_tensor_amax_to_scale(ordinary.abs().amax()))


def test_non_finite_weights_are_refused_by_name():
    """One inf or NaN would be the amax of the shared per-tensor scale: the whole tensor, and every
    tensor of its fused group, would decode to NaN. It is a ValueError naming the weight instead."""
    q, k = torch.randn(64, 32), torch.randn(16, 32)
    k[3, 5], k[0, 0] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=r"^k_proj: weight has non-finite values \(1 inf, 1 nan\): cannot quantize$"):
        global_scale_for(q, k, names=["q_proj", "k_proj"])
    with pytest.raises(ValueError, match=r"^weight has non-finite values \(1 inf, 1 nan\)"):
        NVFP4WeightTensor.from_float(k)
    with pytest.raises(ValueError, match=r"^k_proj: weight has non-finite"):  # also under a finite shared scale
        NVFP4WeightTensor.from_float(k, global_scale_for(q), name="k_proj")


def test_linear_takes_keyword_arguments():
    lin, _ = _linear()
    x = torch.randn(3, 80)
    y = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(F.linear(input=x, weight=lin.weight, bias=lin.bias), y)
    assert torch.equal(F.linear(x, weight=lin.weight, bias=lin.bias), y)
    assert torch.equal(F.linear(input=x, weight=lin.weight), F.linear(x, lin.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_input_grad_equal_dequantized_reference(dtype):
    lin, _ = _linear()
    lin = lin.to(dtype)
    x = torch.randn(3, 5, 80, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = lin.weight.dequantize(dtype)
    bias_ref = lin.bias.detach().clone()
    y, y_ref = lin(x), F.linear(x_ref, w_ref, bias_ref)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    assert lin.bias.grad is not None and torch.allclose(lin.bias.grad, g.reshape(-1, 64).sum(0))
    assert lin.weight.grad is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_reference_backend_dequantizes_and_agrees_with_the_kernels(device, monkeypatch):
    """set_cuda_backend("reference") (A/B checks of the kernels) dequantizes + matmuls on CUDA too:
    the same numbers as the kernel path to bf16 rounding; an unknown name is refused."""
    import qerl.nvfp4 as nv

    with pytest.raises(ValueError, match="unknown NVFP4 CUDA backend 'triton'"):
        nv.set_cuda_backend("triton")
    lin, _ = _linear(n=256, k=512)
    lin = lin.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(4, 512, device=device, dtype=torch.bfloat16)
    y_auto = lin(x)
    monkeypatch.setattr(nv, "_CUDA_BACKEND", "auto")  # (restored after the test)
    nv.set_cuda_backend("reference")
    assert not nv._use_kernels(x)
    y_ref = lin(x)
    torch.testing.assert_close(y_ref, F.linear(x, lin.weight.dequantize(torch.bfloat16), lin.bias))
    torch.testing.assert_close(y_auto, y_ref, rtol=2e-2, atol=2e-2)


def test_state_dict_roundtrip_deepcopy_to_and_compile():
    lin, _ = _linear()
    x = torch.randn(4, 80)
    y = lin(x)
    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert isinstance(sd["weight"], NVFP4WeightTensor)
    other, _ = _linear(seed=5)
    other.load_state_dict(sd)
    assert torch.equal(other(x), y)
    assert torch.equal(copy.deepcopy(lin)(x), y)
    bf = copy.deepcopy(lin).to(torch.bfloat16)
    assert isinstance(bf.weight, NVFP4WeightTensor) and bf.weight.dtype == torch.bfloat16
    assert torch.equal(bf.weight.qdata, lin.weight.qdata)
    compiled = torch.compile(lin)
    xc = x.clone().requires_grad_(True)
    yc = compiled(xc)
    assert torch.allclose(yc, y, atol=1e-6)
    yc.sum().backward()
    assert xc.grad is not None


def test_other_matmuls_refuse_loudly():
    lin, _ = _linear()
    with pytest.raises(NotImplementedError, match="F.linear only"):
        torch.randn(2, 80) @ lin.weight.t()


def test_dequantize_function_matches_method():
    lin, _ = _linear()
    w = lin.weight
    assert torch.equal(dequantize_nvfp4(w.qdata, w.scale, w.per_tensor_scale, torch.float32), w.dequantize(torch.float32))


def test_kernels_load_past_a_foreign_kernels_package(monkeypatch):
    """Hugging Face's ``kernels`` shares our kernels/ package's top-level name and wins wherever the
    repository root is not first on sys.path: the CUDA path must still reach ours, and leave theirs."""
    import types

    import qerl.nvfp4 as nvfp4

    foreign = types.ModuleType("kernels")
    foreign.get_kernel = lambda *a, **k: None  # what their users import
    monkeypatch.setitem(sys.modules, "kernels", foreign)
    monkeypatch.delitem(sys.modules, "qerl_kernels", raising=False)
    monkeypatch.setattr(nvfp4, "_KERNELS", None)
    ours = nvfp4.load_kernels()
    assert ours is not foreign and sys.modules["kernels"] is foreign
    assert Path(ours.__file__).resolve() == Path(nvfp4.__file__).resolve().parent.parent / "kernels" / "__init__.py"
    assert callable(ours.nvfp4_linear_forward) and ours.is_available("cpu") is False
    monkeypatch.setattr(nvfp4, "_KERNELS", None)
    monkeypatch.setitem(sys.modules, "kernels", ours)  # the usual case: the repository's own package
    assert nvfp4.load_kernels() is ours



def test_embedded_engine_imports_past_a_foreign_kernels_package(monkeypatch):
    """Hugging Face's `kernels` package shadowing ours must not break the hf engine's import
    (the CUDA-graph helper it needs lives in qerl, not in kernels/)."""
    import importlib
    import types

    monkeypatch.setitem(sys.modules, "kernels", types.ModuleType("kernels"))  # a foreign, flat module
    monkeypatch.delitem(sys.modules, "qerl.rollout.decoders", raising=False)
    assert callable(importlib.import_module("qerl.rollout.decoders").abandon_capture)


def test_to_another_dtype_copies_the_packed_tensors():
    """``_to_copy`` returns a copy (it aliased the codes: a later ``copy_`` into one changed both)."""
    w = NVFP4WeightTensor.from_float(torch.randn(32, 64))              # presents fp32
    assert w.to(torch.float32) is w                                    # nothing to do: torch returns it
    for moved in (w.to(torch.bfloat16), w.to(torch.float16), w.to("cpu", copy=True)):
        assert isinstance(moved, NVFP4WeightTensor) and torch.equal(moved.qdata, w.qdata)
        assert moved.qdata.data_ptr() != w.qdata.data_ptr() and moved.scale.data_ptr() != w.scale.data_ptr()


def test_a_shared_scale_is_a_value_not_a_storage_and_dense_copies_are_refused():
    """q/k/v quantized under one per-tensor scale each keep their own copy of it: loading new codes into
    one (``copy_``, what ``load_state_dict`` does) leaves its siblings' weights as they were. A dense
    tensor copied into an NVFP4 weight is a one-line TypeError, not torchao's AttributeError."""
    torch.manual_seed(0)
    q = NVFP4WeightTensor.from_float(torch.randn(32, 64))
    k = NVFP4WeightTensor.from_float(torch.randn(32, 64), per_tensor_scale=q.per_tensor_scale)
    assert torch.equal(k.per_tensor_scale, q.per_tensor_scale)
    k_before = k.dequantize().clone()
    q.copy_(NVFP4WeightTensor.from_float(5 * torch.randn(32, 64)))
    assert torch.equal(k.dequantize(), k_before) and not torch.equal(k.per_tensor_scale, q.per_tensor_scale)
    linear = torch.nn.Linear(64, 32, bias=False)
    linear.weight = torch.nn.Parameter(k, requires_grad=False)
    fresh = NVFP4WeightTensor.from_float(torch.randn(32, 64))
    linear.load_state_dict({"weight": fresh})
    assert torch.equal(linear.weight.dequantize(), fresh.dequantize())
    with pytest.raises(RuntimeError, match="cannot copy a dense torch.float32 tensor .* into an NVFP4 weight"):
        linear.load_state_dict({"weight": torch.randn(32, 64)})
