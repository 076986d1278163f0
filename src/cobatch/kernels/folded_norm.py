"""RMSNorm in an order the GEMV can repeat: the norm folded into the GEMV that follows it (quant_gemv's NORM).

A decode step of a few rows spends a launch a layer twice on an RMSNorm of one row (0.14 ms of a q8_0 B = 1 step,
docs/kernels.md). Folded, the GEMV's CTAs compute the norm of their tokens' rows themselves (`row_rstd`, from L2:
each reads the whole x and residual rows) and normalize x as they load it; one CTA writes the residual stream.

A row must keep its bits whichever way its step runs, and the GEMV folds the norm only where it pays (a step of
one row first, FOLD_UPTO). So the steps it does not fold run `rms_norm_gluon`, which sums the squares in the same
order: the layout `row_layout` (FOLD_WARPS warps, each thread its contiguous columns), reduced by the same code.
Hence the fold only in GEMVs of FOLD_WARPS warps (the q8_0 and q4_K plans'). `tl.sum` in the Triton kernel
(norm.py) takes an order of its own over 16 warps, which nothing else can repeat: with the fold on
(COBATCH_FOLD_NORM=1), the Gluon kernel replaces it for every step of a GEMV's width.

Both compute, from x (and the residual r): h = (x + r) rounded to x's dtype, s = sum(h * h) in float32, rstd =
rsqrt(s / n + eps), and the operand (h * rstd * w) rounded once to f16: norm.rms_norm_ref's formula. Gluon has no
interpreter: the CPU path keeps the torch reference, and the GPU tests check the fold against this kernel, bit for
bit (tests/test_folded_norm.py).
"""

from __future__ import annotations

import os

import torch

from cobatch.kernels.triton_support import next_pow2

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - triton without gluon: the norm is not folded
    gluon = gl = None

# COBATCH_FOLD_NORM=1: decode steps of at most FOLD_UPTO rows normalize x inside the GEMV that reads it, and every
# other step of a GEMV's width runs rms_norm_gluon (the same sums). Off by default until the GPU has timed it.
FOLD_NORM = os.environ.get("COBATCH_FOLD_NORM") == "1"
FOLD_UPTO = 1
FOLD_WARPS = 4


def row_block(n_cols: int) -> int:
    """The row's width padded to a power of two, and to at least a thread a column (the padding adds zeros)."""
    return max(32 * FOLD_WARPS, next_pow2(n_cols))


if gluon is not None:

    @gluon.constexpr_function
    def row_layout(BLOCK):
        """A row over FOLD_WARPS warps: each thread its BLOCK / (32 FOLD_WARPS) contiguous columns."""
        return gl.BlockedLayout([BLOCK // (32 * FOLD_WARPS)], [32], [FOLD_WARPS], [0])

    @gluon.jit
    def row_h(x_row_ptr, res_row_ptr, n_cols, HAS_RES: gl.constexpr, BLOCK: gl.constexpr):
        """h = x + residual rounded to x's dtype (x alone without one), as float32 [BLOCK] in row_layout; its
        columns past n_cols 0."""
        cols = gl.arange(0, BLOCK, layout=row_layout(BLOCK))
        mask = cols < n_cols
        h = gl.load(x_row_ptr + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = gl.load(res_row_ptr + cols, mask=mask, other=0.0)
            h = (h.to(gl.float32) + r.to(gl.float32)).to(x_row_ptr.dtype.element_ty)
        return h.to(gl.float32)

    @gluon.jit
    def row_rstd(x_row_ptr, res_row_ptr, n_cols, eps, HAS_RES: gl.constexpr, BLOCK: gl.constexpr):
        """rsqrt(sum(h * h) / n_cols + eps) of the row's h (row_h), the sum in row_layout's order."""
        h = row_h(x_row_ptr, res_row_ptr, n_cols, HAS_RES, BLOCK)
        return gl.rsqrt(gl.sum(h * h, axis=0) / n_cols + eps)

    @gluon.jit
    def _norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n_cols, x_stride, res_stride, out_stride, h_stride, eps,
                     HAS_RES: gl.constexpr, BLOCK: gl.constexpr):
        """Program per row, FOLD_WARPS warps: the residual stream h (with HAS_RES) and the normed row, rounded once.
        h is read again after the sum (from L1) rather than held: a row of 4,096 took 255 registers held."""
        row = gl.program_id(0).to(gl.int64)
        rstd = row_rstd(x_ptr + row * x_stride, res_ptr + row * res_stride, n_cols, eps, HAS_RES, BLOCK)
        h = row_h(x_ptr + row * x_stride, res_ptr + row * res_stride, n_cols, HAS_RES, BLOCK)
        cols = gl.arange(0, BLOCK, layout=row_layout(BLOCK))
        mask = cols < n_cols
        if HAS_RES:
            gl.store(h_ptr + row * h_stride + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
        w = gl.load(w_ptr + cols, mask=mask, other=0.0).to(gl.float32)
        gl.store(out_ptr + row * out_stride + cols, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


else:  # pragma: no cover - triton without gluon
    row_layout = row_h = row_rstd = _norm_kernel = None


def rms_norm_gluon(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None,
                   residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """norm.rms_norm_triton's contract (out: the normed rows, residual_out: x + residual, in place when it is
    `residual`), summing in the order the folded GEMV repeats."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x) if out is None else out
    out2 = out.view(-1, n_cols)
    if residual is None:
        h, res2, h2 = x, x2, x2
    else:
        h = torch.empty_like(x) if residual_out is None else residual_out
        res2, h2 = residual.view(-1, n_cols), h.view(-1, n_cols)
    if x2.shape[0]:
        _norm_kernel[(x2.shape[0],)](x2, res2, weight, out2, h2, n_cols, x2.stride(0), res2.stride(0),
                                     out2.stride(0), h2.stride(0), eps, HAS_RES=residual is not None,
                                     BLOCK=row_block(n_cols), num_warps=FOLD_WARPS)
    return out, h
