"""Narrow quantized GEMV (decode; 8- or 16-token tiles) in Gluon, Triton's explicit-layout dialect.

Why not plain Triton: there the compiler picks register layouts, so a weight tile travels
global -> shared memory -> registers in the MMA operand layout (cp.async, LDS, byte shuffles), and the
inner loop spent 6-8 instructions per weight (docs/kernels.md): half the copy bandwidth at best.
Gluon lets the kernel say where every byte lives:

  - The weights are repacked once at load in "fragment order" (`quant_pack.fragment_order`): for each
    16-row x 32-byte tile, lane L of a warp finds the 16 bytes it needs for its mma.sync A fragments at
    offset 16 L. One 16-byte load per lane per tile, straight into registers; the reshape/permute below
    only renames registers, which `convert_layout(..., assert_trivial=True)` checks at compile time.
    Scales and mins are stored per tile too, with the two rows a lane owns side by side (one vector load per
    lane, one contiguous piece per warp), and so are q6_K's high bits, 8 bytes per lane and tile.
  - Formats: q8_0, q4_0, q4_1, q4_K, q6_K, and the 5-bit q5_0, q5_1, q5_K (q4_0's and q4_1's planes with a fifth
    bit a weight, 4 bytes a lane and tile). q4_K is repacked as q4_1 (a precomputed f16 scale and offset
    per 32-block), q5_K as q5_1. q6_K's scales change every 16 weights, so its chunks run as two k16 halves (one
    mma each per block) with per-half scales.
  - Dequantization is a few packed-f16 instructions per 4 bytes (inline PTX): nibbles or bytes are
    OR-ed under the f16 magic exponent 1024 (ulp 1), a packed subtract removes the magic exactly, a
    packed multiply (or fma with the min) applies the scale. The bytes of a 32-bit word are ordered so
    that `w & 0x000F000F` is already the (k, k+1) pair of one row: no byte shuffles.
  - Tokens are the MMA's N side (8 per tile; 16 above 8 tokens): a batch of 1 and of 8 read the same bytes.
    Inside each 32-column tile the planes' columns are reordered (`quant_pack.k_order`) so that the
    activations a lane needs are contiguous: one 16-byte load per lane and token (`_load_x`).
  - The warps of a CTA own the same rows and split K (a batched 3-D mma: the batch axis is the warp);
    their partial sums meet once, in a fixed order, through shared memory (gl.sum over the warp axis).
    A CTA-level split-K on top reduces through a scratch buffer in split order, as in quant_matmul.py,
    so row t's result never depends on n_tok or on timing.

  - A fused gate|up weight, packed with its rows interleaved 8 by 8 (activation.GATE_UP_GROUP), can have
    act(gate) * up applied in the epilogue (ACT): the accumulator gives a lane rows g and g + 8 of each
    16-row tile, a gate row and its up row, so the pairing moves no data, and the act*mul launch and
    the round trip of the 2 x wider output through memory go away.
  - A call of one 8-token tile is a programmatic dependent (GEMV_PDL): its CTAs start while the kernel before
    finishes and ask their SM's L1 for the first loop iteration's weight bytes, then wait for that kernel.
  - A warp walks its K steps U at a time, their loads issued before their math; a step count U does not divide
    ends in a tail of steps % U (TAIL), in the same K order, so the bits do not depend on U.

MMA operands are f16 (bf16 has too few mantissa bits for the exact byte-to-float trick of q8_0): bf16 x
is converted as it is loaded. The torch reference is `quant_matmul.quant_matmul_ref`; the repack is
checked on the CPU by `quant_pack.unpack_planes`. Gluon has no interpreter: these kernels run on CUDA only
(tests/test_quant_gemv.py), and the CPU CI exercises the same formats through quant_matmul.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cobatch.kernels import fp8_cache, quant_pack
from cobatch.kernels.operand_order import NATURAL, ordered_columns
from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, pdl_launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - triton without gluon: the Triton kernel serves every format
    gluon = gl = mma_v2 = None

def _c(v):
    return gl.constexpr(v) if gl is not None else v


def _byte_fmt_of(fmt) -> bool:
    return int(fmt) in quant_pack.BYTE_FORMATS


def _fifth_bit_of(fmt) -> bool:
    return int(fmt) in quant_pack.FIFTH_BIT_FORMATS


def _affine_of(fmt) -> bool:
    return int(fmt) in quant_pack.AFFINE_FORMATS


def _constexpr_function(f):
    return gluon.constexpr_function(f) if gluon is not None else f


# Inside the kernels: q8_0 and FP8 share their planes (one byte a weight, an f16 scale per 32 weights); q5_0's and
# q5_1's (q5_K's) planes are q4_0's and q4_1's with a fifth bit a weight; q4_1's and q5_1's hold a scale and an offset
_byte_fmt = _constexpr_function(_byte_fmt_of)
_fifth_bit = _constexpr_function(_fifth_bit_of)
_affine = _constexpr_function(_affine_of)


def _moved_of(u, warps, fold) -> int:
    """How many chunks step u of a loop iteration moves the planes' pointers (_k_step's STEP): u x W under FOLD
    (GEMV_FOLD_STEPS), its offsets then those of the iteration's first step; else none."""
    return int(u) * int(warps) if fold else 0


_moved = _constexpr_function(_moved_of)


# The planes' layouts (PackedPlanes.fmt_id); q4_K's fragment planes are q4_1's (quant_pack._q4k_as_affine), and
# FP8's are q8_0's with e4m3 bytes (_byte_fmt: the one difference is the decode, _dequant_operand).
F_Q8_0, F_Q4_0, F_Q4_1, F_Q5_0, F_Q5_1, F_Q6_K, F_FP8, F_NVFP4 = (
    _c(v) for v in (quant_pack.Q8_0, quant_pack.Q4_0, quant_pack.Q4_1, quant_pack.Q5_0, quant_pack.Q5_1,
                    quant_pack.Q6_K, quant_pack.FP8_E4M3, quant_pack.NVFP4))
# The epilogue: store the rows as they are, or act(gate) * up of gate|up rows interleaved 8 by 8.
ACTS = {None: 0, "silu": 1, "gelu_tanh": 2}
ACT_NONE, ACT_SILU, ACT_GELU_TANH = (_c(v) for v in ACTS.values())
# How the loop loads x (the X_LOADS constexpr, x_loads()): K ragged (x's columns and the tokens past the call masked),
# K whole (the tokens masked), or K whole with the tokens clamped to the call's last (GEMV_CLAMP_X).
X_LOAD_MODES = {"ragged_k": 0, "masked_tokens": 1, "clamped_tokens": 2}
X_RAGGED_K, X_MASKED_TOKENS, X_CLAMPED_TOKENS = (_c(v) for v in X_LOAD_MODES.values())


def act_code(act: str | None, order: int = NATURAL) -> int:
    """The kernels' ACT constexpr: the activation's code (ACTS), plus 4 x the column order (operand_order) in which
    act(gate) * up is stored, for a next GEMM that streams it so. One constexpr carries both, so every function
    between a kernel and its epilogue passes the order on as it passes ACT."""
    assert order == NATURAL or act is not None, "only act's output is stored in another column order"
    return ACTS[act] + 4 * order

# --- dequantization, 4 bytes at a time (pack=4) -------------------------------------------------------
# Input word bytes (quant_pack.fragment_order): b0 = (row g, k), b1 = (g+8, k), b2 = (g, k+1),
# b3 = (g+8, k+1). Outputs per tensor: two f16x2 registers, (g, k..k+1) then (g+8, k..k+1).

# 4-bit: low nibbles are one 32-block ("lo"), high nibbles the next ("hi"). The high nibble is used in
# place (value 1024 + 16 q), so its scale comes in divided by 16 (exact).
# $0,$1 lo out; $2,$3 hi out; $4 word; $5,$6 lo scale; $7,$8 hi scale/16; [$9,$10 lo min; $11,$12 hi min]
_NIB_EXTRACT = """
 .reg .b32 v, a0, a1, b0, b1, z0, z1;
 shr.b32 v, $4, 8;
 lop3.b32 a0, $4, 0x000F000F, 0x64006400, 0xEA;
 lop3.b32 a1, v, 0x000F000F, 0x64006400, 0xEA;
 lop3.b32 b0, $4, 0x00F000F0, 0x64006400, 0xEA;
 lop3.b32 b1, v, 0x00F000F0, 0x64006400, 0xEA;
"""


def _minus_offset_times_scale(lo_offset: str, hi_offset: str, scale: int) -> str:
    """Tail of a zero-point dequant: subtract the (magic + offset) f16x2 constants exactly, multiply by the
    scale registers $scale .. $scale+3 (low block g, g + 8; high block g, g + 8) into $0 .. $3."""
    return f"""
 mov.b32 z0, {lo_offset};
 mov.b32 z1, {hi_offset};
 sub.rn.f16x2 a0, a0, z0;
 sub.rn.f16x2 a1, a1, z0;
 sub.rn.f16x2 b0, b0, z1;
 sub.rn.f16x2 b1, b1, z1;
 mul.rn.f16x2 $0, a0, ${scale};
 mul.rn.f16x2 $1, a1, ${scale + 1};
 mul.rn.f16x2 $2, b0, ${scale + 2};
 mul.rn.f16x2 $3, b1, ${scale + 3};
}}"""


# q4_0: offset 8 (the high nibble, used in place, 16 x 8)
ASM_NIB_ZP = _c("{" + _NIB_EXTRACT + _minus_offset_times_scale("0x64086408", "0x64806480", 5))


def _times_scale_plus_offset(scale: int) -> str:
    """Tail of an affine dequant: subtract the magic exactly, then scale $scale .. $scale+3 times the nibbles plus
    the offsets $scale+4 .. $scale+7 (low block g, g + 8; high block g, g + 8) into $0 .. $3."""
    regs = [f"${scale + i}" for i in range(8)]
    return f"""
 mov.b32 z0, 0x64006400;
 sub.rn.f16x2 a0, a0, z0;
 sub.rn.f16x2 a1, a1, z0;
 sub.rn.f16x2 b0, b0, z0;
 sub.rn.f16x2 b1, b1, z0;
 fma.rn.f16x2 $0, a0, {regs[0]}, {regs[4]};
 fma.rn.f16x2 $1, a1, {regs[1]}, {regs[5]};
 fma.rn.f16x2 $2, b0, {regs[2]}, {regs[6]};
 fma.rn.f16x2 $3, b1, {regs[3]}, {regs[7]};
}}"""


# q4_1 (and q4_K as its planes hold it): $5,$6 low scale; $7,$8 high scale / 16; $9,$10 low min; $11,$12 high min
ASM_NIB_AFFINE = _c("{" + _NIB_EXTRACT + _times_scale_plus_offset(5))
# The fifth bits of q5_0 and q5_1 (q5_K): $5 = the lane's fifth-bit byte of this qs word
# (quant_pack.fifth_bits_to_fragment_order) in all four bytes. Bits 4-5 of the byte are those of the low block's
# rows g, g + 8 at column k, bits 0-1 the high block's; at column k + 1 two bits higher each, so the word's upper
# f16 half takes the byte shifted right by 2 (prmt: bytes 0-1 of $5, bytes 2-3 of $5 >> 2). Then each half holds
# row g's bits just above the nibbles they belong to (bit 4: the low block's, bit 8: the high block's, used in
# place), and row g + 8's one higher, as ASM_Q6's: 7 instructions a word.
_FIFTH_BITS = """
 .reg .b32 hs, hw, hv;
 shr.b32 hs, $5, 2;
 prmt.b32 hw, $5, hs, 0x7610;
 shr.b32 hv, hw, 1;
 lop3.b32 a0, hw, 0x00100010, a0, 0xEA;
 lop3.b32 a1, hv, 0x00100010, a1, 0xEA;
 lop3.b32 b0, hw, 0x01000100, b0, 0xEA;
 lop3.b32 b1, hv, 0x01000100, b1, 0xEA;"""
# q5_0: offset 16. $6,$7 low scale; $8,$9 high scale / 16.
ASM_NIB5_ZP = _c("{" + _NIB_EXTRACT + _FIFTH_BITS + _minus_offset_times_scale("0x64106410", "0x65006500", 6))
# q5_1 (and q5_K as its planes hold it): $6..$9 scales (the high block's / 16), $10..$13 offsets
ASM_NIB5_AFFINE = _c("{" + _NIB_EXTRACT + _FIFTH_BITS + _times_scale_plus_offset(6))
# q8_0: flip the sign bit (q + 128 as an unsigned byte), put each byte under the magic, subtract
# 1024 + 128 exactly, scale. $0,$1 out; $2 word; $3,$4 scale.
ASM_Q8 = _c("""{
 .reg .b32 u, a0, a1, z;
 xor.b32 u, $2, 0x80808080;
 mov.b32 z, 0x64806480;
 prmt.b32 a0, u, 0x64646464, 0x4240;
 prmt.b32 a1, u, 0x64646464, 0x4341;
 sub.rn.f16x2 a0, a0, z;
 sub.rn.f16x2 a1, a1, z;
 mul.rn.f16x2 $0, a0, $3;
 mul.rn.f16x2 $1, a1, $4;
}""")

# FP8 (e4m3): $2 = a qs word in decode order (quant_pack.DECODE_SLOTS), its e4m3 bytes paired (b0, b2) and (b1, b3)
# as ASM_Q8 pairs its int8 bytes. Each byte s eeee mmm goes into an f16 half as s at bit 15 and eeee mmm at bits
# 13-7 (the first pair is stored there, the second pair's signs a bit lower and the rest seven): an f16 whose
# exponent bias (15) is 8 more than e4m3's (7), so it reads as the value times 2^-8, subnormals included (0x7F /
# 0xFF, NaN, read as finite: a checkpoint holds none). Integer bit moves, where Hopper's cvt to f16 issues at a
# fraction of their rate; the 2^8 is in the scales $3, $4 (quant_pack.FP8_D_SCALE: q8_0's side data, times 256).
ASM_FP8 = _c("""{
 .reg .b32 m0, m1, s1;
 and.b32 m0, $2, 0xBF80BF80;
 shl.b32 m1, $2, 7;
 shl.b32 s1, $2, 1;
 and.b32 m1, m1, 0x3F803F80;
 lop3.b32 m1, s1, 0x80008000, m1, 0xEA;
 mul.rn.f16x2 $0, m0, $3;
 mul.rn.f16x2 $1, m1, $4;
}""")

# q6_K, one k16 half of a chunk: $4 = qs word (as for the 4-bit formats), $5 = its high-bit word, each
# byte of quant_pack.high_bits_to_fragment_order twice: bits 4-5 | 6-7 | 8-9 | 10-11 of each 16-bit lane
# hold the high bits of (row g, low block) | (g + 8, low) | (g, high) | (g + 8, high), i.e. just above the
# nibble each belongs to (the high block's nibble is used in place, value 16 q). Magic 1024 + 32 (1024 + 512
# for the high block) removes the offset 32 exactly. $6,$7 low-block scale; $8,$9 high-block scale / 16.
ASM_Q6 = _c("{" + _NIB_EXTRACT + """
 .reg .b32 hv;
 shr.b32 hv, $5, 2;
 lop3.b32 a0, $5, 0x00300030, a0, 0xEA;
 lop3.b32 a1, hv, 0x00300030, a1, 0xEA;
 lop3.b32 b0, $5, 0x03000300, b0, 0xEA;
 lop3.b32 b1, hv, 0x03000300, b1, 0xEA;""" + _minus_offset_times_scale("0x64206420", "0x66006600", 6))
# q6_K scales of one row and chunk: $4 = the four int8 scales of its 16-weight groups (low block halves,
# high block halves), $5 = the super-block's f32 d. Outputs d*s0, d*s1, d*s2/16, d*s3/16 in f16.
ASM_Q6_SCALES = _c("""{
 .reg .b32 u, lo, hi, z, dd, k;
 .reg .f16 dh;
 xor.b32 u, $4, 0x80808080;
 prmt.b32 lo, u, 0x64646464, 0x4140;
 prmt.b32 hi, u, 0x64646464, 0x4342;
 mov.b32 z, 0x64806480;
 sub.rn.f16x2 lo, lo, z;
 sub.rn.f16x2 hi, hi, z;
 cvt.rn.f16.f32 dh, $5;
 mov.b32 dd, {dh, dh};
 mul.rn.f16x2 lo, lo, dd;
 mul.rn.f16x2 hi, hi, dd;
 mov.b32 k, 0x2C002C00;
 mul.rn.f16x2 hi, hi, k;
 mov.b32 {$0, $1}, lo;
 mov.b32 {$2, $3}, hi;
}""")
# NVFP4, one k16 half of a chunk: $4 = a qs word in decode order (quant_pack.DECODE_SLOTS): each 4-bit e2m1 code (sign,
# 2 exponent bits, 1 mantissa bit) at f16's sign bit and bits 11..9 of its operand, or where one shift or two put
# it there, which reads as the code's value times 2^-14 for every code, 0 and the subnormal 0.5 included (f16's
# exponent field then equals e2m1's, with f16's subnormals where e2m1 has its own). sm_90 has no e2m1 conversion.
# Times the block scales ($5,$6 low block rows g, g + 8; $7,$8 high block; e4m3 values, exact in f16), every
# product exact; the 2^14 and the row scale are the epilogue's (_fp4_row_scale).
# The third and fourth operands keep sign and magnitude apart (bits 13 and 2..0, 14 and 5..3 of each half): one
# multiply by 2^2 + 2^9 (2^1 + 2^6) of just those bits moves both fields at once, the two shifted copies never
# overlapping, so no carry reaches a kept bit: and, multiply, and, where two shifts, a mask and a merge took four.
ASM_FP4 = _c("""{
 .reg .b32 m0, m1, m2, m3;
 and.b32 m0, $4, 0x8E008E00;
 shl.b32 m1, $4, 3;
 and.b32 m1, m1, 0x8E008E00;
 and.b32 m2, $4, 0x20072007;
 mul.lo.u32 m2, m2, 516;
 and.b32 m2, m2, 0x8E008E00;
 and.b32 m3, $4, 0x40384038;
 mul.lo.u32 m3, m3, 66;
 and.b32 m3, m3, 0x8E008E00;
 mul.rn.f16x2 $0, m0, $5;
 mul.rn.f16x2 $1, m1, $6;
 mul.rn.f16x2 $2, m2, $7;
 mul.rn.f16x2 $3, m3, $8;
}""")
# NVFP4 scales of one row and chunk: $4 = the four e4m3 scales of its 16-weight groups (low block halves, high
# block halves) -> four f16, exact.
ASM_FP4_SCALES = _c("""{
 .reg .b16 lo, hi;
 .reg .b32 a, b;
 mov.b32 {lo, hi}, $4;
 cvt.rn.f16x2.e4m3x2 a, lo;
 cvt.rn.f16x2.e4m3x2 b, hi;
 mov.b32 {$0, $1}, a;
 mov.b32 {$2, $3}, b;
}""")
# The same by bit moves, for GPUs whose cvt has no e4m3 (before sm_89: an A100; fp8_cache.native): bytes 0, 1
# (2, 3) spread to bits 8-15 and 24-31, each sign kept and its exponent and mantissa moved one bit lower, under
# f16's exponent, which reads as the scale times 2^-8 (f16's exponent bias is 8 more than e4m3's), subnormals
# included; times 256, the scale. (On the H200's sm_90 it compiles to 128 more instructions in the GEMV's loop at
# 8 tokens than the cvts: 810 against 682.)
ASM_FP4_SCALES_BITS = _c("""{
 .reg .b32 a, b, t, k;
 prmt.b32 a, $4, 0, 0x1404;
 prmt.b32 b, $4, 0, 0x3424;
 shr.u32 t, a, 1;
 and.b32 t, t, 0x3F803F80;
 and.b32 a, a, 0x80008000;
 or.b32 a, a, t;
 shr.u32 t, b, 1;
 and.b32 t, t, 0x3F803F80;
 and.b32 b, b, 0x80008000;
 or.b32 b, b, t;
 mov.b32 k, 0x5C005C00;
 mul.rn.f16x2 a, a, k;
 mul.rn.f16x2 b, b, k;
 mov.b32 {$0, $1}, a;
 mov.b32 {$2, $3}, b;
}""")
FP4_UNIT = _c(16384.0)    # 2^14: ASM_FP4's codes read as value * 2^-14
# An L2 prefetch of a lane's 16 bytes some K steps ahead: it holds no register or scoreboard entry.
ASM_PREFETCH = _c("prefetch.global.L2 [$1];\n mov.u32 $0, 0;")
# The same into the SM's L1, where the load that follows finds them without a trip to L2.
ASM_PREFETCH_L1 = _c("prefetch.global.L1 [$1];\n mov.u32 $0, 0;")


if gluon is not None:

    @gluon.constexpr_function
    def _byte_layout(W, BYTES):
        """[W, RT, 32 lanes, BYTES]: each lane's BYTES contiguous bytes of a tile in one load."""
        return gl.BlockedLayout([1, 1, 1, BYTES], [1, 1, 32, 1], [W, 1, 1, 1], [3, 2, 1, 0])

    @gluon.constexpr_function
    def _layouts(W, RT, BT):
        """(MMA acc, A operand, B operand, 16-byte load) layouts: [W, 16 RT, BT], [W, 16 RT, 32],
        [W, 32, BT], [W, RT, 32, 16]. The batch axis is the warp."""
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
        a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        return mma, a, b, _byte_layout(W, 16)

    @gluon.constexpr_function
    def _axis_layout(layout, dim):
        """The 1-D layout of axis `dim` of a rank-4 layout: the other three axes sliced away."""
        for other in (3, 2, 1, 0):
            if other != dim:
                layout = gl.SliceLayout(other, layout)
        return layout

    @gluon.jit
    def _tile_offsets(tile0, chunk, tile_stride, RT: gl.constexpr, LD: gl.constexpr, BYTES: gl.constexpr = 16):
        """Byte offsets [W, RT, 32 lanes, BYTES] of each warp's chunk (chunk: [W]) in a fragment-order plane
        of 32 x BYTES bytes per tile and chunk (the quants: 16; q6_K's high bits: 8)."""
        ch = gl.convert_layout(chunk, _axis_layout(LD, 0))
        rt = gl.arange(0, RT, layout=_axis_layout(LD, 1))
        lane = gl.arange(0, 32, layout=_axis_layout(LD, 2))
        byte = gl.arange(0, BYTES, layout=_axis_layout(LD, 3))
        return (ch.to(gl.int64) * (32 * BYTES))[:, None, None, None] \
            + ((tile0 + rt).to(gl.int64) * tile_stride)[None, :, None, None] \
            + (lane * BYTES)[None, None, :, None] + byte[None, None, None, :]

    @gluon.jit
    def _as_operand(q, W: gl.constexpr, RT: gl.constexpr, A: gl.constexpr):
        """Loaded bytes [W, RT, lane, 16] -> the [W, 16 RT, 32] A operand. The lane index splits into
        (g = lane // 4, c = lane % 4) and the byte index into (r3, r2, r1, r0); row = 16 rt + 8 r1 + g,
        k = 16 r3 + 8 r2 + 2 c + r0: exactly the mma.sync A fragment, so no data moves."""
        q = gl.reshape(q, [W, RT, 8, 4, 2, 2, 2, 2])                # w, rt, g, c, r3, r2, r1, r0
        q = gl.permute(q, [0, 1, 6, 2, 4, 5, 3, 7])                 # w, rt, r1, g, r3, r2, c, r0
        q = gl.reshape(q, [W, 16 * RT, 32])
        return gl.convert_layout(q, A, assert_trivial=True)

    @gluon.jit
    def _as_half_operand(q, W: gl.constexpr, RT: gl.constexpr, A: gl.constexpr):
        """One k16 half of the loaded bytes, [W, RT, lane, 8] -> the [W, 16 RT, 16] A operand of one mma
        (as _as_operand, without the r3 bit)."""
        q = gl.reshape(q, [W, RT, 8, 4, 2, 2, 2])                   # w, rt, g, c, r2, r1, r0
        q = gl.permute(q, [0, 1, 5, 2, 4, 3, 6])                    # w, rt, r1, g, r2, c, r0
        q = gl.reshape(q, [W, 16 * RT, 16])
        return gl.convert_layout(q, A, assert_trivial=True)

    @gluon.jit
    def _halves(q, W: gl.constexpr, RT: gl.constexpr, N: gl.constexpr):
        """[W, RT, lane, 2 N] bytes -> the first and the second N (the k16 halves of a lane's tile)."""
        q = gl.permute(gl.reshape(q, [W, RT, 32, 2, N]), [0, 1, 2, 4, 3])
        return gl.split(q)

    @gluon.jit
    def _twice(h, W: gl.constexpr, RT: gl.constexpr, N: gl.constexpr):
        """[W, RT, lane, N] -> [W, RT, lane, 2 N] with every byte twice (h0 h0 h1 h1 ...)."""
        return gl.reshape(gl.join(h, h), [W, RT, 32, 2 * N])

    @gluon.jit
    def _load_x(x_ptr, x_stride, tok0, n_tok, n_cols, k0, BT: gl.constexpr, W: gl.constexpr, B: gl.constexpr,
                X_LOADS: gl.constexpr, K: gl.constexpr = 32):
        """x[tok0 : tok0 + BT, k0 + 0..K-1] as the [W, K, BT] B operand (k0: [W], one K offset per warp),
        in the planes' column order (quant_pack.k_order): lane 4 g + c's logical columns
        k = 16 h + 8 a + 2 c + e are the K / 4 contiguous columns k0 + K / 4 c + .. of token g (and g + 8),
        one vector load per lane and token (a 4-byte load per (k, k + 1) pair made 4x the L1 wavefronts,
        the bottleneck at 16 tokens). The reshape/permute after it only renames registers into the B
        fragment's order, which convert_layout(..., assert_trivial=True) checks at compile time.
        X_LOADS (X_RAGGED_K, X_MASKED_TOKENS, X_CLAMPED_TOKENS): which loads are masked (x_loads)."""
        V: gl.constexpr = K // 4
        L: gl.constexpr = gl.BlockedLayout([1, 1, V, 1], [1, 4, 1, 8], [W, 1, 1, 1], [2, 1, 3, 0])
        k = gl.convert_layout(k0, _axis_layout(L, 0))[:, None, None, None] \
            + (V * gl.arange(0, 4, layout=_axis_layout(L, 1)))[None, :, None, None] \
            + gl.arange(0, V, layout=_axis_layout(L, 2))[None, None, :, None]
        t = tok0 + gl.arange(0, BT, layout=_axis_layout(L, 3))[None, None, None, :]
        # bf16 x is converted here (a few instructions per step, shared by the RT row tiles) rather than by
        # a separate launch per call
        if X_LOADS == X_CLAMPED_TOKENS:
            x = gl.load(x_ptr + gl.minimum(t, n_tok - 1) * x_stride + k).to(gl.float16)   # [W, c, V, BT]
        else:
            mask = t < n_tok
            if X_LOADS == X_RAGGED_K:
                mask = mask & (k < n_cols)
            x = gl.load(x_ptr + t * x_stride + k, mask=mask, other=0.0).to(gl.float16)
        if K == 32:
            x = gl.permute(gl.reshape(x, [W, 4, 2, 2, 2, BT]), [0, 2, 3, 1, 4, 5])        # w, h, a, c, e, t
        else:
            x = gl.permute(gl.reshape(x, [W, 4, 2, 2, BT]), [0, 2, 1, 3, 4])              # w, a, c, e, t
        return gl.convert_layout(gl.reshape(x, [W, K, BT]), B, assert_trivial=True)

    @gluon.jit
    def _as_side(v, W: gl.constexpr, RT: gl.constexpr, SIDE: gl.constexpr):
        """[W, RT, g, r1] values of rows 16 rt + 8 r1 + g -> [W, 16 RT, 1] in the A operand's row layout
        (broadcasts along k); only renames registers."""
        v = gl.reshape(gl.permute(v, [0, 1, 3, 2]), [W, 16 * RT])
        return gl.convert_layout(v, SIDE, assert_trivial=True)[:, :, None]

    @gluon.jit
    def _side_pointers(ptr, tile0, col, tile_stride, W: gl.constexpr, RT: gl.constexpr, E: gl.constexpr):
        """Pointers [W, RT, 8 g, E] to each warp's entry `col` (col: [W]) of row tiles tile0.. in a fragment-order
        side plane: the E values lane group g needs of an entry sit side by side (its rows g and g + 8; for
        q4_1's one plane, (d, m) x (low, high block) x those rows), so a lane loads them as one vector and a
        warp's load reads one contiguous piece."""
        V: gl.constexpr = gl.BlockedLayout([1, 1, 1, E], [1, 1, 8, 4], [W, 1, 1, 1], [3, 2, 1, 0])
        c = gl.convert_layout(col, _axis_layout(V, 0))
        rt = gl.arange(0, RT, layout=_axis_layout(V, 1))
        g = gl.arange(0, 8, layout=_axis_layout(V, 2))
        e = gl.arange(0, E, layout=_axis_layout(V, 3))
        return ptr + ((tile0 + rt).to(gl.int64) * tile_stride)[None, :, None, None] \
            + (8 * E * c)[:, None, None, None] + (E * g)[None, None, :, None] + e[None, None, None, :]

    @gluon.jit
    def _row_side(ptr, tile0, entries_per_row, col, W: gl.constexpr, RT: gl.constexpr, SIDE: gl.constexpr):
        """Side entry (rows of tiles tile0.., col) for col [W] -> [W, 16 RT, 1] (broadcasts along k).
        The plane is in fragment order (quant_pack.side_to_fragment_order): a lane's rows g and g + 8 sit
        side by side, instead of 16 rows' strided pieces (one memory transaction each)."""
        v = gl.load(_side_pointers(ptr, tile0, col, 16 * entries_per_row, W, RT, 2))
        return _as_side(v, W, RT, SIDE)                                  # [W, RT, g, r1]

    @gluon.jit
    def _affine_sides(ptr, tile0, chunk, side32, W: gl.constexpr, RT: gl.constexpr, SIDE: gl.constexpr):
        """q4_1's scales and offsets of each warp's chunk from their one plane
        (quant_pack.affine_sides_to_fragment_order): one 16-byte load per lane and row tile, split in registers
        into (d of the low block, d of the high block, m low, m high), each [W, 16 RT, 1]."""
        v = gl.load(_side_pointers(ptr, tile0, chunk, 32 * side32, W, RT, 8))
        v = gl.reshape(v, [W, RT, 8, 2, 2, 2])                           # w, rt, g, kind, block, r1
        lo, hi = gl.split(gl.permute(v, [0, 1, 2, 5, 3, 4]))              # w, rt, g, r1, kind | block
        d_lo, m_lo = gl.split(lo)
        d_hi, m_hi = gl.split(hi)
        return (_as_side(d_lo, W, RT, SIDE), _as_side(d_hi, W, RT, SIDE), _as_side(m_lo, W, RT, SIDE),
                _as_side(m_hi, W, RT, SIDE))

    @gluon.jit
    def _load_sides(d_ptr, m_ptr, sub_ptr, tile0, chunk, side32, side256, FMT: gl.constexpr, W: gl.constexpr,
                    RT: gl.constexpr, SIDE: gl.constexpr, STEP: gl.constexpr = 0):
        """The scale data of each warp's chunk chunk + STEP (_k_step), raw: four [W, 16 RT, 1] tensors (unused ones
        repeat). Each plane's pointer moves by its entries of STEP chunks (an entry: 8 lane groups x E values,
        _side_pointers), the offsets come from chunk."""
        if _byte_fmt(FMT):
            a = _row_side(d_ptr + STEP * 16, tile0, side32, chunk, W, RT, SIDE)
            b = a
            c = a
            e = a
        elif FMT == F_Q6_K or FMT == F_NVFP4:
            # the four scales of the chunk's 16-weight groups as one word (q6_K's int8, NVFP4's e4m3); q6_K's f32 d
            # (NVFP4's row scale is the epilogue's)
            a = _row_side(sub_ptr.to(gl.pointer_type(gl.int32)) + STEP * 16, tile0, side32 // 2, chunk, W, RT, SIDE)
            if FMT == F_Q6_K:      # one d a super-block of four chunks
                if STEP % 4 == 0:
                    b = _row_side(d_ptr + STEP // 4 * 16, tile0, side256, chunk // 4, W, RT, SIDE)
                else:
                    b = _row_side(d_ptr, tile0, side256, (chunk + STEP) // 4, W, RT, SIDE)
            else:
                b = a
            c = a
            e = b
        elif _affine(FMT):    # q4_1 and q5_1: f16 scales and offsets of the two blocks, from one plane
            a, b, c, e = _affine_sides(d_ptr + STEP * 64, tile0, chunk, side32, W, RT, SIDE)
        else:                 # q4_0 and q5_0: f16 scales of the two blocks
            a = _row_side(d_ptr + STEP * 32, tile0, side32, 2 * chunk, W, RT, SIDE)
            b = _row_side(d_ptr + STEP * 32, tile0, side32, 2 * chunk + 1, W, RT, SIDE)
            c = a
            e = b
        return a, b, c, e

    @gluon.jit
    def _load_side_x(d_ptr, m_ptr, sub_ptr, x_ptr, x_stride, tok0, n_tok, n_cols, tile0, chunk, side32, side256,
                     FMT: gl.constexpr, BT: gl.constexpr, W: gl.constexpr, RT: gl.constexpr, SIDE: gl.constexpr,
                     B: gl.constexpr, X_LOADS: gl.constexpr, STEP: gl.constexpr = 0):
        """The register-side loads of one K step (each warp's chunk; x_ptr already moved by STEP chunks, _k_step):
        scale data and the x blocks."""
        a, b, c, e = _load_sides(d_ptr, m_ptr, sub_ptr, tile0, chunk, side32, side256, FMT, W, RT, SIDE, STEP)
        if _byte_fmt(FMT):
            x0 = _load_x(x_ptr, x_stride, tok0, n_tok, n_cols, chunk * 32, BT, W, B, X_LOADS)
            x1 = x0
        else:
            x0 = _load_x(x_ptr, x_stride, tok0, n_tok, n_cols, chunk * 64, BT, W, B, X_LOADS)
            x1 = _load_x(x_ptr, x_stride, tok0, n_tok, n_cols, chunk * 64 + 32, BT, W, B, X_LOADS)
        return a, b, c, e, x0, x1

    @gluon.jit
    def _prefetch_tile(qs_ptr, tile0, chunk, tile_stride, RT: gl.constexpr, LD: gl.constexpr,
                       ASM: gl.constexpr = ASM_PREFETCH):
        """Prefetch into L2 (ASM_PREFETCH_L1: into L1) the bytes a later step will load (one prefetch per lane and
        row tile)."""
        P: gl.constexpr = gl.SliceLayout(3, LD)
        ch = gl.convert_layout(chunk, gl.SliceLayout(1, gl.SliceLayout(2, P)))
        rt = gl.arange(0, RT, layout=gl.SliceLayout(0, gl.SliceLayout(2, P)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, P)))
        off = (ch.to(gl.int64) * 512)[:, None, None] + ((tile0 + rt).to(gl.int64) * tile_stride)[None, :, None] \
            + (lane * 16)[None, None, :]
        gl.inline_asm_elementwise(ASM, "=r,l", [qs_ptr + off], gl.int32, False, 1)

    @gluon.jit
    def _fifth_bits(qh_ptr, tile0, chunk, tile_stride, W: gl.constexpr, RT: gl.constexpr):
        """The fifth bits of each warp's chunk (q5_0, q5_1), a lane's 4 bytes (quant_pack.fifth_bits_to_fragment_order),
        each repeated over the 4 bytes of the qs word it belongs to: [W, RT, lane, 16], renamed as the quant bytes
        are (_as_operand), so that ASM_NIB5_ZP / ASM_NIB5_AFFINE get a word's bits beside the word."""
        h = gl.load(qh_ptr + _tile_offsets(tile0, chunk, tile_stride // 4, RT, _byte_layout(W, 4), 4))
        return _twice(_twice(h, W, RT, 4), W, RT, 8)

    @gluon.jit
    def _dequant(q, a, b, c, e, h, FMT: gl.constexpr, W: gl.constexpr, RT: gl.constexpr, A: gl.constexpr):
        """Loaded bytes and scale data -> f16 A operands: the (lo, hi) 32-weight blocks of a 4-bit chunk;
        (w, w) for q8_0 (one block per chunk). h: q5_0's and q5_1's fifth bits (_fifth_bits; else unused)."""
        return _dequant_operand(_as_operand(q, W, RT, A), a, b, c, e, _as_operand(h, W, RT, A), FMT)

    @gluon.jit
    def _dequant_operand(q, a, b, c, e, h, FMT: gl.constexpr):
        """_dequant on bytes already renamed into an A-operand layout (the GEMV's mma.sync one, or the GEMM's
        warpgroup-MMA one: both give a lane the same rows and columns), scale data broadcast along k; h: the
        fifth bits renamed the same way."""
        if FMT == F_Q8_0:
            w = gl.inline_asm_elementwise(ASM_Q8, "=r,=r,r,r,r", [q, a], gl.float16, True, 4)
            lo = w
            hi = w
        elif FMT == F_FP8:
            w = gl.inline_asm_elementwise(ASM_FP8, "=r,=r,r,r,r", [q, a], gl.float16, True, 4)
            lo = w
            hi = w
        elif FMT == F_Q4_0:
            lo, hi = gl.inline_asm_elementwise(ASM_NIB_ZP, "=r,=r,=r,=r,r,r,r,r,r", [q, a, b * 0.0625],
                                               (gl.float16, gl.float16), True, 4)
        elif FMT == F_Q5_0:
            lo, hi = gl.inline_asm_elementwise(ASM_NIB5_ZP, "=r,=r,=r,=r,r,r,r,r,r,r", [q, h, a, b * 0.0625],
                                               (gl.float16, gl.float16), True, 4)
        elif FMT == F_Q5_1:   # and q5_K as its planes hold it
            lo, hi = gl.inline_asm_elementwise(ASM_NIB5_AFFINE, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
                                               [q, h, a, b * 0.0625, c, e], (gl.float16, gl.float16), True, 4)
        else:  # Q4_1, and q4_K as its planes hold it
            lo, hi = gl.inline_asm_elementwise(ASM_NIB_AFFINE, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                                               [q, a, b * 0.0625, c, e], (gl.float16, gl.float16), True, 4)
        return lo, hi

    @gluon.jit
    def _q6_operands(q, y, s_lo, s_hi):
        """One k16 half of a q6_K chunk, its bytes and high bits renamed into an A-operand layout -> the f16
        operands of the low and the high block (ASM_Q6)."""
        return gl.inline_asm_elementwise(ASM_Q6, "=r,=r,=r,=r,r,r,r,r,r,r", [q, y, s_lo, s_hi],
                                         (gl.float16, gl.float16), True, 4)

    @gluon.jit
    def _q6_scales(sc, d):
        """q6_K's four int8 scales of a row and chunk (one word) and its super-block's f32 d -> the f16 scales
        of the low block's halves and the high block's halves / 16 (ASM_Q6_SCALES)."""
        return gl.inline_asm_elementwise(ASM_Q6_SCALES, "=h,=h,=h,=h,r,f", [sc, d],
                                         (gl.float16, gl.float16, gl.float16, gl.float16), True, 1)

    @gluon.jit
    def _q6_half(acc, q, y, s_lo, s_hi, x_ptr, x_stride, tok0, n_tok, n_cols, k0, W: gl.constexpr,
                 RT: gl.constexpr, BT: gl.constexpr, A: gl.constexpr, B: gl.constexpr, X_LOADS: gl.constexpr):
        """acc += one k16 half of a q6_K chunk: low block columns k0..k0+15, high block k0+32..k0+47."""
        lo, hi = _q6_operands(_as_half_operand(q, W, RT, A), _as_half_operand(y, W, RT, A), s_lo, s_hi)
        return _half_mmas(acc, lo, hi, x_ptr, x_stride, tok0, n_tok, n_cols, k0, W, BT, B, X_LOADS)

    @gluon.jit
    def _half_mmas(acc, lo, hi, x_ptr, x_stride, tok0, n_tok, n_cols, k0, W: gl.constexpr, BT: gl.constexpr,
                   B: gl.constexpr, X_LOADS: gl.constexpr):
        """acc += one k16 half of a chunk whose scales change every 16 weights (q6_K, NVFP4), its operands
        dequantized: the low block's half times x columns k0..k0+15, the high block's times k0+32..k0+47."""
        acc = mma_v2(lo, _load_x(x_ptr, x_stride, tok0, n_tok, n_cols, k0, BT, W, B, X_LOADS, 16), acc)
        return mma_v2(hi, _load_x(x_ptr, x_stride, tok0, n_tok, n_cols, k0 + 32, BT, W, B, X_LOADS, 16), acc)

    @gluon.jit
    def _q6_chunk(acc, q, h, sc, d, x_ptr, x_stride, tok0, n_tok, n_cols, chunk, W: gl.constexpr,
                  RT: gl.constexpr, BT: gl.constexpr, A: gl.constexpr, B: gl.constexpr, X_LOADS: gl.constexpr):
        """acc += a q6_K chunk (64 weights per row), as two k16 halves: its scales change every 16 weights,
        and a half is one mma's K. q: the quant bytes [W, RT, lane, 16]; h: the high bits [W, RT, lane, 8]."""
        s0, s1, s2, s3 = _q6_scales(sc, d)
        q0, q1 = _halves(q, W, RT, 8)
        h0, h1 = _halves(h, W, RT, 4)
        acc = _q6_half(acc, q0, _twice(h0, W, RT, 4), s0, s2, x_ptr, x_stride, tok0, n_tok, n_cols,
                       chunk * 64, W, RT, BT, A, B, X_LOADS)
        return _q6_half(acc, q1, _twice(h1, W, RT, 4), s1, s3, x_ptr, x_stride, tok0, n_tok, n_cols,
                        chunk * 64 + 16, W, RT, BT, A, B, X_LOADS)

    @gluon.jit
    def _fp4_scales(sc, CVT: gl.constexpr = True):
        """NVFP4's four e4m3 scales of a row and chunk (one word) -> four f16 (ASM_FP4_SCALES; without CVT,
        ASM_FP4_SCALES_BITS)."""
        return gl.inline_asm_elementwise(ASM_FP4_SCALES if CVT else ASM_FP4_SCALES_BITS, "=h,=h,=h,=h,r", [sc],
                                         (gl.float16, gl.float16, gl.float16, gl.float16), True, 1)

    @gluon.jit
    def _fp4_operands(q, s_lo, s_hi):
        """One k16 half of an NVFP4 chunk, its codes renamed into an A-operand layout, and its blocks' f16 scales
        -> the f16 operands of the low and the high block, in units of 2^-14 times the row scale (ASM_FP4)."""
        return gl.inline_asm_elementwise(ASM_FP4, "=r,=r,=r,=r,r,r,r,r,r", [q, s_lo, s_hi],
                                         (gl.float16, gl.float16), True, 4)

    @gluon.jit
    def _fp4_half(acc, q, s_lo, s_hi, x_ptr, x_stride, tok0, n_tok, n_cols, k0, W: gl.constexpr, RT: gl.constexpr,
                  BT: gl.constexpr, A: gl.constexpr, B: gl.constexpr, X_LOADS: gl.constexpr):
        """acc += one k16 half of an NVFP4 chunk: low block columns k0..k0+15, high block k0+32..k0+47."""
        lo, hi = _fp4_operands(_as_half_operand(q, W, RT, A), s_lo, s_hi)
        return _half_mmas(acc, lo, hi, x_ptr, x_stride, tok0, n_tok, n_cols, k0, W, BT, B, X_LOADS)

    @gluon.jit
    def _fp4_chunk(acc, q, sc, x_ptr, x_stride, tok0, n_tok, n_cols, chunk, W: gl.constexpr, RT: gl.constexpr,
                   BT: gl.constexpr, A: gl.constexpr, B: gl.constexpr, X_LOADS: gl.constexpr,
                   E4M3_CVT: gl.constexpr = True):
        """acc += an NVFP4 chunk (64 weights per row) as two k16 halves, q6_K's way: a scale every 16 weights
        (widened by cvt, or without E4M3_CVT by bit moves)."""
        s0, s1, s2, s3 = _fp4_scales(sc, E4M3_CVT)
        q0, q1 = _halves(q, W, RT, 8)
        acc = _fp4_half(acc, q0, s0, s2, x_ptr, x_stride, tok0, n_tok, n_cols, chunk * 64, W, RT, BT, A, B, X_LOADS)
        return _fp4_half(acc, q1, s1, s3, x_ptr, x_stride, tok0, n_tok, n_cols, chunk * 64 + 16, W, RT, BT, A, B,
                         X_LOADS)

    @gluon.jit
    def _fp4_row_scale(total, d_ptr, tile0, RT: gl.constexpr, OUT: gl.constexpr):
        """NVFP4's [16 RT, BT] sums of row tiles tile0.. times each row's f32 scale and FP4_UNIT: the d plane holds
        one 4-byte entry a row, in side order (row r of a tile at 2 (r % 8) + r // 8)."""
        r = gl.arange(0, 16 * RT, layout=gl.SliceLayout(1, OUT))[:, None]
        pos = (tile0 + r // 16).to(gl.int64) * 16 + 2 * (r % 8) + (r % 16) // 8
        return total * (gl.load(d_ptr + pos) * FP4_UNIT)

    @gluon.jit
    def _gate_up_halves(v, RT: gl.constexpr, BT: gl.constexpr):
        """[16 RT, BT] accumulator rows 16 rt + 8 h + i -> the gate (h = 0) and up (h = 1) rows [RT, 8, BT]:
        both in one lane's registers (the mma row pair g, g + 8), so this only renames them."""
        return gl.split(gl.permute(gl.reshape(v, [RT, 2, 8, BT]), [0, 2, 3, 1]))

    @gluon.jit
    def _store_rows(total, out_ptr, out_stride, r, t, n_rows, n_tok, RT: gl.constexpr, BT: gl.constexpr,
                    ACT: gl.constexpr):
        """Store the [16 RT, BT] result of rows r ([16 RT, 1]) and tokens t ([1, BT]). With ACT (act_code), the
        rows are gate|up interleaved 8 by 8 and what is stored is act(gate) * up, column (r // 16) * 8 + r % 16
        of n_rows / 2, or where ACT's column order puts that column: each value rounded to the output dtype
        first, as the separate act*mul kernel would read it (activation._gated_mul_kernel; the same float math,
        in the same order)."""
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        FN: gl.constexpr = ACT % 4
        ORDER: gl.constexpr = ACT // 4
        if FN == ACT_NONE:
            gl.store(out_ptr + t * out_stride + r, total.to(dtype), mask=(t < n_tok) & (r < n_rows))
        else:
            gate, up = _gate_up_halves(total, RT, BT)
            rg, _ = _gate_up_halves(r + 0 * t, RT, BT)
            tg, _ = _gate_up_halves(t + 0 * r, RT, BT)
            g = gate.to(dtype).to(gl.float32)
            u = up.to(dtype).to(gl.float32)
            if FN == ACT_GELU_TANH:    # g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
                a = g * (1 / (1 + gl.exp(-(1.5957691216057308 * (g + 0.044715 * g * g * g)))))
            else:                      # SiLU
                a = g * (1 / (1 + gl.exp(-g)))
            col = (rg // 16) * 8 + rg % 16
            gl.store(out_ptr + tg * out_stride + ordered_columns(col, ORDER), (a * u).to(dtype),
                     mask=(tg < n_tok) & (col < n_rows // 2))

    @gluon.jit
    def _finish_rows(total, out_ptr, out_stride, partial_ptr, count_ptr, r, t, row0, tok0, tile, pid_k, n_rows,
                     n_tok, RT: gl.constexpr, BT: gl.constexpr, SPLIT_K: gl.constexpr, ACT: gl.constexpr):
        """Store a CTA's [16 RT, BT] sums of rows r, tokens t (rows row0.., tokens tok0..); with SPLIT_K > 1, its
        K slice's partial sums instead, and the last CTA of the tile adds all of them in split order and stores.
        Deterministic: no float atomics, so a row's result does not depend on timing (as in quant_matmul.py).
        Shared by the GEMV and the GEMM (quant_gemm.py)."""
        if SPLIT_K == 1:
            _store_rows(total, out_ptr, out_stride, r, t, n_rows, n_tok, RT, BT, ACT)
        else:
            offs = (r - row0) * BT + (t - tok0)
            base = partial_ptr + tile.to(gl.int64) * (SPLIT_K * 16 * RT * BT)
            gl.store(base + pid_k * (16 * RT * BT) + offs, total)
            gl.thread_barrier()
            arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                acc2 = gl.zeros_like(total)
                for k in range(SPLIT_K):
                    acc2 += gl.load(base + k * (16 * RT * BT) + offs, cache_modifier=".cg")
                _store_rows(acc2, out_ptr, out_stride, r, t, n_rows, n_tok, RT, BT, ACT)
                gl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _k_step(acc, chunk, qs_ptr, qh_ptr, d_ptr, m_ptr, sub_ptr, x_ptr, x_stride, tok0, n_tok, n_cols, tile0,
                tile_stride, side32, side256, FMT: gl.constexpr, W: gl.constexpr, RT: gl.constexpr, BT: gl.constexpr,
                A: gl.constexpr, B: gl.constexpr, LD: gl.constexpr, SIDE: gl.constexpr, X_LOADS: gl.constexpr,
                E4M3_CVT: gl.constexpr, STEP: gl.constexpr = 0):
        """One K step of each warp, its chunk chunk + STEP (chunk: [W]): the tile's bytes loaded, dequantized and
        multiplied into acc. Each plane's pointer moves by STEP chunks and the offsets come from `chunk`
        (GEMV_FOLD_STEPS: an iteration's steps share chunk and differ by constants, which fold into the loads'
        immediates)."""
        WPC: gl.constexpr = 32 if _byte_fmt(FMT) else 64
        qs_ptr += STEP * 512
        x_ptr += STEP * WPC
        n_cols -= STEP * WPC               # x's columns, as a ragged K masks them
        q = gl.load(qs_ptr + _tile_offsets(tile0, chunk, tile_stride, RT, LD))
        if FMT == F_Q6_K:
            h = gl.load(qh_ptr + STEP * 256 + _tile_offsets(tile0, chunk, tile_stride // 2, RT, _byte_layout(W, 8), 8))
            a, b, c, e = _load_sides(d_ptr, m_ptr, sub_ptr, tile0, chunk, side32, side256, FMT, W, RT, SIDE, STEP)
            acc = _q6_chunk(acc, q, h, a, b, x_ptr, x_stride, tok0, n_tok, n_cols, chunk, W, RT, BT, A, B, X_LOADS)
        elif FMT == F_NVFP4:
            a, b, c, e = _load_sides(d_ptr, m_ptr, sub_ptr, tile0, chunk, side32, side256, FMT, W, RT, SIDE, STEP)
            acc = _fp4_chunk(acc, q, a, x_ptr, x_stride, tok0, n_tok, n_cols, chunk, W, RT, BT, A, B, X_LOADS, E4M3_CVT)
        else:
            a, b, c, e, x0, x1 = _load_side_x(d_ptr, m_ptr, sub_ptr, x_ptr, x_stride, tok0, n_tok, n_cols, tile0,
                                              chunk, side32, side256, FMT, BT, W, RT, SIDE, B, X_LOADS, STEP)
            if _fifth_bit(FMT):
                h = _fifth_bits(qh_ptr + STEP * 128, tile0, chunk, tile_stride, W, RT)
            else:
                h = q
            lo, hi = _dequant(q, a, b, c, e, h, FMT, W, RT, A)
            acc = mma_v2(lo, x0, acc)
            if not _byte_fmt(FMT):
                acc = mma_v2(hi, x1, acc)
        return acc

    @gluon.jit(do_not_specialize=["n_tok", "n_rows", "n_cols", "n_chunks", "steps_per_split", "tiles_per_expert"])
    def _gemv_kernel(x_ptr, out_ptr, partial_ptr, count_ptr, qs_ptr, d_ptr, m_ptr, sub_ptr, qh_ptr,
                     slot_expert_ptr, slot_start_ptr, slot_count_ptr,
                     n_tok, n_rows, n_cols, x_stride, out_stride, n_chunks, steps_per_split,
                     tiles_per_expert,
                     FMT: gl.constexpr, W: gl.constexpr, RT: gl.constexpr, BT: gl.constexpr,
                     SPLIT_K: gl.constexpr, X_LOADS: gl.constexpr, U: gl.constexpr,
                     D: gl.constexpr, ROUTED: gl.constexpr, ACT: gl.constexpr, PDL: gl.constexpr = False,
                     E4M3_CVT: gl.constexpr = True, TAIL: gl.constexpr = 0, FOLD: gl.constexpr = False):
        MMA: gl.constexpr = _layouts(W, RT, BT)[0]
        A: gl.constexpr = _layouts(W, RT, BT)[1]
        B: gl.constexpr = _layouts(W, RT, BT)[2]
        LD: gl.constexpr = _layouts(W, RT, BT)[3]
        SIDE: gl.constexpr = gl.SliceLayout(2, A)
        WPC: gl.constexpr = 32 if _byte_fmt(FMT) else 64      # weights per chunk (and per K step of a warp)
        n_chunks = gl.multiple_of(n_chunks, 4)
        side32 = n_chunks * WPC // 32
        side256 = n_chunks * WPC // 256
        tile_stride = n_chunks * 512                        # bytes per 16-row tile across all of K
        pid_t = gl.program_id(0)                             # token tile (fastest: weight reuse in L2)
        pid_n = gl.program_id(1) // SPLIT_K
        pid_k = gl.program_id(1) % SPLIT_K
        tile0 = pid_n * RT
        warp = gl.arange(0, W, layout=gl.SliceLayout(1, SIDE))
        tok0 = pid_t * BT
        acc = gl.zeros([W, 16 * RT, BT], gl.float32, MMA)
        first = pid_k * steps_per_split
        last = first + steps_per_split - 1
        if PDL:
            # A programmatic dependent (GEMV_PDL): the first loop iteration's weight bytes are asked into this SM's
            # L1 while the kernel before finishes (weights are never written), then the wait for that kernel
            # before anything it writes (x, the routing slots, the split-K scratch) is touched.
            if not ROUTED:
                for u in gl.static_range(U):
                    _prefetch_tile(qs_ptr, tile0, gl.minimum(first + u, last) * W + warp, tile_stride, RT, LD,
                                   ASM_PREFETCH_L1)
            gdc_wait()
        if ROUTED:
            # Stacked experts (moe_routing.py): token tile pid_t is slot pid_t, at most BT pairs (rows of x and
            # out), with the slot's expert's row tiles. An empty slot runs no K step and stores nothing.
            tok0 = gl.load(slot_start_ptr + pid_t)
            n_tok = tok0 + gl.load(slot_count_ptr + pid_t)
            tile0 += gl.load(slot_expert_ptr + pid_t) * tiles_per_expert
            if tok0 >= n_tok:
                last = first - 1
        # U K steps per iteration, all their loads issued before their math; with D > 0 the quant bytes
        # of step s + D are prefetched into L2 meanwhile. The warps of a CTA read adjacent chunks.
        # (Tried on the H200: a cp.async shared-memory ring of 2-6 stages was slower, and Triton put a CTA
        # barrier in every step of it; a one-step register pipeline compiled to ~1 PRMT per byte, as
        # loop-carried bytes are unpacked, and was not run.)
        body_end = last + 1 - TAIL
        for s in range(first, body_end, U):
            if D > 0:
                for u in gl.static_range(U):
                    _prefetch_tile(qs_ptr, tile0, gl.minimum(s + u + D, last) * W + warp, tile_stride, RT, LD)
            for u in gl.static_range(U):
                # FOLD: the U steps' offsets from one chunk (s's), each step's pointers moved by a constant
                acc = _k_step(acc, (s + u) * W - _moved(u, W, FOLD) + warp, qs_ptr, qh_ptr, d_ptr, m_ptr, sub_ptr,
                              x_ptr, x_stride, tok0, n_tok, n_cols, tile0, tile_stride, side32, side256, FMT, W, RT,
                              BT, A, B, LD, SIDE, X_LOADS, E4M3_CVT, _moved(u, W, FOLD))
        if TAIL > 0:
            # The steps past the last whole iteration (TAIL = a warp's steps % U), their loads again issued before
            # their math; the same order of K steps as any U, so a row's bits do not depend on U. An empty routed
            # slot (last < first) runs none.
            if last >= first:
                for u in gl.static_range(TAIL):
                    acc = _k_step(acc, (body_end + u) * W - _moved(u, W, FOLD) + warp, qs_ptr, qh_ptr, d_ptr, m_ptr,
                                  sub_ptr, x_ptr, x_stride, tok0, n_tok, n_cols, tile0, tile_stride, side32, side256,
                                  FMT, W, RT, BT, A, B, LD, SIDE, X_LOADS, E4M3_CVT, _moved(u, W, FOLD))
        if PDL:     # the next kernel may launch once every CTA's loop is done (not before: a chain of GEMVs
            gdc_launch_dependents()      # resident at once would starve the GEMV still running)
        total = gl.sum(acc, axis=0)                          # [16 RT, BT]: the warps' K slices, in order
        OUT: gl.constexpr = gl.SliceLayout(0, MMA)
        if FMT == F_NVFP4:
            total = _fp4_row_scale(total, d_ptr, tile0, RT, OUT)
        r = pid_n * (16 * RT) + gl.arange(0, 16 * RT, layout=gl.SliceLayout(1, OUT))[:, None]
        t = tok0 + gl.arange(0, BT, layout=gl.SliceLayout(0, OUT))[None, :]
        tile = pid_t * (gl.num_programs(1) // SPLIT_K) + pid_n
        _finish_rows(total, out_ptr, out_stride, partial_ptr, count_ptr, r, t, pid_n * (16 * RT), tok0, tile, pid_k,
                     n_rows, n_tok, RT, BT, SPLIT_K, ACT)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """W warps per CTA (they split K), RT 16-row tiles per warp, split_k CTAs per row block, U K steps
    per loop iteration (their loads issued before their math), L2 prefetch D K steps ahead (0: off),
    R registers per thread allowed to ptxas (0: its own choice).

    Why R: ptxas, left to itself, often issues each weight load just before its data is used, to save
    registers: one 512-byte tile in flight per warp instead of the RT x U the loop issues before its math
    (SASS of q4_1 W=4 RT=4 at 8 tokens: 1 of 4 tile loads ahead of the first mma; 4 of 4 with R = 128).
    More bytes in flight per warp, fewer warps per SM: which wins depends on the shape
    (bench/results/gemv-ab-2026-11-29-xvec-regs.json at 5a66009^), so the plans choose.

    A call of one 8-token tile is launched as a programmatic dependent (GEMV_PDL), its first weight bytes asked
    into L1 before it waits. (Prefetching into L2 instead, in a chain of GEMVs alone, cost 2-15 points of copy:
    bench/results/pdl.md.)"""
    W: int = 4
    RT: int = 4
    split_k: int = 1
    U: int = 1
    D: int = 0
    R: int = 0

    def rows_per_cta(self) -> int:
        return 16 * self.RT


def token_tile(n_tok: int) -> int:
    return 8 if n_tok <= 8 else 16


@dataclass(frozen=True, slots=True)
class GemvPlan:
    """Which GemvConfig runs a call of n_tok tokens: the first `upto` tier (max_tok, config) with
    n_tok <= max_tok (ascending), else `default`.

    Why several: the fastest config at 1 token (1-row tiles, 8-16 K steps in flight per warp) loses at 8
    tokens, where each weight needs 8 x 32 activations and 1-row tiles reload them 4x as often as 4-row
    tiles, and a 16-token tile doubles the operand registers per weight. All tiers split K the same way
    (same W and split_k), so a row's reduction order, hence its bits, does not depend on the batch; RT,
    U and D only change which rows a CTA owns and when bytes are loaded."""
    default: GemvConfig
    upto: tuple[tuple[int, GemvConfig], ...] = ()

    def __post_init__(self):
        bounds = [b for b, _ in self.upto]
        if bounds != sorted(set(bounds)) or any(b < 1 for b in bounds):
            raise ValueError(f"GemvPlan tiers must have distinct ascending token bounds: {bounds}")
        if any((c.W, c.split_k) != (self.default.W, self.default.split_k) for _, c in self.upto):
            raise ValueError(f"GemvPlan tiers must share W and split_k (batch invariance): {self}")

    @property
    def split_k(self) -> int:
        return self.default.split_k

    def configs(self) -> list[GemvConfig]:
        return list(dict.fromkeys([c for _, c in self.upto] + [self.default]))

    def for_tokens(self, n_tok: int) -> GemvConfig:
        for bound, cfg in self.upto:
            if n_tok <= bound:
                return cfg
        return self.default


def steps(p: "quant_pack.PackedPlanes", cfg: GemvConfig) -> int:
    """K steps a warp walks in one split of planes p (warp_steps)."""
    return warp_steps(p.qs.shape[1] // 512, cfg)


def warp_steps(n_chunks: int, cfg: GemvConfig) -> int:
    """K steps a warp walks in one split of n_chunks; a count U does not divide ends in a tail of steps % U."""
    assert n_chunks % (cfg.W * cfg.split_k) == 0, (n_chunks, cfg)
    return n_chunks // (cfg.W * cfg.split_k)


def scratch_need(cfg: GemvConfig | GemvPlan, rows_pad: int, max_tok: int) -> tuple[int, int]:
    """(partial elements, tile counters) the split-K reduction needs for up to max_tok tokens."""
    if isinstance(cfg, GemvPlan):   # each tier at the most tokens it can get
        needs = [scratch_need(c, rows_pad, min(max_tok, bound)) for bound, c in cfg.upto]
        needs.append(scratch_need(cfg.default, rows_pad, max_tok))
        return max(n[0] for n in needs), max(n[1] for n in needs)
    if cfg.split_k == 1:
        return 1, 1
    bt = token_tile(max_tok)
    tiles = (rows_pad // cfg.rows_per_cta()) * -(-max_tok // bt)
    return tiles * cfg.split_k * cfg.rows_per_cta() * bt, tiles


@dataclass(frozen=True, slots=True)
class Routing:
    """A routed launch over stacked experts (kernels/moe_routing.py): slot s multiplies x rows
    slot_start[s] .. + slot_count[s] by expert slot_expert[s], whose rows are the planes' row tiles
    slot_expert[s] * rows_per_expert / 16 .. ; max_count bounds any slot's count, and is one token tile of the
    kernel that runs it (the GEMV's 8 or 16, quant_gemm's 32 or 64)."""
    slot_expert: torch.Tensor
    slot_start: torch.Tensor
    slot_count: torch.Tensor
    max_count: int
    rows_per_expert: int


# A call of one 8-token tile launches as a programmatic dependent (COBATCH_GEMV_PDL=0: plainly, for comparisons):
# its CTAs start while the kernel before finishes (an RMSNorm, attention's reduce, the GEMV before), ask L1 for
# their first weight bytes and wait; and it lets the kernel after it launch once its loops are done. Not at
# 16-token tiles: there the kernel before may be the mid-batch GEMM, which lets its dependents launch at its
# start, and a GEMV resident that early slowed whole steps by 3-5 % (bench/results/decode_gemv_pdl_ab.md).
GEMV_PDL = os.environ.get("COBATCH_GEMV_PDL", "1") != "0"
# A call whose kernel before is decode attention (`launch(dependent=True)`: o's) launches as a programmatic dependent
# at 16-token tiles too: attention's kernels let their dependents launch only after their loops, not at their start
# as the mid-batch GEMM does. Q4_K_M steps (o on the GEMV to 16 tokens) of 12 / 16 rows 0.6 / 0.9 % shorter
# (bench/results/decode_gemv_pdl_after_attention_ab.md, H100); COBATCH_GEMV_PDL_AFTER_ATTENTION=0 turns it off.
GEMV_PDL_AFTER_ATTENTION = os.environ.get("COBATCH_GEMV_PDL_AFTER_ATTENTION", "1") != "0"
# x's loads where K is whole (X_CLAMPED_TOKENS; COBATCH_GEMV_CLAMP_X=0 masks them). A token tile's columns past n_tok
# read the last token's x again (the same addresses, so no bytes more) instead of being masked to zeros: a column of the
# product depends on its own x only, and those columns are never stored. Then no x load is predicated and no register
# zeroed for it: 1-5 % fewer instructions in the GEMV's loop, the same bits (sm_90 SASS of the plans' configs at an
# 8-token tile: q4_K W4 RT1 U16 1191 -> 1127 a warp per 16,384 weights, q8_0 W8 RT1 U8 359 -> 343 per 4,096, q4_K W4 RT4
# U1 268 -> 264). With GEMV_FOLD_STEPS, whole steps (H100, 16 layers) 0.7-1.3 % shorter for Q4_K_M at B = 1 / 8 / 16,
# 0.1-0.4 % for q8_0 (bench/results/decode_gemv_lean_loops_ab.md).
GEMV_CLAMP_X = os.environ.get("COBATCH_GEMV_CLAMP_X", "1") != "0"
# The U steps of a loop iteration take their load offsets from one chunk index, each step's pointers moved by a constant
# (the kernel's FOLD; COBATCH_GEMV_FOLD_STEPS=0 indexes them by step). Indexed by step, each load's address was computed
# apart in 32 bits and widened (2-3 LEA / IADD3 a load); moved by constants, they fold into the loads' immediate
# offsets: 7-19 % fewer instructions in the loop at U = 4-16 (sm_90 SASS at an 8-token tile, x clamped: q4_K W4 RT1 U16
# 1127 -> 990 a warp per 16,384 weights, W8 RT1 U8 567 -> 502, q8_0 W8 RT1 U8 343 -> 278), the same bits by
# construction. Configs of 4 row tiles a warp keep the plain loop: there it added spills under their register caps (the
# output heads' plans: q6_K's 40 -> 248 bytes of stack at 16 tokens; bench/sass_loop.py --plans) for 0-4 % fewer
# instructions. Whole steps: with GEMV_CLAMP_X above.
GEMV_FOLD_STEPS = os.environ.get("COBATCH_GEMV_FOLD_STEPS", "1") != "0"


def folds_steps(cfg: GemvConfig) -> bool:
    """The kernel's FOLD for a call in config cfg (GEMV_FOLD_STEPS, up to 2 row tiles a warp)."""
    return GEMV_FOLD_STEPS and cfg.RT <= 2


def x_loads(whole_k: bool) -> int:
    """The X_LOADS constexpr of a call: a ragged K masks x's columns and tokens; a whole one its tokens, or clamps
    them (GEMV_CLAMP_X)."""
    if not whole_k:
        return X_LOAD_MODES["ragged_k"]
    return X_LOAD_MODES["clamped_tokens" if GEMV_CLAMP_X else "masked_tokens"]


def launch(p: "quant_pack.PackedPlanes", x: torch.Tensor, out: torch.Tensor, cfg: GemvConfig | GemvPlan,
           partial: torch.Tensor, count: torch.Tensor, routing: Routing | None = None, act: str | None = None,
           out_order: int = NATURAL, dependent: bool = False) -> None:
    """out[n_tok, rows] = x @ W.T for fragment-order planes; x f16 or bf16 [n_tok, cols] (row stride free).
    dependent: the kernel before is decode attention (GEMV_PDL_AFTER_ATTENTION).
    With `routing`, p holds the experts stacked and out[pair] = x[pair] @ W[expert of its slot].T, out having
    rows_per_expert columns; the plan's tier is the one for max_count tokens.
    With `act` ("silu", "gelu_tanh"), W's rows (each expert's) are gate|up interleaved 8 by 8
    (activation.GATE_UP_GROUP) and out gets act(gate) * up: half as many columns, in out_order's column order."""
    assert p.fragment and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1
    n_tok = x.shape[0]
    tokens = routing.max_count if routing else n_tok          # the most rows one weight is dotted with
    if isinstance(cfg, GemvPlan):
        cfg = cfg.for_tokens(tokens)
    bt = token_tile(tokens)
    n_chunks = p.qs.shape[1] // 512
    rows, rows_pad = (routing.rows_per_expert, routing.rows_per_expert) if routing else (p.rows, p.rows_pad)
    if routing:
        assert routing.max_count == bt, "a slot is one token tile (moe_routing.slot_size)"
    assert out.shape[-1] == (rows // 2 if act else rows) and (not act or rows % 16 == 0), (out.shape, rows, act)
    token_tiles = routing.slot_expert.shape[0] if routing else -(-n_tok // bt)
    grid = (token_tiles, (rows_pad // cfg.rows_per_cta()) * cfg.split_k)
    dummy = p.qs
    warp_steps = steps(p, cfg)
    _gemv_kernel[grid](
        x, out, partial, count, p.qs, p.d, p.m if p.m is not None else dummy,
        p.sub if p.sub is not None else dummy, p.qh if p.qh is not None else dummy,
        routing.slot_expert if routing else dummy, routing.slot_start if routing else dummy,
        routing.slot_count if routing else dummy,
        n_tok, rows, p.cols, x.stride(0), out.stride(0), n_chunks, warp_steps,
        rows_pad // 16,
        FMT=p.fmt_id, W=cfg.W, RT=cfg.RT, BT=bt, SPLIT_K=cfg.split_k, X_LOADS=x_loads(p.cols == p.cols_pad),
        U=cfg.U, TAIL=warp_steps % cfg.U, FOLD=folds_steps(cfg),
        D=cfg.D, ROUTED=routing is not None, ACT=act_code(act, out_order),
        num_warps=cfg.W, maxnreg=cfg.R or None,
        **(pdl_launch(x) if GEMV_PDL and (bt == 8 or (dependent and GEMV_PDL_AFTER_ATTENTION)) else {}),
        **({"E4M3_CVT": False} if p.fmt_id == F_NVFP4 and not fp8_cache.native(x.device) else {}))
