"""Mid-batch quantized GEMM (9 or 17 to 256 tokens) in Gluon, on Hopper's warpgroup MMA.

Past 16 tokens the GEMV (quant_gemv.py) runs one CTA row per 16-token tile, so each weight byte is read once
per tile; dequantizing to bf16 for cuBLAS moves ~5 bytes per weight. This kernel reads each weight byte once per
call up to 256 tokens, from the same fragment-order planes (no second copy of the weights):

  - Tokens are wgmma's N side (16-256, one token tile per CTA), weights its M side: a CTA of NW warps owns
    16 NW rows, warp w the 16-row tile w, which is exactly the tile a lane's fragment-order bytes describe.
    So weight bytes go global -> registers with one 16-byte load per lane and tile, are dequantized there by
    the GEMV's own packed-f16 code (quant_gemv._dequant_operand, _q6_operands, _fp4_operands) and feed wgmma as
    its register A operand. Every fragment-order format runs it: q8_0 / FP8 (a byte a weight), q4_0, q4_1 / q4_K,
    q5_0, q5_1 / q5_K (a fifth bit a weight, quant_gemv._fifth_bits), and the two scaled every 16 weights, q6_K
    and NVFP4 (four k16 MMAs a chunk; NVFP4's row scale in the epilogue). The renames from loaded bytes to the
    operand are checked at compile time (assert_trivial).
  - Activations are wgmma's B operand, from shared memory: each K step's x block is loaded by the CTA's
    threads, converted to f16 and stored in the planes' column order (quant_pack.k_order: a per-32-column
    permutation, in registers) into the swizzled buffer of its step of the loop iteration (4 steps, 4 buffers).
    One barrier per K step orders the stores before the MMAs. A buffer is rewritten 4 steps later, when every
    warpgroup has waited for the MMAs that read it (each waits for all but its current step's, and for all at
    the end of an iteration).
  - The wgmmas are asynchronous: a step's MMAs run while the next step loads and dequantizes. With P, each
    step's loads are issued one step earlier, before the barrier of the step before (a barrier also keeps the
    compiler from hoisting loads above it).
  - Split-K for the small matrices (qkv, o) reduces in split order through the scratch buffer, as the GEMV does
    (quant_gemv._finish_rows), and the act*mul epilogue of a gate|up weight is the GEMV's too.
  - A TMA variant (_gemm_tma_kernel, GemmConfig.TMA): x converted once per call by x_operands and streamed by
    TMA into a ring of mbarrier-tracked buffers, so the loop holds no x registers and stores no x. It wins at
    128-256 tokens and loses below; a weight's plan runs it past its `wide_from` (matmul_plans.MatmulPlan).
  - A ring variant (_gemm_ring_kernel, GemmConfig.RING): a producer warp TMA-copies the weight rows' planes, as
    they are, and x_operands' x into a ring of shared-memory stages; the consumer warps read each chunk back into
    the registers the global loads would fill and go on as above. More weight bytes in flight per SM, without
    registers: it wins on the big matrices from 32-64 tokens and on all of them at 128-256. With APART its two
    consumer warpgroups are partitions of their own (each on its 64 rows of every stage, finishing on its own),
    so one's MMAs overlap the other's dequantization instead of both meeting at every stage's barrier. With
    PERSIST one or two CTAs an SM walk the (token tile, row block, K split) work items, the ring running from one
    item's stages into the next's, where a CTA per item fills its ring and drains it once (and 224 row blocks on
    132 SMs run as 1.7 waves). With AHEAD a stage's quant bytes are loaded at once. A ring runs as many of its
    stages as fit an SM at the call's token tile (ring_stages: x's share of a stage grows with the tile). Its
    tiles of 96, 160 and 192 tokens (split_tile: the decode graphs' buckets between powers of two) are two
    accumulators, 64 + 32, 128 + 32 and 128 + 64 token columns, over x's block of the next power of two.
  - Routed (ROUTED, the plain and the ring kernel): an MoE projection's experts stacked in one set of planes
    (packed_experts.py), a token tile being one slot of moe_routing.py (one expert's run of up to BN (row, expert)
    pairs): its x rows from the slot's first pair, its weight rows offset to the slot's expert. One launch runs
    every expert a step chose, with no host sync. Without split-K; an empty slot runs no K step (a persistent
    ring's CTAs run them as any item, so that every item keeps the same count of ring stages).

Row t's result depends only on its own activations: the K order and split are fixed per weight, whatever the
number of tokens. It is not bitwise the GEMV's (a different split of K): batch invariance holds within each
kernel's token range. The torch reference is quant_matmul.quant_matmul_ref. Gluon has no interpreter: these
kernels run on CUDA only (tests/test_quant_gemm.py); the CPU CI compiles them for sm_90
(tests/test_kernels_compile.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from cobatch.kernels import quant_gemv, quant_pack
from cobatch.kernels.quant_gemv import (F_NVFP4, F_Q4_0, F_Q5_0, F_Q6_K, _byte_fmt, _fifth_bit, act_code, gl,
                                       gluon)
from cobatch.kernels.operand_order import order_of, ordered_columns, ordered_ref
from cobatch.kernels.scratch import DeviceScratch
from cobatch.kernels.triton_support import device_sms, gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl

try:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - triton without gluon's Hopper modules
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

# Token tiles (wgmma's N): a call of n tokens runs the smallest tile >= n, several 256-token tiles above.
TOKEN_TILES = (16, 32, 64, 128, 256)
# K steps per loop iteration of the kernel, each with an x buffer of its own (at least 3: a buffer is rewritten
# only after every warpgroup retired the MMAs that read it). Every packed weight's chunk count divides by it.
STEPS_PER_ITERATION = 4
_STEPS = quant_gemv._c(STEPS_PER_ITERATION)    # the kernel's copy (Triton reads constexpr globals only)
# The ring variant's producer warp only issues copies and counts stages: the fewest registers setmaxnreg allows.
RING_PRODUCER_REGISTERS = 24
_PRODUCER_REGS = quant_gemv._c(RING_PRODUCER_REGISTERS)
# With APART, the second consumer warpgroup is a worker partition too: what setmaxnreg gives it, the same as the
# default partition's share of a CTA launched at 168 registers (12 warps) once the producer's group gave back its own.
RING_APART_CONSUMER_REGISTERS = 240
_APART_CONSUMER_REGS = quant_gemv._c(RING_APART_CONSUMER_REGISTERS)


def token_tile(n_tok: int) -> int:
    return next((b for b in TOKEN_TILES if n_tok <= b), TOKEN_TILES[-1])


# The ring variant's token tiles between the powers of two, as two accumulators (BN, BN2) over one x block of the
# next power of two: the decode graphs' buckets of 96, 160 and 192 rows (engine/cuda_graphs.py) then multiply 25,
# 37 and 25 % fewer token columns than the 128 and 256 tiles they ran. A row's bits are the same (the same split
# of K; each token is its own column of the MMAs). Whole steps of those sizes, H100: 2-6 % faster on q8_0, 2-10 %
# on Q4_K_M (bench/results/decode_split_tiles_ab.md). COBATCH_GEMM_SPLIT_TILES=0: powers of two only.
SPLIT_TILES = {96: (64, 32), 160: (128, 32), 192: (128, 64)}
SPLIT_TOKEN_TILES = os.environ.get("COBATCH_GEMM_SPLIT_TILES", "1") != "0"


def split_tile(n_tok: int) -> tuple[int, int]:
    """(BN, BN2) of a ring call of n_tok tokens: the two accumulators of the smallest tile that holds them, BN2 = 0
    where that tile is a power of two (token_tile)."""
    if SPLIT_TOKEN_TILES:
        for total, tiles in SPLIT_TILES.items():
            if n_tok <= total < token_tile(n_tok):
                return tiles
    return token_tile(n_tok), 0


if gluon is not None and warpgroup_mma is not None:

    @gluon.constexpr_function
    def _layouts(NW, BN):
        """(wgmma accumulator [16 NW, BN], its A operand [16 NW, K], weight bytes [NW, 32 lanes, 16]). Warp w
        holds rows 16 w .. 16 w + 15 of both, as an mma.sync fragment would."""
        mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 16])
        a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        ld = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
        return mma, a, ld

    @gluon.constexpr_function
    def _bytes_layout(NW, BYTES):
        return gl.BlockedLayout([1, 1, BYTES], [1, 32, 1], [NW, 1, 1], [2, 1, 0])

    @gluon.constexpr_function
    def _by16(FMT):
        """Is FMT scaled every 16 weights (q6_K, NVFP4: quant_pack.SCALED_BY_16)? Then a chunk is four k16 MMAs,
        each k16 half of a tile keeps its own columns (k_order), and x is permuted per 16 columns."""
        return int(FMT) in quant_pack.SCALED_BY_16

    @gluon.constexpr_function
    def _x_layout(NW, BY16):
        """A step's x as loaded, [BN, tile, c, v]: GGUF column T tile + V c + v of the step, T = 32 (BY16: 16)
        columns per permuted tile, V = T / 4 contiguous columns per thread and token (one vector load)."""
        return gl.BlockedLayout([1, 1, 1, 4 if BY16 else 8], [8, 1, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])

    @gluon.constexpr_function
    def _x_smem_layout(BN, KB):
        return gl.NVMMASharedLayout.get_default_for([BN, KB], gl.float16)

    @gluon.jit
    def _tile_offsets(tile0, chunk, tile_stride, NW: gl.constexpr, BYTES: gl.constexpr):
        """Byte offsets [NW, 32 lanes, BYTES] of `chunk` in row tiles tile0 .. tile0 + NW - 1 of a fragment-order
        plane of 32 x BYTES bytes per tile and chunk."""
        L: gl.constexpr = _bytes_layout(NW, BYTES)
        rt = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        byte = gl.arange(0, BYTES, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        return ((tile0 + rt).to(gl.int64) * tile_stride)[:, None, None] + chunk.to(gl.int64) * (32 * BYTES) \
            + (lane * BYTES)[None, :, None] + byte[None, None, :]

    @gluon.jit
    def _prefetch(qs_ptr, tile0, chunk, tile_stride, NW: gl.constexpr):
        """An L2 prefetch of each lane's 16 bytes of `chunk` (quant_gemv.ASM_PREFETCH)."""
        L: gl.constexpr = gl.SliceLayout(2, _bytes_layout(NW, 16))
        rt = gl.arange(0, NW, layout=gl.SliceLayout(1, L))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
        off = ((tile0 + rt).to(gl.int64) * tile_stride)[:, None] + chunk.to(gl.int64) * 512 + (lane * 16)[None, :]
        gl.inline_asm_elementwise(quant_gemv.ASM_PREFETCH, "=r,l", [qs_ptr + off], gl.int32, False, 1)

    @gluon.jit
    def _as_operand(q, NW: gl.constexpr, A: gl.constexpr):
        """Bytes [NW, lane, 16] -> the [16 NW, 32] A operand (as quant_gemv._as_operand, with the warp as the
        row tile): lane = (g, c), byte = (r3, r2, r1, r0); row = 16 w + 8 r1 + g, k = 16 r3 + 8 r2 + 2 c + r0."""
        q = gl.reshape(q, [NW, 8, 4, 2, 2, 2, 2])                  # w, g, c, r3, r2, r1, r0
        q = gl.permute(q, [0, 5, 1, 3, 4, 2, 6])                   # w, r1, g, r3, r2, c, r0
        return gl.convert_layout(gl.reshape(q, [16 * NW, 32]), A, assert_trivial=True)

    @gluon.jit
    def _as_half_operand(q, NW: gl.constexpr, A: gl.constexpr):
        """One k16 half, [NW, lane, 8] -> [16 NW, 16] (as _as_operand, without r3)."""
        q = gl.reshape(q, [NW, 8, 4, 2, 2, 2])                     # w, g, c, r2, r1, r0
        q = gl.permute(q, [0, 4, 1, 3, 2, 5])                      # w, r1, g, r2, c, r0
        return gl.convert_layout(gl.reshape(q, [16 * NW, 16]), A, assert_trivial=True)

    @gluon.jit
    def _halves(q, NW: gl.constexpr, N: gl.constexpr):
        """[NW, lane, 2 N] -> its first and second N bytes per lane (a tile's two k16 halves)."""
        return gl.split(gl.permute(gl.reshape(q, [NW, 32, 2, N]), [0, 1, 3, 2]))

    @gluon.jit
    def _twice(h, NW: gl.constexpr, N: gl.constexpr):
        """[NW, lane, N] -> [NW, lane, 2 N], every byte twice (quant_gemv._twice)."""
        return gl.reshape(gl.join(h, h), [NW, 32, 2 * N])

    @gluon.jit
    def _side(ptr, tile0, col, tile_stride, NW: gl.constexpr, E: gl.constexpr):
        """Entry `col` of a fragment-order side plane for row tiles tile0..: [NW, 8 g, E], the E values a lane
        group needs side by side (quant_pack.side_to_fragment_order)."""
        V: gl.constexpr = gl.BlockedLayout([1, 1, E], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
        rt = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, V)))
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, V)))
        e = gl.arange(0, E, layout=gl.SliceLayout(0, gl.SliceLayout(1, V)))
        return gl.load(ptr + ((tile0 + rt).to(gl.int64) * tile_stride)[:, None, None] + (8 * E) * col
                       + (E * g)[None, :, None] + e[None, None, :])

    @gluon.jit
    def _as_rows(v, NW: gl.constexpr, SIDE: gl.constexpr):
        """[NW, g, r1] values of rows 16 w + 8 r1 + g -> [16 NW, 1] in the A operand's row layout."""
        v = gl.reshape(gl.permute(v, [0, 2, 1]), [16 * NW])
        return gl.convert_layout(v, SIDE, assert_trivial=True)[:, None]

    @gluon.jit
    def _side_entry(src, tile0, col, tile_stride, NW: gl.constexpr, E: gl.constexpr, SMEM: gl.constexpr):
        """_side from global memory (src a pointer), or with SMEM from a ring stage's copy of the plane's rows
        (src a [NW, entries * 8, E] shared buffer: the same values in the same registers)."""
        if SMEM:
            V: gl.constexpr = gl.BlockedLayout([1, 1, E], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
            return src.slice(8 * col, 8, dim=1).load(V)
        else:
            return _side(src, tile0, col, tile_stride, NW, E)

    @gluon.jit
    def _sides(d_src, sub_src, tile0, chunk, d_col, side32, side256, FMT: gl.constexpr, NW: gl.constexpr,
               SIDE: gl.constexpr, SMEM: gl.constexpr = False):
        """A chunk's scale data as four [16 NW, 1] tensors, in quant_gemv._dequant_operand's order; d_col: q6_K's
        super-block entry (chunk // 4 in the plane, 0 in a ring stage). With SMEM the sources are a ring stage's
        buffers and `chunk` counts within the stage (_side_entry)."""
        if _byte_fmt(FMT):
            a = _as_rows(_side_entry(d_src, tile0, chunk, 16 * side32, NW, 2, SMEM), NW, SIDE)
            b = a
            c = a
            e = a
        elif _by16(FMT):      # four scales as one word (q6_K's int8, NVFP4's e4m3); q6_K's super-block f32 d
            if SMEM:
                sub = sub_src
            else:
                sub = sub_src.to(gl.pointer_type(gl.int32))
            a = _as_rows(_side_entry(sub, tile0, chunk, 8 * side32, NW, 2, SMEM), NW, SIDE)
            if FMT == F_Q6_K:
                b = _as_rows(_side_entry(d_src, tile0, d_col, 16 * side256, NW, 2, SMEM), NW, SIDE)
            else:             # NVFP4's row scale is the epilogue's (_row_scaled)
                b = a
            c = a
            e = b
        elif FMT == F_Q4_0 or FMT == F_Q5_0:
            a = _as_rows(_side_entry(d_src, tile0, 2 * chunk, 16 * side32, NW, 2, SMEM), NW, SIDE)
            b = _as_rows(_side_entry(d_src, tile0, 2 * chunk + 1, 16 * side32, NW, 2, SMEM), NW, SIDE)
            c = a
            e = b
        else:                 # q4_1 and q5_1 (q4_K, q5_K): (d, m) x (low, high block) x (row g, g + 8) in one plane
            v = gl.reshape(_side_entry(d_src, tile0, chunk, 32 * side32, NW, 8, SMEM), [NW, 8, 2, 2, 2])
            lo, hi = gl.split(gl.permute(v, [0, 1, 4, 2, 3]))     # w, g, r1, kind | block
            d_lo, m_lo = gl.split(lo)
            d_hi, m_hi = gl.split(hi)
            a = _as_rows(d_lo, NW, SIDE)
            b = _as_rows(d_hi, NW, SIDE)
            c = _as_rows(m_lo, NW, SIDE)
            e = _as_rows(m_hi, NW, SIDE)
        return a, b, c, e

    @gluon.jit
    def _x_load(x_ptr, x_stride, tok0, n_tok, n_cols, k0, BN: gl.constexpr, KC: gl.constexpr, NW: gl.constexpr,
                BY16: gl.constexpr, EVEN_K: gl.constexpr):
        """x[tok0 : tok0 + BN, k0 : k0 + KC] as loaded, [BN, tile, c, v] in its own dtype: GGUF column
        T tile + V c + v of the step, T = 32 (BY16: 16) columns per permuted tile (_x_operand)."""
        L: gl.constexpr = _x_layout(NW, BY16)
        N1: gl.constexpr = 2 if BY16 else 4                  # j (p) values: the tile is 8 N1 columns
        NT: gl.constexpr = KC // (8 * N1)
        t = tok0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
        tile = gl.arange(0, NT, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
        c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
        v = gl.arange(0, 2 * N1, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
        col = k0 + (8 * N1 * tile)[None, :, None, None] + (2 * N1 * c)[None, None, :, None] \
            + v[None, None, None, :]
        tt = t[:, None, None, None]
        mask = tt < n_tok
        if not EVEN_K:
            mask = mask & (col < n_cols)
        return gl.load(x_ptr + tt.to(gl.int64) * x_stride + col, mask=mask, other=0.0)

    @gluon.jit
    def _x_operand(x, BN: gl.constexpr, KC: gl.constexpr, BY16: gl.constexpr):
        """A loaded x step -> f16 [BN, KC] in the planes' logical column order (quant_pack.k_order), per 32-column
        tile: logical k = 8 j + 2 c + e holds GGUF column 8 c + 2 j + e (q6_K, per 16-column half:
        8 p + 2 c + e holds 4 c + 2 p + e; NVFP4 too). Each thread owns the columns it moves: only registers are
        renamed."""
        N1: gl.constexpr = 2 if BY16 else 4
        NT: gl.constexpr = KC // (8 * N1)
        x = gl.permute(gl.reshape(x.to(gl.float16), [BN, NT, 4, N1, 2]), [0, 1, 3, 2, 4])     # t, tile, j, c, e
        return gl.reshape(x, [BN, KC])

    @gluon.jit
    def _load_step(chunk, x_ptr, x_stride, qs_ptr, d_ptr, sub_ptr, qh_ptr, tok0, n_tok, n_cols, tile0, tile_stride,
                   side32, side256, FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr, EVEN_K: gl.constexpr,
                   SIDE: gl.constexpr, X: gl.constexpr = True):
        """The loads of one K step (a chunk): quant bytes, scale data, q6_K's high bits or q5_0's fifth bits (each
        byte repeated over its qs word, quant_gemv._fifth_bits; else the quant bytes again: unused) and, with X, x,
        raw (else the quant bytes again)."""
        KC: gl.constexpr = 32 if _byte_fmt(FMT) else 64
        q = gl.load(qs_ptr + _tile_offsets(tile0, chunk, tile_stride, NW, 16))
        a, b, c, e = _sides(d_ptr, sub_ptr, tile0, chunk, chunk // 4, side32, side256, FMT, NW, SIDE)
        if FMT == F_Q6_K:
            h = gl.load(qh_ptr + _tile_offsets(tile0, chunk, tile_stride // 2, NW, 8))
        elif _fifth_bit(FMT):
            h4 = gl.load(qh_ptr + _tile_offsets(tile0, chunk, tile_stride // 4, NW, 4))
            h = _twice(_twice(h4, NW, 4), NW, 8)
        else:
            h = q
        if X:
            x = _x_load(x_ptr, x_stride, tok0, n_tok, n_cols, chunk * KC, BN, KC, NW, _by16(FMT), EVEN_K)
        else:
            x = q
        return q, a, b, c, e, h, x

    @gluon.jit
    def _mma_step(acc, buf, q, a, b, c, e, h, x, FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr,
                  A: gl.constexpr, STAGE: gl.constexpr = True):
        """One K step from its loads: with STAGE, stage x in `buf` (else it is there: TMA), dequantize, and issue
        the step's MMAs on acc (asynchronously: the caller waits)."""
        KC: gl.constexpr = 32 if _byte_fmt(FMT) else 64
        if STAGE:
            buf.store(_x_operand(x, BN, KC, _by16(FMT)))
        w0, w1, w2, w3 = _step_operands(q, a, b, c, e, h, FMT, NW, A)
        if STAGE:
            fence_async_shared()
            gl.thread_barrier()
        return _step_mmas(acc, w0, w1, w2, w3, buf, FMT)

    @gluon.jit
    def _step_operands(q, a, b, c, e, h, FMT: gl.constexpr, NW: gl.constexpr, A: gl.constexpr):
        """One K step's weights dequantized into wgmma's A operands: (w0, w1, w2, w3) the chunk's k16 quarters
        for q6_K and NVFP4 (low block +0, +16; high block +32, +48), else (w0, w1) its two k32 halves (q8_0's
        chunk is w0 alone), repeated to fill the four."""
        if _by16(FMT):
            q0, q1 = _halves(q, NW, 8)
            if FMT == F_Q6_K:
                s0, s1, s2, s3 = quant_gemv._q6_scales(a, b)
                h0, h1 = _halves(h, NW, 4)
                w0, w2 = quant_gemv._q6_operands(_as_half_operand(q0, NW, A),
                                                 _as_half_operand(_twice(h0, NW, 4), NW, A), s0, s2)
                w1, w3 = quant_gemv._q6_operands(_as_half_operand(q1, NW, A),
                                                 _as_half_operand(_twice(h1, NW, 4), NW, A), s1, s3)
            else:       # NVFP4, in units of 2^-14 times the row scale (_row_scaled)
                s0, s1, s2, s3 = quant_gemv._fp4_scales(a)
                w0, w2 = quant_gemv._fp4_operands(_as_half_operand(q0, NW, A), s0, s2)
                w1, w3 = quant_gemv._fp4_operands(_as_half_operand(q1, NW, A), s1, s3)
        else:
            w0, w1 = quant_gemv._dequant_operand(_as_operand(q, NW, A), a, b, c, e, _as_operand(h, NW, A), FMT)
            w2, w3 = w0, w1
        return w0, w1, w2, w3

    @gluon.jit
    def _step_mmas(acc, w0, w1, w2, w3, buf, FMT: gl.constexpr):
        """Issue one K step's MMAs (_step_operands' operands) on acc against the x block `buf` [tokens, chunk
        columns], asynchronously. The tokens are buf's rows: any wgmma N, so a slice of a token tile too."""
        if _by16(FMT):
            acc = warpgroup_mma(w0, buf.slice(0, 16, 1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(w1, buf.slice(16, 16, 1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(w2, buf.slice(32, 16, 1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(w3, buf.slice(48, 16, 1).permute((1, 0)), acc, is_async=True)
        elif _byte_fmt(FMT):
            acc = warpgroup_mma(w0, buf.permute((1, 0)), acc, is_async=True)
        else:       # the low nibbles are the chunk's first 32 columns, the high nibbles the next 32
            acc = warpgroup_mma(w0, buf.slice(0, 32, 1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(w1, buf.slice(32, 32, 1).permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _row_scaled(acc, d_ptr, tile0, FMT: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
        """NVFP4's sums [16 NW, BN] of row tiles tile0.. times each row's scale (quant_gemv._fp4_row_scale);
        the other formats' as they are."""
        if FMT == F_NVFP4:
            acc = quant_gemv._fp4_row_scale(acc, d_ptr, tile0, NW, MMA)
        return acc

    @gluon.jit(do_not_specialize=["n_tok", "n_rows", "n_cols", "n_chunks", "steps_per_split", "tiles_per_expert"])
    def _gemm_kernel(x_ptr, out_ptr, partial_ptr, count_ptr, qs_ptr, d_ptr, sub_ptr, qh_ptr,
                     slot_expert_ptr, slot_start_ptr, slot_count_ptr,
                     n_tok, n_rows, n_cols, x_stride, out_stride, n_chunks, steps_per_split, tiles_per_expert,
                     FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr, SPLIT_K: gl.constexpr,
                     EVEN_K: gl.constexpr, D: gl.constexpr, P: gl.constexpr, ACT: gl.constexpr,
                     ROUTED: gl.constexpr = False):
        MMA: gl.constexpr = _layouts(NW, BN)[0]
        A: gl.constexpr = _layouts(NW, BN)[1]
        SIDE: gl.constexpr = gl.SliceLayout(1, A)
        WPC: gl.constexpr = 32 if _byte_fmt(FMT) else 64      # weights per chunk (one K step)
        NB: gl.constexpr = 1 if _byte_fmt(FMT) else (4 if _by16(FMT) else 2)   # MMAs (commit groups) per step
        KC: gl.constexpr = WPC                               # x columns per step
        n_chunks = gl.multiple_of(n_chunks, 4)
        side32 = n_chunks * WPC // 32
        side256 = n_chunks * WPC // 256
        tile_stride = n_chunks * 512
        pid_t = gl.program_id(0)                             # token tile (fastest: the weights stay in L2)
        pid_n = gl.program_id(1) // SPLIT_K
        pid_k = gl.program_id(1) % SPLIT_K
        tile0 = pid_n * NW
        tok0 = pid_t * BN
        n_steps = steps_per_split
        if ROUTED:
            # Stacked experts (moe_routing.py), as the routed GEMV: token tile pid_t is slot pid_t, at most BN
            # pairs (rows of x and out), with the slot's expert's row tiles. An empty slot runs no K step and
            # stores nothing.
            tok0 = gl.load(slot_start_ptr + pid_t)
            n_tok = tok0 + gl.load(slot_count_ptr + pid_t)
            tile0 += gl.load(slot_expert_ptr + pid_t) * tiles_per_expert
            n_steps = steps_per_split * (tok0 < n_tok).to(gl.int32)
        # One x buffer per step of an iteration, each an allocation of its own: Triton orders a store after an
        # MMA's read of the same allocation with a barrier of its own, on top of the step's.
        XS: gl.constexpr = _x_smem_layout(BN, KC)
        xs = (gl.allocate_shared_memory(gl.float16, [BN, KC], XS), gl.allocate_shared_memory(gl.float16, [BN, KC], XS),
              gl.allocate_shared_memory(gl.float16, [BN, KC], XS), gl.allocate_shared_memory(gl.float16, [BN, KC], XS))
        acc = gl.zeros([16 * NW, BN], gl.float32, MMA)
        first = pid_k * steps_per_split
        # U K steps per iteration. Each step's MMAs stay in flight while the next step loads and dequantizes;
        # the iteration ends with none in flight. ptxas serializes every wgmma of a loop whose register
        # operands (loaded from global memory) are redefined while a wgmma reading them is in flight across
        # the back edge (its warnings C7514 / C7515): within an unrolled iteration each step's operands are
        # registers of their own.
        U: gl.constexpr = _STEPS
        if P:   # the loads of step s + 1 are issued before step s's barrier, so their latency overlaps it
            q, a, b, c, e, h, x = _load_step(first, x_ptr, x_stride, qs_ptr, d_ptr, sub_ptr, qh_ptr, tok0, n_tok,
                                             n_cols, tile0, tile_stride, side32, side256, FMT, NW, BN, EVEN_K, SIDE)
        for s0 in range(0, n_steps, U):
            for u in gl.static_range(U):
                s = s0 + u
                if D > 0:   # the quant bytes of step s + D into L2 (no register held)
                    _prefetch(qs_ptr, tile0, first + gl.minimum(s + D, steps_per_split - 1), tile_stride, NW)
                if P:       # (the last step loads itself again: harmless, and no branch)
                    q1, a1, b1, c1, e1, h1, x1 = _load_step(first + gl.minimum(s + 1, steps_per_split - 1), x_ptr,
                                                            x_stride, qs_ptr, d_ptr, sub_ptr, qh_ptr, tok0, n_tok,
                                                            n_cols, tile0, tile_stride, side32, side256, FMT, NW, BN,
                                                            EVEN_K, SIDE)
                    acc = _mma_step(acc, xs[u], q, a, b, c, e, h, x, FMT, NW, BN, A)
                    q, a, b, c, e, h, x = q1, a1, b1, c1, e1, h1, x1
                else:
                    q0, a0, b0, c0, e0, h0, x0 = _load_step(first + s, x_ptr, x_stride, qs_ptr, d_ptr, sub_ptr,
                                                            qh_ptr, tok0, n_tok, n_cols, tile0, tile_stride, side32,
                                                            side256, FMT, NW, BN, EVEN_K, SIDE)
                    acc = _mma_step(acc, xs[u], q0, a0, b0, c0, e0, h0, x0, FMT, NW, BN, A)
                if u < U - 1:   # retire the step before this one
                    acc = warpgroup_mma_wait(num_outstanding=NB, deps=(acc,))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _finish_tile(acc, d_ptr, out_ptr, out_stride, partial_ptr, count_ptr, pid_t, pid_n, pid_k, tile0, tok0, n_rows,
                     n_tok, FMT, NW, BN, SPLIT_K, ACT)


    @gluon.jit(do_not_specialize=["n_tok", "n_rows", "n_cols", "n_chunks", "steps_per_split"])
    def _gemm_tma_kernel(x_desc, out_ptr, partial_ptr, count_ptr, qs_ptr, d_ptr, sub_ptr, qh_ptr,
                         n_tok, n_rows, n_cols, out_stride, n_chunks, steps_per_split,
                         FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr, SPLIT_K: gl.constexpr,
                         D: gl.constexpr, P: gl.constexpr, S: gl.constexpr, ACT: gl.constexpr):
        """_gemm_kernel with x already f16 and in the planes' column order (x_operands) and streamed by TMA into a
        ring of S buffers, each with an mbarrier: no x registers, no x stores. A buffer is refilled (with the
        step S - 1 ahead) after the CTA barrier that follows every warpgroup's retiring of the MMAs that read it."""
        MMA: gl.constexpr = _layouts(NW, BN)[0]
        A: gl.constexpr = _layouts(NW, BN)[1]
        SIDE: gl.constexpr = gl.SliceLayout(1, A)
        WPC: gl.constexpr = 32 if _byte_fmt(FMT) else 64
        NB: gl.constexpr = 1 if _byte_fmt(FMT) else (4 if _by16(FMT) else 2)
        n_chunks = gl.multiple_of(n_chunks, 4)
        side32 = n_chunks * WPC // 32
        side256 = n_chunks * WPC // 256
        tile_stride = n_chunks * 512
        pid_t = gl.program_id(0)
        pid_n = gl.program_id(1) // SPLIT_K
        pid_k = gl.program_id(1) % SPLIT_K
        tile0 = pid_n * NW
        tok0 = pid_t * BN
        xs = gl.allocate_shared_memory(gl.float16, [S, BN, WPC], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()
        first = pid_k * steps_per_split
        for i in gl.static_range(S - 1):     # the ring's first steps
            mbarrier.expect(ready.index(i), x_desc.block_type.nbytes, pred=i < steps_per_split)
            tma.async_copy_global_to_shared(x_desc, [tok0, (first + i) * WPC], ready.index(i), xs.index(i),
                                            pred=i < steps_per_split)
        acc = gl.zeros([16 * NW, BN], gl.float32, MMA)
        U: gl.constexpr = _STEPS
        if P:
            q, a, b, c, e, h, x = _load_step(first, out_ptr, 0, qs_ptr, d_ptr, sub_ptr, qh_ptr, tok0, n_tok,
                                             n_cols, tile0, tile_stride, side32, side256, FMT, NW, BN, True, SIDE,
                                             False)
        for s0 in range(0, steps_per_split, U):
            for u in gl.static_range(U):
                s = s0 + u
                if D > 0:
                    _prefetch(qs_ptr, tile0, first + gl.minimum(s + D, steps_per_split - 1), tile_stride, NW)
                if P:
                    q1, a1, b1, c1, e1, h1, x1 = _load_step(first + gl.minimum(s + 1, steps_per_split - 1), out_ptr,
                                                            0, qs_ptr, d_ptr, sub_ptr, qh_ptr, tok0, n_tok, n_cols,
                                                            tile0, tile_stride, side32, side256, FMT, NW, BN, True,
                                                            SIDE, False)
                else:
                    q, a, b, c, e, h, x = _load_step(first + s, out_ptr, 0, qs_ptr, d_ptr, sub_ptr, qh_ptr, tok0,
                                                     n_tok, n_cols, tile0, tile_stride, side32, side256, FMT, NW, BN,
                                                     True, SIDE, False)
                slot = s % S
                mbarrier.wait(ready.index(slot), (s // S) & 1)
                acc = _mma_step(acc, xs.index(slot), q, a, b, c, e, h, x, FMT, NW, BN, A, False)
                if P:
                    q, a, b, c, e, h, x = q1, a1, b1, c1, e1, h1, x1
                if u < U - 1:   # retire the step before this one
                    acc = warpgroup_mma_wait(num_outstanding=NB, deps=(acc,))
                else:           # none in flight across the back edge
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                gl.thread_barrier()         # every warpgroup has retired step s - 1: its buffer is free
                nxt = s + S - 1
                free = (s + S - 1) % S
                mbarrier.expect(ready.index(free), x_desc.block_type.nbytes, pred=nxt < steps_per_split)
                tma.async_copy_global_to_shared(x_desc, [tok0, (first + nxt) * WPC], ready.index(free),
                                                xs.index(free), pred=nxt < steps_per_split)
        for i in gl.static_range(S):
            mbarrier.invalidate(ready.index(i))
        _finish_tile(acc, d_ptr, out_ptr, out_stride, partial_ptr, count_ptr, pid_t, pid_n, pid_k, tile0, tok0, n_rows,
                     n_tok, FMT, NW, BN, SPLIT_K, ACT)


    # --- the ring variant: weights and x streamed by TMA through shared memory --------------------------------

    @gluon.constexpr_function
    def _plain_layout(rank):
        """Unswizzled row-major shared memory: a TMA copy of plane rows lands there byte for byte as in global
        memory, so a ring stage is read back with the global loads' own register layouts."""
        return gl.SwizzledSharedLayout(1, 1, 1, list(range(rank - 1, -1, -1)))

    @gluon.constexpr_function
    def _side_shape(FMT, NW, C):
        """(a ring stage's d plane [NW, entries], the element count E a lane group reads side by side): per chunk
        q8_0 16 f16 (E 2), q4_0 / q5_0 32 (E 2), q4_1 / q5_1 (q4_K, q5_K) 64 (E 8); q6_K 16 f32 per super-block of
        4 chunks (E 2); NVFP4 its sub plane, 16 int32 words of four e4m3 scales (E 2), as q6_K's sub."""
        fmt = int(FMT)
        if fmt == quant_pack.Q6_K:
            return [NW, 16], 2
        return [NW, C * _SIDE_PER_CHUNK[fmt]], 8 if fmt in quant_pack.AFFINE_FORMATS else 2   # NVFP4: its sub words

    @gluon.jit
    def _ring_loads(qs_buf, d_buf, sub_buf, qh_buf, c: gl.constexpr, FMT: gl.constexpr, NW: gl.constexpr,
                    C: gl.constexpr, SIDE: gl.constexpr):
        """Chunk c of a ring stage, from its shared buffers into registers: what _load_step loads from global
        memory (quant bytes, the four scale tensors, q6_K's high bits, the fifth bits or the quant bytes again)."""
        q = qs_buf._reinterpret(gl.uint8, [NW, 32 * C, 16], _plain_layout(3)).slice(32 * c, 32, dim=1) \
            .load(_bytes_layout(NW, 16))
        shape: gl.constexpr = _side_shape(FMT, NW, C)[0]
        E: gl.constexpr = _side_shape(FMT, NW, C)[1]
        d = d_buf._reinterpret(d_buf.dtype, [NW, shape[1] // E, E], _plain_layout(3))
        if FMT == F_Q6_K:
            sub = sub_buf._reinterpret(gl.int32, [NW, 8 * C, 2], _plain_layout(3))
            h = qh_buf._reinterpret(gl.uint8, [NW, 32 * C, 8], _plain_layout(3)).slice(32 * c, 32, dim=1) \
                .load(_bytes_layout(NW, 8))
        elif _fifth_bit(FMT):
            sub = d
            h4 = qh_buf._reinterpret(gl.uint8, [NW, 32 * C, 4], _plain_layout(3)).slice(32 * c, 32, dim=1) \
                .load(_bytes_layout(NW, 4))
            h = _twice(_twice(h4, NW, 4), NW, 8)
        else:
            sub = d
            h = q
        a, b, cc, e = _sides(d, sub, 0, c, 0, 0, 0, FMT, NW, SIDE, True)
        return q, a, b, cc, e, h

    @gluon.jit
    def _stage_bytes(qs_buf, NW: gl.constexpr, C: gl.constexpr):
        """A ring stage's quant bytes, all C chunks in one load (C 16-byte loads a lane into registers of their
        own), as C tensors [NW, lane, 16]: chunk c is what _ring_loads(c) reads."""
        q = qs_buf._reinterpret(gl.uint8, [NW, 32 * C, 16], _plain_layout(3)).load(_bytes_layout(NW, 16))
        if C == 1:
            chunks = (q,)
        elif C == 2:
            chunks = gl.split(gl.permute(gl.reshape(q, [NW, 2, 32, 16]), [0, 2, 3, 1]))   # w, lane, byte, chunk
        else:
            q = gl.permute(gl.reshape(q, [NW, 2, 2, 32, 16]), [0, 3, 4, 1, 2])      # chunk = 2 c1 + c0
            lo, hi = gl.split(q)                                                   # c0 = 0, 1
            q0, q2 = gl.split(lo)
            q1, q3 = gl.split(hi)
            chunks = (q0, q1, q2, q3)
        return chunks

    @gluon.jit
    def _item_of(item, n_nk, SPLIT_K: gl.constexpr):
        """(token tile, row block, K split) of work item `item`: the 2-D grid's (program_id(0), program_id(1))
        linearized, program_id(1) being row block x SPLIT_K + split."""
        return item // n_nk, (item % n_nk) // SPLIT_K, (item % n_nk) % SPLIT_K

    @gluon.jit
    def _item_origin(item, n_nk, n_tok, route, BN: gl.constexpr, SPLIT_K: gl.constexpr, ROUTED: gl.constexpr):
        """(token tile, row block, K split, first token, end of its tokens, first row tile of its matrix) of work
        item `item`. ROUTED (stacked experts, as _gemm_kernel's): the token tile is slot pid_t of `route`
        (slot_expert, slot_start, slot_count pointers and the row tiles of an expert), its pairs and its expert's
        rows; else BN tokens of the call's n_tok and the planes' rows."""
        pid_t, pid_n, pid_k = _item_of(item, n_nk, SPLIT_K)
        if ROUTED:
            slot_expert_ptr, slot_start_ptr, slot_count_ptr, tiles_per_expert = route
            tok0 = gl.load(slot_start_ptr + pid_t)
            tok_end = tok0 + gl.load(slot_count_ptr + pid_t)
            tile_base = gl.load(slot_expert_ptr + pid_t) * tiles_per_expert
        else:
            tok0 = pid_t * BN
            tok_end = n_tok
            tile_base = 0
        return pid_t, pid_n, pid_k, tok0, tok_end, tile_base

    @gluon.jit
    def _ring_producer(descs, bufs, ready, empty, n_stages, n_nk, n_items, n_tok, route, FMT: gl.constexpr,
                       NW: gl.constexpr, BN: gl.constexpr, C: gl.constexpr, PARTS: gl.constexpr,
                       SPLIT_K: gl.constexpr, PERSIST: gl.constexpr, PDL: gl.constexpr, ROUTED: gl.constexpr):
        """The producer of the CTA's work items: its program's one (the 2-D grid), or with PERSIST items pid,
        pid + G, ... of the 1-D grid of G CTAs, their stages streamed through the ring back to back. With PDL the
        first item's first stages of weights are copied before the wait for the kernel before (weights are
        never written), x only after it."""
        if PERSIST:
            for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
                done = (item - gl.program_id(0)) // gl.num_programs(0) * n_stages    # stages of earlier items
                _ring_produce(descs, bufs, ready, empty, item, done, n_stages, n_nk, n_tok, route, FMT, NW, BN, C,
                              PARTS, SPLIT_K, PDL, ROUTED, False)
        else:
            item = gl.program_id(0) * n_nk + gl.program_id(1)
            _ring_produce(descs, bufs, ready, empty, item, 0, n_stages, n_nk, n_tok, route, FMT, NW, BN, C, PARTS,
                          SPLIT_K, PDL, ROUTED, ROUTED)

    @gluon.jit
    def _ring_produce(descs, bufs, ready, empty, item, done, n_stages, n_nk, n_tok, route, FMT: gl.constexpr,
                      NW: gl.constexpr, BN: gl.constexpr, C: gl.constexpr, PARTS: gl.constexpr,
                      SPLIT_K: gl.constexpr, PDL: gl.constexpr, ROUTED: gl.constexpr, SKIP_EMPTY: gl.constexpr):
        """One warp, one work item: for each stage of C chunks, wait until its buffers are free, then TMA-copy the
        weight rows' planes (one block per consumer part) and the C x blocks into them, the stage's `ready`
        barrier counting the bytes. `done`: the stages the ring carried before this item (slots and phases).
        With PDL, on the CTA's first item (done == 0: every slot free), the first S stages' weights are issued,
        then the wait for the kernel before, then their x. SKIP_EMPTY (a routed CTA of one item): an empty slot
        copies nothing, as its consumers read nothing (with PERSIST an empty slot's stages run as any item's, so
        that every CTA's ring keeps the same count of stages an item). With PDL a routed item waits for the kernel
        before first: its slots are that kernel's output (the waits after return at once)."""
        if PDL and ROUTED:
            gdc_wait()
        pid_t, pid_n, pid_k, tok0, tok_end, tile_base = _item_origin(item, n_nk, n_tok, route, BN, SPLIT_K, ROUTED)
        first = pid_k * n_stages * C
        if SKIP_EMPTY:
            n_stages = n_stages * (tok0 < tok_end).to(gl.int32)
        S: gl.constexpr = ready.shape[0]
        ahead = 0
        if PDL:
            if done == 0:
                ahead = gl.minimum(n_stages, S)
            for i in range(ahead):
                mbarrier.expect(ready.index(i), _stage_nbytes(descs, FMT, C, PARTS))
                _copy_stage_weights(descs, bufs, ready.index(i), i, tile_base + pid_n * NW, first + i * C, FMT, C,
                                    PARTS)
            gdc_wait()
            for i in range(ahead):
                _copy_stage_x(descs, bufs, ready.index(i), i, tok0, first + i * C, C)
        for i in range(ahead, n_stages):
            g = done + i
            slot = g % S
            mbarrier.wait(empty.index(slot), ((g // S) & 1) ^ 1)     # a new barrier's phase before 0 is complete
            bar = ready.index(slot)
            mbarrier.expect(bar, _stage_nbytes(descs, FMT, C, PARTS))
            _copy_stage_weights(descs, bufs, bar, slot, tile_base + pid_n * NW, first + i * C, FMT, C, PARTS)
            _copy_stage_x(descs, bufs, bar, slot, tok0, first + i * C, C)

    @gluon.constexpr_function
    def _stage_nbytes(descs, FMT, C, PARTS):
        """The bytes one ring stage carries: each consumer part's weight blocks and the C x blocks."""
        qs_desc, d_desc, sub_desc, qh_desc, x_desc = descs
        weights = qs_desc.block_type.nbytes + d_desc.block_type.nbytes
        if int(FMT) == quant_pack.Q6_K:
            weights += sub_desc.block_type.nbytes + qh_desc.block_type.nbytes
        elif int(FMT) in quant_pack.FIFTH_BIT_FORMATS:
            weights += qh_desc.block_type.nbytes
        return PARTS * weights + C * x_desc.block_type.nbytes

    @gluon.jit
    def _copy_stage_weights(descs, bufs, bar, slot, tile0, chunk0, FMT: gl.constexpr, C: gl.constexpr,
                            PARTS: gl.constexpr):
        """TMA-copy one stage's weight blocks (row tiles from tile0, C chunks from chunk0) into ring slot `slot`."""
        qs_desc, d_desc, sub_desc, qh_desc, x_desc = descs
        qs_bufs, d_bufs, sub_bufs, qh_bufs, x_bufs = bufs
        TILES: gl.constexpr = qs_desc.block_type.shape[0]        # 16-row tiles of one part
        SD: gl.constexpr = d_desc.block_type.shape[1]
        for part in gl.static_range(PARTS):
            b = slot * PARTS + part
            t0 = tile0 + part * TILES
            tma.async_copy_global_to_shared(qs_desc, [t0, 2 * chunk0, 0], bar, qs_bufs.index(b))
            if FMT == F_Q6_K:
                tma.async_copy_global_to_shared(d_desc, [t0, (chunk0 // 4) * SD], bar, d_bufs.index(b))
                tma.async_copy_global_to_shared(sub_desc, [t0, chunk0 * 16], bar, sub_bufs.index(b))
                tma.async_copy_global_to_shared(qh_desc, [t0, chunk0, 0], bar, qh_bufs.index(b))
            else:
                tma.async_copy_global_to_shared(d_desc, [t0, chunk0 * (SD // C)], bar, d_bufs.index(b))
                if _fifth_bit(FMT):
                    tma.async_copy_global_to_shared(qh_desc, [t0, chunk0, 0], bar, qh_bufs.index(b))

    @gluon.jit
    def _copy_stage_x(descs, bufs, bar, slot, tok0, chunk0, C: gl.constexpr):
        """TMA-copy one stage's C x blocks (tokens from tok0) into ring slot `slot`."""
        x_desc = descs[4]
        x_bufs = bufs[4]
        KC: gl.constexpr = x_desc.block_type.shape[1]
        for c in gl.static_range(C):
            tma.async_copy_global_to_shared(x_desc, [tok0, (chunk0 + c) * KC], bar, x_bufs.index(slot * C + c))

    @gluon.jit
    def _release(empty, slot):
        """Hand ring stage `slot` back to the producer: every consumer warp's shared reads of it done (the barrier)
        before the TMA writes the producer issues next (the arrive is one thread's)."""
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)

    @gluon.jit
    def _ring_consumer(bufs, ready, empty, n_stages, done, part, FMT: gl.constexpr, NW: gl.constexpr,
                       BN: gl.constexpr, BN2: gl.constexpr, C: gl.constexpr, PARTS: gl.constexpr, LAG: gl.constexpr,
                       AHEAD: gl.constexpr, MAYBE_EMPTY: gl.constexpr = False):
        """NW consumer warps: per stage, wait for its bytes, dequantize each chunk of their part's rows from shared
        memory and issue its MMAs (asynchronously, as _gemm_kernel does); hand a stage's buffers back once the
        MMAs reading them retired (each part arrives once on `empty`). With LAG a stage's MMAs stay in flight
        until the next stage's are issued, across the loop's back edge too; without it every loop iteration
        ends with none in flight. An iteration is two stages at least (GemmConfig.steps_per_iteration): the
        stage in flight across the back edge then reads other registers than the ones the next iteration's
        first stage dequantizes into. With AHEAD a stage's quant bytes come in one load (_stage_bytes: registers of
        their own for each chunk, so chunk c + 1's load need not wait for chunk c's conversion); the per-chunk
        load of them in _ring_loads is then dead code the compiler drops. MAYBE_EMPTY: n_stages may be 0 (a
        routed item of an empty slot: nothing to hand back). BN2 > 0: a second accumulator over the stage's x
        rows BN .. BN + BN2 (_split_tile), the same dequantized operands multiplied into both. Returns both
        accumulators (the second a placeholder without BN2)."""
        qs_bufs, d_bufs, sub_bufs, qh_bufs, x_bufs = bufs
        MMA: gl.constexpr = _layouts(NW, BN)[0]
        A: gl.constexpr = _layouts(NW, BN)[1]
        SIDE: gl.constexpr = gl.SliceLayout(1, A)
        NB: gl.constexpr = 1 if _byte_fmt(FMT) else (4 if _by16(FMT) else 2)
        S: gl.constexpr = ready.shape[0]
        U: gl.constexpr = max(2, _STEPS // C)
        MMAS: gl.constexpr = NB * C * (2 if BN2 > 0 else 1)     # the wgmmas a stage issues
        acc = gl.zeros([16 * NW, BN], gl.float32, MMA)
        MMA2: gl.constexpr = _layouts(NW, _second_tokens(BN2))[0]
        acc2 = gl.zeros([16 * NW, _second_tokens(BN2)], gl.float32, MMA2)
        for i0 in range(0, n_stages, U):
            for u in gl.static_range(U):
                i = done + i0 + u                     # the ring's stage count, this item's stages after `done`
                slot = i % S
                b = slot * PARTS + part
                mbarrier.wait(ready.index(slot), (i // S) & 1)
                if AHEAD:
                    stage_q = _stage_bytes(qs_bufs.index(b), NW, C)
                for c in gl.static_range(C):
                    q, a, bb, cc, e, h = _ring_loads(qs_bufs.index(b), d_bufs.index(b), sub_bufs.index(b),
                                                     qh_bufs.index(b), c, FMT, NW, C, SIDE)
                    if AHEAD:
                        q = stage_q[c]
                        if FMT != F_Q6_K and not _fifth_bit(FMT):
                            h = q
                    xb = x_bufs.index(slot * C + c)
                    if BN2 > 0:
                        w0, w1, w2, w3 = _step_operands(q, a, bb, cc, e, h, FMT, NW, A)
                        acc = _step_mmas(acc, w0, w1, w2, w3, xb.slice(0, BN, 0), FMT)
                        acc2 = _step_mmas(acc2, w0, w1, w2, w3, xb.slice(BN, BN2, 0), FMT)
                    else:
                        acc = _mma_step(acc, xb, q, a, bb, cc, e, h, q, FMT, NW, BN, A, False)
                if LAG:     # retire stage i - 1, whose MMAs ran while this stage was dequantized
                    acc, acc2 = _retire(acc, acc2, MMAS, BN2)
                    if u > 0:
                        _release(empty, (i + S - 1) % S)
                    elif i0 > 0:
                        _release(empty, (i + S - 1) % S)
                else:       # retire stage i - 1, and at the iteration's end stage i too
                    acc, acc2 = _retire(acc, acc2, MMAS if u < U - 1 else 0, BN2)
                    if u > 0:
                        _release(empty, (i + S - 1) % S)
                    if u == U - 1:
                        _release(empty, slot)
        if LAG:
            acc, acc2 = _retire(acc, acc2, 0, BN2)
            if MAYBE_EMPTY:
                if n_stages > 0:
                    _release(empty, (done + n_stages - 1) % S)
            else:
                _release(empty, (done + n_stages - 1) % S)
        return acc, acc2

    @gluon.constexpr_function
    def _second_tokens(BN2):
        """The second accumulator's tokens: BN2, or a placeholder's 8 where there is none (never multiplied)."""
        return max(int(BN2), 8)

    @gluon.jit
    def _retire(acc, acc2, OUTSTANDING: gl.constexpr, BN2: gl.constexpr):
        """Wait until at most OUTSTANDING of the consumer's wgmmas are in flight (both accumulators' with BN2)."""
        if BN2 > 0:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc,))
        return acc, acc2

    @gluon.jit
    def _ring_part(bufs, ready, empty, n_stages, n_nk, n_items, part, out_ptr, partial_ptr, count_ptr, d_ptr, n_tok,
                   n_rows, out_stride, route, FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr,
                   BN2: gl.constexpr, C: gl.constexpr, PARTS: gl.constexpr, SPLIT_K: gl.constexpr, ACT: gl.constexpr,
                   PERSIST: gl.constexpr, LAG: gl.constexpr, AHEAD: gl.constexpr, PDL: gl.constexpr,
                   ROUTED: gl.constexpr):
        """A consumer part over the CTA's work items, as _ring_producer walks them. With PDL it waits for the kernel
        before, as the producer does before any x: its stores then follow that kernel's reads and writes."""
        if PDL:
            gdc_wait()
        if PERSIST:
            for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
                done = (item - gl.program_id(0)) // gl.num_programs(0) * n_stages
                _ring_part_item(bufs, ready, empty, n_stages, item, done, n_nk, part, out_ptr, partial_ptr,
                                count_ptr, d_ptr, n_tok, n_rows, out_stride, route, FMT, NW, BN, BN2, C, PARTS,
                                SPLIT_K, ACT, LAG, AHEAD, ROUTED, False)
        else:
            _ring_part_item(bufs, ready, empty, n_stages, gl.program_id(0) * n_nk + gl.program_id(1), 0, n_nk, part,
                            out_ptr, partial_ptr, count_ptr, d_ptr, n_tok, n_rows, out_stride, route, FMT, NW, BN, BN2,
                            C, PARTS, SPLIT_K, ACT, LAG, AHEAD, ROUTED, ROUTED)

    @gluon.jit
    def _ring_part_item(bufs, ready, empty, n_stages, item, done, n_nk, part, out_ptr, partial_ptr, count_ptr, d_ptr,
                        n_tok, n_rows, out_stride, route, FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr,
                        BN2: gl.constexpr, C: gl.constexpr, PARTS: gl.constexpr, SPLIT_K: gl.constexpr,
                        ACT: gl.constexpr, LAG: gl.constexpr, AHEAD: gl.constexpr, ROUTED: gl.constexpr,
                        SKIP_EMPTY: gl.constexpr):
        """A consumer part on one work item, from its first stage to its stored rows: the 16 NW rows `part` of the
        CTA's PARTS x 16 NW. Each part finishes on its own (its own split-K tile counter), so two parts never wait
        on each other but for the ring's stages. SKIP_EMPTY: an empty slot reads no stage (_ring_produce). A token
        tile is BN + BN2 tokens (_split_tile)."""
        if SKIP_EMPTY:
            _, _, _, tok0, tok_end, _ = _item_origin(item, n_nk, n_tok, route, BN, SPLIT_K, ROUTED)
            n_stages = n_stages * (tok0 < tok_end).to(gl.int32)
        acc, acc2 = _ring_consumer(bufs, ready, empty, n_stages, done, part, FMT, NW, BN, BN2, C, PARTS, LAG, AHEAD,
                                   SKIP_EMPTY)
        # the item's coordinates after the loop, as registers it need not hold through it
        pid_t, pid_n, pid_k, tok0, tok_end, tile_base = _item_origin(item, n_nk, n_tok, route, BN + BN2, SPLIT_K,
                                                                     ROUTED)
        row0 = (pid_n * PARTS + part) * (16 * NW)
        MMA: gl.constexpr = _layouts(NW, BN)[0]
        acc = _row_scaled(acc, d_ptr, tile_base + row0 // 16, FMT, NW, MMA)
        tile = (pid_t * (n_nk // SPLIT_K) + pid_n) * PARTS + part
        if BN2 > 0:
            MMA2: gl.constexpr = _layouts(NW, BN2)[0]
            acc2 = _row_scaled(acc2, d_ptr, tile_base + row0 // 16, FMT, NW, MMA2)
            _finish_split_tile(acc, acc2, out_ptr, out_stride, partial_ptr, count_ptr, row0, tok0, tile, pid_k,
                               n_rows, tok_end, NW, BN, BN2, SPLIT_K, ACT)
        else:
            r, t = _rows_and_tokens(row0, tok0, NW, BN)
            quant_gemv._finish_rows(acc, out_ptr, out_stride, partial_ptr, count_ptr, r, t, row0, tok0, tile, pid_k,
                                    n_rows, tok_end, NW, BN, SPLIT_K, ACT)

    @gluon.jit
    def _finish_tile(acc, d_ptr, out_ptr, out_stride, partial_ptr, count_ptr, pid_t, pid_n, pid_k, tile0, tok0, n_rows,
                     n_tok, FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr, SPLIT_K: gl.constexpr,
                     ACT: gl.constexpr):
        """The register and TMA kernels' epilogue: acc's rows scaled (_row_scaled), then quant_gemv._finish_rows for
        token tile pid_t, row block pid_n and K split pid_k of a grid (token tiles, row blocks x SPLIT_K)."""
        MMA: gl.constexpr = _layouts(NW, BN)[0]
        acc = _row_scaled(acc, d_ptr, tile0, FMT, NW, MMA)
        r, t = _rows_and_tokens(pid_n * (16 * NW), tok0, NW, BN)
        tile = pid_t * (gl.num_programs(1) // SPLIT_K) + pid_n
        quant_gemv._finish_rows(acc, out_ptr, out_stride, partial_ptr, count_ptr, r, t, pid_n * (16 * NW), tok0,
                                tile, pid_k, n_rows, n_tok, NW, BN, SPLIT_K, ACT)

    @gluon.jit
    def _rows_and_tokens(row0, tok0, NW: gl.constexpr, BN: gl.constexpr):
        """The rows [16 NW, 1] and tokens [1, BN] of an accumulator [16 NW, BN] whose first is (row0, tok0)."""
        MMA: gl.constexpr = _layouts(NW, BN)[0]
        r = row0 + gl.arange(0, 16 * NW, layout=gl.SliceLayout(1, MMA))[:, None]
        t = tok0 + gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))[None, :]
        return r, t

    @gluon.jit
    def _finish_split_tile(acc, acc2, out_ptr, out_stride, partial_ptr, count_ptr, row0, tok0, tile, pid_k, n_rows,
                           n_tok, NW: gl.constexpr, BN: gl.constexpr, BN2: gl.constexpr, SPLIT_K: gl.constexpr,
                           ACT: gl.constexpr):
        """quant_gemv._finish_rows for a token tile of two accumulators, acc's tokens from tok0 and acc2's from
        tok0 + BN: with SPLIT_K > 1 both K-slice partials go into the tile's scratch, BN + BN2 tokens a row, one
        count for the tile, and the last CTA adds each in split order and stores it. One accumulator at a time,
        each with its own coordinates, for fewer live registers."""
        r, t = _rows_and_tokens(row0, tok0, NW, BN)
        if SPLIT_K == 1:
            quant_gemv._store_rows(acc, out_ptr, out_stride, r, t, n_rows, n_tok, NW, BN, ACT)
            r2, t2 = _rows_and_tokens(row0, tok0 + BN, NW, BN2)
            quant_gemv._store_rows(acc2, out_ptr, out_stride, r2, t2, n_rows, n_tok, NW, BN2, ACT)
        else:
            TB: gl.constexpr = BN + BN2
            base = partial_ptr + tile.to(gl.int64) * (SPLIT_K * 16 * NW * TB) + pid_k * (16 * NW * TB)
            gl.store(base + (r - row0) * TB + (t - tok0), acc)
            r2, t2 = _rows_and_tokens(row0, tok0 + BN, NW, BN2)
            gl.store(base + (r2 - row0) * TB + (t2 - tok0), acc2)
            gl.thread_barrier()
            arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                base = partial_ptr + tile.to(gl.int64) * (SPLIT_K * 16 * NW * TB)
                _sum_splits_and_store(acc, base, out_ptr, out_stride, row0, tok0, tok0, n_rows, n_tok, NW, BN, TB,
                                      SPLIT_K, ACT)
                _sum_splits_and_store(acc2, base, out_ptr, out_stride, row0, tok0, tok0 + BN, n_rows, n_tok, NW, BN2,
                                      TB, SPLIT_K, ACT)
                gl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _sum_splits_and_store(like, base, out_ptr, out_stride, row0, tok0, first, n_rows, n_tok, NW: gl.constexpr,
                              BN: gl.constexpr, TB: gl.constexpr, SPLIT_K: gl.constexpr, ACT: gl.constexpr):
        """Add the SPLIT_K partials of the accumulator [16 NW, BN] whose first token is `first` (a tile's scratch
        from tok0, TB tokens a row) in split order, as quant_gemv._finish_rows does, and store them."""
        r, t = _rows_and_tokens(row0, first, NW, BN)
        offs = (r - row0) * TB + (t - tok0)
        total = gl.zeros_like(like)
        for k in range(SPLIT_K):
            total += gl.load(base + k * (16 * NW * TB) + offs, cache_modifier=".cg")
        quant_gemv._store_rows(total, out_ptr, out_stride, r, t, n_rows, n_tok, NW, BN, ACT)

    @gluon.jit(do_not_specialize=["n_tok", "n_rows", "n_stages", "n_nk", "n_slots", "tiles_per_expert"])
    def _gemm_ring_kernel(qs_desc, d_desc, sub_desc, qh_desc, x_desc, out_ptr, partial_ptr, count_ptr, d_ptr,
                          slot_expert_ptr, slot_start_ptr, slot_count_ptr,
                          n_tok, n_rows, out_stride, n_stages, n_nk, n_slots, tiles_per_expert,
                          FMT: gl.constexpr, NW: gl.constexpr, BN: gl.constexpr, SPLIT_K: gl.constexpr,
                          C: gl.constexpr, S: gl.constexpr, ACT: gl.constexpr, APART: gl.constexpr,
                          PERSIST: gl.constexpr, LAG: gl.constexpr, AHEAD: gl.constexpr, PDL: gl.constexpr,
                          ROUTED: gl.constexpr = False, BN2: gl.constexpr = 0):
        """_gemm_kernel with every operand through a ring of S shared-memory stages of C chunks each: one producer
        warp TMA-copies the weight rows' planes (fragment order, as they are: no second copy of the weights)
        and x (f16, in the planes' column order: x_operands), while the NW consumer warps dequantize from
        shared memory and run the MMAs. S stages of weight bytes are in flight per CTA without a register.
        With APART (NW 8) the two warpgroups are two partitions, each on its own 64 rows of every stage: one's
        MMAs run while the other dequantizes, where in lock step both wait at every stage's barrier.
        Work items are (token tile, row block, K split), n_nk row blocks x splits a token tile: one per program of
        a 2-D grid, or with PERSIST a 1-D grid of G CTAs each walking items pid, pid + G, ..., the ring running
        from one item's stages into the next's (the same work per item, so the same bits). d_ptr: NVFP4's row
        scales (its stages carry the sub plane in d_desc's place), else unused. LAG: _ring_consumer's, for the
        default partition's consumer (with APART the first warpgroup's: ptxas serializes the MMAs of a worker
        partition's consumer that keeps them in flight across its loop, info line C7512). AHEAD: _ring_consumer's.
        PDL: launched as a programmatic dependent (pdl_launch): the next kernel may launch at once (its CTAs find
        room as this one's leave), and this one's first weight stages load while the kernel before finishes.
        ROUTED: stacked experts (as _gemm_kernel's): the token tiles are the n_slots slots, each over its pairs
        (rows of x and out) with its expert's n_rows rows (tiles_per_expert row tiles an expert).
        BN2 > 0 (_split_tile, not routed): a token tile is BN + BN2 tokens, two accumulators of BN and BN2 over
        the rows of x's block (a power of two, BN + BN2 or more) in that order: wgmma's N need not be a power of
        two, where Gluon's tensor shapes must."""
        if PDL:
            gdc_launch_dependents()
        PARTS: gl.constexpr = 2 if APART else 1
        # LAG where ptxas keeps the MMAs pipelined: q6_K's and NVFP4's four a chunk serialize in flight (C7513), and
        # with the fifth bits' registers most configs' do (C7515)
        LAG_KEPT: gl.constexpr = LAG and not _by16(FMT) and not _fifth_bit(FMT)
        WNW: gl.constexpr = NW // PARTS                       # warps (16-row tiles) of one consumer part
        n_items = (n_slots if ROUTED else (n_tok + BN + BN2 - 1) // (BN + BN2)) * n_nk
        if ROUTED:
            route = (slot_expert_ptr, slot_start_ptr, slot_count_ptr, tiles_per_expert)
        else:       # nothing the partitions must capture
            route = ()
        WB: gl.constexpr = S * PARTS                          # weight buffers: a stage's blocks, one per part
        qs_bufs = gl.allocate_shared_memory(gl.uint8, [WB] + qs_desc.block_type.shape, qs_desc.layout)
        d_bufs = gl.allocate_shared_memory(d_desc.dtype, [WB] + d_desc.block_type.shape, d_desc.layout)
        if FMT == F_Q6_K:
            sub_bufs = gl.allocate_shared_memory(sub_desc.dtype, [WB] + sub_desc.block_type.shape, sub_desc.layout)
            qh_bufs = gl.allocate_shared_memory(gl.uint8, [WB] + qh_desc.block_type.shape, qh_desc.layout)
        elif _fifth_bit(FMT):
            sub_bufs = d_bufs
            qh_bufs = gl.allocate_shared_memory(gl.uint8, [WB] + qh_desc.block_type.shape, qh_desc.layout)
        else:
            sub_bufs = d_bufs
            qh_bufs = qs_bufs
        x_bufs = gl.allocate_shared_memory(gl.float16, [S * C] + x_desc.block_type.shape, x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(S):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=PARTS)
        fence_async_shared()
        descs = (qs_desc, d_desc, sub_desc, qh_desc, x_desc)
        bufs = (qs_bufs, d_bufs, sub_bufs, qh_bufs, x_bufs)
        if APART:
            gl.warp_specialize([
                (_ring_part, (bufs, ready, empty, n_stages, n_nk, n_items, 0, out_ptr, partial_ptr, count_ptr, d_ptr,
                              n_tok, n_rows, out_stride, route, FMT, WNW, BN, BN2, C, PARTS, SPLIT_K, ACT, PERSIST,
                              LAG_KEPT, AHEAD, PDL, ROUTED)),
                (_ring_part, (bufs, ready, empty, n_stages, n_nk, n_items, 1, out_ptr, partial_ptr, count_ptr, d_ptr,
                              n_tok, n_rows, out_stride, route, FMT, WNW, BN, BN2, C, PARTS, SPLIT_K, ACT, PERSIST,
                              False, AHEAD, PDL, ROUTED)),
                (_ring_producer, (descs, bufs, ready, empty, n_stages, n_nk, n_items, n_tok, route, FMT, NW,
                                  BN + BN2, C, PARTS, SPLIT_K, PERSIST, PDL, ROUTED)),
            ], [WNW, 1], [_APART_CONSUMER_REGS, _PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_ring_part, (bufs, ready, empty, n_stages, n_nk, n_items, 0, out_ptr, partial_ptr, count_ptr, d_ptr,
                              n_tok, n_rows, out_stride, route, FMT, NW, BN, BN2, C, PARTS, SPLIT_K, ACT, PERSIST,
                              LAG_KEPT, AHEAD, PDL, ROUTED)),
                (_ring_producer, (descs, bufs, ready, empty, n_stages, n_nk, n_items, n_tok, route, FMT, NW,
                                  BN + BN2, C, PARTS, SPLIT_K, PERSIST, PDL, ROUTED)),
            ], [1], [_PRODUCER_REGS])

@jit
def _x_operands_kernel(x_ptr, out_ptr, n_cols, x_stride, ORDER: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    """out[t] = x[t] as f16 in the planes' column order (operand_order's ORDER, quant_pack.k_order), one program per
    (row, BLOCK columns): each column stored where ordered_columns puts it, as the kernels that write x in order
    store it."""
    if PDL:  # a programmatic dependent: let the GEMM after it launch, and wait for the kernel before
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = k < n_cols
    v = tl.load(x_ptr + t.to(tl.int64) * x_stride + k, mask=ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * n_cols + ordered_columns(k, ORDER), v.to(tl.float16), mask=ok)


# COBATCH_GEMM_PDL=0 launches x_operands and the ring variant plainly: each then starts only once the kernel before
# has ended, where as programmatic dependents the ring's first weight stages load during that kernel's tail.
GEMM_PDL = os.environ.get("COBATCH_GEMM_PDL", "1") != "0"


def _chained(x: torch.Tensor) -> dict:
    """Launch arguments of x_operands and the ring variant: programmatic dependents where GEMM_PDL allows."""
    return pdl_launch(x) if GEMM_PDL else {"PDL": False}


def x_operands(x: torch.Tensor, fmt_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [n_tok, cols] (cols % 32 == 0) -> f16 [n_tok, cols] in the column order of fmt_id's planes: what the TMA
    and ring variants stream. One launch."""
    n_tok, cols = x.shape
    assert cols % 32 == 0 and x.stride(-1) == 1
    out = torch.empty(n_tok, cols, dtype=torch.float16, device=x.device) if out is None else out
    block = 1024
    _x_operands_kernel[(n_tok, -(-cols // block))](x, out, cols, x.stride(0), ORDER=order_of(fmt_id), BLOCK=block,
                                                   **_chained(x))
    return out


def x_operands_ref(x: torch.Tensor, fmt_id: int) -> torch.Tensor:
    """The torch reference of x_operands: x in fmt_id's planes' order (operand_order.ordered_ref), as f16."""
    return ordered_ref(x, order_of(fmt_id)).to(torch.float16)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """NW warps per CTA (16 NW weight rows; 4 or 8: one or two warpgroups), split_k CTAs per row block, the quant
    bytes prefetched into L2 D K steps ahead (0: off), P: each step's loads issued one step ahead (into
    registers), R registers per thread allowed to ptxas (0: its own). Only split_k changes a row's bits."""
    NW: int = 8
    split_k: int = 1
    D: int = 0
    P: bool = False
    R: int = 0
    TMA: int = 0     # > 0: x converted once per call (x_operands) and streamed by TMA through a ring of TMA buffers
    # RING > 0: weights and x through a ring of RING shared-memory stages of CHUNKS K steps each (fewer at token
    # tiles whose x leaves room for fewer: ring_stages), filled by a producer warp (_gemm_ring_kernel); P, D and
    # TMA do not apply
    RING: int = 0
    CHUNKS: int = 1
    # APART (a ring of NW 8): the two consumer warpgroups run as partitions of their own, each on its 64 rows of
    # every stage, instead of in lock step; a row's bits are the same
    APART: bool = False
    # PERSIST > 0 (a ring): that many CTAs an SM at most, each walking several (token tile, row block, K split)
    # items with the ring running from one into the next, instead of a CTA per item; a row's bits are the same
    PERSIST: int = 0
    # LAG (a ring of a format scaled per 32 weights or more, not a 5-bit one): each stage's MMAs stay in flight
    # while the next stage is dequantized, across loop iterations too, instead of none in flight at each
    # iteration's end (with APART the first warpgroup's only); a row's bits are the same
    LAG: bool = False
    # AHEAD (a ring): a stage's quant bytes read from shared memory in one load, each chunk into registers of its
    # own, instead of chunk by chunk into the same ones; a row's bits are the same
    AHEAD: bool = False

    def __post_init__(self):
        if self.NW not in (4, 8) or self.TMA == 1:
            raise ValueError(f"GemmConfig needs NW 4 or 8 (one or two warpgroups) and TMA 0 or a ring of 2+: {self}")
        if self.RING and (self.RING < 2 or self.CHUNKS not in (1, 2, 4) or self.TMA or self.P or self.D):
            raise ValueError(f"a ring GemmConfig needs 2+ stages of 1, 2 or 4 chunks, without TMA, P or D: {self}")
        if self.APART and not (self.RING and self.NW == 8):
            raise ValueError(f"APART needs a ring of two warpgroups (RING, NW 8): {self}")
        if self.PERSIST and not (self.RING and self.PERSIST in (1, 2)):
            raise ValueError(f"PERSIST needs a ring, and 1 or 2 CTAs an SM: {self}")
        if (self.LAG or self.AHEAD) and not self.RING:
            raise ValueError(f"LAG and AHEAD need a ring: {self}")

    def rows_per_cta(self) -> int:
        return 16 * self.NW

    def steps_per_iteration(self) -> int:
        """K steps (chunks) per loop iteration of the kernel: a split's steps are a multiple of it. A ring's
        iteration is two stages at least (_ring_consumer)."""
        return max(STEPS_PER_ITERATION, 2 * self.CHUNKS) if self.RING else STEPS_PER_ITERATION

    def streams_x(self) -> bool:
        """Does this config read x as f16 in the planes' column order (x_operands' scratch)?"""
        return bool(self.TMA or self.RING)

    def registers(self, bn: int) -> int | None:
        """ptxas's register cap per thread: R, else for the ring variant (NW consumer warps and a warpgroup for
        the producer) what fits one CTA of two warpgroups, or two CTAs of one, in an SM's 64k registers;
        setmaxnreg then moves most of them to the consumers. One warpgroup's accumulator of 256 tokens alone
        takes 128 a thread: one CTA an SM."""
        if self.R:
            return self.R
        if not self.RING:
            return None
        return 168 if self.NW == 8 else (128 if bn <= 128 else 232)


# The formats whose fragment planes this kernel reads: all that have them.
FORMATS = quant_pack.FRAGMENT_FORMATS


def default_config(rows_pad: int, n_chunks: int, sms: int = 132) -> GemmConfig:
    """Two warpgroups (128 rows) per CTA; split K until the row blocks fill the GPU about once."""
    cfg = GemmConfig()
    blocks = rows_pad // cfg.rows_per_cta()
    split = 1
    while blocks * split < sms and split < 8 and n_chunks % (split * 2 * STEPS_PER_ITERATION) == 0:
        split *= 2
    return dataclasses.replace(cfg, split_k=split)


def default_ring_config(rows_pad: int, n_chunks: int, byte_format: bool, sms: int = 132) -> GemmConfig:
    """The ring config a shape without a plan of its own runs, shaped like the ones the sweep chose for the
    Llama-3-8B shapes (quant_configs.json): two warpgroups a CTA on the big matrices (16k rows and more), one on
    the rest; a deep ring of 4-chunk stages for one byte a weight (q8_0, FP8), of 2-chunk stages for the rest; LAG
    (kept only where the format's MMAs stay pipelined); and K split until the row blocks reach about 0.7 of a wave
    (qkv 1, o and down 2, k or v 8), by halves where a split would not divide K. AHEAD where a CTA walks K in one
    or two splits, as the plans of qkv, o and gate_up have it."""
    nw = 8 if rows_pad >= 16384 else 4
    chunks, ring = (4, 6) if byte_format else (2, 8)
    blocks = rows_pad // (16 * nw)
    split = 1
    while blocks * split < 0.7 * sms and split < 8:
        split *= 2
    while chunks > 1 and n_chunks % (2 * chunks) != 0:          # a ring iteration is two stages
        chunks //= 2
    steps = max(STEPS_PER_ITERATION, 2 * chunks)
    while split > 1 and n_chunks % (split * steps) != 0:
        split //= 2
    return GemmConfig(NW=nw, split_k=split, RING=ring, CHUNKS=chunks, LAG=True, AHEAD=split <= 2)


def steps(p: "quant_pack.PackedPlanes", cfg: GemmConfig) -> int:
    n_chunks = p.qs.shape[1] // 512
    assert n_chunks % (cfg.split_k * cfg.steps_per_iteration()) == 0, (n_chunks, cfg)
    return n_chunks // cfg.split_k


def scratch_need(cfg: GemmConfig, rows_pad: int, max_tok: int) -> tuple[int, int]:
    """(partial elements, tile counters) of the split-K reduction for calls of up to max_tok tokens (with APART
    each warpgroup of a CTA counts its half of the rows apart)."""
    if cfg.split_k == 1:
        return 1, 1
    bn = token_tile(max_tok)
    tiles = (rows_pad // cfg.rows_per_cta()) * -(-max_tok // bn)
    return tiles * cfg.split_k * cfg.rows_per_cta() * bn, tiles * (2 if cfg.APART else 1)


def launch(p: "quant_pack.PackedPlanes", x: torch.Tensor, out: torch.Tensor, cfg: GemmConfig,
           partial: torch.Tensor, count: torch.Tensor, act: str | None = None,
           routing: "quant_gemv.Routing | None" = None, x_ordered: bool = False, out_order: int = 0) -> None:
    """out[n_tok, rows] = x @ W.T for fragment-order planes; x f16 or bf16 [n_tok, cols] (row stride free).
    x_ordered (the TMA and ring variants): x is f16 in the planes' column order already (operand_order.py).
    With `act`, W's rows are gate|up interleaved 8 by 8 and out gets act(gate) * up (quant_gemv.launch), its
    columns in out_order's order (operand_order: the next GEMM's).
    With `routing`, p holds the experts stacked and out[pair] = x[pair] @ W[expert of its slot].T (as
    quant_gemv.launch), a slot being one token tile of max_count pairs: the plain or the ring kernel, without
    split-K."""
    assert p.fragment and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1
    assert p.rows_pad % cfg.rows_per_cta() == 0, (p.rows_pad, cfg)
    n_tok = x.shape[0]
    bn = routing.max_count if routing else token_tile(n_tok)
    rows = routing.rows_per_expert if routing else p.rows
    assert out.shape[-1] == (rows // 2 if act else rows), (out.shape, rows, act)
    dummy = p.qs
    sub, qh = (p.sub if p.sub is not None else dummy), (p.qh if p.qh is not None else dummy)
    n_chunks = p.qs.shape[1] // 512
    slots = (dummy, dummy, dummy)
    n_slots = routing.slot_expert.shape[0] if routing else 0
    if routing:
        assert bn in TOKEN_TILES and rows % cfg.rows_per_cta() == 0, (bn, rows, cfg)
        assert cfg.split_k == 1 and not cfg.TMA, f"a routed GEMM runs the plain or the ring kernel, K whole: {cfg}"
        n_nk = rows // cfg.rows_per_cta()
        grid = (n_slots, n_nk)
        slots = (routing.slot_expert, routing.slot_start, routing.slot_count)
    else:
        n_nk = (p.rows_pad // cfg.rows_per_cta()) * cfg.split_k       # row blocks x K splits of a token tile
        grid = (-(-n_tok // bn), n_nk)
    if cfg.RING:
        stages = ring_stages(cfg, p.fmt_id, bn)
        if stages < 2:
            raise ValueError(f"{cfg} does not fit an SM's shared memory at {bn}-token tiles")
        # two accumulators over x's block of bn tokens where the call's tile is not a power of two (one tile:
        # the grid stands)
        bn1, bn2 = (bn, 0) if routing else split_tile(n_tok)
        x16 = _x_streamed(p, x, n_tok, bn, x_ordered)
        descs = ring_descriptors(p, cfg) + (_x_descriptor(x16, bn, p.fmt_id),)
        if cfg.PERSIST:
            grid = (min(grid[0] * grid[1], cfg.PERSIST * device_sms(x)),)
        _gemm_ring_kernel[grid](
            *descs, out, partial, count, p.d, *slots, n_tok, rows, out.stride(0), steps(p, cfg) // cfg.CHUNKS, n_nk,
            n_slots, rows // 16, FMT=p.fmt_id, NW=cfg.NW, BN=bn1, SPLIT_K=cfg.split_k, C=cfg.CHUNKS, S=stages,
            ACT=act_code(act, out_order), APART=cfg.APART, PERSIST=bool(cfg.PERSIST), LAG=cfg.LAG, AHEAD=cfg.AHEAD,
            ROUTED=routing is not None, BN2=bn2, **_chained(x), num_warps=cfg.NW // 2 if cfg.APART else cfg.NW,
            maxnreg=cfg.registers(bn))
        return
    if cfg.TMA:
        x16 = _x_streamed(p, x, n_tok, bn, x_ordered)
        _gemm_tma_kernel[grid](
            _x_descriptor(x16, bn, p.fmt_id), out, partial, count, p.qs, p.d, sub, qh, n_tok, p.rows, p.cols,
            out.stride(0), n_chunks,
            steps(p, cfg), FMT=p.fmt_id, NW=cfg.NW, BN=bn, SPLIT_K=cfg.split_k, D=cfg.D, P=cfg.P, S=cfg.TMA,
            ACT=act_code(act, out_order), num_warps=cfg.NW, maxnreg=cfg.registers(bn))
        return
    assert not x_ordered, f"{cfg} reads x in the model's column order"
    _gemm_kernel[grid](
        x, out, partial, count, p.qs, p.d, sub, qh, *slots,
        n_tok, rows, p.cols, x.stride(0), out.stride(0), n_chunks, steps(p, cfg), rows // 16,
        FMT=p.fmt_id, NW=cfg.NW, BN=bn, SPLIT_K=cfg.split_k, EVEN_K=p.cols == p.cols_pad, D=cfg.D, P=cfg.P,
        ACT=act_code(act, out_order), ROUTED=routing is not None, num_warps=cfg.NW, maxnreg=cfg.registers(bn))


# The TMA variants' x as whole token tiles: a tile's box past the last token then reads scratch rows (whatever they
# hold: a token's column of the MMA never meets another's, and the epilogue stores only the call's tokens) instead
# of the copy engine's out-of-bounds fill
PAD_X_TO_TILE = os.environ.get("COBATCH_GEMM_PAD_X", "1") != "0"


def _padded(n_tok: int, bn: int) -> int:
    return -(-n_tok // bn) * bn if PAD_X_TO_TILE else n_tok


def _x_streamed(p: "quant_pack.PackedPlanes", x: torch.Tensor, n_tok: int, bn: int, x_ordered: bool) -> torch.Tensor:
    """The f16 x in the planes' column order that the TMA and ring variants stream, over whole token tiles: x
    itself where its writer put it in that order (x_ordered; the tiles' rows past n_tok where its storage holds
    them, as operand_order.operand_buffer allocates), else x_operands' copy of it in the scratch."""
    rows = _padded(n_tok, bn)
    if x_ordered:
        assert x.dtype == torch.float16 and x.stride(0) == p.cols, (x.dtype, x.stride(), p.cols)
        whole = x.untyped_storage().nbytes() >= (x.storage_offset() + rows * p.cols) * x.element_size()
        return x.as_strided((rows, p.cols), (p.cols, 1)) if whole else x
    x16 = _x_scratch(x.device, rows, p.cols)
    x_operands(x, p.fmt_id, x16[:n_tok])
    return x16


def x_scratch_rows(max_tok: int) -> int:
    """The x scratch rows a call of up to max_tok tokens takes (whole token tiles; the most at max_tok itself, as
    the rounded-up count only grows with the tokens)."""
    return _padded(max_tok, token_tile(max_tok))


def _x_descriptor(x16: torch.Tensor, bn: int, fmt_id: int):
    """x16's TMA descriptor: one K step's [bn tokens, chunk columns] block, swizzled for the MMA."""
    kc = 32 if fmt_id in quant_pack.BYTE_FORMATS else 64
    return TensorDescriptor.from_tensor(x16, [bn, kc], _x_block_layout(bn, kc))


@functools.cache
def _x_block_layout(bn: int, kc: int):
    """The swizzled shared layout of x's [bn, kc] block (built once a shape: a launch of an eager step paid for
    Gluon's layout construction every call)."""
    return gl.NVMMASharedLayout.get_default_for([bn, kc], gl.float16)


# Entries per 16-row tile and chunk of the plane a ring stage carries as its d (_side_shape's table, for the host):
# f16 d (and q4_1's m), or NVFP4's sub plane as int32 words (four e4m3 scales a row); q6_K carries more planes
_SIDE_PER_CHUNK = {quant_pack.Q8_0: 16, quant_pack.FP8_E4M3: 16, quant_pack.Q4_0: 32, quant_pack.Q4_1: 64,
                   quant_pack.Q5_0: 32, quant_pack.Q5_1: 64, quant_pack.NVFP4: 16}
_weight_descriptors: dict[tuple, object] = {}


def ring_descriptors(p: "quant_pack.PackedPlanes", cfg: GemmConfig) -> tuple:
    """TMA descriptors of a weight's planes for the ring variant: (qs, d, sub, qh) blocks of one stage and
    consumer part, NW row tiles (NW / 2 with APART) x CHUNKS chunks, copied unswizzled (q6_K only has sub, and qh
    with the fifth-bit formats; the others pass qs again; NVFP4's stage carries its sub plane as d). A descriptor
    is plain values (address, shape, strides, block), so it is made once per weight and config."""
    nw, c = cfg.NW // 2 if cfg.APART else cfg.NW, cfg.CHUNKS       # the row tiles of one consumer part
    key = (p.qs.data_ptr(), p.d.data_ptr(), tuple(p.qs.shape), tuple(p.d.shape), p.fmt_id, nw, c)
    if key in _weight_descriptors:
        return _weight_descriptors[key]
    tiles, n_chunks = p.qs.shape[0], p.qs.shape[1] // 512

    def descriptor(t: torch.Tensor, block: list[int]):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * t.element_size(), rank=len(block))
        return TensorDescriptor.from_tensor(t, block, layout)

    qs = descriptor(p.qs.view(tiles, 2 * n_chunks, 256), [nw, 2 * c, 256])
    if p.fmt_id == quant_pack.Q6_K:
        found = (qs, descriptor(p.d, [nw, 16]), descriptor(p.sub.view(torch.int32), [nw, 16 * c]),
                 descriptor(p.qh.view(tiles, n_chunks, 256), [nw, c, 256]))
    else:
        side = p.sub.view(torch.int32) if p.fmt_id == quant_pack.NVFP4 else p.d    # NVFP4's row scale: the epilogue's
        fifth = (descriptor(p.qh.view(tiles, n_chunks, 128), [nw, c, 128])
                 if p.fmt_id in quant_pack.FIFTH_BIT_FORMATS else qs)
        found = (qs, descriptor(side, [nw, c * _SIDE_PER_CHUNK[p.fmt_id]]), qs, fifth)
    _weight_descriptors[key] = found
    return found


# The shared memory one ring CTA may take: Hopper's 227 KB a block, with room for the barriers.
RING_SMEM_BYTES = 227 * 1024 - 2048


def _ring_stage_bytes(cfg: GemmConfig, fmt_id: int, bn: int) -> int:
    kc = 32 if fmt_id in quant_pack.BYTE_FORMATS else 64
    chunk = 512 * cfg.NW + 2 * bn * kc
    if fmt_id == quant_pack.Q6_K:
        chunk += 256 * cfg.NW + 64 * cfg.NW
        side = 64 * cfg.NW
    else:
        chunk += 128 * cfg.NW if fmt_id in quant_pack.FIFTH_BIT_FORMATS else 0
        side = (4 if fmt_id == quant_pack.NVFP4 else 2) * _SIDE_PER_CHUNK[fmt_id] * cfg.NW * cfg.CHUNKS
    return cfg.CHUNKS * chunk + side + 16


def ring_stages(cfg: GemmConfig, fmt_id: int, bn: int) -> int:
    """The stages the ring variant runs at token tile bn: cfg.RING, or as many as fit RING_SMEM_BYTES where the
    x blocks, which grow with the tile, leave room for fewer. The depth only moves loads (a row's bits are the
    same), so one config serves every token tile. Below 2 the config cannot run at this tile."""
    return min(cfg.RING, RING_SMEM_BYTES // _ring_stage_bytes(cfg, fmt_id, bn))


def ring_smem_bytes(cfg: GemmConfig, fmt_id: int, bn: int) -> int:
    """Shared memory of the ring variant's buffers at token tile bn (ring_stages of them)."""
    return ring_stages(cfg, fmt_id, bn) * _ring_stage_bytes(cfg, fmt_id, bn)


# The TMA variant's f16 activations (calls on one stream run one after another); grown when a call needs more,
# so reserve it before a CUDA-graph capture (reserve_x_scratch).
_X_SCRATCH = DeviceScratch(torch.float16)


def reserve_x_scratch(device: torch.device, elems: int) -> None:
    """Grow the TMA variant's f16 activation buffer to `elems` (at load: never inside a CUDA-graph capture)."""
    _X_SCRATCH.reserve(device, elems)


def _x_scratch(device: torch.device, n_tok: int, cols: int) -> torch.Tensor:
    return _X_SCRATCH.get(device, n_tok * cols).view(n_tok, cols)
