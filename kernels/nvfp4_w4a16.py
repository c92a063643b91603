"""Triton NVFP4 weight x bf16/fp16 activation (W4A16) kernels for Hopper (sm_90).

Weight format (fixed by ``qerl/nvfp4.py``)::

    qdata  uint8          [N, K/2]   element 2j in the low nibble, 2j+1 in the high nibble
    scale  float8_e4m3fn  [N, K/16]  one block scale per 16 consecutive k
    pts    float32        0-d        per-tensor scale (multiplicative)
    W[n, k] = e2m1(code[n, k]) * float(scale[n, k // 16]) * pts

The H200 has no FP4 tensor cores, so the win comes from reading 4.5 bits per weight instead of 16
and dequantizing in registers right before ``tl.dot`` (bf16 tensor cores). Design:

* **Decode** (``_decode_tile``). Each 16-group of one row is 8 bytes, so a weight tile is loaded
  as ``[R, BK//16, 8]`` bytes plus its ``[R, BK//16]`` scales. On the GPU an inline-PTX block
  decodes 4 packed bytes (8 codes) with 2 ``prmt`` + 14 shift/logic ops + 4 packed
  ``bf16x2`` multiplies: the code is placed in a bf16 bit pattern worth ``e2m1 * 2^-126`` (0.5
  becomes a bf16 subnormal, as in Marlin) and multiplied by ``scale * 2^118``, so every decoded
  element is ``e2m1 * scale * 2^-8`` -- exact in bf16 (5 significant bits, range [2^-19, 10.5]).
  That is 2.5 integer/FMA-pipe ops per weight against ~10 for a naive per-nibble decode, which
  matters because at M <= 16 the decode, not the MMA, competes with the memory stream.
  The per-tensor scale and the 2^8 are folded into the fp32 epilogue (exact: one scalar).
  ``USE_ASM=False`` selects an equivalent pure-Triton decode (fp16 bit trick) that the CPU
  interpreter can run (tests) -- the interpreter cannot run inline PTX.
* **Forward** ``y[M, N] = x[M, K] @ W^T`` (``_fwd_kernel``): grid (M tiles, N tiles, K splits);
  M tiles vary fastest so that programs sharing a weight tile run together and hit it in L2.
  The scale groups run along the reduction axis here.
* **Grad-input** ``gx[M, K] = g[M, N] @ W`` (``_bwd_kernel``): grid (M tiles, K tiles, N splits);
  the reduction runs over N, across the block-scale groups -- which is why the weight is
  dequantized in registers (the same ``_decode_tile``) instead of using a scaled-dot MMA whose
  scales must lie along the reduction axis; Wᵀ is never re-quantized.
* **Split reduction** (small M: too few output tiles to fill 132 SMs): each split writes an fp32
  partial tile to a workspace, then bumps a per-tile counter (``atomic_add``, acq_rel). The program
  that arrives last sums the partials in split order (deterministic), applies the scale, writes
  the output and resets its counter to 0, so the counter buffer is reusable without a memset
  (one launch per linear; safe under CUDA-graph capture).
* ``SWAP`` computes the transposed product (``W @ xᵀ``) so the weight tile is the MMA's M side:
  at M <= 16 that lets Hopper use wgmma (M >= 64 per warpgroup) instead of mma.sync.
* **Dequantize** (``_dequant_kernel``) writes W in bf16/fp16 (pts applied) for the large-M path,
  where cuBLAS on the dequantized weight beats a fused Triton GEMM (compute-bound; the extra
  2.56 B/weight of traffic is a few % of the GEMM time at M >= 1-2k tokens).

Launch wrappers, config choice and autotuning live in ``kernels/_launch.py``.
"""

import triton
import triton.language as tl

# bf16 pattern of e2m1 with exponent offset -126: fold the 2^126 into the scale, minus 2^8 of headroom
# (scale * 2^118 <= 448 * 2^118 < bf16 max); the epilogue multiplies by pts * 2^8.
SCALE_BIAS = tl.constexpr(2.0**118)
OUT_BIAS = tl.constexpr(2.0**8)

# Inline PTX: 4 packed bytes (8 e2m1 codes) -> 4 bf16x2 registers, each multiplied by its scale.
# Operands (Triton packs sub-32-bit elements into 32-bit registers, pack=4):
#   $0,$1: "even" results (low nibbles) of bytes (0,1) and (2,3);  $2,$3: "odd" (high nibbles)
#   $4: the 4 packed bytes;  $5,$6: the bf16 scales of bytes (0,1) and (2,3)
# prmt puts byte i in byte 1 and byte i+1 in byte 3 of a temp t, so the high nibbles sit at the top
# of each 16-bit half: odd = (t & sign) | ((t >> 6) & mag) -- sign already at bit 15/31, the 3
# magnitude bits move to 6..8 / 22..24 (bf16 exponent low bits + mantissa msb = e2m1 * 2^-126);
# the low nibbles need one more shift. 20 ops per 8 codes (checked bit-exact in Python emulation
# and exhaustively on the GPU, tests/test_kernels.py::test_gpu_decode_exhaustive).
_DECODE_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, a, b, z;
mov.b32 z, 0x80008000;
prmt.b32 t0, $4, $4, 0x1000;
prmt.b32 t1, $4, $4, 0x3222;
shl.b32 a, t0, 4; shr.b32 b, t0, 2;
and.b32 a, a, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 $0, a, $5, z;
shl.b32 a, t1, 4; shr.b32 b, t1, 2;
and.b32 a, a, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 $1, a, $6, z;
shr.b32 b, t0, 6;
and.b32 a, t0, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 $2, a, $5, z;
shr.b32 b, t1, 6;
and.b32 a, t1, 0x80008000; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 $3, a, $6, z;
}
""")


@triton.jit
def _decode_tile(q_ptr, s_ptr, rn, g0, N, KG, BR: tl.constexpr, BG: tl.constexpr,
                 USE_ASM: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Load and dequantize rows ``rn`` [BR] x 16-groups [g0, g0+BG).

    Returns ``(ev, od)``, each [BR, BG*8]: ``ev[:, j]`` is the weight at k = 2j (low nibbles),
    ``od[:, j]`` at k = 2j+1 (high nibbles), relative to the tile start. Values are
    ``e2m1 * scale * 2^-8`` (exact) in bf16 (USE_ASM) or fp32 (interpreter path). Keeping even and
    odd k apart (instead of interleaving them back) lets each bf16x2 register that the PTX writes
    feed the MMA operand as is: the callers reduce over even and odd k with two dots (forward) or
    keep two accumulators (grad-input). Rows >= N and groups >= KG (= K // 16) read as 0.
    """
    rg = g0 + tl.arange(0, BG)
    row = rn.to(tl.int64)
    # q is loaded as a 2-D [BR, BG*8] tile (one contiguous run of BG*8 bytes per row) so that the
    # loads coalesce along the row; a 3-D [BR, BG, 8] pointer tensor made Triton give each thread
    # its own row, 32 cache lines per warp access: ncu showed L1 at 91% and DRAM at 19%.
    rq = g0 * 8 + tl.arange(0, BG * 8)
    q_ptrs = q_ptr + row[:, None] * (KG * 8) + rq[None, :]
    s_ptrs = s_ptr + row[:, None] * KG + rg[None, :]
    if EVEN_N and EVEN_K:
        q = tl.load(q_ptrs)                                                     # [BR, BG*8] u8
        s = tl.load(s_ptrs)                                                     # [BR, BG] u8
    else:
        m2 = (rn[:, None] < N) & (rg[None, :] < KG)
        q = tl.load(q_ptrs, mask=(rn[:, None] < N) & (rq[None, :] < KG * 8), other=0)
        s = tl.load(s_ptrs, mask=m2, other=0)
    q = tl.reshape(q, (BR, BG, 8))
    sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if USE_ASM:
        sb = tl.broadcast_to((sf * SCALE_BIAS).to(tl.bfloat16)[:, :, None], (BR, BG, 8))
        ev, od = tl.inline_asm_elementwise(
            _DECODE_PTX, "=r,=r,=r,=r,r,r,r", [q, sb],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        qi = q.to(tl.int32)
        sc = (sf * (16384.0 / OUT_BIAS))[:, :, None]
        ev = _e2m1_f32(qi & 0xF) * sc
        od = _e2m1_f32(qi >> 4) * sc
    return tl.reshape(ev, (BR, BG * 8)), tl.reshape(od, (BR, BG * 8))


@triton.jit
def _e2m1_f32(c):
    """e2m1 code (int32, 0..15) -> value * 2^-14 in fp32 via the fp16 bit pattern (exact)."""
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _split_epilogue(acc, out_ptr, ws_ptr, cnt_ptr, r0, r1, n0, n1, stride0, stride1, scale,
                    tile_id, num_tiles, pid_s, split, B0: tl.constexpr, B1: tl.constexpr,
                    HAS_SPLIT: tl.constexpr):
    """Write ``acc * scale`` [B0, B1] (fp32) at rows r0 < n0, cols r1 < n1 of out.

    With HAS_SPLIT the partial goes to ``ws[pid_s, tile_id]``; the last of the ``split`` programs
    of a tile sums them.
    """
    mask = (r0[:, None] < n0) & (r1[None, :] < n1)
    optr = out_ptr + r0.to(tl.int64)[:, None] * stride0 + r1.to(tl.int64)[None, :] * stride1
    if not HAS_SPLIT:
        tl.store(optr, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        loc = tl.arange(0, B0)[:, None] * B1 + tl.arange(0, B1)[None, :]
        tile_ws = ws_ptr + tile_id.to(tl.int64) * (B0 * B1)
        # only in-range elements travel (at M = 1 that is 1/16 of a BM = 16 tile)
        tl.store(tile_ws + pid_s.to(tl.int64) * num_tiles * (B0 * B1) + loc, acc, mask=mask)
        tl.debug_barrier()                        # every thread's partial is stored ...
        prev = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")   # ... then release
        if prev == split - 1:                     # last split of this tile: reduce in fixed order
            tot = tl.zeros((B0, B1), dtype=tl.float32)
            for s in range(split):
                tot += tl.load(tile_ws + s * num_tiles * (B0 * B1) + loc, mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.store(optr, (tot * scale).to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M", "ITERS", "split"])
def _fwd_kernel(x_ptr, q_ptr, s_ptr, pts_ptr, y_ptr, ws_ptr, cnt_ptr,
                M, N, K, KG, stride_xm, stride_ym, ITERS, split,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_SPLIT: tl.constexpr,
                SWAP: tl.constexpr, USE_ASM: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, MMA_V2: tl.constexpr = False):
    """y[M, N] = x[M, K] @ W[N, K]^T * pts.  Grid: (cdiv(M,BM), cdiv(N,BN), split).

    Each program owns rows [pid_n*BN, +BN) of W and K blocks [pid_s*ITERS, +ITERS).
    Even and odd k are reduced by two dots (x split the same way), see ``_decode_tile``.
    MMA_V2 is not read here: it only keys the compiled variant that the launcher builds with
    Triton's DISABLE_MMA_V3 (mma.sync instead of wgmma; see ``_launch.py``).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    kb0 = pid_s * ITERS
    kb1 = tl.minimum(kb0 + ITERS, tl.cdiv(K, BK))
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb0, kb1):
        ev, od = _decode_tile(q_ptr, s_ptr, rn, kb * (BK // 16), N, KG, BN, BK // 16,
                              USE_ASM, EVEN_N, EVEN_K)                          # [BN, BK/2] x2
        rk = kb * BK + tl.arange(0, BK)
        if EVEN_K:
            x = tl.load(x_rows + rk[None, :], mask=rm[:, None] < M, other=0.0)   # [BM, BK]
        else:
            x = tl.load(x_rows + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        xe, xo = tl.split(tl.reshape(x, (BM, BK // 2, 2)))                      # [BM, BK/2] x2
        ev = ev.to(x.dtype)
        od = od.to(x.dtype)
        if SWAP:
            acc = tl.dot(ev, tl.trans(xe), acc)                                 # [BN, BM]
            acc = tl.dot(od, tl.trans(xo), acc)
        else:
            acc = tl.dot(xe, tl.trans(ev), acc)                                 # [BM, BN]
            acc = tl.dot(xo, tl.trans(od), acc)
    scale = tl.load(pts_ptr) * OUT_BIAS
    tile_id = pid_n * tl.num_programs(0) + pid_m
    num_tiles = tl.num_programs(0) * tl.num_programs(1)
    if SWAP:
        _split_epilogue(acc, y_ptr, ws_ptr, cnt_ptr, rn, rm, N, M, 1, stride_ym, scale,
                        tile_id, num_tiles, pid_s, split, BN, BM, HAS_SPLIT)
    else:
        _split_epilogue(acc, y_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, 1, scale,
                        tile_id, num_tiles, pid_s, split, BM, BN, HAS_SPLIT)


@triton.jit(do_not_specialize=["M", "ITERS", "split"])
def _bwd_kernel(g_ptr, q_ptr, s_ptr, pts_ptr, gx_ptr, ws_ptr, cnt_ptr,
                M, N, K, KG, stride_gm, stride_xm, ITERS, split,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_SPLIT: tl.constexpr,
                SWAP: tl.constexpr, USE_ASM: tl.constexpr, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, MMA_V2: tl.constexpr = False):
    """gx[M, K] = g[M, N] @ W[N, K] * pts (reduction over N).  Grid: (cdiv(M,BM), cdiv(K,BK), split).

    Each program owns output columns [pid_k*BK, +BK) and N blocks [pid_s*ITERS, +ITERS); even and
    odd output columns accumulate separately and are interleaved once, in the epilogue.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    nb0 = pid_s * ITERS
    nb1 = tl.minimum(nb0 + ITERS, tl.cdiv(N, BN))
    g_rows = g_ptr + rm.to(tl.int64)[:, None] * stride_gm
    if SWAP:
        acc_e = tl.zeros((BK // 2, BM), dtype=tl.float32)
        acc_o = tl.zeros((BK // 2, BM), dtype=tl.float32)
    else:
        acc_e = tl.zeros((BM, BK // 2), dtype=tl.float32)
        acc_o = tl.zeros((BM, BK // 2), dtype=tl.float32)
    for nb in range(nb0, nb1):
        rn = nb * BN + tl.arange(0, BN)
        ev, od = _decode_tile(q_ptr, s_ptr, rn, pid_k * (BK // 16), N, KG, BN, BK // 16,
                              USE_ASM, EVEN_N, EVEN_K)                          # [BN, BK/2] x2
        if EVEN_N:
            g = tl.load(g_rows + rn[None, :], mask=rm[:, None] < M, other=0.0)   # [BM, BN]
        else:
            g = tl.load(g_rows + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
        ev = ev.to(g.dtype)
        od = od.to(g.dtype)
        if SWAP:
            acc_e = tl.dot(tl.trans(ev), tl.trans(g), acc_e)                    # [BK/2, BM]
            acc_o = tl.dot(tl.trans(od), tl.trans(g), acc_o)
        else:
            acc_e = tl.dot(g, ev, acc_e)                                        # [BM, BK/2]
            acc_o = tl.dot(g, od, acc_o)
    scale = tl.load(pts_ptr) * OUT_BIAS
    tile_id = pid_k * tl.num_programs(0) + pid_m
    num_tiles = tl.num_programs(0) * tl.num_programs(1)
    if SWAP:
        acc = tl.reshape(tl.permute(tl.join(acc_e, acc_o), (0, 2, 1)), (BK, BM))
        _split_epilogue(acc, gx_ptr, ws_ptr, cnt_ptr, rk, rm, K, M, 1, stride_xm, scale,
                        tile_id, num_tiles, pid_s, split, BK, BM, HAS_SPLIT)
    else:
        acc = tl.reshape(tl.join(acc_e, acc_o), (BM, BK))
        _split_epilogue(acc, gx_ptr, ws_ptr, cnt_ptr, rm, rk, M, K, stride_xm, 1, scale,
                        tile_id, num_tiles, pid_s, split, BM, BK, HAS_SPLIT)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, pts_ptr, w_ptr, N, K, KG,
                    BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr,
                    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """w[N, K] = dequantized weight (pts applied) in w's dtype.  Grid: (cdiv(K,BK), cdiv(N,BN))."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    ev, od = _decode_tile(q_ptr, s_ptr, rn, pid_k * (BK // 16), N, KG, BN, BK // 16,
                          USE_ASM, EVEN_N, EVEN_K)
    w = tl.interleave(ev, od).to(tl.float32) * (tl.load(pts_ptr) * OUT_BIAS)
    ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    if EVEN_N and EVEN_K:
        tl.store(ptrs, w.to(w_ptr.dtype.element_ty))
    else:
        tl.store(ptrs, w.to(w_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))
