"""Top-k, then top-p over the top-k-renormalized distribution, on whole rows without torch.topk or a sort: each row
keeps its `count` largest tokens (largest first, the lower id first among equal values), where `count` is k cut to
the smallest prefix of that order whose mass, over the k tokens alone, reaches p. k is at most CAP.

The reference (`top_k_keep_ref`) sorts every row. On the GPU the sampler took llama.cpp's settings (top-k 40, top-p
0.95, min-p 0.05) through torch.topk and a dozen launches over the row, 815 us of GPU time a call at B = 64
(docs/kernels.md, the sampler). The kernel runs one program a row:
- the row's max, least finite value and count of finite values (one pass);
- the k-th value by counts: halving passes over [least, max], each counting the tokens above a midpoint, narrow
  the interval until at most CAP tokens lie at or above its lower end, which are copied aside (the whole top-k
  set among them). Where ties at the k-th value alone exceed CAP, the tokens above it are copied and the ties
  counted;
- in registers: the k-th value exactly, the mass of the top-k set, and top-p's cut by halving its masses;
- the output pass (kernels/top_p.store_kept) keeps the tokens above the cut and the lowest ids among its ties.
The search runs over the floats' order as int32 keys (kernels/top_p.float_key), so its cuts are values of the row.
"""

from __future__ import annotations

import math

import torch

from cobatch.kernels.top_p import (BLOCK, CAP, VALUE_STEPS, apply_min_p, copy_aside, cut_by_mass, float_key, key_float,
                                  load_aside, min_p_values, row_pointers, search_midpoint, store_kept)
from cobatch.kernels.triton_support import jit, tl

# a program's warps: 16 took 8-12 % off 8's time at 1 and 64 rows, level at 256 (H100,
# bench/results/sampler_filter_kernels.json; bench/sampler.py --warps times others)
WARPS = 16


def top_k_keep_ref(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V] scores, int [R] k in [1, V], float32 [R] p in (0, 1] -> the scores with every token outside
    each row's top-k-then-top-p set at -inf: a stable descending sort, the softmax of its first k, and the tokens
    among them whose mass before them is below p; then min_p's (float32 [R], 0: none; top_p.apply_min_p)."""
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    within_k = torch.arange(scores.shape[-1], device=scores.device)[None, :] < top_k[:, None]
    probs = ordered.masked_fill(~within_k, -math.inf).softmax(dim=-1)
    before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    no_top_p = torch.full_like(top_p, math.inf)        # p = 1: never trimmed by the running sum's rounding
    drop_sorted = ~within_k | (before >= torch.where(top_p < 1.0, top_p, no_top_p)[:, None])
    drop_sorted[:, 0] = False                           # the largest value always stays
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return apply_min_p(scores.masked_fill(drop, -math.inf), min_p)


@jit
def _top_k_kernel(scores_ptr, out_ptr, k_ptr, p_ptr, min_p_ptr, aside_ptr, n_cols, stride_row, BLOCK: tl.constexpr,
                  CAP: tl.constexpr, VALUE_STEPS: tl.constexpr):
    row = tl.program_id(0)
    src, dst, aside = row_pointers(scores_ptr, out_ptr, aside_ptr, n_cols, stride_row, CAP)
    cols = tl.arange(0, BLOCK)
    neg_inf = -float("inf")
    min_key = -2147483647 - 1

    m_vec = tl.full([BLOCK], neg_inf, tl.float32)
    least_vec = tl.full([BLOCK], float("inf"), tl.float32)
    finite_vec = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(src + start + cols, mask=start + cols < n_cols, other=neg_inf)
        finite = x > neg_inf
        m_vec = tl.maximum(m_vec, x)
        least_vec = tl.where(finite, tl.minimum(least_vec, x), least_vec)
        finite_vec += finite.to(tl.int32)
    m_row = tl.max(m_vec, 0)
    n_finite = tl.sum(finite_vec, 0)
    empty = m_row == neg_inf                           # every token already -inf: the row passes through
    m = tl.where(empty, 0.0, m_row)
    k = tl.load(k_ptr + row).to(tl.int32)
    p = tl.load(p_ptr + row)

    # lo: a key with at least k tokens at or above it (n_lo of them); hi: one with fewer (n_hi). With fewer than k
    # finite tokens the k-th value is -inf, and the interval is that key alone.
    neg_inf_key = -2139095041 + 0 * row.to(tl.int64)          # float_key(-inf)
    few = n_finite < k
    lo = tl.where(few, neg_inf_key, float_key(tl.min(least_vec, 0)).to(tl.int64))
    hi = tl.where(few, neg_inf_key + 1, float_key(m_row).to(tl.int64) + 1)
    n_lo = tl.where(few, n_cols, n_finite)
    n_hi = tl.where(few, n_finite, 0)
    step = 0 * row
    while (hi - lo > 1) & (n_lo > CAP):
        mid = search_midpoint(lo, hi, step, VALUE_STEPS)
        hi32, mid32 = tl.minimum(hi, 2147483647).to(tl.int32), mid.to(tl.int32)
        n_high = tl.zeros([BLOCK], tl.int32)
        for start in range(0, n_cols, BLOCK):
            key = float_key(tl.load(src + start + cols, mask=start + cols < n_cols, other=neg_inf))
            n_high += ((key >= mid32) & (key < hi32)).to(tl.int32)
        n_mid = n_hi + tl.sum(n_high, 0)
        reaches = n_mid >= k
        lo = tl.where(reaches, mid, lo)
        n_lo = tl.where(reaches, n_mid, n_lo)
        hi = tl.where(reaches, hi, mid)
        n_hi = tl.where(reaches, n_hi, n_mid)
        step += 1

    # Copy aside every token at or above lo; where the ties at lo alone are too many (then hi = lo + 1 and lo is the
    # k-th value), every token above them.
    overflow = n_lo > CAP
    floor = tl.where(overflow, hi, lo).to(tl.int32)
    offset = copy_aside(src, aside, n_cols, n_cols, floor, 2147483647, BLOCK)
    kept_key, kept_e = load_aside(aside, offset, m, CAP)
    while hi - lo > 1:                                 # the k-th value's key: the largest with k tokens at or above
        mid = lo + (hi - lo) // 2
        n_mid = n_hi + tl.sum(((kept_key >= mid) & (kept_key < hi)).to(tl.int32), 0)
        reaches = n_mid >= k
        lo = tl.where(reaches, mid, lo)
        hi = tl.where(reaches, hi, mid)
        n_hi = tl.where(reaches, n_hi, n_mid)
    kth = lo
    above_kth = kept_key > kth
    kth_ties = k - tl.sum(above_kth.to(tl.int32), 0)   # how many of the tokens equal to the k-th value are in the set
    kth_mass = tl.exp(key_float(kth) - m)
    target = p * (tl.sum(tl.where(above_kth, kept_e, 0.0), 0) + kth_ties * kth_mass)

    # Top-p's cut: the largest key at or above the k-th value's whose tokens in the set hold >= target (mass_hi:
    # the set's mass at or above hi). Top-k alone (p = 1) cuts at the k-th value.
    hi = tl.where(p < 1.0, float_key(m_row).to(tl.int64) + 1, kth + 1)
    lo, mass_hi = cut_by_mass(kept_key, kept_e, kth, hi, target * 0.0, target)

    at_kth = lo == kth
    cut_mass = tl.exp(key_float(lo) - m)
    by_mass = tl.minimum(tl.ceil((target - mass_hi) / tl.where(cut_mass > 0.0, cut_mass, 1.0)), 1073741824.0)
    ties_kept = tl.where((p < 1.0) & (cut_mass > 0.0), tl.maximum(by_mass, 1.0), 1073741824.0).to(tl.int32)
    ties_kept = tl.where(at_kth, tl.minimum(ties_kept, kth_ties), ties_kept)
    cut = tl.where(empty, min_key, lo).to(tl.int32)    # an empty row: every key above the cut
    store_kept(src, dst, n_cols, cut, ties_kept, m, tl.load(min_p_ptr + row), BLOCK)


def top_k_keep_triton(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor | None = None) -> torch.Tensor:
    """top_k_keep_ref's result (up to rows whose mass lands on p, or a token on min-p's bound, within rounding), one
    program a row; scores' rows contiguous, every k at most CAP."""
    rows, vocab = scores.shape
    out = torch.empty_like(scores)
    aside = torch.empty(rows, CAP, dtype=torch.float32, device=scores.device)
    if rows:
        _top_k_kernel[(rows,)](scores, out, top_k.to(torch.int32).contiguous(), top_p.to(torch.float32).contiguous(),
                               min_p_values(min_p, rows, scores), aside, vocab, scores.stride(0), BLOCK=BLOCK, CAP=CAP,
                               VALUE_STEPS=VALUE_STEPS, num_warps=WARPS)
    return out
