"""The Triton quantized matmul: y = x @ W.T with W in its packed GGUF block planes, one kernel for every format.

One Triton kernel serves every packed format (FMT constexpr) and every batch size; only the tile config
(TileConfig) changes with n_tok:
  - narrow (decode): each program owns BN weight rows and a slice of K (split-K), loads every weight block once,
    dequantizes it in registers and multiplies it against all n_tok activation rows at once. "Swap AB": the
    weight tile is the MMA's M side (A operand, straight from registers) and the tokens, padded to BM=16, are its
    N side, so a batch of 1 and a batch of 16 cost the same bytes. Split-K partials are summed in a fixed order
    by the last program of each tile (no float atomics), so row t's result is bitwise the same whatever n_tok is.
  - gemm (prefill): the same kernel with big token tiles (BM 64..128) on tensor cores.
On CUDA the fragment-order formats run the Gluon GEMV and GEMM instead (quant_gemv.py, quant_gemm.py); this kernel
serves the other devices and formats, and every format in CI through the interpreter. `dequantize_planes` writes
a weight's dense matrix in one pass, for cuBLAS past the quantized kernels' range (DEQUANT_CUBLAS: on the H200
that won for every format at 2048 tokens, 0.74-0.88 of cuBLAS bf16 against 0.42-0.45 for this kernel's tl.dot
GEMM, whose register-A wgmma Triton waits on after every MMA).

Which kernel and config a weight runs at each token count is its plan (matmul_plans.py); the weight itself, with
its dispatch, is packed_weight.PackedWeight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cobatch.kernels import fragment_dequant, quant_pack
from cobatch.kernels.quant_pack import PackedPlanes
from cobatch.kernels.scratch import SplitScratch
from cobatch.kernels.triton_support import interpreting, jit, split_k_total, tl, triton
from cobatch.quant.weight import QuantWeight


def quant_matmul_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The torch reference: float32 x @ dequant(W).T -> float32 [n_tok, rows]."""
    return x.float() @ w.dequantize(torch.float32).to(x.device).T


# --- Triton -------------------------------------------------------------------------------------------
#
# Loop structure: per K tile (BK weights), per 64-weight chunk, one [BN, 32]-byte quant load gives two
# 32-weight blocks (q8_0: two loads). Each block is dequantized into the MMA's register A operand and
# multiplied by x[toks, block].T ([32, BM], from shared memory) with its per-row scale broadcast along K.
# Block-sized 2-D tiles keep Triton from routing the dequantized tile through shared memory (a [BN, BK]
# tile with a per-32 scale broadcast did: +1 STS/weight), and 4-byte side loads (scales, mins, high
# bits) per chunk let the pipeliner turn every load into an async copy.

# The format ids as compile-time constants (Triton reads only constexpr globals).
_const = tl.constexpr if tl is not None else (lambda v: v)
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, FP8, NVFP4 = (
    _const(getattr(quant_pack, n)) for n in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "FP8_E4M3",
                                             "NVFP4"))
FP8_D = _const(1.0 / quant_pack.FP8_D_SCALE)    # FP8's d holds the row scale times FP8_D_SCALE
# quant_pack.DECODE_SLOTS: where FP8's and NVFP4's fragment-order words keep operand r's value and sign (half 0)
(FP8_V0, FP8_S0), (FP8_V1, FP8_S1) = ((_const(v), _const(s)) for v, s in quant_pack.DECODE_SLOTS[quant_pack.FP8_E4M3])
(FP4_V0, FP4_S0), (FP4_V1, FP4_S1), (FP4_V2, FP4_S2), (FP4_V3, FP4_S3) = (
    (_const(v), _const(s)) for v, s in quant_pack.DECODE_SLOTS[quant_pack.NVFP4])


def _nibble_asm(dtype: str, affine: bool) -> str:
    """Two bytes -> 4 weights as two packed pairs: $0 = low nibbles (block 2c), $1 = high nibbles (2c+1).

    The nibbles go into 16-bit lanes under a magic exponent (bf16 0x4300 = 128, f16 0x6400 = 1024, whose
    ulp is 1), one packed add removes the magic (and q4_0's zero point 8) exactly, one packed mul/fma
    applies the scale: ~1.75 instructions per weight instead of ~5 for int->float conversions."""
    magic, zp8, zp0 = {"bf16": ("0x43004300", "0xC308C308", "0xC300C300"),
                       "f16": ("0x64006400", "0xE408E408", "0xE400E400")}[dtype]
    scale = (f"fma.rn.{dtype}x2 $0, $0, $3, $5;\n fma.rn.{dtype}x2 $1, $1, $4, $6;" if affine else
             f"mul.rn.{dtype}x2 $0, $0, $3;\n mul.rn.{dtype}x2 $1, $1, $4;")
    return f"""{{
 .reg .b32 t, u, z;
 mov.b32 z, {zp0 if affine else zp8};
 prmt.b32 t, $2, 0, 0x4140;
 shr.u32 u, t, 4;
 lop3.b32 $0, t, 0x000F000F, {magic}, 0xEA;
 lop3.b32 $1, u, 0x000F000F, {magic}, 0xEA;
 add.rn.{dtype}x2 $0, $0, z;
 add.rn.{dtype}x2 $1, $1, z;
 {scale}
}}"""


def _q8_asm(dtype: str) -> str:
    """Two int8 bytes -> one packed pair: 2^23 magic in f32 (exact), f32 scale, one rounding to dtype."""
    return f"""{{
 .reg .b32 x, f0, f1, c;
 mov.b32 c, 0x4B000000;
 xor.b32 x, $1, 0x8080;
 prmt.b32 f0, x, c, 0x7440;
 prmt.b32 f1, x, c, 0x7441;
 sub.f32 f0, f0, 0f4B000080;
 sub.f32 f1, f1, 0f4B000080;
 mul.f32 f0, f0, $2;
 mul.f32 f1, f1, $3;
 cvt.rn.{dtype}x2.f32 $0, f1, f0;
}}"""


_ASM_NIB_ZP_BF16, _ASM_NIB_ZP_F16 = _const(_nibble_asm("bf16", False)), _const(_nibble_asm("f16", False))
_ASM_NIB_AFF_BF16, _ASM_NIB_AFF_F16 = _const(_nibble_asm("bf16", True)), _const(_nibble_asm("f16", True))
_ASM_Q8_BF16, _ASM_Q8_F16 = _const(_q8_asm("bf16")), _const(_q8_asm("f16"))


@jit
def _exact_f32(u, offset: tl.constexpr):
    """u int32 in [0, 2^23) -> float(u) - offset, exactly: the 2^23 magic number instead of a (slow) I2F."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@jit
def _pair(ptr):
    """Load [BN, 2] at ptr and return its two columns as [BN, 1] tensors."""
    a, b = tl.split(tl.load(ptr))
    return a[:, None], b[:, None]


@jit
def _quad(ptr):
    """Load [BN, 4] at ptr (4 consecutive elements per row) and return its four columns as [BN, 1]."""
    t = tl.load(ptr)
    even, odd = tl.split(tl.reshape(t, [t.shape[0], 2, 2]))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0[:, None], c1[:, None], c2[:, None], c3[:, None]


@jit
def _nibbles(q, s0, s1, m0, m1, AFFINE: tl.constexpr, ZP: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """Bytes q [BN, 32] -> (low nibbles * s0 + m0, high nibbles * s1 + m1) in DT ([BN, 1] scales; or
    (q - ZP) * s without mins). One return at the end: Triton checks every branch's return type."""
    if ASM:  # (dtypes spelled out: inline_asm_elementwise wants a dtype, not a constexpr)
        if DT == tl.bfloat16:
            if AFFINE:
                w0, w1 = tl.inline_asm_elementwise(
                    _ASM_NIB_AFF_BF16, "=r,=r,r,r,r,r,r", [q, s0.to(tl.bfloat16), s1.to(tl.bfloat16),
                                                           m0.to(tl.bfloat16), m1.to(tl.bfloat16)],
                    (tl.bfloat16, tl.bfloat16), True, 2)
            else:
                w0, w1 = tl.inline_asm_elementwise(_ASM_NIB_ZP_BF16, "=r,=r,r,r,r",
                                                   [q, s0.to(tl.bfloat16), s1.to(tl.bfloat16)],
                                                   (tl.bfloat16, tl.bfloat16), True, 2)
        else:
            if AFFINE:
                w0, w1 = tl.inline_asm_elementwise(
                    _ASM_NIB_AFF_F16, "=r,=r,r,r,r,r,r", [q, s0.to(tl.float16), s1.to(tl.float16),
                                                          m0.to(tl.float16), m1.to(tl.float16)],
                    (tl.float16, tl.float16), True, 2)
            else:
                w0, w1 = tl.inline_asm_elementwise(_ASM_NIB_ZP_F16, "=r,=r,r,r,r",
                                                   [q, s0.to(tl.float16), s1.to(tl.float16)],
                                                   (tl.float16, tl.float16), True, 2)
    else:
        qi = q.to(tl.int32)
        lo = _exact_f32(qi & 0xF, ZP) * s0.to(tl.float32)
        hi = _exact_f32((qi >> 4) & 0xF, ZP) * s1.to(tl.float32)
        if AFFINE:
            lo += m0.to(tl.float32)
            hi += m1.to(tl.float32)
        w0 = lo.to(DT)
        w1 = hi.to(DT)
    return w0, w1


@jit
def _q8_block(q, d, DT: tl.constexpr, ASM: tl.constexpr):
    """int8 bits q [BN, 32] (uint8) times d [BN, 1] -> DT."""
    if ASM:
        if DT == tl.bfloat16:
            w = tl.inline_asm_elementwise(_ASM_Q8_BF16, "=r,r,r,r", [q, d.to(tl.float32)], tl.bfloat16, True, 2)
        else:
            w = tl.inline_asm_elementwise(_ASM_Q8_F16, "=r,r,r,r", [q, d.to(tl.float32)], tl.float16, True, 2)
    else:
        w = (_exact_f32((q.to(tl.int32) & 0xFF) ^ 0x80, 128.0) * d.to(tl.float32)).to(DT)
    return w


@jit
def _e4m3(q):
    """OCP e4m3 bytes (any integer tensor) -> f32, widened by hand (sign, exponent + 120, mantissa; subnormals
    m * 2^-9), which every backend, the interpreter too, runs exactly; 0x7F / 0xFF (NaN) read as 480, and a
    checkpoint holds none."""
    qi = q.to(tl.int32) & 0xFF
    e = (qi >> 3) & 15
    m = qi & 7
    sign = tl.where(qi >= 128, -1.0, 1.0)
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return sign * tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@jit
def _e2m1(code):
    """NVFP4's e2m1 codes (int32, 4 bits: sign, 2 exponent bits, 1 mantissa bit) -> f32: +-0, 0.5, 1, 1.5, 2, 3,
    4, 6."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    magnitude = tl.where(e == 0, 0.5 * m, (2.0 + m) * tl.where(e == 1, 0.5, tl.where(e == 2, 1.0, 2.0)))
    return tl.where(code >= 8, -magnitude, magnitude)


@jit
def _logical_col(j, FMT: tl.constexpr):
    """GGUF column j of a 32-column tile -> its logical column in a fragment-order plane (the inverse of
    quant_pack.k_order: j = 8 c + 4 h + 2 a + e, or 16 h + 4 c + 2 a + e for q6_K and NVFP4;
    k = 16 h + 8 a + 2 c + e)."""
    if FMT == Q6_K or FMT == NVFP4:
        c = (j // 4) % 4
        h = j // 16
    else:
        c = j // 8
        h = (j // 4) % 2
    return 16 * h + 8 * ((j // 2) % 2) + 2 * c + j % 2


@jit
def _qs_tile(qs_ptr, row, qs_stride, col, j, FMT: tl.constexpr, FRAG: tl.constexpr):
    """The [BN, 32] bytes at columns col + j (col % 32 == 0) of the qs plane. FRAG: the plane is in
    fragment order (quant_pack.fragment_order, the Gluon GEMV's layout), read by a gather: byte (r, k)
    of a 16 x 32 tile (k: the logical column) sits at lane 4 (r % 8) + (k % 8) // 2, byte
    4 (k // 8) + r // 8 + 2 (k % 2); FP8's and NVFP4's words are in decode order, so their bytes are put back
    together from the whole word."""
    if FRAG:
        r = row % 16
        k = _logical_col(j, FMT)
        lane = 4 * (r % 8) + (k % 8) // 2
        at = qs_ptr + (row // 16) * (16 * qs_stride) + (col // 32) * 512 + 16 * lane + 4 * (k // 8)
        b = (r // 8 + 2 * (k % 2)).to(tl.int32)
        if FMT == FP8 or FMT == NVFP4:
            return _byte_of_decode_order(tl.load(at.to(tl.pointer_type(tl.int32))), b, FMT)
        return tl.load(at + b)
    return tl.load(qs_ptr + row * qs_stride + col + j)


@jit
def _bits(w, at, width: tl.constexpr):
    return (w >> at) & ((1 << width) - 1)


@jit
def _byte_of_decode_order(w, b, FMT: tl.constexpr):
    """Fragment byte b (0..3) of a word in quant_pack's decode order: byte b holds the values of operands b % 2
    (FP8's byte; NVFP4's low nibble) and b % 2 + 2 (NVFP4's high nibble), in half b // 2."""
    half = 16 * (b // 2)
    odd = b % 2 == 1
    if FMT == FP8:
        v, sign = tl.where(odd, FP8_V1, FP8_V0) + half, tl.where(odd, FP8_S1, FP8_S0) + half
        return (_bits(w, v, 7) | (_bits(w, sign, 1) << 7)).to(tl.uint8)
    lo_v, lo_s = tl.where(odd, FP4_V1, FP4_V0) + half, tl.where(odd, FP4_S1, FP4_S0) + half
    hi_v, hi_s = tl.where(odd, FP4_V3, FP4_V2) + half, tl.where(odd, FP4_S3, FP4_S2) + half
    lo = _bits(w, lo_v, 3) | (_bits(w, lo_s, 1) << 3)
    return (lo | (_bits(w, hi_v, 3) << 4) | (_bits(w, hi_s, 1) << 7)).to(tl.uint8)


@jit
def _side(row, entries_per_row, entry, FRAG: tl.constexpr):
    """Index of side entry (row, entry) of a side plane: row-major, or in fragment order
    (quant_pack.side_to_fragment_order: per 16-row tile and entry, rows g and g + 8 side by side)."""
    if FRAG:
        r = row % 16
        return (row // 16) * (16 * entries_per_row) + 16 * entry + 2 * (r % 8) + r // 8
    return row * entries_per_row + entry


@jit
def _fifth_bits(qh_ptr, row, qs_stride, side32, chunk, j, FMT: tl.constexpr, FRAG: tl.constexpr):
    """The fifth bits (q5_0, q5_1, q5_K) of weights j of the chunk's low and high 32-blocks, rows `row`: from the
    qh words a block (row-major), or from fragment order (quant_pack.fifth_bits_to_fragment_order: a byte per lane
    and qs word of the tile)."""
    if FRAG:
        r = row % 16
        k = _logical_col(j, FMT)
        lane = 4 * (r % 8) + (k % 8) // 2
        b = tl.load(qh_ptr + (row // 16) * (4 * qs_stride) + 128 * chunk + 4 * lane + k // 8).to(tl.int32)
        at = 2 * (k % 2) + (r // 8).to(tl.int32)     # column k + 1: two bits higher; rows g + 8: one
        return (b >> (at + 4)) & 1, (b >> at) & 1     # the low block's at bits 4-7, the high block's at 0-3
    h0, h1 = _pair(qh_ptr + row * side32 + 2 * chunk + tl.arange(0, 2)[None, :])   # the two blocks' words
    return (h0 >> j) & 1, (h1 >> j) & 1


@jit
def _dequant_chunk(qs_ptr, d_ptr, m_ptr, sub_ptr, qh_ptr, row, qs_stride, side32, side256, chunk, j,
                   FMT: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr, FRAG: tl.constexpr = False):
    """Weights [64*chunk, 64*chunk + 64) of rows `row` ([BN, 1] int64) as two [BN, 32] tiles in DT: the
    32-weight blocks 2*chunk and 2*chunk+1. j = arange(32)[None, :]. qs_stride: bytes per row."""
    two = tl.arange(0, 2)[None, :]
    four = tl.arange(0, 4)[None, :]
    if FMT == Q8_0 or FMT == FP8:      # the same planes (quant_pack.BYTE_FORMATS), int8 or e4m3 bytes
        q0 = _qs_tile(qs_ptr, row, qs_stride, 64 * chunk, j, FMT, FRAG)
        q1 = _qs_tile(qs_ptr, row, qs_stride, 64 * chunk + 32, j, FMT, FRAG)
        d0, d1 = _pair(d_ptr + _side(row, side32, 2 * chunk + two, FRAG))
        if FMT == FP8:
            return (_e4m3(q0) * (d0.to(tl.float32) * FP8_D)).to(DT), (_e4m3(q1) * (d1.to(tl.float32) * FP8_D)).to(DT)
        return _q8_block(q0, d0, DT, ASM), _q8_block(q1, d1, DT, ASM)
    if FMT == NVFP4:    # codes paired as the 4-bit formats', an e4m3 scale per 16 (4 a chunk), an f32 row scale
        q = _qs_tile(qs_ptr, row, qs_stride, 32 * chunk, j, FMT, FRAG)
        s0, s1, s2, s3 = _quad(sub_ptr + 4 * _side(row, side32 // 2, chunk, FRAG) + four)
        scale = tl.load(d_ptr + _side(row, 1, 0, FRAG))
        first = j < 16
        lo = tl.where(first, _e4m3(s0), _e4m3(s1)) * scale
        hi = tl.where(first, _e4m3(s2), _e4m3(s3)) * scale
        qi = q.to(tl.int32)
        return (_e2m1(qi & 15) * lo).to(DT), (_e2m1(qi >> 4) * hi).to(DT)
    q = _qs_tile(qs_ptr, row, qs_stride, 32 * chunk, j, FMT, FRAG)        # low nibbles: block 2c, high: 2c+1
    if FMT == Q4_0:
        d0, d1 = _pair(d_ptr + _side(row, side32, 2 * chunk + two, FRAG))
        return _nibbles(q, d0, d1, d0, d1, False, 8.0, DT, ASM)
    elif FMT == Q4_1 or FMT == Q5_1 or FMT == Q4_K or FMT == Q5_K:
        if FMT == Q4_K or FMT == Q5_K:
            # Row-major only: fragment-order q4_K (q5_K) planes are q4_1's (q5_1's: quant_pack._q4k_as_affine).
            # 4-byte entries: (scale, min) x 2 blocks per chunk; (d, dmin) per super-block
            sc0, mn0, sc1, mn1 = _quad(sub_ptr + row * (2 * side32) + 4 * chunk + four)
            d, dmin = _pair(d_ptr + row * (2 * side256) + 2 * (chunk // 4) + two)
            d = d.to(tl.float32)
            dmin = dmin.to(tl.float32)
            d0, d1 = d * sc0.to(tl.float32), d * sc1.to(tl.float32)
            m0, m1 = -(dmin * mn0.to(tl.float32)), -(dmin * mn1.to(tl.float32))
        elif FRAG:     # one plane (quant_pack.affine_sides_to_fragment_order): d at +0, +2; m at +4, +6
            r = row % 16
            side = (row // 16) * (32 * side32) + 64 * chunk + 8 * (r % 8) + r // 8 + 2 * two
            d0, d1 = _pair(d_ptr + side)
            m0, m1 = _pair(d_ptr + side + 4)
        else:
            d0, d1 = _pair(d_ptr + _side(row, side32, 2 * chunk + two, False))
            m0, m1 = _pair(m_ptr + _side(row, side32, 2 * chunk + two, False))
        if FMT == Q4_1 or FMT == Q4_K:
            return _nibbles(q, d0, d1, m0, m1, True, 0.0, DT, ASM)
        lo_bit, hi_bit = _fifth_bits(qh_ptr, row, qs_stride, side32, chunk, j, FMT, FRAG)
        qi = q.to(tl.int32)
        lo = _exact_f32((qi & 0xF) | (lo_bit << 4), 0.0) * d0.to(tl.float32) + m0.to(tl.float32)
        hi = _exact_f32(((qi >> 4) & 0xF) | (hi_bit << 4), 0.0) * d1.to(tl.float32) + m1.to(tl.float32)
        return lo.to(DT), hi.to(DT)
    elif FMT == Q5_0:   # the fifth bit: plain Triton ops
        d0, d1 = _pair(d_ptr + _side(row, side32, 2 * chunk + two, FRAG))
        lo_bit, hi_bit = _fifth_bits(qh_ptr, row, qs_stride, side32, chunk, j, FMT, FRAG)
        qi = q.to(tl.int32)
        lo = _exact_f32((qi & 0xF) | (lo_bit << 4), 16.0) * d0.to(tl.float32)
        hi = _exact_f32(((qi >> 4) & 0xF) | (hi_bit << 4), 16.0) * d1.to(tl.float32)
        return lo.to(DT), hi.to(DT)
    else:               # Q6_K: low nibble | 2 high bits << 4, minus 32; an int8 scale per 16 weights
        s0, s1, s2, s3 = _quad(sub_ptr + 4 * _side(row, side32 // 2, chunk, FRAG) + four)
        d = tl.load(d_ptr + _side(row, side256, chunk // 4, FRAG))
        first = j < 16
        qi = q.to(tl.int32)
        if FRAG:       # quant_pack.high_bits_to_fragment_order: a byte per (lane, column) of the qs tile
            r = row % 16
            k = _logical_col(j, FMT)
            lane = 4 * (r % 8) + (k % 8) // 2
            b = tl.load(qh_ptr + (row // 16) * (8 * qs_stride) + 256 * chunk + 8 * lane + 2 * (k // 8)
                        + k % 2).to(tl.int32)
            half = (r // 8).to(tl.int32)     # rows g + 8: the next bit pair
            lo_bits = (b >> (4 + 2 * half)) & 3
            hi_bits = (b >> (2 * half)) & 3
        else:
            h0, h1, h2, h3 = _quad(qh_ptr + row * (2 * side32) + 4 * chunk + four)
            shift = 2 * (j % 16)
            lo_bits = (tl.where(first, h0, h1) >> shift) & 3
            hi_bits = (tl.where(first, h2, h3) >> shift) & 3
        lo = _exact_f32((qi & 0xF) | (lo_bits << 4), 32.0)
        hi = _exact_f32(((qi >> 4) & 0xF) | (hi_bits << 4), 32.0)
        lo = lo * (d * tl.where(first, s0, s1).to(tl.float32))
        hi = hi * (d * tl.where(first, s2, s3).to(tl.float32))
        return lo.to(DT), hi.to(DT)


@jit
def _dot_block(acc, x_ptr, x_stride, toks, tok_ok, n_cols, w, k, j_col, EVEN_K: tl.constexpr):
    """acc[BN, BM] += w[BN, 32] @ x[toks, k:k+32].T"""
    ptrs = x_ptr + toks[None, :] * x_stride + (k + j_col)
    if EVEN_K:
        xt = tl.load(ptrs, mask=tok_ok[None, :], other=0.0)
    else:
        xt = tl.load(ptrs, mask=tok_ok[None, :] & (k + j_col < n_cols), other=0.0)
    return tl.dot(w, xt.to(w.dtype), acc)


def _kernel_jit(fn):
    # Sizes and strides are not specialized (one compile serves every shape of a format and config, and
    # n_tok = 1 runs the very same binary as n_tok = 16); their alignment is asserted with multiple_of.
    if triton is None:
        return jit(fn)
    return triton.jit(fn, do_not_specialize=["n_tok", "n_rows", "n_cols", "n_super", "k_tiles_per_split"])


@_kernel_jit
def _quant_matmul_kernel(
        x_ptr, out_ptr, partial_ptr, count_ptr,
        qs_ptr, d_ptr, m_ptr, sub_ptr, qh_ptr,
        n_tok, n_rows, n_cols, x_stride, out_stride, n_super, k_tiles_per_split,
        FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr, F32_DOT: tl.constexpr):
    C: tl.constexpr = BK // 64
    # Row strides of the planes from the padded row length in 256-weight super-blocks, so the compiler
    # sees their alignment (16-byte vector loads) without specializing on the shape.
    side256 = n_super
    side32 = 8 * n_super
    qs_stride = (256 if FMT == Q8_0 or FMT == FP8 else 128) * n_super
    # The interpreter's bf16 dot is wrong (numpy has no bf16) and runs no inline asm: f32 there.
    DT: tl.constexpr = tl.float32 if F32_DOT else x_ptr.dtype.element_ty
    ASM: tl.constexpr = not F32_DOT
    pid_m = tl.program_id(0)               # token tile: fastest, so programs sharing a weight tile run together
    pid_n = tl.program_id(1) // SPLIT_K
    pid_k = tl.program_id(1) % SPLIT_K
    rows = pid_n * BN + tl.arange(0, BN)
    row = rows.to(tl.int64)[:, None]
    j = tl.arange(0, 32)[None, :]
    j_col = tl.arange(0, 32)[:, None]
    toks = pid_m * BM + tl.arange(0, BM)
    tok_ok = toks < n_tok
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for i in range(0, k_tiles_per_split):  # a contiguous K range per split
        kt = pid_k * k_tiles_per_split + i
        for c in tl.static_range(C):
            chunk = kt * C + c
            w0, w1 = _dequant_chunk(qs_ptr, d_ptr, m_ptr, sub_ptr, qh_ptr, row, qs_stride, side32, side256,
                                    chunk, j, FMT, DT, ASM)
            acc = _dot_block(acc, x_ptr, x_stride, toks, tok_ok, n_cols, w0, 64 * chunk, j_col, EVEN_K)
            acc = _dot_block(acc, x_ptr, x_stride, toks, tok_ok, n_cols, w1, 64 * chunk + 32, j_col, EVEN_K)

    out_ptrs = out_ptr + toks[:, None] * out_stride + rows[None, :]
    out_mask = tok_ok[:, None] & (rows[None, :] < n_rows)
    if SPLIT_K == 1:
        tl.store(out_ptrs, tl.trans(acc).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * (tl.num_programs(1) // SPLIT_K) + pid_n
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        last, total = split_k_total(tl.trans(acc), partial_ptr, count_ptr, tile, pid_k, offs, SPLIT_K, BM * BN)
        if last:
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)


@jit
def _dequant_kernel(out_ptr, qs_ptr, d_ptr, m_ptr, sub_ptr, qh_ptr, n_rows, n_cols, out_stride, n_super,
                    FMT: tl.constexpr, BN: tl.constexpr, CHUNKS: tl.constexpr, F32: tl.constexpr,
                    FRAG: tl.constexpr):
    """Write the dense matrix [n_rows, n_cols] (out's dtype): the prefill path dequantizes once per call
    into a scratch matrix and lets cuBLAS run the GEMM. Same per-chunk dequant as the matmul kernel."""
    DT: tl.constexpr = tl.float32 if F32 else out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row = rows.to(tl.int64)[:, None]
    j = tl.arange(0, 32)[None, :]
    qs_stride = (256 if FMT == Q8_0 or FMT == FP8 else 128) * n_super
    row_ok = row < n_rows
    for c in tl.static_range(CHUNKS):
        chunk = tl.program_id(1) * CHUNKS + c
        w0, w1 = _dequant_chunk(qs_ptr, d_ptr, m_ptr, sub_ptr, qh_ptr, row, qs_stride, 8 * n_super, n_super,
                                chunk, j, FMT, DT, not F32, FRAG)
        k = 64 * chunk + j
        tl.store(out_ptr + row * out_stride + k, w0.to(out_ptr.dtype.element_ty), mask=row_ok & (k < n_cols))
        tl.store(out_ptr + row * out_stride + k + 32, w1.to(out_ptr.dtype.element_ty),
                 mask=row_ok & (k + 32 < n_cols))


FRAGMENT_DEQUANT = os.environ.get("COBATCH_FRAGMENT_DEQUANT", "1") != "0"


def dequantize_planes(p: PackedPlanes, out: torch.Tensor) -> torch.Tensor:
    """out [rows, cols] bf16/f16 <- the planes' values (one launch, no sync): on CUDA the fragment-order planes of
    fragment_dequant.FORMATS through the Gluon kernel that reads them as the GEMV does (fragment_dequant.supports;
    COBATCH_FRAGMENT_DEQUANT=0 turns it off), else this module's Triton kernel."""
    assert out.shape == (p.rows, p.cols) and out.stride(1) == 1
    if out.is_cuda and not interpreting() and FRAGMENT_DEQUANT and fragment_dequant.supports(p):
        return fragment_dequant.dequantize(p, out)
    bn, chunks = 64, 4
    dummy = p.qs
    _dequant_kernel[(p.rows_pad // bn, p.cols_pad // (64 * chunks))](
        out, p.qs, p.d, p.m if p.m is not None else dummy, p.sub if p.sub is not None else dummy,
        p.qh if p.qh is not None else dummy, p.rows, p.cols, out.stride(0), p.cols_pad // 256,
        FMT=p.fmt_id, BN=bn, CHUNKS=chunks, F32=interpreting(), FRAG=p.fragment, num_warps=4)
    return out


@dataclass(frozen=True, slots=True)
class TileConfig:
    BM: int
    BN: int
    BK: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @staticmethod
    def parse(d: dict) -> "TileConfig":
        return TileConfig(**d)


def scratch_need(cfg: TileConfig, n_rows_pad: int, max_tok: int) -> tuple[int, int]:
    """(partial elements, tile counters) of the split-K reduction for calls of up to max_tok tokens."""
    if cfg.split_k == 1:
        return 1, 1
    tiles = (n_rows_pad // cfg.BN) * -(-max_tok // cfg.BM)
    return tiles * cfg.split_k * cfg.BM * cfg.BN, tiles


def launch(p: PackedPlanes, x: torch.Tensor, out: torch.Tensor, cfg: TileConfig) -> None:
    """One kernel launch; no host sync, no allocation when split_k == 1 or the scratch is reserved."""
    n_tok = x.shape[0]
    k_tiles = p.cols_pad // cfg.BK
    assert p.cols_pad % cfg.BK == 0 and p.rows_pad % cfg.BN == 0 and cfg.BK % 64 == 0
    assert k_tiles % cfg.split_k == 0, (k_tiles, cfg)
    grid_m = -(-n_tok // cfg.BM)
    grid = (grid_m, (p.rows_pad // cfg.BN) * cfg.split_k)
    if cfg.split_k > 1:
        SplitScratch.reserve(x.device, *scratch_need(cfg, p.rows_pad, n_tok))   # no-op once reserved at load
        partial, count = SplitScratch.get(x.device)
    else:
        partial, count = out, out                          # unused
    dummy = p.qs
    _quant_matmul_kernel[grid](
        x, out, partial, count,
        p.qs, p.d, p.m if p.m is not None else dummy, p.sub if p.sub is not None else dummy,
        p.qh if p.qh is not None else dummy,
        n_tok, p.rows, p.cols, x.stride(0), out.stride(0), p.cols_pad // 256, k_tiles // cfg.split_k,
        FMT=p.fmt_id, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, SPLIT_K=cfg.split_k, EVEN_K=p.cols == p.cols_pad,
        F32_DOT=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
