"""The column order in which the mid-batch GEMM's ring reads x, for the kernel that writes x to write it in.

The ring (quant_gemm) streams x through TMA in the column order of the weight's fragment planes
(quant_pack.k_order): inside each 32-column tile, pieces of two columns change places. x_operands puts an x in that
order, one launch per GEMM call. A kernel that writes x anyway (the RMSNorm before qkv and gate|up) can store each
column where that order wants it instead, for the cost of an index computation; the GEMM then streams x as it
comes (PackedWeight.operand_order says when, `matmul(x_order=...)` that it was done). The values are the same, only
their places differ, so a row's sums and bits are the same as through x_operands. Two of a layer's four
x_operands launches go that way; down's input comes in order from gate|up's act epilogue (quant_gemv.act_code) and
o's from the attention kernels (their ORDER), so a dense layer launches none
(bench/results/decode_ordered_operands_ab.md).
"""

from __future__ import annotations

import torch

from cobatch.kernels import quant_pack
from cobatch.kernels.triton_support import jit, tl

NATURAL = 0     # the model's own column order
BY_32 = 1       # k_order of the formats scaled per 32 weights or more (q8_0, the 4- and 5-bit ones)
BY_16 = 2       # k_order of the formats scaled per 16 (q6_K, NVFP4): each k16 half keeps its own columns


def order_of(fmt_id: int) -> int:
    """The order the GEMM's x takes for a weight of fmt_id's planes."""
    return BY_16 if fmt_id in quant_pack.SCALED_BY_16 else BY_32


def _fmt_of(order: int) -> int:
    return quant_pack.Q6_K if order == BY_16 else quant_pack.Q8_0


def ordered_ref(x: torch.Tensor, order: int) -> torch.Tensor:
    """The torch reference: x's columns gathered through quant_pack.k_order (NATURAL: x itself)."""
    if order == NATURAL:
        return x
    index = torch.tensor(quant_pack.k_order(_fmt_of(order)), device=x.device)
    rows, cols = x.reshape(-1, x.shape[-1]).shape
    return x.reshape(rows, cols // 32, 32)[:, :, index].reshape(x.shape)


@jit
def ordered_columns(cols, ORDER: tl.constexpr):
    """Where column `cols` of a row goes in ORDER: the place k_order gives it within its 32-column tile. BY_32:
    column 8 c + 2 j + e goes to 8 j + 2 c + e; BY_16: column 16 h + 4 c + 2 p + e goes to 16 h + 8 p + 2 c + e.
    Called from the Triton kernels (the norm, attention) and from the Gluon GEMV's and GEMM's epilogue alike.
    (A jit function reads no module global that is not a constexpr: 1 is BY_32, 2 BY_16.)"""
    placed = cols
    if ORDER == 1:
        within = cols % 32
        placed = cols - within + 8 * ((within // 2) % 4) + 2 * (within // 8) + within % 2
    if ORDER == 2:
        within = cols % 16
        placed = cols - within + 8 * ((within // 2) % 2) + 2 * (within // 4) + within % 2
    return placed


def padded_rows(n: int) -> int:
    """The rows an ordered x of n rows is allocated with: whole 256-row tiles. Every token tile the GEMM streams
    (16 to 256 rows; a split tile's 128- or 256-row block) divides 256, so its TMA reads whole tiles (rows past n
    hold whatever they hold: a token's column of the MMA never meets another's, and only n rows are stored)."""
    return -(-n // 256) * 256


def operand_buffer(n: int, cols: int, dtype: torch.dtype, device: torch.device, order: int = NATURAL) -> torch.Tensor:
    """An empty [n, cols] tensor for the x a kernel writes in `order`: its storage padded_rows(n) rows long where
    the order is a GEMM's (NATURAL: n rows)."""
    return torch.empty(n if order == NATURAL else padded_rows(n), cols, dtype=dtype, device=device)[:n]
