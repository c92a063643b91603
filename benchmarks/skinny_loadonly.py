"""What bounds the CUDA skinny forward at M = 1: the same kernel with the decode + MMA removed.

    python benchmarks/skinny_loadonly.py [--out PATH]

For the Qwen2.5-7B gate_up / down and 32B gate_up shapes, times (CUDA graph over weight copies that
do not fit in L2, CUDA-event median) the real kernel and a variant whose per-chunk work is a
handful of XORs over the loaded registers (same grid, same loads, same prefetch, same epilogue).
If the load-only variant is not much faster, the access pattern / memory side is the limit, not
the decode arithmetic. Writes benchmarks/results/skinny_loadonly_h200.json.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.kernels import copy_bandwidth, graph_ms, rand_nvfp4  # noqa: E402
from kernels import _launch as L, nvfp4_skinny as S  # noqa: E402

TOUCH = r"""
__device__ __forceinline__ void touch(const Chunk &c, float (&acc)[R][TT][4]) {
  u32 v = 0;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) v ^= c.q[r][h].x ^ c.q[r][h].y ^ c.q[r][h].z ^ c.q[r][h].w ^ c.s[r][h];
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int i = 0; i < 4; ++i) v ^= c.x[tt][i].x ^ c.x[tt][i].w;
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(v & 0x007fffffu));
  acc[0][0][0] += f;
}
"""


def load_only_kernel(R, TT, W, device):
    src = S.source(R, TT, W)
    src = src.replace('extern "C" __global__', TOUCH + '\nextern "C" __global__')
    src = src.replace("compute(b0, acc);", "touch(b0, acc);").replace("compute(b1, acc);", "touch(b1, acc);")
    with torch.cuda.device(device):
        return torch.cuda._compile_kernel(src, "nvfp4_skinny_fwd")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "skinny_loadonly_h200.json"))
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for name, N, K, BN, W in [("7b gate_up", 37888, 3584, 32, 4), ("7b down", 3584, 18944, 16, 8),
                              ("32b gate_up", 55296, 5120, 32, 4)]:
        R = BN // 16
        copies = max(3, int(400e6 // (N * K * 0.5625)) + 1)
        ws = [rand_nvfp4(N, K) for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        cfg = L._cuda(BN, W, 1)
        full = graph_ms([lambda w=w: L.linear_forward(x, *w, out=y, config=cfg) for w in ws])
        k = load_only_kernel(R, 1, W, x.device)
        tiles = -(-N // BN)

        def run(w):
            k(grid=(tiles, 1, 1), block=(W * 32, 1, 1),
              args=[x, w[0], w[1].view(torch.uint8), w[2], y, y, y, 1, N, K, K, N, K // 128])
        L.linear_forward(x, *ws[0], out=y, config=cfg)        # compiles the real one
        lo = graph_ms([lambda w=w: run(w) for w in ws])
        floor = (N * K * 0.5625 + 2 * K + 2 * N) / bw * 1e3
        rows.append(dict(shape=name, N=N, K=K, config=cfg.short(), full_ms=full, load_only_ms=lo,
                         floor_ms=floor, full_pct=100 * floor / full, load_only_pct=100 * floor / lo))
        print(f"{name:12s} full {full * 1e3:6.1f} us ({100 * floor / full:4.1f}% bw)   "
              f"load-only {lo * 1e3:6.1f} us ({100 * floor / lo:4.1f}% bw)   floor {floor * 1e3:5.1f} us")
        del ws
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {"device": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12,
                            "command": "python benchmarks/skinny_loadonly.py"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
