"""The dense matrix of a fragment-order weight, for the prefill path (dequantize once, then cuBLAS), in Gluon.

Past the mid-batch GEMM's range a call dequantizes the whole weight into a scratch matrix and runs cuBLAS on it
(quant_matmul.DEQUANT_CUBLAS), so that pass moves about 3 bytes a weight (q8_0: 1.06 read, 2 written). The Triton
dequantize (quant_matmul._dequant_kernel) gathers fragment-order bytes one by one. This kernel reads them as the
GEMV does, one 16-byte vector per lane and row tile, decodes them with the GEMV's own code (quant_gemv._dequant:
f16 operands of the mma.sync A layout) and stores each lane's values where they go: lane c of a 32-column block holds
its GGUF columns 8 c .. 8 c + 7 (quant_pack.k_order), so a lane writes its rows' 8 contiguous columns.

The formats whose planes use the 32-column order: q8_0 / FP8, q4_0, q4_1 / q4_K (FORMATS). The values are the GEMV's
f16 operands (q8_0: q times d rounded to f16) in the output's dtype. The torch reference is
quant_pack.unpack_planes; Gluon has no interpreter, so the tests run on CUDA (tests/test_quant_matmul.py).
"""

from __future__ import annotations

import torch

from cobatch.kernels import quant_gemv, quant_pack
from cobatch.kernels.quant_gemv import gl, gluon

FORMATS = (quant_pack.Q8_0, quant_pack.FP8_E4M3, quant_pack.Q4_0, quant_pack.Q4_1)
WARPS = 4             # each warp dequantizes its own chunks of the CTA's rows
ROW_TILES = 4         # 16-row tiles a CTA covers
CHUNKS_PER_WARP = 4   # chunks a warp covers, one after another in K

if gluon is not None:

    @gluon.constexpr_function
    def _out_layout(W):
        """[W, rows, 32 columns]: a lane holds 8 contiguous GGUF columns of rows g, g + 8, ... (one 16-byte store
        per row): the A layout's distribution, its columns renamed (_in_gguf_order)."""
        return gl.BlockedLayout([1, 1, 8], [1, 8, 4], [W, 1, 1], [2, 1, 0])

    @gluon.jit
    def _in_gguf_order(v, W: gl.constexpr, RT: gl.constexpr):
        """An A operand [W, 16 RT, 32] (logical column k = 16 h + 8 a + 2 c + e) -> the same values with GGUF
        column 8 c + 4 h + 2 a + e at index 8 c + 4 h + 2 a + e (quant_pack.k_order): only registers renamed."""
        v = gl.permute(gl.reshape(v, [W, 16 * RT, 2, 2, 4, 2]), [0, 1, 4, 2, 3, 5])     # w, row, c, h, a, e
        return gl.convert_layout(gl.reshape(v, [W, 16 * RT, 32]), _out_layout(W), assert_trivial=True)

    @gluon.jit
    def _dequant_kernel(out_ptr, qs_ptr, d_ptr, m_ptr, sub_ptr, n_rows, out_stride, n_chunks,
                        FMT: gl.constexpr, W: gl.constexpr, RT: gl.constexpr, U: gl.constexpr):
        """Program (row block of 16 RT rows, group of W U chunks): warp w decodes chunks g W U + u W + w. K has no
        padding (supports), so only rows are masked: each lane's 8 columns go out as one 16-byte store."""
        A: gl.constexpr = quant_gemv._layouts(W, RT, 8)[1]
        LD: gl.constexpr = quant_gemv._layouts(W, RT, 8)[3]
        SIDE: gl.constexpr = gl.SliceLayout(2, A)
        OUT: gl.constexpr = _out_layout(W)
        WPC: gl.constexpr = 32 if quant_gemv._byte_fmt(FMT) else 64      # weights per chunk
        side32 = n_chunks * WPC // 32
        tile_stride = n_chunks * 512
        tile0 = gl.program_id(0) * RT
        warp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, OUT)))
        row = tile0 * 16 + gl.arange(0, 16 * RT, layout=gl.SliceLayout(0, gl.SliceLayout(2, OUT)))[None, :, None]
        col = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, OUT)))[None, None, :]
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        for u in gl.static_range(U):
            chunk = gl.program_id(1) * (W * U) + u * W + warp
            q = gl.load(qs_ptr + quant_gemv._tile_offsets(tile0, chunk, tile_stride, RT, LD))
            a, b, c, e = quant_gemv._load_sides(d_ptr, m_ptr, sub_ptr, tile0, chunk, side32, 0, FMT, W, RT, SIDE)
            lo, hi = quant_gemv._dequant(q, a, b, c, e, FMT, W, RT, A)
            k = (chunk * WPC)[:, None, None] + col
            at = out_ptr + row.to(gl.int64) * out_stride + k
            gl.store(at, _in_gguf_order(lo, W, RT).to(dtype), mask=row < n_rows)
            if not quant_gemv._byte_fmt(FMT):     # the high nibbles: the chunk's second 32-column block
                gl.store(at + 32, _in_gguf_order(hi, W, RT).to(dtype), mask=row < n_rows)


def supports(p: "quant_pack.PackedPlanes") -> bool:
    """Can this kernel dequantize these planes (fragment order, a 32-column-order format, K unpadded and a chunk
    count the programs divide)?"""
    return (gluon is not None and p.fragment and p.fmt_id in FORMATS and p.cols == p.cols_pad
            and (p.qs.shape[1] // 512) % (WARPS * CHUNKS_PER_WARP) == 0)


def dequantize(p: "quant_pack.PackedPlanes", out: torch.Tensor) -> torch.Tensor:
    """out [rows, cols] bf16/f16 <- the planes' values, as the GEMV's f16 operands (one launch, no sync)."""
    assert supports(p) and out.shape == (p.rows, p.cols) and out.stride(1) == 1
    n_chunks = p.qs.shape[1] // 512
    grid = (p.rows_pad // (16 * ROW_TILES), n_chunks // (WARPS * CHUNKS_PER_WARP))
    dummy = p.qs
    _dequant_kernel[grid](out, p.qs, p.d, p.m if p.m is not None else dummy, p.sub if p.sub is not None else dummy,
                          p.rows, out.stride(0), n_chunks, FMT=p.fmt_id, W=WARPS, RT=ROW_TILES,
                          U=CHUNKS_PER_WARP, num_warps=WARPS)
    return out
