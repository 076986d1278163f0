"""Quantized linear layers on the GPU: y = x @ W.T with W kept in its GGUF block format.

One Triton kernel serves every packed format (FMT constexpr) and every batch size; only the tile config
changes with n_tok:
  - narrow (n_tok <= T, decode): each program owns BN weight rows and a slice of K (split-K), loads every
    weight block once, dequantizes it in registers and multiplies it against all n_tok activation rows at
    once. "Swap AB": the weight tile is the MMA's M side (A operand, straight from registers) and the
    tokens, padded to BM=16, are its N side, so a batch of 1 and a batch of 16 cost the same bytes.
    Split-K partials are summed in a fixed order by the last program of each tile (no float atomics),
    so row t's result is bitwise the same whatever n_tok is.
  - mid (T < n_tok <= mid_upto, busy decode steps; Hopper): the Gluon quantized GEMM of quant_gemm.py, which
    reads every weight byte once per call on warpgroup MMAs, from the GEMV's fragment-order planes; or, where the
    plan table names it (for all of mid, or a `first` range of the fewest tokens), the CUDA C++ GEMM of
    quant_gemm_cuda.py on the same planes.
  - gemm (n_tok > T, prefill): either the same kernel with big token tiles (BM 64..128) on tensor cores,
    or DEQUANT_CUBLAS: dequantize into a shared bf16/f16 scratch matrix (one pass, `_dequant_kernel`)
    and let cuBLAS multiply. On the H200 the second won for every format (0.74-0.88 of cuBLAS bf16 at
    2048 tokens against 0.42-0.45 for the Triton tl.dot GEMM, whose register-A wgmma Triton waits on
    after every MMA). The scratch is sized at load to the largest such matrix (1 GB for a 128k vocab).
The crossover T and the tile configs come from quant_configs.json (measured on the H200 by
bench/kernels.py --sweep); nothing is autotuned at run time.

Formats without a packed layout (q2_K, q3_K, f16/bf16/f32 matrices) are dequantized once at load
to a dense matrix and go through F.linear: correct, but they read 2 bytes per weight.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from cobatch.kernels import fragment_dequant, quant_gemm, quant_gemm_cuda, quant_gemv, quant_pack
from cobatch.kernels.activation import gated_mul_triton
from cobatch.kernels.quant_gemm import GemmConfig
from cobatch.kernels.quant_gemm_cuda import CudaGemmConfig
from cobatch.kernels.quant_gemv import GemvConfig, GemvPlan
from cobatch.kernels.quant_pack import PACKED_FORMATS, PackedPlanes, pack_planes
from cobatch.kernels.scratch import DeviceScratch
from cobatch.kernels.triton_support import interpreting, jit, tl, triton
from cobatch.quant.weight import QuantWeight

CONFIG_PATH = Path(__file__).with_name("quant_configs.json")


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
        # Deterministic split-K: every split writes its partial tile; the last to arrive sums them in
        # split order. The counter is re-armed by that program, so CUDA-graph replays start from 0.
        tile = pid_m * (tl.num_programs(1) // SPLIT_K) + pid_n
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(partial_ptr + (tile * SPLIT_K + pid_k) * (BM * BN) + offs, tl.trans(acc))
        tl.debug_barrier()                  # all threads' partial stores precede the release below
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(partial_ptr + (tile * SPLIT_K + s) * (BM * BN) + offs, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


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
# PackedWeight.operand_dtype: f16 where the GEMV and the GEMM read it natively (COBATCH_F16_OPERANDS=0: the model's
# dtype throughout)
F16_OPERANDS = os.environ.get("COBATCH_F16_OPERANDS", "1") != "0"

# Q5_0 (what llama.cpp writes where a width is not whole 256-blocks: DeepSeek-V2-Lite's down experts and dense down,
# 133 of the 170 quantized tensors of Qwen2.5-Coder-0.5B's Q4_K_M) has fragment planes of its own, the GEMV and the
# GEMM reading its fifth bits beside the nibbles. COBATCH_Q5_0_AS_Q8_0=1 converts such weights to Q8_0 at load
# instead (the same values in 55 % more bytes), dense and routed, as every Q5_0 weight was before: for comparisons.
AS_Q8_0 = ("q5_0",) if os.environ.get("COBATCH_Q5_0_AS_Q8_0") == "1" else ()


def as_q8_0_on(w: QuantWeight, device: torch.device) -> QuantWeight:
    """w, or on CUDA w as Q8_0 (converted on the device) where its format is one of AS_Q8_0."""
    if w.fmt.name not in AS_Q8_0 or torch.device(device).type != "cuda":
        return w
    return QuantWeight(w.fmt, w.rows, w.cols, w.raw.to(device)).as_q8_0()


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


# --- configs ------------------------------------------------------------------------------------------

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


# Used when quant_configs.json has no entry for a format/shape.
DEFAULT_NARROW = TileConfig(BM=16, BN=64, BK=256, split_k=1, num_warps=4, num_stages=3)
DEFAULT_GEMM = TileConfig(BM=128, BN=128, BK=64, split_k=1, num_warps=8, num_stages=3)
DEFAULT_CROSSOVER = 16
INTERPRETER_NARROW = TileConfig(BM=16, BN=32, BK=64, split_k=2)   # small tiles keep the CPU tests fast
INTERPRETER_GEMM = TileConfig(BM=32, BN=32, BK=64)


RESIDENT_DENSE_CROSSOVER = 16   # with a resident dense copy (keep_dense), see from_quant
GEMV_CROSSOVER = 16             # the Gluon GEMV's token tiles are 8 and 16 wide
# measured: the quantized GEMM beats dequantize + cuBLAS up to here (bench/results/gemm.md)
QUANT_GEMM_UPTO = 128

# plan.gemm may be this instead of a TileConfig: dequantize into a shared scratch matrix, then cuBLAS.
DEQUANT_CUBLAS = "dequant+cublas"


@dataclass(frozen=True, slots=True)
class MatmulPlan:
    """The tile configs of one weight: chosen at load, fixed for the process."""
    narrow: TileConfig | GemvPlan   # GemvPlan: the Gluon kernel on fragment-order planes
    gemm: TileConfig | str   # a TileConfig, or DEQUANT_CUBLAS
    crossover: int           # n_tok <= crossover -> narrow
    # crossover < n_tok <= mid_upto -> the quantized GEMM (quant_gemm.py, or quant_gemm_cuda.py's CudaGemmConfig)
    mid: GemmConfig | CudaGemmConfig | None = None
    mid_upto: int = 0
    # wide_from < n_tok <= mid_upto -> the GEMM in config `wide` (the TMA variant: it wins at 128-256 tokens
    # and loses below). Same split of K as `mid`, so a row's bits do not change where the plan switches.
    wide: GemmConfig | CudaGemmConfig | None = None
    wide_from: int = 0
    # crossover < n_tok <= first_upto -> the GEMM in config `first`, ahead of mid: a kernel that wins on the fewest
    # tokens only (the CUDA C++ GEMM on small matrices at 16-32 tokens). Batch invariance holds within each range.
    first: GemmConfig | CudaGemmConfig | None = None
    first_upto: int = 0

    def __post_init__(self):
        if self.wide is not None and (self.mid is None or self.wide.split_k != self.mid.split_k):
            raise ValueError(f"the wide GEMM config needs the mid config's split of K: {self.mid} / {self.wide}")

    def config_for(self, n_tok: int) -> "TileConfig | GemvPlan | GemmConfig | str":
        if n_tok <= self.crossover:
            return self.narrow
        if self.first is not None and n_tok <= self.first_upto:
            return self.first
        if self.mid is not None and n_tok <= self.mid_upto:
            return self.wide if self.wide is not None and n_tok > self.wide_from else self.mid
        return self.gemm

    def gemm_ranges(self) -> list[tuple[GemmConfig | CudaGemmConfig, int]]:
        """Each GEMM config of the plan, with the most tokens a call it serves has."""
        return [(c, upto) for c, upto in ((self.first, self.first_upto), (self.mid, self.mid_upto),
                                          (self.wide, self.mid_upto)) if c is not None]

    def gemm_configs(self) -> list[GemmConfig | CudaGemmConfig]:
        return [c for c, _ in self.gemm_ranges()]


@lru_cache(maxsize=None)
def _config_table(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


def default_split_k(n_rows: int, n_cols_pad: int, cfg: TileConfig, sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice: small matrices split K, big ones don't."""
    tiles = -(-n_rows // cfg.BN)
    k_tiles = n_cols_pad // cfg.BK
    split = 1
    while tiles * split < 2 * sms and split * 2 <= 8 and k_tiles % (split * 2) == 0:
        split *= 2
    return split


def uses_gemv(fmt_name: str, device: torch.device) -> bool:
    """Does this weight go through the Gluon GEMV (fragment-order planes)? CUDA only: Gluon has no
    interpreter. COBATCH_TRITON_GEMV=1 keeps the Triton kernel (for comparisons)."""
    return (torch.device(device).type == "cuda" and not interpreting() and quant_gemv.gluon is not None
            and PACKED_FORMATS.get(fmt_name) in quant_pack.FRAGMENT_FORMATS
            and os.environ.get("COBATCH_TRITON_GEMV") != "1")


def default_gemv_config(fmt_name: str, n_rows_pad: int, n_chunks: int, sms: int = 132) -> GemvConfig:
    """4 warps x 4 row tiles per CTA (64 rows); split K across CTAs until there are about 2 CTAs per SM
    (what the H200 sweep preferred for shapes without an entry in quant_configs.json), by the fewest of the warps'
    chunks' divisors up to 16 that get there (11 splits for 44 chunks a warp group, where doubling from 1 stopped
    at 1: DeepSeek-V2-Lite's shared down, 32 CTAs); each warp's loads up to 4 K steps ahead (loads_ahead). The
    4-bit formats (the 5-bit ones with them) get a register budget: it won 14 of their 16 plan tiers on the Llama-3-8B
    shapes, q8_0 and q6_K about half (bench/results/gemv-ab-2026-11-29-xvec-regs.json)."""
    w, rt = 4, 4
    ctas = n_rows_pad // (16 * rt)
    splits = [d for d in range(1, 17) if (n_chunks // w) % d == 0]
    split = next((d for d in splits if ctas * d >= 2 * sms), splits[-1])
    return GemvConfig(W=w, RT=rt, split_k=split, U=loads_ahead(n_chunks // (w * split)), D=0,
                      R=128 if fmt_name in ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k") else 0)


def loads_ahead(steps: int) -> int:
    """The GEMV's U for a warp of `steps` K steps: 4, 2 or 1, whichever divides them first. A warp whose steps
    run one at a time waits a load round trip each (DeepSeek-V2-Lite's routed down at one token: 12 steps, 21 us
    for 18 MB)."""
    return next(u for u in (4, 2, 1) if steps % u == 0)


def uses_quant_gemm(device: torch.device) -> bool:
    """Does a GEMV weight on this device also get the quantized GEMM for mid-size batches? Hopper (wgmma)
    only; COBATCH_QUANT_GEMM=0 keeps dequantize + cuBLAS there (for comparisons)."""
    device = torch.device(device)
    return (device.type == "cuda" and quant_gemm.warpgroup_mma is not None
            and torch.cuda.get_device_capability(device)[0] == 9 and os.environ.get("COBATCH_QUANT_GEMM") != "0")


def gemv_chunks(fmt_name: str, n_cols_pad: int) -> int:
    return n_cols_pad // (32 if PACKED_FORMATS.get(fmt_name) in quant_pack.BYTE_FORMATS else 64)


# A checkpoint format takes, shape by shape, the configs of the GGUF format whose kernel loops it shares, under the
# ones of its own (a sweep of its GEMV alone keeps the other's GEMM configs): FP8's planes are q8_0's (only the
# byte decode differs), NVFP4's hold q4_K's bytes a weight.
PLANS_LIKE = {"fp8_e4m3": "q8_0", "nvfp4": "q4_k"}
# The 5-bit formats take the plans of the 4-bit format whose planes theirs extend (the kernels' loops are the same
# but for the fifth bits); COBATCH_Q5_PLANS_LIKE_Q4=0 leaves them the defaults (for comparisons).
if os.environ.get("COBATCH_Q5_PLANS_LIKE_Q4", "1") != "0":
    PLANS_LIKE.update({"q5_0": "q4_0", "q5_1": "q4_1", "q5_k": "q4_k"})


def nearest_shape(n_rows: int, n_cols: int, shapes: list[str]) -> str | None:
    """Of the "NxK" keys in `shapes`: "n_rows x n_cols" itself, else the one of K = n_cols whose N is nearest to
    n_rows by ratio (the larger on a tie), else None. Every config's rows per CTA divides the planes' row padding,
    so any entry's configs run any row count."""
    exact = f"{n_rows}x{n_cols}"
    if exact in shapes:
        return exact
    same_k = [int(key.split("x")[0]) for key in shapes if key.split("x")[1] == str(n_cols)]
    if not same_k:
        return None
    rows = min(same_k, key=lambda r: (abs(math.log(r / n_rows)), -r))
    return f"{rows}x{n_cols}"


def gemm_config(entry: dict) -> GemmConfig | CudaGemmConfig:
    """A plan entry's GEMM config: the CUDA C++ kernel's where the entry names it (quant_gemm_cuda.PLAN_KERNEL), else
    the Gluon kernel's."""
    if entry.get("kernel") == quant_gemm_cuda.PLAN_KERNEL:
        return quant_gemm_cuda.from_plan_entry(entry)
    return GemmConfig(**entry)


def plan_for(fmt_name: str, n_rows: int, n_cols: int, n_cols_pad: int, gemv: bool = False,
             quant_gemm_too: bool = False) -> MatmulPlan:
    """Look up (format, "NxK") in quant_configs.json (for FP8 and NVFP4 over PLANS_LIKE's format's entry), else
    the entry of the same K whose row count is nearest (nearest_shape: a stacked q|k, say, runs the plans of the
    q|k|v it is a part of), else the format's default, else the built-in default.
    gemv: the weight runs the Gluon GEMV (its configs are the entry's "gemv" and "gemv_upto", else
    default_gemv_config). quant_gemm_too (with gemv): mid-size batches run the quantized GEMM (the entry's
    "quant_gemm" config and "quant_gemm_upto", else quant_gemm.default_config and QUANT_GEMM_UPTO), from
    the GEMV's last token tile ("quant_gemm_crossover", else GEMV_CROSSOVER) on, and past "quant_gemm_wide_from"
    the entry's "quant_gemm_wide" config when it has one; up to "quant_gemm_first_upto" tokens, the entry's
    "quant_gemm_first" config when it has one."""
    if interpreting():
        return MatmulPlan(INTERPRETER_NARROW, INTERPRETER_GEMM, 4)
    table = _config_table(os.environ.get("COBATCH_QUANT_CONFIGS", str(CONFIG_PATH)))
    formats = table.get("formats", {})
    fmt_table = formats.get(fmt_name, {})
    like_shapes = formats.get(PLANS_LIKE.get(fmt_name), {}).get("shapes", {})
    shape = nearest_shape(n_rows, n_cols, [*fmt_table.get("shapes", {}), *like_shapes])
    own = fmt_table.get("shapes", {}).get(shape, {})
    like = like_shapes.get(shape, {})
    if "gemv" in own:    # a GEMV plan of its own replaces the borrowed one whole: its tiers share its K split
        like = {k: v for k, v in like.items() if k != "gemv_upto"}
    if PACKED_FORMATS.get(fmt_name) not in quant_gemm_cuda.FORMATS:   # borrowed CUDA C++ GEMM configs: not its planes
        like = {k: v for k, v in like.items()
                if not (isinstance(v, dict) and v.get("kernel") == quant_gemm_cuda.PLAN_KERNEL)}
    entry = {**table.get("default", {}), **fmt_table.get("default", {}), **like, **own}
    narrow = TileConfig.parse(entry["narrow"]) if "narrow" in entry else DEFAULT_NARROW
    if "narrow" not in entry or entry["narrow"].get("split_k") is None:
        narrow = TileConfig(narrow.BM, narrow.BN, narrow.BK, default_split_k(n_rows, n_cols_pad, narrow),
                            narrow.num_warps, narrow.num_stages)
    gemm = entry.get("gemm", DEFAULT_GEMM)
    gemm = gemm if isinstance(gemm, (TileConfig, str)) else TileConfig.parse(gemm)
    crossover = int(entry.get("crossover", DEFAULT_CROSSOVER))
    if gemv:   # fragment-order planes: the Triton GEMM tiers cannot read them
        gemm = DEQUANT_CUBLAS
        rows_pad = -(-n_rows // quant_pack.ROW_PAD) * quant_pack.ROW_PAD
        default = (GemvConfig(**entry["gemv"]) if "gemv" in entry
                   else default_gemv_config(fmt_name, rows_pad, gemv_chunks(fmt_name, n_cols_pad)))
        # "gemv_upto": {"max_tok": config}, the sweep's better configs for calls of few tokens
        upto = sorted((int(n), GemvConfig(**c)) for n, c in entry.get("gemv_upto", {}).items())
        narrow = GemvPlan(default, tuple(upto))
        crossover = int(entry.get("gemv_crossover", GEMV_CROSSOVER))
        if quant_gemm_too:
            rows_pad = -(-n_rows // quant_pack.ROW_PAD) * quant_pack.ROW_PAD
            mid = (gemm_config(entry["quant_gemm"]) if "quant_gemm" in entry
                   else quant_gemm.default_config(rows_pad, gemv_chunks(fmt_name, n_cols_pad)))
            wide = gemm_config(entry["quant_gemm_wide"]) if "quant_gemm_wide" in entry else None
            first = gemm_config(entry["quant_gemm_first"]) if "quant_gemm_first" in entry else None
            return MatmulPlan(narrow, gemm, int(entry.get("quant_gemm_crossover", GEMV_CROSSOVER)), mid,
                              int(entry.get("quant_gemm_upto", QUANT_GEMM_UPTO)), wide,
                              int(entry.get("quant_gemm_wide_from", 0)), first,
                              int(entry.get("quant_gemm_first_upto", 0)))
    return MatmulPlan(narrow, gemm, crossover)


# --- split-K scratch ----------------------------------------------------------------------------------

class _SplitScratch:
    """One partial-sum buffer and one counter array per device, shared by all weights.

    Kernels on one stream run one after another, so they can share it; every counter is back at 0 when a
    kernel ends. Grown at load time (from_quant), never inside a CUDA-graph capture."""
    partial = DeviceScratch(torch.float32)
    count = DeviceScratch(torch.int32, zeroed=True)

    @classmethod
    def reserve(cls, device: torch.device, partial_elems: int, tiles: int) -> None:
        cls.partial.reserve(device, partial_elems)
        cls.count.reserve(device, tiles)

    @classmethod
    def get(cls, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return cls.partial.get(device), cls.count.get(device)


# The DEQUANT_CUBLAS path's dense matrix, as bytes: grown at load to the largest matrix.
_DENSE_SCRATCH = DeviceScratch(torch.uint8)


def _dense_scratch(device: torch.device, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] matrix of dtype (2 bytes) in the dense scratch."""
    return _DENSE_SCRATCH.get(device, rows * cols * 2).view(dtype).view(rows, cols)


def _scratch_need(cfg: TileConfig | GemvConfig | GemvPlan | GemmConfig, n_rows_pad: int,
                  max_tok: int) -> tuple[int, int]:
    if isinstance(cfg, (GemvConfig, GemvPlan)):
        return quant_gemv.scratch_need(cfg, n_rows_pad, max_tok)
    if isinstance(cfg, GemmConfig):
        return quant_gemm.scratch_need(cfg, n_rows_pad, max_tok)
    if isinstance(cfg, CudaGemmConfig):
        return quant_gemm_cuda.scratch_need(cfg, n_rows_pad, max_tok)
    if cfg.split_k == 1:
        return 1, 1
    tiles = (n_rows_pad // cfg.BN) * -(-max_tok // cfg.BM)
    return tiles * cfg.split_k * cfg.BM * cfg.BN, tiles


# --- the weight -------------------------------------------------------------------------------------

def reserve_scratch(device: torch.device, plan: MatmulPlan, rows_pad: int, rows: int, cols: int,
                    dense: bool = True) -> None:
    """Grow the shared split-K buffers, and with `dense` the dequantize-to-cuBLAS matrix, to what a weight of
    this plan and shape needs (at load: never inside a CUDA-graph capture)."""
    _SplitScratch.reserve(device, *_scratch_need(plan.narrow, rows_pad, plan.crossover))
    for cfg, upto in plan.gemm_ranges():
        _SplitScratch.reserve(device, *_scratch_need(cfg, rows_pad, upto))
        if isinstance(cfg, CudaGemmConfig):
            quant_gemm_cuda.reserve_scratch(device, upto, cols)
        elif cfg.streams_x():
            quant_gemm.reserve_x_scratch(device, quant_gemm.x_scratch_rows(upto) * cols)
    if dense and plan.gemm == DEQUANT_CUBLAS:
        _DENSE_SCRATCH.reserve(device, rows * cols * 2)


def load_plan(fmt_name: str, rows: int, cols: int, planes: PackedPlanes, device: torch.device,
              keep_dense: bool = False) -> MatmulPlan:
    """The plan a weight packed into `planes` gets at load, from the table in force (plan_for). A resident dense
    copy (keep_dense: --dense-large-batch) serves every batch past the GEMV itself."""
    plan = plan_for(fmt_name, rows, cols, planes.cols_pad, gemv=planes.fragment,
                    quant_gemm_too=planes.fragment and not keep_dense and uses_quant_gemm(device)
                    and PACKED_FORMATS[fmt_name] in quant_gemm.FORMATS)
    if isinstance(plan.first, CudaGemmConfig) and not quant_gemm_cuda.nvrtc.available():
        plan = replace(plan, first=None, first_upto=0)      # without NVRTC the mid config takes those calls too
    for cfg, upto in plan.gemm_ranges():
        if isinstance(cfg, CudaGemmConfig) and not quant_gemm_cuda.supports(planes, cfg, upto):
            raise ValueError(f"the plan table gives the {fmt_name} {rows}x{cols} weight a CUDA C++ GEMM config it "
                             f"cannot run: {cfg}")
    return plan


class PackedWeight:
    """What the GPU model holds for one linear layer: repacked once at load, then `matmul` per step."""

    def __init__(self, fmt_name: str, rows: int, cols: int, planes: PackedPlanes | None = None,
                 dense: torch.Tensor | None = None, plan: MatmulPlan | None = None, gate_up_interleaved: bool = False):
        self.fmt_name, self.rows, self.cols = fmt_name, rows, cols
        self.planes, self.dense, self.plan = planes, dense, plan
        # rows are a gate|up pair interleaved 8 by 8 (kernels/activation.py): matmul(x, act=...) applies act*mul
        self.gate_up_interleaved = gate_up_interleaved
        self.resident_dense: torch.Tensor | None = None   # see from_quant(keep_dense=True)
        self.nbytes = planes.nbytes if planes is not None else dense.numel() * dense.element_size()

    @classmethod
    def from_quant(cls, w: QuantWeight, device, dtype: torch.dtype = torch.bfloat16,
                   plan: MatmulPlan | None = None, keep_dense: bool = False,
                   gate_up_interleaved: bool = False) -> "PackedWeight":
        """keep_dense: also keep a dequantized copy for n_tok above the crossover (big decode batches,
        prefill), trading memory (2 bytes/weight) for skipping the per-call dequantize pass there.
        gate_up_interleaved: w is a gate|up pair with its rows interleaved (QuantWeight.interleave_rows)."""
        device = torch.device(device)
        if plan is None:
            w = as_q8_0_on(w, device)
        # a row scale (FP8 and NVFP4 checkpoints) travels in their planes only
        assert w.row_scale is None or PACKED_FORMATS.get(w.fmt.name) in (None, *quant_pack.ROW_SCALED), w.fmt.name
        if not quant_pack.weight_packable(w.fmt.name, w.row_scale):   # documented fallback: dense matrix + cuBLAS
            return cls(w.fmt.name, w.rows, w.cols, dense=w.dequantize(torch.float32).to(device, dtype))
        # An explicit Triton TileConfig plan keeps row-major planes (tests, benchmarks of that kernel).
        gemv = uses_gemv(w.fmt.name, device) and (plan is None or isinstance(plan.narrow, (GemvConfig, GemvPlan)))
        planes = pack_planes(w.fmt, w.rows, w.cols, w.raw, device, fragment=gemv,
                             row_scale=w.row_scale if PACKED_FORMATS[w.fmt.name] in quant_pack.ROW_SCALED else None)
        plan = plan or load_plan(w.fmt.name, w.rows, w.cols, planes, device, keep_dense)
        if keep_dense and plan.gemm == DEQUANT_CUBLAS:
            # Past 16 tokens the narrow kernel's time grows per 16-token tile, while cuBLAS on the resident
            # bf16 copy costs about the same from 16 to 64 tokens (H200: B=32 11.3 ms/step narrow vs
            # B=64 8.7 ms dense, bench/results/decode-2026-11-29-dense.md): hand over at 16.
            plan = MatmulPlan(plan.narrow, plan.gemm, min(plan.crossover, RESIDENT_DENSE_CROSSOVER))
        self = cls(w.fmt.name, w.rows, w.cols, planes=planes, plan=plan, gate_up_interleaved=gate_up_interleaved)
        if device.type == "cuda" or interpreting():
            resident = keep_dense and plan.gemm == DEQUANT_CUBLAS
            if resident:
                self.resident_dense = dequantize_planes(planes, torch.empty(w.rows, w.cols, dtype=dtype,
                                                                            device=device))
            reserve_scratch(device, plan, planes.rows_pad, w.rows, w.cols, dense=not resident)
        return self

    def operand_dtype(self, n_tok: int, dtype: torch.dtype) -> torch.dtype:
        """The dtype in which this weight's kernels read an x of n_tok rows: f16 where they are the GEMV or the
        mid-batch GEMM, which read f16 x as it is and convert bf16 x as they load it (on the H200 that costs a
        q8_0 down GEMV 4-9 % and q4_K's o, gate_up and down 5-8 % at 1-8 tokens, bench/results/kernels.json's
        us_bf16_input); else `dtype`. A kernel writing this weight's input in it spares them the conversion."""
        if not F16_OPERANDS or dtype != torch.bfloat16 or self.dense is not None:
            return dtype
        config = self.plan.config_for(n_tok)
        return torch.float16 if isinstance(config, (GemvConfig, GemvPlan, GemmConfig, CudaGemmConfig)) else dtype

    def matmul(self, x: torch.Tensor, config: TileConfig | str | None = None, out: torch.Tensor | None = None,
               act: str | None = None) -> torch.Tensor:
        """x [n_tok, cols] bf16/f16 -> [n_tok, rows] in x's dtype. `config` overrides the plan (benchmarks).
        act ("silu", "gelu_tanh"; gate_up_interleaved weights only): act(gate) * up, [n_tok, rows / 2], applied
        in the GEMV's epilogue, or by gated_mul after the other kernels."""
        assert act is None or self.gate_up_interleaved, "act needs a gate|up weight packed interleaved"
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols)
        n_tok = x2.shape[0]
        out_cols = self.rows // 2 if act else self.rows
        if config is None and self.dense is None:
            config = self.plan.config_for(n_tok)
        if act and not isinstance(config, (GemvConfig, GemvPlan, GemmConfig, CudaGemmConfig)):
            y = self.matmul(x2, config)
            return gated_mul_triton(y, act, out=out, interleaved=True).reshape(*lead, out_cols)
        if self.dense is not None:
            y = F.linear(x2, self.dense if self.dense.dtype == x.dtype else self.dense.to(x.dtype))
            return (y if out is None else out.copy_(y)).reshape(*lead, self.rows)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(n_tok, out_cols, dtype=x.dtype, device=x.device) if out is None else out
        if n_tok == 0:
            return out.reshape(*lead, out_cols)
        if config == DEQUANT_CUBLAS and x2.dtype != out.dtype:
            x2 = x2.to(out.dtype)        # cuBLAS multiplies in one dtype (an x in another op's operand_dtype)
        if config == DEQUANT_CUBLAS and self.resident_dense is not None and self.resident_dense.dtype == x.dtype:
            torch.mm(x2, self.resident_dense.t(), out=out.view(n_tok, self.rows))
        elif config == DEQUANT_CUBLAS:
            w = dequantize_planes(self.planes, _dense_scratch(x.device, self.rows, self.cols, x.dtype))
            torch.mm(x2, w.t(), out=out.view(n_tok, self.rows))
        elif isinstance(config, (GemvConfig, GemvPlan)):
            xg = x2 if x2.dtype in (torch.float16, torch.bfloat16) else x2.to(torch.float16)   # f32 x
            partial, count = out, out
            if config.split_k > 1:
                _SplitScratch.reserve(x.device, *_scratch_need(config, self.planes.rows_pad, n_tok))
                partial, count = _SplitScratch.get(x.device)
            quant_gemv.launch(self.planes, xg, out.view(n_tok, out_cols), config, partial, count, act=act)
        elif isinstance(config, (GemmConfig, CudaGemmConfig)):
            xg = x2 if x2.dtype in (torch.float16, torch.bfloat16) else x2.to(torch.float16)
            partial, count = out, out
            if config.split_k > 1:
                _SplitScratch.reserve(x.device, *_scratch_need(config, self.planes.rows_pad, n_tok))
                partial, count = _SplitScratch.get(x.device)
            gemm = quant_gemm if isinstance(config, GemmConfig) else quant_gemm_cuda
            gemm.launch(self.planes, xg, out.view(n_tok, out_cols), config, partial, count, act=act)
        else:
            launch(self.planes, x2, out, config)
        return out.reshape(*lead, out_cols)

    def __repr__(self) -> str:
        kind = "dense" if self.dense is not None else "packed"
        return f"PackedWeight({self.fmt_name}, {self.rows}x{self.cols}, {kind}, {self.nbytes} B)"


def launch(p: PackedPlanes, x: torch.Tensor, out: torch.Tensor, cfg: TileConfig) -> None:
    """One kernel launch; no host sync, no allocation when split_k == 1 or the scratch is reserved."""
    n_tok = x.shape[0]
    k_tiles = p.cols_pad // cfg.BK
    assert p.cols_pad % cfg.BK == 0 and p.rows_pad % cfg.BN == 0 and cfg.BK % 64 == 0
    assert k_tiles % cfg.split_k == 0, (k_tiles, cfg)
    grid_m = -(-n_tok // cfg.BM)
    grid = (grid_m, (p.rows_pad // cfg.BN) * cfg.split_k)
    if cfg.split_k > 1:
        elems, tiles = _scratch_need(cfg, p.rows_pad, n_tok)
        _SplitScratch.reserve(x.device, elems, tiles)   # no-op once reserved at load
        partial, count = _SplitScratch.get(x.device)
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
