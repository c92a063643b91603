"""CUDA NVFP4 W4A16 forward for skinny activations (M <= 16 tokens: decode), compiled with NVRTC.

Why CUDA next to the Triton kernels: at M <= 16 the Triton forward is issue-bound, not memory-bound
(``kernels/NOTES.md``): ~4.3 SASS instructions per weight, of which the decode is ~2.5 and the
rest is Triton moving the decoded tile from its load layout into the ``mma`` operand layout
(shared-memory round trip, barriers). Here each thread loads exactly the codes of its own
``mma.sync.m16n8k16`` A-fragment with 16-byte loads and decodes them in registers, so nothing
else sits between the load and the MMA.

The k order inside one MMA does not matter as long as A and B use the same one, which is what
lets the fragments come straight from the existing ``[N, K/2]`` layout (no repacking):

* A chunk is 128 k (64 bytes of a row). Thread ``(g, t) = (lane / 4, lane % 4)`` loads bytes
  ``[16t, 16t+16)`` of rows ``g`` and ``g + 8`` of its 16-row tile: the 32 codes
  ``k = 32t .. 32t+31`` = scale groups ``2t`` and ``2t+1``.
* MMA step ``s`` (8 per chunk) uses bytes ``2s, 2s+1`` of each row: the decode (the same
  20-instruction PTX as ``nvfp4_w4a16._DECODE_PTX``) yields ``ev = (k0, k2)`` (low nibbles) and
  ``od = (k1, k3)`` (high nibbles) with ``k0 = 32t + 4s``: ``a0 = ev(row g)``, ``a1 = ev(row g+8)``,
  ``a2 = od(row g)``, ``a3 = od(row g+8)``, already multiplied by their block scale.
* The B fragment of token ``g`` then needs ``(x[k0], x[k0+2])`` and ``(x[k0+1], x[k0+3])``: two
  ``prmt`` of the activation words. Every thread's 16 MMA slots map to 16 distinct k, and the 8
  steps of a chunk cover all 128.

Decoded values are ``e2m1 * scale * 2^-8`` in bf16 (exact); ``pts * 2^8`` is applied in the fp32
epilogue. CTA ``(tile, s)`` owns ``16 * R`` weight rows and the ``s``-th of ``split`` ranges of K
chunks; its ``WARPS`` warps take every ``WARPS``-th chunk of it and are summed in a fixed order
through shared memory; with ``split > 1`` the CTAs of a tile meet through an fp32 workspace and a
self-resetting counter, the last to arrive summing in split order: deterministic either way. Each
warp prefetches its next chunk (weights, scales, activations) into registers while it decodes the
current one. Rows >= N and tokens >= M read row / token 0 and are never stored (no predication).

Measured on the H200 (``kernels/NOTES.md``): 3.3 SASS instructions per weight (Triton: 4.3); one
Qwen2.5-7B layer's linears at M = 1 in 63 us (Triton 89 us, cuBLAS bf16 145 us), 51% of copy
bandwidth; the same loads without the decode reach 83-87% on gate_up: the decode does not overlap
the memory stream fully.

Requirements (checked by ``supported``; otherwise the Triton kernel runs): bf16 activations,
M <= 16, K % 128 == 0, 16-byte aligned pointers and an activation row stride that keeps them aligned.
Compiled once per (R, TT, WARPS, SM_WARPS, device) with ``torch.cuda._compile_kernel`` (NVRTC, no headers);
launched on the current stream, so it is captured by CUDA graphs like any kernel.
"""

import warnings

import torch

# Device helpers shared with the wgmma kernel (kernels/nvfp4_wgmma.py): the fragment decode, the
# e4m3 scale conversion, MMA and load wrappers, the split-K rendezvous primitives.
DEVICE_HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;

// 4 bytes of one row-pair step -> the 4 A-fragment registers (see the module docstring).
// wg / wg8: the word holding bytes (2s, 2s+1) of rows g / g+8; sel: which half of it;
// sg / sg8: bf16x2 of (block scale * 2^118) of groups (2t, 2t+1) for rows g / g+8, HI: use the high
// half (group 2t+1); the broadcast of one half is an operand modifier of HMUL2/HFMA2, not an op.
#define DECODE_ASM(H)                                                                   \
  "{\n"                                                                               \
  ".reg .b32 t0, t1, a, b, z, s0, s1;\n"                                              \
  ".reg .b16 l0, h0, l1, h1;\n"                                                       \
  "mov.b32 {l0, h0}, %7;\n"                                                          \
  "mov.b32 {l1, h1}, %8;\n"                                                          \
  "mov.b32 s0, {" H "0, " H "0};\n"                                                  \
  "mov.b32 s1, {" H "1, " H "1};\n"                                                  \
  "mov.b32 z, 0x80008000;\n"                                                          \
  "prmt.b32 t0, %4, %4, %6;\n"                                                        \
  "prmt.b32 t1, %5, %5, %6;\n"                                                        \
  "shl.b32 a, t0, 4; shr.b32 b, t0, 2;\n"                                             \
  "and.b32 a, a, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;\n"             \
  "fma.rn.bf16x2 %0, a, s0, z;\n"                                                     \
  "shl.b32 a, t1, 4; shr.b32 b, t1, 2;\n"                                             \
  "and.b32 a, a, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;\n"             \
  "fma.rn.bf16x2 %1, a, s1, z;\n"                                                     \
  "shr.b32 b, t0, 6;\n"                                                               \
  "and.b32 a, t0, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;\n"            \
  "fma.rn.bf16x2 %2, a, s0, z;\n"                                                     \
  "shr.b32 b, t1, 6;\n"                                                               \
  "and.b32 a, t1, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;\n"            \
  "fma.rn.bf16x2 %3, a, s1, z;\n"                                                     \
  "}\n"

template <bool HI>
__device__ __forceinline__ void decode_step(u32 wg, u32 wg8, u32 sel, u32 sg, u32 sg8,
                                            u32 &a0, u32 &a1, u32 &a2, u32 &a3) {
  if (HI)
    asm(DECODE_ASM("h") : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
        : "r"(wg), "r"(wg8), "r"(sel), "r"(sg), "r"(sg8));
  else
    asm(DECODE_ASM("l") : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
        : "r"(wg), "r"(wg8), "r"(sel), "r"(sg), "r"(sg8));
}

// Two e4m3 block scales (low byte first) -> one bf16x2 of (scale * 2^118), exact.
__device__ __forceinline__ u32 scales_bf16x2(u32 s16) {
  u32 h2, out;
  asm("{\n.reg .b16 s;\ncvt.u16.u32 s, %1;\ncvt.rn.f16x2.e4m3x2 %0, s;\n}\n" : "=r"(h2) : "r"(s16));
  float f0, f1;
  asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
      : "=f"(f0), "=f"(f1) : "r"(h2));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(f1 * 0x1p118f), "f"(f0 * 0x1p118f));
  return out;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ u32 ldg2(const void *p) {
  u16 v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ldg16(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ int atomic_add_gpu(int *p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ float ld_cg(const float *p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// The CTA's summed partials red[o] (shared memory; o = ((tile * TT_ + tt) * 4 + i) * 32 + lane over
// its 16-row tiles, the MMA C fragment: i = 0, 1 row g, tokens 2t, 2t + 1; i = 2, 3 row g + 8) times
// pts * 2^8 to y. With gridDim.y = split > 1 the CTAs of a tile meet through ws[split][tiles][TOTAL]
// and the tile's self-resetting counter; the last to arrive sums in split order (deterministic).
template <int TOTAL, int TT_>
__device__ __forceinline__ void store_tiles(float *red, float *__restrict__ ws, int *__restrict__ cnt,
                                            const float *__restrict__ pts, u16 *__restrict__ y,
                                            int n0, int M, int N, int ldy) {
  const float out_scale = *pts * 256.0f;
  const int split = gridDim.y, nthr = blockDim.x;
  if (split > 1) {
    float *tile_ws = ws + (long)blockIdx.x * TOTAL;           // ws[split][tiles][TOTAL]
    const long split_stride = (long)gridDim.x * TOTAL;
    for (int o = threadIdx.x; o < TOTAL; o += nthr) tile_ws[blockIdx.y * split_stride + o] = red[o];
    fence_gpu();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomic_add_gpu(cnt + blockIdx.x, 1) == split - 1;
    __syncthreads();
    if (!last) return;
    fence_gpu();
    for (int o = threadIdx.x; o < TOTAL; o += nthr) {
      float v = 0.f;
      for (int s2 = 0; s2 < split; ++s2) v += ld_cg(tile_ws + s2 * split_stride + o);
      red[o] = v;
    }
    if (threadIdx.x == 0) atomic_add_gpu(cnt + blockIdx.x, -split);   // back to 0: reusable, no memset
  }
  for (int o = threadIdx.x; o < TOTAL; o += nthr) {
    const int ln = o & 31, i = (o >> 5) & 3, tt = (o >> 7) % TT_, tile = (o >> 7) / TT_;
    const int row = n0 + 16 * tile + (ln >> 2) + 8 * (i >> 1);
    const int tokn = 8 * tt + 2 * (ln & 3) + (i & 1);
    if (row < N && tokn < M) {
      u16 bits;
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(red[o] * out_scale));
      y[(long)tokn * ldy + row] = bits;
    }
  }
}
"""

# The per-thread fragment math shared with the warp-specialised experiment (benchmarks/stream_ws.py):
# one 128-k chunk of R row tiles and TT token tiles, decoded and multiplied into acc.
FRAGMENT_MATH = r"""
struct Chunk {
  uint4 q[R][2];      // 16 bytes of rows g, g+8 of each row tile
  u32 s[R][2];        // the two e4m3 scales (groups 2t, 2t+1) of each of those rows
  uint4 x[TT][4];     // 32 bf16 activations of token g (+8 per token tile)
};

__device__ __forceinline__ void compute(const Chunk &cur, float (&acc)[R][TT][4]) {
  u32 sbf[R][2];                                            // [tile][row g / g+8]: groups (2t, 2t+1)
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) sbf[r][h] = scales_bf16x2(cur.s[r][h]);
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    u32 b[TT][2];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      const uint4 xv = cur.x[tt][s >> 1];                   // x[32t + 4s .. 4s+3] = 2 words
      const u32 w0 = (s & 1) ? xv.z : xv.x, w1 = (s & 1) ? xv.w : xv.y;
      b[tt][0] = prmt(w0, w1, 0x5410);                      // (x[k0], x[k0+2])
      b[tt][1] = prmt(w0, w1, 0x7632);                      // (x[k0+1], x[k0+3])
    }
    const u32 sel = (s & 1) ? 0x3222u : 0x1000u;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 qa = cur.q[r][0], qb = cur.q[r][1];
      const int wi = s >> 1;
      const u32 wg = wi == 0 ? qa.x : wi == 1 ? qa.y : wi == 2 ? qa.z : qa.w;
      const u32 wg8 = wi == 0 ? qb.x : wi == 1 ? qb.y : wi == 2 ? qb.z : qb.w;
      u32 a0, a1, a2, a3;
      if (s >= 4) decode_step<true>(wg, wg8, sel, sbf[r][0], sbf[r][1], a0, a1, a2, a3);  // group 2t+1
      else decode_step<false>(wg, wg8, sel, sbf[r][0], sbf[r][1], a0, a1, a2, a3);        // group 2t
#pragma unroll
      for (int tt = 0; tt < TT; ++tt) mma_bf16(acc[r][tt], a0, a1, a2, a3, b[tt][0], b[tt][1]);
    }
  }
}
"""

_SRC = DEVICE_HELPERS + FRAGMENT_MATH + r"""
// Pointers of one thread, advanced by 2 * WARPS chunks per loop trip. Out-of-range rows and
// tokens read row 0 / token 0 instead (valid memory); they only feed outputs that are never
// stored (a row's output depends on that row alone, a token's on that token). K % 128 == 0.
struct Ptrs {
  const unsigned char *q[R][2];
  const unsigned char *s[R][2];
  const u16 *x[TT];
};

__device__ __forceinline__ void load(const Ptrs &p, int off, Chunk &ch) {
  // off: 0 or WARPS (chunk offset from the pointers' current chunk)
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ch.q[r][h] = ldg16(p.q[r][h] + off * 64);
      ch.s[r][h] = ldg2(p.s[r][h] + off * 8);
    }
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int i = 0; i < 4; ++i) ch.x[tt][i] = ldg16(p.x[tt] + off * 128 + 8 * i);
}


extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
nvfp4_skinny_fwd(const u16 *__restrict__ x, const unsigned char *__restrict__ q,
                 const unsigned char *__restrict__ sc, const float *__restrict__ pts,
                 u16 *__restrict__ y, float *__restrict__ ws, int *__restrict__ cnt,
                 int M, int N, int K, int ldx, int ldy, int cps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * (16 * R);
  const long kb = K >> 1, kg = K >> 4;
  // this CTA's chunks: [c_begin, c_end); its warp w takes c_begin + w, + WARPS, ...
  const int c_begin = blockIdx.y * cps;
  const int nchunks = (int)(blockIdx.y + 1) * cps < (K >> 7) ? (int)(blockIdx.y + 1) * cps : (K >> 7);

  Ptrs p;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n0 + 16 * r + g + 8 * h;
      const long nn = n < N ? n : 0;
      p.q[r][h] = q + nn * kb + 16 * t + (c_begin + warp) * 64;
      p.s[r][h] = sc + nn * kg + 2 * t + (c_begin + warp) * 8;
    }
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) {
    const int m = 8 * tt + g;
    p.x[tt] = x + (long)(m < M ? m : 0) * ldx + 32 * t + (c_begin + warp) * 128;
  }

  float acc[R][TT][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][tt][i] = 0.f;

  // Ping-pong between two register buffers (no copies): the loads of chunk c + WARPS are in
  // flight while chunk c is decoded. The last chunk of a ragged K (!KFULL) may cover k >= K for
  // some threads: those read k = 0 of their rows with zero scales.
  Chunk b0, b1;
  int c = c_begin + warp;
  if (c < nchunks) load(p, 0, b0);
  while (c < nchunks) {
    // b0 holds chunk c; this trip decodes c (b0) and c + WARPS (b1)
    const int c1 = c + WARPS, c2 = c + 2 * WARPS;
    if (c1 < nchunks) load(p, WARPS, b1);
    compute(b0, acc);
    if (c1 >= nchunks) break;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) { p.q[r][h] += 2 * WARPS * 64; p.s[r][h] += 2 * WARPS * 8; }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) p.x[tt] += 2 * WARPS * 128;
    if (c2 < nchunks) load(p, 0, b0);
    compute(b1, acc);
    c = c2;
  }

  // Sum the warps' partials in a fixed order; C fragment: c0,c1 = (row g, tokens 2t, 2t+1),
  // c2,c3 = (row g+8, same tokens).
  constexpr int PER_WARP = R * TT * 4 * 32;
  __shared__ float red[WARPS * PER_WARP];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp * PER_WARP + ((r * TT + tt) * 4 + i) * 32 + lane] = acc[r][tt][i];
  __syncthreads();
  for (int o = threadIdx.x; o < PER_WARP; o += WARPS * 32) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += red[w * PER_WARP + o];
    red[o] = v;                            // (each o is read and written by one thread only)
  }
  store_tiles<PER_WARP, TT>(red, ws, cnt, pts, y, n0, M, N, ldy);
}
"""

_KERNELS = {}
_BROKEN: list[str] = []     # why NVRTC compilation failed, once it has: then the Triton path runs


class CompileError(RuntimeError):
    """NVRTC could not build the kernel (no NVRTC library, an unsupported toolkit, ...)."""


def source(R: int, TT: int, WARPS: int, SM_WARPS: int = 16) -> str:
    """The kernel source for R row tiles (16 rows each), TT token tiles (8 tokens each), WARPS warps
    per CTA and register use capped so that SM_WARPS warps fit on one SM (16: 128 registers)."""
    min_blocks = max(1, SM_WARPS // WARPS)
    return f"#define R {R}\n#define TT {TT}\n#define WARPS {WARPS}\n#define MIN_BLOCKS {min_blocks}\n" + _SRC


def available() -> bool:
    """True where NVRTC compilation through torch is there (torch >= 2.8 on CUDA) and has not failed."""
    return not _BROKEN and torch.cuda.is_available() and hasattr(torch.cuda, "_compile_kernel")


def compile_source(src: str, name: str = "nvfp4_skinny_fwd", broken: list | None = None, **kwargs):
    """``torch.cuda._compile_kernel`` on the current device; a failure is remembered in ``broken``
    (default: this kernel's, so ``available()`` turns false and the callers use Triton), warned
    about once, and raised as CompileError."""
    broken = _BROKEN if broken is None else broken
    try:
        return torch.cuda._compile_kernel(src, name, **kwargs)
    except Exception as e:
        if not broken:
            warnings.warn(f"NVFP4 CUDA kernel {name} unavailable, using the Triton kernels instead "
                          f"({type(e).__name__}: {str(e)[:300]})", RuntimeWarning, stacklevel=2)
        broken.append(f"{type(e).__name__}: {e}")
        raise CompileError(str(e)) from e


def supported(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether this kernel handles the call (else the Triton path does)."""
    M, K = x.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and 1 <= M <= 16 and K % 128 == 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and qdata.data_ptr() % 16 == 0 and scale.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9) and available())


def _kernel(R: int, TT: int, WARPS: int, SM_WARPS: int, device: torch.device):
    key = (R, TT, WARPS, SM_WARPS, device.index)
    k = _KERNELS.get(key)
    if k is None:
        with torch.cuda.device(device):
            k = compile_source(source(R, TT, WARPS, SM_WARPS))
        _KERNELS[key] = k
    return k


def auto_split(tiles: int, WARPS: int, chunks: int, num_sms: int, waves: float = 2.0) -> int:
    """Splits of K across CTAs so that ~``waves`` x (16 warps x SMs) warps run, each warp keeping at
    least 2 chunks (a short warp spends most of its time filling its prefetch)."""
    want = int(waves * 16 * num_sms)
    split = max(1, -(-want // (tiles * WARPS)))
    return max(1, min(split, chunks // (2 * WARPS), 32))


def chunk_split(chunks: int, split: int) -> tuple[int, int]:
    """(CTAs per K, chunks per CTA) for ``split`` requested CTAs: clamped to [1, chunks], and
    trimmed so that no CTA gets an empty range."""
    cps = -(-chunks // max(1, min(split, chunks)))
    return -(-chunks // cps), cps


def forward(x, qdata, scale_u8, pts, out, counters, num_sms: int, R: int = 1, WARPS: int = 8,
            split: int | None = None, SM_WARPS: int = 16):
    """out[M, N] = x[M, K] @ W^T * pts for bf16 x with M <= 16 (see ``supported``).

    ``counters(n)`` returns an int32 buffer of >= n zeros that the kernel leaves at zero;
    ``num_sms`` (the device's multiprocessor count) sizes the automatic split."""
    M, K = x.shape
    N = qdata.shape[0]
    TT = 1 if M <= 8 else 2
    if TT == 2:                                 # two token tiles need the registers: 128 (two row
        SM_WARPS = min(SM_WARPS, 16 if R == 1 else 12)  # tiles spill there), 162 for two row tiles
    tiles, chunks = -(-N // (16 * R)), K // 128
    if split is None:
        split = auto_split(tiles, WARPS, chunks, num_sms)
    split, cps = chunk_split(chunks, split)
    if split > 1:
        ws = torch.empty(split * tiles * R * TT * 128, dtype=torch.float32, device=x.device)
        cnt = counters(tiles)
    else:
        ws, cnt = out, out                      # not read
    kern = _kernel(R, TT, WARPS, SM_WARPS, x.device)
    kern(grid=(tiles, split, 1), block=(WARPS * 32, 1, 1),
         args=[x, qdata, scale_u8, pts, out, ws, cnt, M, N, K, x.stride(0), out.stride(0), cps])
    return out
