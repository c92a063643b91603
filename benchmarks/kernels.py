"""Benchmark the NVFP4 W4A16 kernels (Triton + the CUDA skinny forward) against bf16 cuBLAS and torchao.

    python benchmarks/kernels.py [--models 7b,32b] [--ms 1,8,16,64,256,1024,4096] [--out PATH]
        [--tune [--write-presets kernels/presets_h200.json]]

Without ``--tune`` every call uses the pinned configs of ``kernels/presets_h200.json``; with it the
tuner picks per shape in this run, and ``--write-presets`` stores its winners as the new pins.

For every Qwen2.5 linear shape (q/k/v fused, o, gate/up fused, down) and token count M it times,
side by side in one process: bf16 ``x @ W^T`` (cuBLAS), torchao's ``NVFP4Tensor`` linear (if
torchao imports; timed eagerly on one weight, host dispatch included: its order of magnitude only),
our forward, our grad-input ``g @ W`` and bf16 ``g @ W``. Timing: each call but torchao's is
captured R times in a CUDA graph over R different weight copies (so weights are not L2-resident:
R copies span >= ~0.4 GB, several times the 60 MB L2), replayed; CUDA-event median per call.
Inputs are random normal (never zero); weights random codes and scales.

floor_ms = bytes(packed weight + e4m3 scales + x + y) / measured copy bandwidth (read + write of a
1 GiB device copy, measured in the same run). pct_of_bandwidth = floor_ms / nvfp4_fwd_ms.
Writes rows (plus a per-layer "sum" row per model and M) to benchmarks/results/kernels_h200.json.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402
from kernels import _launch as L  # noqa: E402

MODELS = {  # layer -> (N, K) of the linear weight [N, K]; q/k/v and gate/up as the fused linears run them
    # the small ones (the testbed's 0.5B and its neighbours) were pinned with
    # --models 0.5b,1.5b,3b --tune --write-presets kernels/presets_h200.json (the others' pins are kept)
    "0.5b": {"qkv": (896 + 2 * 2 * 64, 896), "o": (896, 896),
             "gate_up": (2 * 4864, 896), "down": (896, 4864)},
    "1.5b": {"qkv": (1536 + 2 * 2 * 128, 1536), "o": (1536, 1536),
             "gate_up": (2 * 8960, 1536), "down": (1536, 8960)},
    "3b": {"qkv": (2048 + 2 * 2 * 128, 2048), "o": (2048, 2048),
           "gate_up": (2 * 11008, 2048), "down": (2048, 11008)},
    "7b": {"qkv": (3584 + 2 * 4 * 128, 3584), "o": (3584, 3584),
           "gate_up": (2 * 18944, 3584), "down": (3584, 18944)},
    "32b": {"qkv": (5120 + 2 * 8 * 128, 5120), "o": (5120, 5120),
            "gate_up": (2 * 27648, 5120), "down": (5120, 27648)},
}
COPY_BYTES = 400e6


def cuda_median_ms(fn, reps=12, warmup=2):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def graph_ms(calls, reps=12):
    """Median ms per call of ``calls`` (list of thunks) captured back to back in one CUDA graph."""
    for c in calls[:2]:
        c()                                    # warm-up / tune / compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return cuda_median_ms(g.replay, reps=reps) / len(calls)


def copy_bandwidth():
    n = 1 << 29                                 # 1 GiB of bf16
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = cuda_median_ms(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() * a.element_size() / (ms * 1e-3)


def rand_nvfp4(N, K):
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
    s = (torch.rand(N, K // 16, device="cuda") * 3 + 0.25).to(torch.float8_e4m3fn)
    p = torch.tensor(0.004, device="cuda")
    return q, s, p


def torchao_weight(w_bf16):
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
        return NVFP4Tensor.to_nvfp4(w_bf16, per_tensor_scale=per_tensor_amax_to_scale(w_bf16.abs().amax()),
                                    is_swizzled_scales=False)
    except Exception as e:      # torchao missing or its API moved
        print(f"[bench] torchao unavailable: {type(e).__name__}: {e}")
        return None


def bench_layer(N, K, Ms, bw, use_torchao=True, log=print):
    rows = []
    nv_bytes = N * K // 2 + N * K // 16
    bf_bytes = N * K * 2
    # copies by bytes alone (>= COPY_BYTES each), so a small layer (0.5B o: 0.45 MB packed) is not
    # timed from the 60 MB L2; the cap only bounds the graph's length
    r_nv = max(1, min(1024, int(COPY_BYTES // nv_bytes) + 1))
    r_bf = max(1, min(1024, int(COPY_BYTES // bf_bytes) + 1))
    nvw = [rand_nvfp4(N, K) for _ in range(r_nv)]
    bfw = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(r_bf)]
    aow = torchao_weight(bfw[0]) if use_torchao else None
    for M in Ms:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        gx = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        rep_nv = max(r_nv, 3)
        rep_bf = max(r_bf, 3)
        t = {}
        t["bf16_ms"] = graph_ms([lambda w=bfw[i % r_bf]: torch.matmul(x, w.t(), out=y) for i in range(rep_bf)])
        t["bf16_bwd_input_ms"] = graph_ms([lambda w=bfw[i % r_bf]: torch.matmul(g, w, out=gx) for i in range(rep_bf)])
        t["nvfp4_fwd_ms"] = graph_ms([lambda w=nvw[i % r_nv]: kernels.nvfp4_linear_forward(x, *w, out=y)
                                      for i in range(rep_nv)])
        t["nvfp4_bwd_input_ms"] = graph_ms([lambda w=nvw[i % r_nv]: kernels.nvfp4_linear_grad_input(g, *w, out=gx)
                                            for i in range(rep_nv)])
        t["torchao_ms"] = None  # eager (host dispatch included), one weight: an order of magnitude only
        if aow is not None:
            try:
                t["torchao_ms"] = cuda_median_ms(lambda: F.linear(x, aow), reps=5, warmup=1)
            except Exception as e:
                log(f"[bench] torchao linear failed: {type(e).__name__}: {str(e)[:200]}")
                aow = None
        floor = (nv_bytes + M * K * 2 + M * N * 2) / bw * 1e3
        key = (torch.bfloat16, L._bucket(M), N, K)
        row = dict(M=M, N=N, K=K, **t, floor_ms=floor, pct_of_bandwidth=100 * floor / t["nvfp4_fwd_ms"],
                   fwd_config=_cfg_name("fwd", key), bwd_config=_cfg_name("bwd", key))
        rows.append(row)
        log(f"  N={N:6d} K={K:6d} M={M:5d}  bf16 {t['bf16_ms']:.4f}  ours {t['nvfp4_fwd_ms']:.4f} "
            f"({t['bf16_ms'] / t['nvfp4_fwd_ms']:.2f}x, {row['pct_of_bandwidth']:.0f}% bw)  "
            f"bwd bf16 {t['bf16_bwd_input_ms']:.4f} ours {t['nvfp4_bwd_input_ms']:.4f}  "
            f"torchao {t['torchao_ms'] if t['torchao_ms'] is None else round(t['torchao_ms'], 4)}  "
            f"[{row['fwd_config']} | {row['bwd_config']}]")
    del nvw, bfw, aow
    torch.cuda.empty_cache()
    return rows


def _cfg_name(op, key):
    c = L.KERNEL_PRESETS.get((op,) + key) or L._TUNED.get((op,) + key)
    if c is None:
        c = L.candidates(op, key[1])[0]
    return c.short()


def summarize(rows):
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for M in dict.fromkeys(r["M"] for r in rows if r["model"] == model):
            rs = [r for r in rows if r["model"] == model and r["M"] == M and r["layer"] != "sum"]
            s = {"model": model, "layer": "sum", "M": M}
            for k in ("bf16_ms", "torchao_ms", "nvfp4_fwd_ms", "nvfp4_bwd_input_ms", "bf16_bwd_input_ms", "floor_ms"):
                vals = [r[k] for r in rs]
                s[k] = None if any(v is None for v in vals) else sum(vals)
            s["pct_of_bandwidth"] = 100 * s["floor_ms"] / s["nvfp4_fwd_ms"]
            s["fwd_speedup_vs_bf16"] = s["bf16_ms"] / s["nvfp4_fwd_ms"]
            s["fwd_plus_bwd_vs_bf16"] = ((s["nvfp4_fwd_ms"] + s["nvfp4_bwd_input_ms"])
                                         / (s["bf16_ms"] + s["bf16_bwd_input_ms"]))
            out.append(s)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="7b,32b", help=f"any of {','.join(MODELS)}")
    ap.add_argument("--ms", default="1,8,16,64,256,1024,4096")
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "kernels_h200.json"))
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--tune", action="store_true", help="ignore the pinned presets, autotune every shape")
    ap.add_argument("--write-presets", default=None, metavar="PATH",
                    help="with --tune: write the pinned presets with this run's winners in place of the "
                         "old ones for the shapes measured (e.g. kernels/presets_h200.json)")
    args = ap.parse_args()
    if args.write_presets and not args.tune:
        ap.error("--write-presets needs --tune")
    pinned = dict(L.KERNEL_PRESETS)
    if args.tune:
        L.KERNEL_PRESETS.clear()
    Ms = [int(m) for m in args.ms.split(",")]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  "
          f"torch {torch.__version__}")
    t0 = time.time()
    rows = []
    for model in args.models.split(","):
        for layer in args.layers.split(","):
            N, K = MODELS[model][layer]
            print(f"{model} {layer}:")
            for r in bench_layer(N, K, Ms, bw, use_torchao=not args.no_torchao):
                rows.append({"model": model, "layer": layer, **r})
            _write(args.out, bw, rows, [])          # partial results survive a timeout
    sums = summarize(rows)
    print(f"\nper-layer sums (ms; {time.time() - t0:.0f} s)")
    print(f"{'model':5} {'M':>5} {'bf16':>8} {'nvfp4':>8} {'x':>6} {'%bw':>5} {'floor':>7} "
          f"{'bwd_bf16':>9} {'bwd_nv':>8} {'(f+b)/bf16':>10} {'torchao':>8}")
    for s in sums:
        ta = "-" if s["torchao_ms"] is None else f"{s['torchao_ms']:.3f}"
        print(f"{s['model']:5} {s['M']:5d} {s['bf16_ms']:8.4f} {s['nvfp4_fwd_ms']:8.4f} "
              f"{s['fwd_speedup_vs_bf16']:6.2f} {s['pct_of_bandwidth']:5.1f} {s['floor_ms']:7.4f} "
              f"{s['bf16_bwd_input_ms']:9.4f} {s['nvfp4_bwd_input_ms']:8.4f} {s['fwd_plus_bwd_vs_bf16']:10.3f} {ta:>8}")
    _write(args.out, bw, rows, sums)
    print(f"wrote {args.out}")
    if args.write_presets:
        from kernels._presets import write_presets
        table = dict(pinned)
        for (op, _dt, mb, n, k), cfg in L._TUNED.items():      # tuned here with bf16 activations
            for dt in (torch.bfloat16, torch.float16):
                table[(op, dt, mb, n, k)] = cfg
        write_presets(table, args.write_presets, device=torch.cuda.get_device_name(),
                      how=f"winners of the graph-timed tuner: python benchmarks/kernels.py {' '.join(sys.argv[1:])}"
                          f" ({time.strftime('%Y-%m-%d')}; shapes not measured then keep their earlier preset)")
        print(f"wrote {args.write_presets} ({len(L._TUNED)} tuned keys)")


def _write(path, bw, rows, sums):
    meta = {"device": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12,
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "python": platform.python_version(),
            "timing": "CUDA graph of R calls over R weight copies, CUDA-event median per call",
            "configs": "presets (kernels/presets_h200.json)" if L.KERNEL_PRESETS else "autotuned in this run",
            "floor": "bytes(packed weight + e4m3 scales + x + y) / copy_bandwidth"}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows + sums}, f, indent=1)


if __name__ == "__main__":
    main()
