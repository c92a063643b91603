"""What the wgmma mid-M forward spends its time on: variants that leave one stage out.

    python benchmarks/wgmma_stages.py [--out PATH]

For the Qwen2.5-7B linears at M = 64 and a few launch configs each, times (CUDA graph over weight
copies that do not fit in L2, CUDA-event median) the real kernel (``kernels/nvfp4_wgmma.py``) and
variants of its source with one stage removed: ``no_x`` (no activation staging after the first
chunk: no loads, shared stores, proxy fence, barrier), ``no_barrier`` (the per-chunk CTA barrier),
``no_wload`` (the weight codes / scales loaded once, not per chunk), ``no_decode`` (a few ALU ops
instead of the fragment decode), ``no_mma`` (an add instead of the wgmma), and ``mma_only`` (no
loads, no staging, no decode: the wgmma chain and the loop alone). Only ``full`` computes the right
result (its relative error is reported); the others are timings. The difference to ``full`` is
what a stage costs where it does not overlap the rest. Writes benchmarks/results/wgmma_stages_h200.json.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.kernels import graph_ms, rand_nvfp4  # noqa: E402
from kernels import _launch as L, _presets, nvfp4_skinny as S, nvfp4_wgmma as W  # noqa: E402

LOOP_LOADS = "if (ci + 1 < nch) { load_w(ci + 1); load_x(ci + 1); }"
DECODE = """      if (s >= 4) decode_step<true>(wg, wg8, sel, sbf0, sbf1, a0, a1, a2, a3);
      else decode_step<false>(wg, wg8, sel, sbf0, sbf1, a0, a1, a2, a3);"""
MMA = "wgmma(acc, a0, a1, a2, a3, desc(xbase + s * STEP_BYTES, LBO, SBO));"
STAGE = """      store_x(buf ^ 1);
      asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
      __syncthreads();"""
LOOP_END = """      __syncthreads();
    }
  }

  // D fragment"""
VARIANTS = {
    "full": [],
    "no_x": [(LOOP_LOADS, "if (ci + 1 < nch) { load_w(ci + 1); }"), (STAGE, "")],
    "no_barrier": [(LOOP_END, LOOP_END.replace("__syncthreads();", "", 1))],
    "no_wload": [(LOOP_LOADS, "if (ci + 1 < nch) { load_x(ci + 1); }")],
    "no_decode": [(DECODE, "      a0 = wg ^ sbf0; a1 = wg8 ^ sbf1; a2 = wg + sbf0 + s; a3 = wg8 + sbf1;")],
    "no_mma": [(MMA, "acc[s] += __uint_as_float((a0 ^ a1 ^ a2 ^ a3) & 0x3f7fffffu);")],
    "mma_only": [(LOOP_LOADS, ""), (STAGE, ""), (DECODE, "      a0 = sbf0 + s; a1 = sbf1; a2 = sbf0; a3 = sbf1 ^ s;")],
}
# (name, N, K, [(warpgroups, tokens per CTA, CTAs per SM, K split)]): the presets' configs first
SHAPES = [("7b gate_up", 37888, 3584, [(2, 64, 3, 1), (4, 64, 1, 1), (2, 64, 2, 1)]),
          ("7b down", 3584, 18944, [(4, 32, 1, 4), (2, 64, 3, 4), (2, 64, 3, 8), (1, 64, 4, 8)]),
          ("7b qkv", 4608, 3584, [(1, 64, 4, 4), (2, 64, 3, 4), (1, 64, 4, 2)]),
          ("7b o", 3584, 3584, [(1, 64, 4, 4), (2, 64, 3, 4), (1, 64, 4, 2)])]
_KERNELS = {}


def kernel(variant: str, WG: int, TN: int, SMC: int):
    key = (variant, WG, TN, SMC)
    if key not in _KERNELS:
        body = W._BODY
        for old, new in VARIANTS[variant]:
            if old not in body:
                raise RuntimeError(f"kernels/nvfp4_wgmma.py changed: {old[:50]!r} not found; update this script")
            body = body.replace(old, new)
        _KERNELS[key] = S.compile_source(W.source(WG, TN, SMC).replace(W._BODY, body), "nvfp4_wgmma_fwd", [],
                                         compute_capability="90a")
    return _KERNELS[key]


def launch(variant, x, q, s, p, y, WG, TN, SMC, split):
    """``nvfp4_wgmma.forward`` with the variant's kernel."""
    W.forward(x, q, s.view(torch.uint8), p.reshape(1), y, lambda n: L._counters(x.device, n), L._num_sms(x.device),
              WG=WG, TN=TN, split=split, SM_CTAS=SMC, kernel=kernel(variant, WG, TN, SMC))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "wgmma_stages_h200.json"))
    args = ap.parse_args()
    L.KERNEL_PRESETS.update(_presets.load_presets())
    M, rows = args.M, []
    for name, N, K, configs in SHAPES:
        copies = max(3, int(400e6 // (N * K * 0.5625)) + 1)
        weights = [rand_nvfp4(N, K) for _ in range(copies)]
        dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, int(400e6 // (N * K * 2)) + 1))]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = L.linear_forward(x, *weights[0], config=L.DEQUANT).float()
        preset = graph_ms([lambda w=w: L.linear_forward(x, *w, out=y) for w in weights]) * 1e3
        bf16 = graph_ms([lambda b=b: torch.matmul(x, b.t()) for b in dense]) * 1e3
        print(f"{name} M={M}: bf16 {bf16:.1f} us, pinned preset {preset:.1f} us", flush=True)
        for WG, TN, SMC, split in configs:
            row = dict(shape=name, N=N, K=K, M=M, WG=WG, TN=TN, SMC=SMC, split=split, bf16_us=bf16, preset_us=preset)
            y.fill_(float("nan"))
            launch("full", x, *weights[0], y, WG, TN, SMC, split)
            row["err"] = float((y.float() - ref).norm() / ref.norm())
            for v in VARIANTS:
                row[v] = graph_ms([lambda w=w: launch(v, x, *w, y, WG, TN, SMC, split) for w in weights]) * 1e3
            print(f"  wg{WG} tn{TN} occ{SMC} split{split}: rel.err {row['err']:.1e}  "
                  + "  ".join(f"{v} {row[v]:.1f}" for v in VARIANTS), flush=True)
            rows.append(row)
        del weights, dense
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "unit": "us per call",
            "command": "python benchmarks/wgmma_stages.py " + " ".join(sys.argv[1:])}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
