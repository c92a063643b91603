"""CUDA NVFP4 W4A16 forward for mid M (16 < M <= 128 tokens: batched decode) on Hopper's wgmma.

Why: at M = 64 the weight is decoded once per CTA and feeds M tokens, so the tensor cores matter as
much as the decode. ``mma.sync`` needs every B fragment rebuilt in registers from shared memory at
every k step (``kernels/NOTES.md``: the mma.sync mid-M kernel issued ~2x the instructions per
weight of the skinny kernel and lost to Triton). ``wgmma`` reads B (the activations) from shared
memory itself and takes A (the weights) from registers, so each warp does exactly the skinny
kernel's work per weight -- 16-byte loads of its own fragment codes, the same decode -- and one
``wgmma.mma_async`` per k16 step for the whole warpgroup (64 rows x TN tokens).

Layout (see ``kernels/nvfp4_skinny.py`` for the fragment decode and its free k order):

* CTA = ``WG`` warpgroups = ``64 * WG`` weight rows x ``TN`` tokens; warp ``w`` of warpgroup
  ``v`` owns rows ``64v + 16w .. +15``, and each thread loads/decodes exactly as in the skinny
  kernel (rows g, g + 8; bytes ``16t .. 16t+15`` of each 128-k chunk).
* The skinny decode pairs physical k ``(4s + 32t, +2)`` and ``(4s + 32t + 1, +3)`` into the A
  registers of logical k ``(2t, 2t+1)`` and ``(2t+8, 2t+9)`` of step ``s``. B must use the same
  order, so the activations are staged in shared memory *permuted*: every thread loads 32
  consecutive activations of one token (4 x 16 B) and writes 16 words ``(x[p], x[p+2])`` -- one
  ``prmt`` each -- at their logical place. Shared layout per 128-k chunk: ``[step 8][k half 2]
  [token block TN/8][8 tokens][16 B]`` (K-major core matrices, no swizzle).
* Per chunk: loads of the next chunk's codes, scales and activations go to registers first; the 8
  steps decode -> ``wgmma.fence`` -> ``wgmma`` -> ``commit`` -> ``wait_group 1`` (two A register
  sets alternate); then ``wait_group 0``, the next chunk's activations are stored into the other
  shared buffer, ``fence.proxy.async`` + CTA barrier.
* Split-K across CTAs through an fp32 workspace and a self-resetting counter (last arrival sums in
  split order: deterministic), as in the skinny kernel.

Measured on the H200 (``kernels/NOTES.md``): at M = 64 it wins the big linears, 7B gate_up 76 us
(Triton 84, cuBLAS bf16 83), 32B gate_up 129 us (Triton 153, bf16 161), and loses qkv / o and
M = 32 to Triton: the tuner picks per shape (``kernels/presets_h200.json``). It issues ~6
instructions per weight and is latency-bound (loads, the per-chunk barrier, wgmma waits).

Requirements (``supported``): bf16 activations, K % 128 == 0, 16-byte aligned pointers and row
stride, compute capability 9.0 (``sm_90a``: wgmma). Tokens are covered in tiles of ``TN``.
"""

import torch

from . import nvfp4_skinny as S

_BODY = r"""
#define NACC (TN / 2)

__device__ __forceinline__ unsigned smem_u32(const void *p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// wgmma matrix descriptor, no swizzle: start address, leading (K) and stride (N) byte offsets.
__device__ __forceinline__ unsigned long long desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void wgmma(float (&d)[NACC], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long db) {
  asm volatile(WGMMA_ASM : WGMMA_OUT : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}

extern "C" __global__ void __launch_bounds__(WG * 128, MIN_BLOCKS)
nvfp4_wgmma_fwd(const u16 *__restrict__ x, const unsigned char *__restrict__ q,
                const unsigned char *__restrict__ sc, const float *__restrict__ pts,
                u16 *__restrict__ y, float *__restrict__ ws, int *__restrict__ cnt,
                int M, int N, int K, int ldx, int ldy, int cps) {
  // x staged per chunk: [buf 2][step 8][khalf 2][TN/8 blocks][8 tokens][8 bf16]
  constexpr int CORE = 128, STEP_BYTES = 2 * (TN / 8) * CORE, BUF_BYTES = 8 * STEP_BYTES;
  __shared__ __align__(128) unsigned char xs[2 * BUF_BYTES];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;   // warp: 0 .. 4 WG - 1
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * (64 * WG) + 16 * warp;               // this warp's 16 rows
  const int m0 = blockIdx.z * TN;                                  // this CTA's tokens
  const long kb = K >> 1, kg = K >> 4;
  const int c_begin = blockIdx.y * cps;
  const int c_end = (blockIdx.y + 1) * cps < (K >> 7) ? (blockIdx.y + 1) * cps : (K >> 7);

  // weight rows g, g + 8 of this warp (rows >= N read row 0, never stored)
  const unsigned char *pq[2], *ps[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = n0 + g + 8 * h;
    const long nn = n < N ? n : 0;
    pq[h] = q + nn * kb + 16 * t + c_begin * 64;
    ps[h] = sc + nn * kg + 2 * t + c_begin * 8;
  }
  // staging: thread -> (token, quad): tokens 8 * j + g for j = warp, warp + 4 WG, ...; 32 k of quad t
  constexpr int STAGE_ITERS = (TN / 8 + 4 * WG - 1) / (4 * WG);
  const u16 *px[STAGE_ITERS];
#pragma unroll
  for (int i = 0; i < STAGE_ITERS; ++i) {
    const int m = m0 + 8 * (warp + 4 * WG * i) + g;
    px[i] = x + (long)(m < M ? m : 0) * ldx + 32 * t + c_begin * 128;
  }

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

  uint4 qc[2], xr[STAGE_ITERS][4];
  u32 scl[2];
  const int nch = c_end - c_begin;
  auto load_w = [&](int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) { qc[h] = ldg16(pq[h] + c * 64); scl[h] = ldg2(ps[h] + c * 8); }
  };
  auto load_x = [&](int c) {
#pragma unroll
    for (int i = 0; i < STAGE_ITERS; ++i)
      if (8 * (warp + 4 * WG * i) < TN)
#pragma unroll
        for (int j = 0; j < 4; ++j) xr[i][j] = ldg16(px[i] + c * 128 + 8 * j);
  };
  // the permuted store: word (s, kh) of quad t = (x[32t + 4s + kh], x[32t + 4s + kh + 2])
  auto store_x = [&](int buf) {
#pragma unroll
    for (int i = 0; i < STAGE_ITERS; ++i) {
      const int blk = warp + 4 * WG * i;
      if (8 * blk < TN) {
        unsigned char *base = xs + buf * BUF_BYTES + blk * CORE + g * 16 + 4 * t;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const uint4 v = xr[i][s >> 1];
          const u32 w0 = (s & 1) ? v.z : v.x, w1 = (s & 1) ? v.w : v.y;   // x[4s .. 4s+3] of quad t
          *(u32 *)(base + s * STEP_BYTES) = prmt(w0, w1, 0x5410);
          *(u32 *)(base + s * STEP_BYTES + (TN / 8) * CORE) = prmt(w0, w1, 0x7632);
        }
      }
    }
  };

  if (nch > 0) {
    load_x(0);
    load_w(0);
    store_x(0);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
  }
  for (int ci = 0; ci < nch; ++ci) {
    const int buf = ci & 1;
    const uint4 qa = qc[0], qb = qc[1];
    u32 sbf0 = scales_bf16x2(scl[0]), sbf1 = scales_bf16x2(scl[1]);
    if (ci + 1 < nch) { load_w(ci + 1); load_x(ci + 1); }
    const unsigned xbase = smem_u32(xs + buf * BUF_BYTES);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int wi = s >> 1;
      const u32 wg = wi == 0 ? qa.x : wi == 1 ? qa.y : wi == 2 ? qa.z : qa.w;
      const u32 wg8 = wi == 0 ? qb.x : wi == 1 ? qb.y : wi == 2 ? qb.z : qb.w;
      const u32 sel = (s & 1) ? 0x3222u : 0x1000u;
      u32 a0, a1, a2, a3;
      if (s >= 4) decode_step<true>(wg, wg8, sel, sbf0, sbf1, a0, a1, a2, a3);
      else decode_step<false>(wg, wg8, sel, sbf0, sbf1, a0, a1, a2, a3);
      wg_fence();
      wgmma(acc, a0, a1, a2, a3, desc(xbase + s * STEP_BYTES, LBO, SBO));
      wg_commit();
      wg_wait<1>();
    }
    wg_wait<0>();
    if (ci + 1 < nch) {
      store_x(buf ^ 1);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
    }
  }

  // D fragment (per warp, per n8 block j): d[4j + i] = (row g + 8 (i >> 1), token 8j + 2t + (i & 1))
  const float out_scale = *pts * 256.0f;
  const int split = gridDim.y;
  if (split > 1) {
    const long tile = (long)blockIdx.z * gridDim.x + blockIdx.x;
    const long tiles = (long)gridDim.x * gridDim.z;
    constexpr int PER_CTA = WG * 128 * NACC;
    float *mine = ws + ((long)blockIdx.y * tiles + tile) * PER_CTA;
#pragma unroll
    for (int i = 0; i < NACC; ++i) mine[i * WG * 128 + threadIdx.x] = acc[i];
    fence_gpu();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomic_add_gpu(cnt + tile, 1) == split - 1;
    __syncthreads();
    if (!last) return;
    fence_gpu();
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      float v = 0.f;
      for (int s2 = 0; s2 < split; ++s2) v += ld_cg(ws + ((long)s2 * tiles + tile) * PER_CTA + i * WG * 128 + threadIdx.x);
      acc[i] = v;
    }
    if (threadIdx.x == 0) atomic_add_gpu(cnt + tile, -split);   // back to 0: reusable, no memset
  }
#pragma unroll
  for (int i = 0; i < NACC; ++i) {
    const int row = n0 + g + 8 * ((i >> 1) & 1);
    const int tok = m0 + 8 * (i >> 2) + 2 * t + (i & 1);
    if (row < N && tok < M) {
      u16 bits;
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(acc[i] * out_scale));
      y[(long)tok * ldy + row] = bits;
    }
  }
}
"""

_KERNELS = {}
_BROKEN: list[str] = []     # why compilation failed, once it has (then the other kernels run)


def _wgmma_asm(TN: int) -> tuple[str, str]:
    n = TN // 2
    d = ", ".join(f"%{i}" for i in range(n))
    asm = (f'"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 5}, 0;\\n'
           f'wgmma.mma_async.sync.aligned.m64n{TN}k16.f32.bf16.bf16 {{{d}}}, '
           f'{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}\\n"')
    out = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return asm, out


def source(WG: int, TN: int, SM_CTAS: int = 1) -> str:
    """The kernel source: ``WG`` warpgroups (64 weight rows each) x ``TN`` tokens per CTA, registers
    capped so that ``SM_CTAS`` CTAs fit on an SM. Descriptor (no swizzle, K-major): leading byte
    offset = the stride between the two 8-k halves of a step, stride byte offset = between 8-token
    blocks (the other reading of the PTX manual faults; checked on the H200)."""
    if TN not in (16, 32, 64) or WG not in (1, 2, 4):
        raise ValueError(f"wgmma kernel: TN in (16, 32, 64) (static shared memory), WG in (1, 2, 4); got {TN}, {WG}")
    asm, out = _wgmma_asm(TN)
    lbo, sbo = (TN // 8) * 128, 128
    return (f"#define WG {WG}\n#define TN {TN}\n#define MIN_BLOCKS {SM_CTAS}\n#define LBO {lbo}\n#define SBO {sbo}\n"
            f"#define WGMMA_ASM {asm}\n#define WGMMA_OUT {out}\n" + S.DEVICE_HELPERS + _BODY)


def supported(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> bool:
    M, K = x.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and M > 0 and K % 128 == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and qdata.data_ptr() % 16 == 0 and scale.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device) == (9, 0) and S.available() and not _BROKEN)


def _kernel(WG: int, TN: int, SM_CTAS: int, device: torch.device):
    key = (WG, TN, SM_CTAS, device.index)
    k = _KERNELS.get(key)
    if k is None:
        with torch.cuda.device(device):
            k = S.compile_source(source(WG, TN, SM_CTAS), "nvfp4_wgmma_fwd", _BROKEN,
                                 compute_capability="90a")     # wgmma needs the arch-specific target
        _KERNELS[key] = k
    return k


def forward(x, qdata, scale_u8, pts, out, counters, num_sms: int, WG: int = 2, TN: int = 64,
            split: int | None = None, SM_CTAS: int = 1, kernel=None):
    """out[M, N] = x[M, K] @ W^T * pts for bf16 x (see ``supported``); ``split`` None: enough
    CTAs for ~2 per SM, each keeping >= 4 chunks. ``kernel``: another compilation of this source
    with the same parameters (``benchmarks/wgmma_stages.py`` times edited variants)."""
    M, K = x.shape
    N = qdata.shape[0]
    tiles_n, tiles_m, chunks = -(-N // (64 * WG)), -(-M // TN), K // 128
    if split is None:
        want = 2 * num_sms
        split = max(1, min(-(-want // (tiles_n * tiles_m)), chunks // 4, 32))
    split, cps = S.chunk_split(chunks, split)
    if split > 1:
        ws = torch.empty(split * tiles_n * tiles_m * WG * 128 * (TN // 2), dtype=torch.float32, device=x.device)
        cnt = counters(tiles_n * tiles_m)
    else:
        ws, cnt = out, out                      # not read
    kern = kernel or _kernel(WG, TN, SM_CTAS, x.device)
    kern(grid=(tiles_n, split, tiles_m), block=(WG * 128, 1, 1),
         args=[x, qdata, scale_u8, pts, out, ws, cnt, M, N, K, x.stride(0), out.stride(0), cps])
    return out
