"""Tests for the Triton NVFP4 W4A16 kernels (``kernels/``).

* CPU: the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, fp32, in a
  subprocess because the variable must be set before triton is imported); skipped without triton.
* GPU (``@pytest.mark.gpu``, skipped without CUDA): forward and grad-input against an fp64
  reference of the dequantized weight, bf16 activations, rel. error <= 1e-2, outputs poisoned
  with NaN before every run, fresh random inputs for every check; an exhaustive decode check;
  every autotuning candidate config; determinism of the split-K reduction; CUDA-graph capture.
"""

import os
import subprocess
import textwrap

import pytest
import torch

import kernels
import triton_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def ref_weight(qdata, scale, pts):
    """fp64 W[N, K] from the packed format (16-entry LUT, independent of torchao)."""
    q = qdata.cpu()
    N = q.shape[0]
    codes = torch.stack([q & 15, q >> 4], -1).reshape(N, -1).long()
    return (LUT[codes].view(N, -1, 16) * (scale.cpu().double() * pts.cpu().double())[..., None]).view(N, -1)


def rand_weight(N, K, device="cpu", gen=None):
    """Random codes (all 16 used) and e4m3 block scales over ~2^-9..2^4 (subnormals included)."""
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    e = torch.randint(-9, 5, (N, K // 16), generator=gen).double()
    s = (torch.rand(N, K // 16, generator=gen, dtype=torch.float64) + 1) * 2.0 ** e
    pts = torch.tensor(0.013 + torch.rand(1, generator=gen).item() * 0.01, dtype=torch.float32)
    return q.to(device), s.to(torch.float8_e4m3fn).to(device), pts.to(device)


def rel_err(out, ref):
    out = out.double().cpu()
    assert torch.isfinite(out).all(), "output has NaN/inf (element not written?)"
    return ((out - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------------------- CPU
_INTERP_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from test_kernels import ref_weight, rand_weight, rel_err
    from kernels import _launch as L
    import kernels
    g = torch.Generator().manual_seed(0)
    cases = [(3, 40, 80, L._fused(16, 16, 32, split=2)),            # K % BK != 0, N % BN != 0
             (5, 48, 208, L._fused(16, 16, 64, swap=True, split=3)),
             (37, 33, 96, L._fused(16, 32, 32, split=1)),           # several M tiles
             (2, 64, 128, L._fused(16, 32, 64, split=None)),        # EVEN_N and EVEN_K
             (4, 64, 128, L._fused(16, 32, 64, swap=True, split=2))]
    for M, N, K, cfg in cases:
        q, s, p = rand_weight(N, K, gen=g)
        W = ref_weight(q, s, p)
        x, go = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
        y = torch.full((M, N), float("nan")); L.linear_forward(x, q, s, p, out=y, config=cfg)
        gx = torch.full((M, K), float("nan")); L.linear_grad_input(go, q, s, p, out=gx, config=cfg)
        e1 = rel_err(y, x.double() @ W.t()); e2 = rel_err(gx, go.double() @ W)
        assert e1 < 1e-5 and e2 < 1e-5, (M, N, K, cfg, e1, e2)
        wd = kernels.nvfp4_dequantize(q, s, p, torch.float32)
        assert (wd.double() - W).abs().max().item() <= 1e-6 * W.abs().max().item()
    print("INTERP_OK")
""")


@pytest.mark.skipif(not triton_interpreter.ready(), reason=triton_interpreter.REASON)
def test_kernels_in_triton_interpreter():
    triton_interpreter.run(_INTERP_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests")), "INTERP_OK", timeout=300)


def test_import_and_availability_on_cpu():
    assert kernels.is_available("cpu") is False
    assert callable(kernels.nvfp4_linear_forward) and callable(kernels.nvfp4_linear_grad_input)


def test_shape_validation():
    q, s, p = rand_weight(32, 64)
    with pytest.raises(ValueError):
        kernels.nvfp4_linear_forward(torch.randn(2, 48), q, s, p)
    with pytest.raises(ValueError):
        kernels.nvfp4_linear_grad_input(torch.randn(2, 31), q, s, p)


def test_bad_out_scale_dtype_and_devices_are_refused_before_any_launch(monkeypatch):
    """``out`` of the wrong shape, dtype or strides would be written past or garbled (the kernels
    write every row, in the activation dtype, at unit column stride); e5m2 scales would decode as
    e4m3; a weight on another device than the activation would hand a kernel a host pointer."""
    from kernels import _launch as L

    monkeypatch.setattr(L, "_run", lambda *a, **k: pytest.fail("launched"))
    q, s, p = rand_weight(32, 64)
    x, g = torch.randn(5, 64), torch.randn(5, 32)
    bad_outs = {"rows": torch.empty(3, 32), "dtype": torch.empty(5, 32, dtype=torch.float64),
                "transposed": torch.empty(32, 5).t(), "3-d": torch.empty(1, 5, 32)}
    for name, out in bad_outs.items():
        with pytest.raises(ValueError, match="^out must be"):
            kernels.nvfp4_linear_forward(x, q, s, p, out=out)
        with pytest.raises(ValueError, match="^out must be"):
            L.linear_forward(x, q, s, p, out=out)
    with pytest.raises(ValueError, match="^out must be"):
        kernels.nvfp4_linear_grad_input(g, q, s, p, out=torch.empty(5, 32))
    with pytest.raises(ValueError, match="got torch.float8_e5m2"):
        kernels.nvfp4_linear_forward(x, q, s.view(torch.uint8).view(torch.float8_e5m2), p)
    with pytest.raises(ValueError, match="on different devices"):
        kernels.nvfp4_linear_forward(x, q, s, p.to("meta"))


def test_split_counters_are_not_first_made_inside_graph_capture(monkeypatch):
    from kernels import _launch as L

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(L, "_COUNTERS", {})
    with pytest.raises(RuntimeError, match="inside CUDA-graph capture: run this linear once eagerly"):
        L._counters(torch.device("cuda", 0), 10)


def test_tuner_weight_copies_are_equal_slices_of_one_buffer_sized_by_bytes():
    """The tuner times a small weight over enough copies to leave the 60 MB L2 (by bytes, not a
    fixed count), held in one buffer per tensor rather than hundreds of small-pool clones."""
    from kernels._launch import weight_copies

    q = torch.randint(0, 256, (896, 448), dtype=torch.uint8)         # the 0.5B o_proj, packed
    s = torch.randn(896, 56).to(torch.float8_e4m3fn)
    weights = weight_copies(q, s, copy_bytes=2e8)
    assert len(weights) - 1 == int(2e8 // (q.numel() + s.numel()))   # ~440 copies, ~0.2 GB
    assert weights[0][0] is q and weights[0][1] is s
    for wq, ws in weights[1:]:
        assert wq.is_contiguous() and ws.is_contiguous() and wq.shape == q.shape and ws.dtype == s.dtype
        assert torch.equal(wq, q) and torch.equal(ws.view(torch.uint8), s.view(torch.uint8))
    assert len({ws.untyped_storage().data_ptr() for _, ws in weights[1:]}) == 1
    odd_q, odd_s = torch.randint(0, 256, (5, 40), dtype=torch.uint8), torch.randn(5, 5).to(torch.float8_e4m3fn)
    for wq, ws in weight_copies(odd_q, odd_s, copy_bytes=1e3)[1:]:  # 200 + 25 bytes: every copy 256-aligned
        assert (wq.data_ptr() - wq.untyped_storage().data_ptr()) % 256 == 0 and torch.equal(wq, odd_q)
        assert (ws.data_ptr() - ws.untyped_storage().data_ptr()) % 256 == 0 and ws.is_contiguous()
    assert len(weight_copies(q, s, copy_bytes=1e3)) == 1                  # too few bytes: the weight alone
    assert len(weight_copies(torch.zeros(16, 8, dtype=torch.uint8), torch.zeros(16, 1), copy_bytes=1e9)) == 512


def test_autotune_with_every_candidate_failing_falls_back_to_the_default(monkeypatch):
    """tune() skips candidates that fail (out of memory at peak training memory): with none left the
    default config runs (and is kept, so the failing tune is not repeated every call) instead of an
    IndexError inside a forward or backward."""
    from types import SimpleNamespace

    from kernels import _launch as L

    monkeypatch.setattr(L, "tune", lambda *args, **kwargs: [])
    monkeypatch.setenv("QERL_KERNELS_AUTOTUNE", "1")
    monkeypatch.setattr(L, "_interpret", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a = SimpleNamespace(shape=(8, 1000), dtype=torch.bfloat16, device=torch.device("cuda"))  # no preset: tunes
    q, s, p = rand_weight(1008, 1000)
    cfg = L._choose("fwd", a, q, s, p, None)
    key = ("fwd", torch.bfloat16, L._bucket(8), 1008, 1000)
    assert cfg == L.candidates("fwd", L._bucket(8))[0] and L._TUNED.pop(key) == cfg


def test_missing_triton_is_said_once_and_other_errors_are_not_hidden(monkeypatch, caplog):
    """Without triton the NVFP4 linears fall back to dequant + cuBLAS, said once (a silent 20x
    slowdown otherwise); a bad device is the caller's error, not a quiet False."""
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    monkeypatch.setattr(kernels, "_SAID_NO_TRITON", [])
    assert kernels.is_available("cuda") is False and kernels.is_available("cuda:0") is False
    said = [r.getMessage() for r in caplog.records if r.name == "qerl.kernels"]
    assert len(said) == 1 and said[0].startswith("triton cannot be imported"), said
    with pytest.raises(RuntimeError):
        kernels.is_available("not-a-device")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_tuner_survives_a_candidate_failing_inside_graph_capture(monkeypatch):
    """A candidate that raises while the tuner captures it is skipped, and the failed capture is
    undone: later allocations and random ops (vLLM's sampler) work, a later capture succeeds."""
    from kernels import _launch as L

    broken = L._fused(16, 64, 256, 4, 3, waves=3.0)      # a config only this test uses
    real_run = L._run

    def run(op, a, qdata, scale, pts, out, cfg):
        if cfg == broken and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fails under capture")
        return real_run(op, a, qdata, scale, pts, out, cfg)

    monkeypatch.setattr(L, "_run", run)
    q, s, p = rand_weight(512, 1024, "cuda")
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    ok = L.candidates("fwd", 4)[0]
    res = L.tune("fwd", x, q, s, p, torch.empty(4, 512, device="cuda", dtype=torch.bfloat16), [broken, ok])
    assert [c for _, c in res] == [ok]
    assert not torch.cuda.is_current_stream_capturing()
    torch.randn(1000, device="cuda").uniform_()                      # the RNG is not left "capturing"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = L.linear_forward(x, q, s, p, config=ok)
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()


# ---------------------------------------------------------------------------------------- GPU
SHAPES = [  # (M, N, K): M off the blocks, K not a multiple of 64, N off the tiles, split and not
    (1, 256, 80), (1, 4608, 3584), (3, 96, 208), (7, 3584, 18944), (16, 1000, 1040),
    (33, 200, 1040), (64, 640, 336), (100, 384, 512), (255, 1032, 2048), (300, 272, 208),
    (1024, 768, 1536), (1500, 512, 1024),
]


def _check_linear(M, N, K, dtype=torch.bfloat16, lead=(), config=None, tol=1e-2):
    q, s, p = rand_weight(N, K, "cuda")
    W = ref_weight(q, s, p)
    x = torch.randn(*lead, M, K, device="cuda", dtype=dtype)
    go = torch.randn(*lead, M, N, device="cuda", dtype=dtype)
    y = torch.full((*lead, M, N), float("nan"), device="cuda", dtype=dtype)
    gx = torch.full((*lead, M, K), float("nan"), device="cuda", dtype=dtype)
    if config is None:
        kernels.nvfp4_linear_forward(x, q, s, p, out=y)
        kernels.nvfp4_linear_grad_input(go, q, s, p, out=gx)
    else:
        from kernels import _launch as L
        L.linear_forward(x.view(-1, K), q, s, p, out=y.view(-1, N), config=config)
        L.linear_grad_input(go.view(-1, N), q, s, p, out=gx.view(-1, K), config=config)
    torch.cuda.synchronize()
    ef = rel_err(y.view(-1, N), x.view(-1, K).double().cpu() @ W.t())
    eb = rel_err(gx.view(-1, K), go.view(-1, N).double().cpu() @ W)
    assert ef <= tol and eb <= tol, f"M={M} N={N} K={K} {config}: fwd {ef:.2e} bwd {eb:.2e}"
    return ef, eb


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_forward_and_grad_input(M, N, K):
    for _ in range(2):      # fresh random inputs each check
        _check_linear(M, N, K)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_nvfp4_linear_dispatches_to_the_kernels(monkeypatch):
    """On CUDA, ``F.linear`` on an NVFP4 weight (what every quantized decoder linear runs) calls these
    kernels forward and backward, not the dequantize + matmul reference."""
    from qerl.nvfp4 import NVFP4WeightTensor, load_kernels

    found, calls = load_kernels(), []
    for name in ("nvfp4_linear_forward", "nvfp4_linear_grad_input"):
        real = getattr(found, name)
        monkeypatch.setattr(found, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    w = NVFP4WeightTensor.from_float(torch.randn(320, 256, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, w).sum().backward()
    assert calls == ["nvfp4_linear_forward", "nvfp4_linear_grad_input"] and x.grad.shape == x.shape


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fp16_and_batched_input():
    _check_linear(5, 320, 208, dtype=torch.float16)
    _check_linear(70, 256, 128, dtype=torch.float16)
    _check_linear(6, 192, 160, lead=(2, 3))


def _all_candidates():
    try:
        from kernels import _launch as L
    except Exception:       # triton missing: the GPU tests are skipped anyway
        return []
    out = []
    for mb in (1, 16, 32, 64, 128, 256, 1024, 2048):
        for op in ("fwd", "bwd"):
            for cfg in L.candidates(op, mb):
                if (mb, cfg) not in [(m, c) for m, c in out] and cfg not in [c for _, c in out]:
                    out.append((mb, cfg))
    return out


@pytest.mark.parametrize("mb,cfg", _all_candidates(), ids=lambda v: v.short() if hasattr(v, "short") else str(v))
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_every_candidate_config(mb, cfg):
    from triton.runtime.errors import OutOfResources
    M = max(1, min(mb, 300) - 3)
    try:
        _check_linear(M, 384, 1536, config=cfg)      # EVEN tiles
        _check_linear(M, 200, 208, config=cfg)       # ragged N and K
    except OutOfResources as e:                      # the tuner skips such configs too
        pytest.skip(f"config does not fit: {e}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_decode_exhaustive():
    """Every byte (both nibbles) x scales incl. e4m3 subnormals and 448, exact in bf16."""
    N = 64
    q = torch.arange(256, dtype=torch.uint8).repeat(N, 1)                       # [N, 256] -> K=512
    sc = torch.tensor([2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -6, 0.75, 1.0, 1.125, 7.0, 448.0]).repeat(N * 4)
    s = sc[torch.randperm(sc.numel())].view(N, 32).to(torch.float8_e4m3fn)
    for pts in (1.0, 0.0123):
        p = torch.tensor(pts, dtype=torch.float32)
        ref = ref_weight(q, s, p)
        got = kernels.nvfp4_dequantize(q.cuda(), s.cuda(), p.cuda(), torch.bfloat16).cpu()
        assert torch.equal(got, ref.to(torch.bfloat16)), (got.double() - ref).abs().max()
        got32 = kernels.nvfp4_dequantize(q.cuda(), s.cuda(), p.cuda(), torch.float32).cpu().double()
        assert (got32 - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_split_reduction_deterministic_and_graph_safe():
    from kernels import _launch as L
    q, s, p = rand_weight(1024, 4096, "cuda")
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = L._fused(16, 64, 128, split=8)
    y1 = L.linear_forward(x, q, s, p, config=cfg)
    y2 = L.linear_forward(x, q, s, p, config=cfg)
    assert torch.equal(y1, y2)
    out = torch.full_like(y1, float("nan"))
    kernels.nvfp4_linear_forward(x, q, s, p, out=out)          # tune/compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernels.nvfp4_linear_forward(x, q, s, p, out=out)
    for _ in range(2):
        out.fill_(float("nan"))
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        W = ref_weight(q, s, p)
        assert rel_err(out, x.double().cpu() @ W.t()) <= 1e-2


# ------------------------------------------------------------- CUDA skinny forward (M <= 16)
def _skinny_configs():   # (BN, warps, split): every knob, incl. forced cross-CTA splits
    return [(16, 8, None), (32, 4, None), (16, 4, 1), (32, 8, 1), (16, 16, None), (32, 4, 3), (16, 4, 7)]


def _ptxas_report(source: str, arch: str) -> str:
    """``nvcc -cubin -Xptxas -v`` on a kernel source (skips without nvcc); ptxas' report."""
    import shutil
    import tempfile
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.cu")
        with open(src, "w") as f:
            f.write(source)
        r = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", src + ".cubin", src],
                           capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def test_skinny_source_compiles_without_spills():
    """Each specialisation of the NVRTC source assembles for sm_90 with nvcc (when present) and
    keeps everything in registers (a spill would cost far more than the decode saves)."""
    from kernels import nvfp4_skinny
    for R, TT, W, SMW in [(1, 1, 8, 16), (2, 1, 8, 16), (1, 2, 8, 16), (2, 1, 4, 16), (1, 1, 16, 16), (2, 2, 4, 12)]:
        report = _ptxas_report(nvfp4_skinny.source(R, TT, W, SMW), "sm_90")
        assert "0 bytes spill stores" in report and "stack frame" in report, report


def test_stream_ws_benchmark_kernel_compiles_without_spills():
    """benchmarks/stream_ws.py (the warp-specialised experiment) builds its kernel from the skinny
    kernel's shared source pieces: every config and variant it times assembles for sm_90 with nvcc
    (when present), in registers."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "stream_ws_bench", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "stream_ws.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert set(bench.VARIANTS) == {"full", "no_compute", "no_copy"}
    for NC, R, CH, ST in bench.CONFIGS[:2] + [(4, 2, 2, 4)]:
        for TT in (1, 2):
            for variant in bench.VARIANTS:
                src = bench.source(NC, R, TT, CH, ST, variant)
                assert variant == "full" or src != bench.source(NC, R, TT, CH, ST)
        report = _ptxas_report(bench.source(NC, R, 2, CH, ST), "sm_90")
        assert "0 bytes spill stores" in report, report


def _wgmma_candidates():
    from kernels import _launch as L
    return [c for c in L.candidates("fwd", 64) if c.kind == "wgmma"]


def test_wgmma_source_compiles_without_spills():
    """Every tuner candidate of the wgmma kernel assembles for sm_90a (wgmma is arch-specific) with
    nvcc (when present), in registers, with its accumulators, and its shared memory static."""
    from kernels import _launch as L, nvfp4_wgmma
    for c in _wgmma_candidates():
        report = _ptxas_report(nvfp4_wgmma.source(**L.wgmma_params(c)), "sm_90a")
        assert "0 bytes spill stores" in report and "serialized" not in report, report
    with pytest.raises(ValueError, match="TN"):
        nvfp4_wgmma.source(2, 128)                                  # 64 KB of static shared memory


def test_presets_file_round_trip(tmp_path):
    """kernels/presets_h200.json loads into the tuner's keys (bf16 and fp16), survives a write/load
    round trip, and pins only what each op can run (the CUDA kernel is forward-only)."""
    import torch as T
    from kernels import _launch as L, _presets as P
    table = P.load_presets()
    assert table and all(k[1] in (T.bfloat16, T.float16) for k in table)
    assert all(c.kind in ("fused", "cuda", "wgmma", "dequant") for c in table.values())
    assert not any(c.kind in ("cuda", "wgmma") for k, c in table.items() if k[0] == "bwd")
    assert table[("fwd", T.bfloat16, 1, 37888, 3584)].kind == "cuda"          # 7B gate_up at M = 1
    P.write_presets(table, tmp_path / "p.json", how="test", device="cpu")
    assert P.load_presets(tmp_path / "p.json") == table
    if os.environ.get("QERL_KERNELS_PRESETS", "1") != "0":
        assert all(L.KERNEL_PRESETS[k] == c for k, c in table.items())


def test_skinny_compile_failure_falls_back_once(monkeypatch):
    """An NVRTC failure (no library, old toolkit) is warned about once and turns the CUDA path off,
    so the callers use Triton instead of crashing."""
    from kernels import nvfp4_skinny as S

    def broken(src, name):
        raise OSError("libnvrtc.so not found")

    monkeypatch.setattr(S, "_BROKEN", [])
    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken, raising=False)
    with pytest.warns(RuntimeWarning, match="Triton"):
        with pytest.raises(S.CompileError):
            S.compile_source("x")
    assert S._BROKEN and not S.available()


def test_skinny_loadonly_benchmark_still_applies():
    """benchmarks/skinny_loadonly.py edits the kernel source by string: the edits must still hit."""
    from kernels import nvfp4_skinny
    src = nvfp4_skinny.source(2, 1, 4)
    assert 'extern "C" __global__' in src and "compute(b0, acc);" in src and "compute(b1, acc);" in src


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("BN,WARPS,SPLIT", _skinny_configs())
def test_gpu_skinny_forward(BN, WARPS, SPLIT):
    """Against the fp64 reference: M across one and two token tiles, N off the 16/32-row tiles,
    K from one chunk (fewer chunks than warps) to many, a strided activation, poisoned outputs."""
    from kernels import _launch as L, nvfp4_skinny
    assert nvfp4_skinny.available(), "torch.cuda._compile_kernel (NVRTC) missing"
    _check_forward(L._cuda(BN, WARPS, SPLIT), nvfp4_skinny.supported,
                   [(1, 16, 128), (2, 40, 896), (8, 4608, 3584), (9, 100, 1024), (16, 3584, 18944), (5, 257, 3584)])


def _check_forward(cfg, supported, shapes):
    """``cfg``'s forward against the fp64 reference for each (M, N, K): a strided activation (ldx =
    K + 64) the kernel takes (``supported``), a NaN-poisoned output, bitwise-repeatable results."""
    from kernels import _launch as L
    for M, N, K in shapes:
        q, s, p = rand_weight(N, K, "cuda")
        W = ref_weight(q, s, p)
        xs = torch.randn(M, K + 64, device="cuda", dtype=torch.bfloat16)[:, :K]
        assert supported(xs, q, s)
        y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        L.linear_forward(xs, q, s, p, out=y, config=cfg)
        y2 = L.linear_forward(xs, q, s, p, config=cfg)
        torch.cuda.synchronize()
        assert torch.equal(y, y2), "not deterministic"
        err = rel_err(y, xs.double().cpu() @ W.t())
        assert err <= 1e-2, f"{cfg.short()} M={M} N={N} K={K}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cfg", _wgmma_candidates(), ids=lambda c: c.short().replace(" ", "_"))
def test_gpu_wgmma_forward(cfg):
    """The wgmma kernel against the fp64 reference: M within one token tile and across several,
    N off the 64-row tiles, K from one chunk to a split one, a strided activation, poisoned outputs,
    deterministic (split-K sums in a fixed order)."""
    from kernels import nvfp4_wgmma
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    _check_forward(cfg, nvfp4_wgmma.supported, [(17, 64, 128), (40, 200, 384), (64, 4608, 3584), (100, 300, 768),
                                                (128, 3584, 18944), (33, 257, 1024)])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_skinny_exact_decode_every_k():
    """One-hot activations pick single weights: y[m, n] must be bf16(W[n, k_m]) exactly, for every
    k position of a chunk (checks the fragment k permutation), every byte and e4m3 subnormal scales."""
    from kernels import _launch as L
    N, K = 64, 512
    q = torch.arange(256, dtype=torch.uint8).repeat(N, 1).roll(7, dims=1)
    q[5] = torch.randint(0, 256, (256,), dtype=torch.uint8)
    sc = torch.tensor([2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -6, 0.75, 1.0, 1.125, 7.0, 448.0, 0.0]).repeat(N * 4)
    s = sc[torch.randperm(sc.numel())][: N * 32].view(N, 32).to(torch.float8_e4m3fn)
    p = torch.tensor(0.0123, dtype=torch.float32)
    ref = ref_weight(q, s, p).to(torch.bfloat16)                                   # [N, K]
    qc, sc_, pc = q.cuda(), s.cuda(), p.cuda()
    configs = [L._cuda(16, 8), L._cuda(32, 4, 2)]
    if torch.cuda.get_device_capability() == (9, 0):
        configs += [L._wgmma(128, 32, 1, 24), L._wgmma(256, 64, 2)]                 # same decode, wgmma
    for cfg in configs:
        for k0 in range(0, K, 16):
            x = torch.zeros(16, K, dtype=torch.bfloat16)
            x[torch.arange(16), k0 + torch.arange(16)] = 1.0
            y = L.linear_forward(x.cuda(), qc, sc_, pc, config=cfg).cpu()
            assert torch.equal(y, ref[:, k0:k0 + 16].t()), (cfg.short(), k0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_skinny_in_cuda_graph():
    from kernels import _launch as L
    q, s, p = rand_weight(1000, 2048, "cuda")
    W = ref_weight(q, s, p)
    configs = [L._cuda(32, 4, 2)]                                                   # split: counters
    if torch.cuda.get_device_capability() == (9, 0):
        configs.append(L._wgmma(128, 32, 2, 24))
    for cfg in configs:
        x = torch.randn(3 if cfg.kind == "cuda" else 40, 2048, device="cuda", dtype=torch.bfloat16)
        out = torch.full((x.shape[0], 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
        L.linear_forward(x, q, s, p, out=out, config=cfg)                           # compile outside
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            L.linear_forward(x, q, s, p, out=out, config=cfg)
        for _ in range(2):
            out.fill_(float("nan"))
            x.copy_(torch.randn_like(x))
            g.replay()
            torch.cuda.synchronize()
            assert rel_err(out, x.double().cpu() @ W.t()) <= 1e-2, cfg.short()
