"""The dense matrix of a fragment-order weight, for the prefill path (dequantize once, then cuBLAS), in Gluon.

Past the mid-batch GEMM's range a call dequantizes the whole weight into a scratch matrix and runs cuBLAS on it
(matmul_plans.DEQUANT_CUBLAS), so that pass moves about 3 bytes a weight (q8_0: 1.06 read, 2 written). The Triton
dequantize (quant_matmul._dequant_kernel) gathers fragment-order bytes one by one. This kernel reads them as the
GEMV does, one 16-byte vector per lane and row tile, decodes them with the GEMV's own code (quant_gemv._dequant:
f16 operands of the mma.sync A layout) and stores each lane's values where they go: lane c of a 32-column block holds
its GGUF columns 8 c .. 8 c + 7 (quant_pack.k_order), so a lane writes its rows' 8 contiguous columns.

FORMATS: q8_0 / FP8, q4_0, q5_0, q4_1 / q4_K and q5_1 / q5_K, whose planes use the 32-column order, and q6_K,
whose k16 halves keep their columns (a lane's 4 columns of each half, 8-byte stores). The values are the GEMV's f16
operands (q8_0: q times d rounded to f16) in the output's dtype. The torch reference is quant_pack.unpack_planes;
Gluon has no interpreter, so the tests run on CUDA (tests/test_quant_matmul.py), and tests/test_kernels_compile.py
checks the stores' width.
"""

from __future__ import annotations

import torch

from cobatch.kernels import quant_gemv, quant_pack
from cobatch.kernels.quant_gemv import gl, gluon

FORMATS = (quant_pack.Q8_0, quant_pack.FP8_E4M3, quant_pack.Q4_0, quant_pack.Q4_1, quant_pack.Q5_0, quant_pack.Q5_1,
           quant_pack.Q6_K)
WARPS = 4             # each warp dequantizes its own chunks of the CTA's rows
ROW_TILES = 4         # 16-row tiles a CTA covers
CHUNKS_PER_WARP = 4   # chunks a warp covers, one after another in K

if gluon is not None:

    @gluon.constexpr_function
    def _out_layout(W, V):
        """[W, rows, 4 V columns]: a lane holds V contiguous GGUF columns of rows g, g + 8, ... (one store of 2 V bytes
        per row): the A layout's distribution, its columns renamed (_in_gguf_order)."""
        return gl.BlockedLayout([1, 1, V], [1, 8, 4], [W, 1, 1], [2, 1, 0])

    @gluon.jit
    def _in_gguf_order(v, W: gl.constexpr, RT: gl.constexpr):
        """An A operand [W, 16 RT, 32] (logical column k = 16 h + 8 a + 2 c + e) -> the same values with GGUF
        column 8 c + 4 h + 2 a + e at index 8 c + 4 h + 2 a + e (quant_pack.k_order): only registers renamed."""
        v = gl.permute(gl.reshape(v, [W, 16 * RT, 2, 2, 4, 2]), [0, 1, 4, 2, 3, 5])     # w, row, c, h, a, e
        return gl.convert_layout(gl.reshape(v, [W, 16 * RT, 32]), _out_layout(W, 8), assert_trivial=True)

    @gluon.jit
    def _in_gguf_half_order(v, W: gl.constexpr, RT: gl.constexpr):
        """q6_K's A operand of one k16 half [W, 16 RT, 16] (k = 8 a + 2 c + e) -> GGUF column 4 c + 2 a + e of the
        half at that index (quant_pack.k_order, HALF_ORDERED)."""
        v = gl.permute(gl.reshape(v, [W, 16 * RT, 2, 4, 2]), [0, 1, 3, 2, 4])           # w, row, c, a, e
        return gl.convert_layout(gl.reshape(v, [W, 16 * RT, 16]), _out_layout(W, 4), assert_trivial=True)

    @gluon.jit
    def _store(out_ptr, out_stride, v, tile0, k0, n_rows, W: gl.constexpr, RT: gl.constexpr):
        """Store v [W, 16 RT, N] (GGUF column order, _out_layout) at rows tile0 * 16.., columns k0 + 0..N-1 of each
        warp's k0 ([W])."""
        L: gl.constexpr = v.type.layout
        N: gl.constexpr = v.shape[2]
        row = tile0 * 16 + gl.arange(0, 16 * RT, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))[None, :, None]
        col = gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))[None, None, :]
        k = gl.convert_layout(k0, gl.SliceLayout(1, gl.SliceLayout(2, L)))[:, None, None] + col
        gl.store(out_ptr + row.to(gl.int64) * out_stride + k, v.to(out_ptr.dtype.element_ty), mask=row < n_rows)

    @gluon.jit
    def _q6_half(out_ptr, out_stride, q, h, s_lo, s_hi, tile0, k0, n_rows, W: gl.constexpr, RT: gl.constexpr,
                 A: gl.constexpr):
        """One k16 half of a q6_K chunk (quant_gemv._q6_half's decode): its low block's 16 columns from k0, its high
        block's from k0 + 32."""
        lo, hi = quant_gemv._q6_operands(quant_gemv._as_half_operand(q, W, RT, A), quant_gemv._as_half_operand(
            quant_gemv._twice(h, W, RT, 4), W, RT, A), s_lo, s_hi)
        _store(out_ptr, out_stride, _in_gguf_half_order(lo, W, RT), tile0, k0, n_rows, W, RT)
        _store(out_ptr, out_stride, _in_gguf_half_order(hi, W, RT), tile0, k0 + 32, n_rows, W, RT)

    @gluon.jit
    def _dequant_kernel(out_ptr, qs_ptr, d_ptr, m_ptr, sub_ptr, qh_ptr, n_rows, out_stride, n_chunks,
                        FMT: gl.constexpr, W: gl.constexpr, RT: gl.constexpr, U: gl.constexpr):
        """Program (row block of 16 RT rows, group of W U chunks): warp w decodes chunks g W U + u W + w. K has no
        padding (supports), so only rows are masked: each lane's columns of a row go out in one store."""
        A: gl.constexpr = quant_gemv._layouts(W, RT, 8)[1]
        LD: gl.constexpr = quant_gemv._layouts(W, RT, 8)[3]
        SIDE: gl.constexpr = gl.SliceLayout(2, A)
        WPC: gl.constexpr = 32 if quant_gemv._byte_fmt(FMT) else 64      # weights per chunk
        side32 = n_chunks * WPC // 32
        tile_stride = n_chunks * 512
        tile0 = gl.program_id(0) * RT
        warp = gl.arange(0, W, layout=gl.SliceLayout(1, SIDE))
        for u in gl.static_range(U):
            chunk = gl.program_id(1) * (W * U) + u * W + warp
            k0 = chunk * WPC
            q = gl.load(qs_ptr + quant_gemv._tile_offsets(tile0, chunk, tile_stride, RT, LD))
            a, b, c, e = quant_gemv._load_sides(d_ptr, m_ptr, sub_ptr, tile0, chunk, side32, side32 // 8, FMT, W, RT,
                                                SIDE)
            if FMT == quant_gemv.F_Q6_K:   # two k16 halves, a scale each (quant_gemv._q6_chunk's decode)
                h = gl.load(qh_ptr + quant_gemv._tile_offsets(tile0, chunk, tile_stride // 2, RT,
                                                              quant_gemv._byte_layout(W, 8), 8))
                s0, s1, s2, s3 = quant_gemv._q6_scales(a, b)
                q0, q1 = quant_gemv._halves(q, W, RT, 8)
                h0, h1 = quant_gemv._halves(h, W, RT, 4)
                _q6_half(out_ptr, out_stride, q0, h0, s0, s2, tile0, k0, n_rows, W, RT, A)
                _q6_half(out_ptr, out_stride, q1, h1, s1, s3, tile0, k0 + 16, n_rows, W, RT, A)
            else:
                if quant_gemv._fifth_bit(FMT):
                    h = quant_gemv._fifth_bits(qh_ptr, tile0, chunk, tile_stride, W, RT)
                else:
                    h = q
                lo, hi = quant_gemv._dequant(q, a, b, c, e, h, FMT, W, RT, A)
                _store(out_ptr, out_stride, _in_gguf_order(lo, W, RT), tile0, k0, n_rows, W, RT)
                if not quant_gemv._byte_fmt(FMT):     # the high nibbles: the chunk's second 32-column block
                    _store(out_ptr, out_stride, _in_gguf_order(hi, W, RT), tile0, k0 + 32, n_rows, W, RT)


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
                          p.qh if p.qh is not None else dummy, p.rows, out.stride(0), n_chunks, FMT=p.fmt_id,
                          W=WARPS, RT=ROW_TILES, U=CHUNKS_PER_WARP, num_warps=WARPS)
    return out
