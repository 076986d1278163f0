"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from cobatch.kernels.operand_order import NATURAL, ordered_columns, ordered_ref
from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, jit, next_pow2, pdl_launch, tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, order: int = NATURAL) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, residual_stream): residual_stream = x + residual (or x), normed = rmsnorm(residual_stream)
    in out_dtype (default x's), rounded once from float32, its columns in `order` (operand_order: the order the
    next weight's GEMM reads; the residual stream keeps the model's)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return ordered_ref(out.to(out_dtype or x.dtype), order), h


# --- Triton -------------------------------------------------------------------------------------------


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n_cols, x_stride, res_stride, out_stride, h_stride,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, ORDER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # launched as a programmatic dependent: let the next kernel launch, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to x's dtype before normalizing, as the reference does.
        h = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * h_stride + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + ordered_columns(cols, ORDER), (x * rstd * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                    order: int = NATURAL) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as rms_norm_ref. residual_out receives x + residual (pass `residual` itself to update the
    residual stream in place); out receives the normed rows, in `order`. Both are allocated when not given."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    assert x2.stride(-1) == 1 and weight.is_contiguous() and (order == NATURAL or n_cols % 32 == 0)
    out = torch.empty_like(x) if out is None else out
    out2 = out.view(-1, n_cols)
    if residual is None:
        h, res2, h2 = x, x2, x2
    else:
        h = torch.empty_like(x) if residual_out is None else residual_out
        res2, h2 = residual.view(-1, n_cols), h.view(-1, n_cols)
    block = next_pow2(n_cols)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out2, h2, n_cols, x2.stride(0), res2.stride(0), out2.stride(0), h2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, **pdl_launch(x), ORDER=order,
        num_warps=min(16, max(1, block // 256)))
    return out, h
