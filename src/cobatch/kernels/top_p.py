"""Top-p (nucleus) filtering of whole rows without sorting them: each row keeps the smallest prefix of its tokens,
ordered by value (largest first, the lower id first among equal values), whose probability mass reaches p, and the
rest become -inf.

The reference sorts every row (`top_p_keep_ref`): on the GPU, a sort of [B, 128256] float32 and some forty more
launches over the row, about 1.1 ms of GPU time a call at B = 64 (docs/kernels.md, the sampler). The kernel finds
the row's cut value instead, one program a row:
- the row's max m and mass Z = sum exp(x - m) (two passes);
- the cut value t is the largest value whose tokens at or above it hold at least p Z. No token below
  L = m + ln((1 - p) Z / V) can be in the nucleus (all V of them together hold less than (1 - p) Z), so the search
  starts in [L, m]: halving passes over the row, each summing exp(x - m) above a midpoint, narrow it until at most
  CAP tokens lie inside, which are copied aside and searched in registers down to one value;
- the output pass keeps the tokens above t, and of those equal to t the lowest ids, as many as the mass left needs.
The search runs over the floats' order as 32-bit integer keys, so it ends on a value of the row, exactly. The masses
are summed in another order than the sort's running sum, so a row whose mass lands on p within rounding may keep
one token more or less than the reference; a row's result depends on its own values alone (one program a row).
"""

from __future__ import annotations

import math

import torch

from cobatch.kernels.triton_support import jit, tl

BLOCK = 2048          # columns a program loads at once
CAP = 4096            # tokens of the search's last interval copied aside and searched in registers
VALUE_STEPS = 8       # halving passes that split the interval's values before they split its keys (always progress)
WARPS = 8             # a program's warps (bench/sampler.py --warps times others)


def top_p_keep_ref(scores: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V] scores, float32 [R] p in (0, 1] -> the scores with the tokens outside each row's nucleus at
    -inf: a stable descending sort, the softmax of it, and the tokens whose mass before them is below p; then
    min_p's (float32 [R], 0: none) below min_p times the largest token's probability (apply_min_p)."""
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    probs = ordered.softmax(dim=-1)
    before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    drop_sorted = before >= top_p[:, None]
    drop_sorted[:, 0] = False                           # the largest value always stays
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return apply_min_p(scores.masked_fill(drop, -math.inf), min_p)


def apply_min_p(scores: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """min-p: the tokens whose probability is below min_p (float32 [R]) times the row's largest set to -inf, as
    exp(x - max) < min_p (the sampler's torch way, and the form the kernels' output pass repeats); None: the scores
    as they are."""
    if min_p is None:
        return scores
    relative_prob = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    return scores.masked_fill(relative_prob < min_p.to(scores.device, torch.float32)[:, None], -math.inf)


@jit
def float_key(x):
    """float32 -> int32 in the floats' order (-0.0 as 0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def key_float(key):
    """float_key's inverse (an int32 or int64 key that fits int32)."""
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@jit
def row_pointers(scores_ptr, out_ptr, aside_ptr, n_cols, stride_row, CAP: tl.constexpr):
    """This program's row: its scores, its output (contiguous) and its CAP slots aside."""
    row = tl.program_id(0).to(tl.int64)
    return scores_ptr + row * stride_row, out_ptr + row * n_cols, aside_ptr + row * CAP


@jit
def search_midpoint(lo, hi, step, VALUE_STEPS: tl.constexpr):
    """A halving pass's midpoint key in [lo, hi) (int64 keys): the midpoint of the interval's values for the first
    VALUE_STEPS passes, where it makes progress, else of its keys (always progress)."""
    mid = float_key((key_float(lo) + key_float(hi)) * 0.5).to(tl.int64)
    by_keys = (step >= VALUE_STEPS) | (mid <= lo) | (mid >= hi)
    return tl.where(by_keys, lo + (hi - lo) // 2, mid)


@jit
def load_aside(aside, offset, m, CAP: tl.constexpr):
    """The `offset` values copy_aside stored, as keys (the least key past them) and exp(x - m)."""
    slots = tl.arange(0, CAP)
    kept_x = tl.load(aside + slots, mask=slots < offset, other=-float("inf"))
    return tl.where(slots < offset, float_key(kept_x), -2147483647 - 1), tl.exp(kept_x - m)


@jit
def cut_by_mass(kept_key, kept_e, lo, hi, mass_hi, target):
    """The search's end in registers: halve [lo, hi) over the keys set aside (every token inside it among them) down
    to the largest key whose tokens at or above it hold >= target, mass_hi being the mass at or above hi. Returns
    that key and the mass above it."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        mass_mid = mass_hi + tl.sum(tl.where((kept_key >= mid) & (kept_key < hi), kept_e, 0.0), 0)
        reaches = mass_mid >= target
        lo = tl.where(reaches, mid, lo)
        hi = tl.where(reaches, hi, mid)
        mass_hi = tl.where(reaches, mass_hi, mass_mid)
    return lo, mass_hi


@jit
def copy_aside(src, aside, copy_cols, n_cols, lo32, hi32, BLOCK: tl.constexpr):
    """Store the values of the row's first copy_cols columns whose keys lie in [lo32, hi32) at aside[0:n], in
    column order; returns n."""
    cols = tl.arange(0, BLOCK)
    offset = lo32 * 0
    for start in range(0, copy_cols, BLOCK):
        x = tl.load(src + start + cols, mask=start + cols < n_cols, other=-float("inf"))
        key = float_key(x)
        inside = ((key >= lo32) & (key < hi32)).to(tl.int32)
        tl.store(aside + offset + tl.cumsum(inside, 0) - 1, x, mask=inside != 0)
        offset += tl.sum(inside, 0)
    return offset


@jit
def store_kept(src, dst, n_cols, cut, ties_kept, m, min_p, BLOCK: tl.constexpr):
    """Write the row to dst with the tokens whose keys lie above `cut` (int32) kept, and of those equal to it the
    ties_kept lowest ids, then min-p's: those whose exp(x - m) (m the row's max) is at least min_p; the rest -inf."""
    cols = tl.arange(0, BLOCK)
    tie_base = ties_kept * 0
    for start in range(0, n_cols, BLOCK):
        in_row = start + cols < n_cols
        x = tl.load(src + start + cols, mask=in_row, other=-float("inf"))
        key = float_key(x)
        tie = (key == cut) & in_row
        n_tie = tl.sum(tie.to(tl.int32), 0)
        keep = key > cut
        if tie_base + n_tie <= ties_kept:         # the block's ties all kept: no running count
            keep = keep | tie
        else:
            keep = keep | (tie & (tie_base + tl.cumsum(tie.to(tl.int32), 0) <= ties_kept))
        keep = keep & (tl.exp(x - m) >= min_p)
        tl.store(dst + start + cols, tl.where(keep, x, -float("inf")), mask=in_row)
        tie_base += n_tie


@jit
def _top_p_kernel(scores_ptr, out_ptr, p_ptr, min_p_ptr, aside_ptr, n_cols, stride_row, BLOCK: tl.constexpr,
                  CAP: tl.constexpr, VALUE_STEPS: tl.constexpr):
    row = tl.program_id(0)
    src, dst, aside = row_pointers(scores_ptr, out_ptr, aside_ptr, n_cols, stride_row, CAP)
    cols = tl.arange(0, BLOCK)
    neg_inf = -float("inf")

    m_vec = tl.full([BLOCK], neg_inf, tl.float32)
    for start in range(0, n_cols, BLOCK):
        m_vec = tl.maximum(m_vec, tl.load(src + start + cols, mask=start + cols < n_cols, other=neg_inf))
    m_row = tl.max(m_vec, 0)
    empty = m_row == neg_inf                           # every token already -inf: the row passes through
    m = tl.where(empty, 0.0, m_row)
    z_vec = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        z_vec += tl.exp(tl.load(src + start + cols, mask=start + cols < n_cols, other=neg_inf) - m)
    z = tl.sum(z_vec, 0)
    p = tl.load(p_ptr + row)
    target = p * z

    # lo: a key whose tokens at or above hold >= target; hi: one whose hold less (mass_hi); n_inside: tokens in
    # [lo, hi). The margin (- 1) keeps lo's side of the bound against rounding.
    lo = float_key(m + tl.log((1.0 - p) * tl.where(empty, 1.0, z) / n_cols) - 1.0).to(tl.int64)
    hi = float_key(m_row).to(tl.int64) + 1
    lo = tl.minimum(lo, hi - 1)
    mass_hi = z * 0.0
    n_inside = n_cols + 0 * row
    step = 0 * row
    while (hi - lo > 1) & (n_inside > CAP):
        mid = search_midpoint(lo, hi, step, VALUE_STEPS)
        hi32, mid32 = tl.minimum(hi, 2147483647).to(tl.int32), mid.to(tl.int32)
        mass_vec = tl.zeros([BLOCK], tl.float32)
        n_high = tl.zeros([BLOCK], tl.int32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(src + start + cols, mask=start + cols < n_cols, other=neg_inf)
            key = float_key(x)
            high = (key >= mid32) & (key < hi32)
            mass_vec += tl.where(high, tl.exp(x - m), 0.0)
            n_high += high.to(tl.int32)
        mass_mid = mass_hi + tl.sum(mass_vec, 0)
        reaches = mass_mid >= target
        n_inside = tl.where(reaches, tl.sum(n_high, 0), n_inside - tl.sum(n_high, 0))
        lo = tl.where(reaches, mid, lo)
        hi = tl.where(reaches, hi, mid)
        mass_hi = tl.where(reaches, mass_hi, mass_mid)
        step += 1

    # At most CAP tokens left inside [lo, hi): copy them aside (no pass when the search is over) and finish there.
    offset = copy_aside(src, aside, tl.where(hi - lo > 1, n_cols, 0), n_cols, lo.to(tl.int32),
                        tl.minimum(hi, 2147483647).to(tl.int32), BLOCK)
    kept_key, kept_e = load_aside(aside, offset, m, CAP)
    lo, mass_hi = cut_by_mass(kept_key, kept_e, lo, hi, mass_hi, target)

    # lo is the cut value's key, mass_hi the mass above it: ties at the cut kept lowest ids first while the mass
    # before each is below target.
    cut = tl.where(empty, -2147483647 - 1, lo).to(tl.int32)      # an empty row: every key above the cut
    cut_mass = tl.where(empty, 1.0, tl.exp(key_float(lo) - m))
    ties_kept = tl.minimum(tl.ceil((target - mass_hi) / cut_mass), 1073741824.0)
    ties_kept = tl.maximum(ties_kept, 1.0).to(tl.int32)
    store_kept(src, dst, n_cols, cut, ties_kept, m, tl.load(min_p_ptr + row), BLOCK)


def top_p_keep_triton(scores: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """top_p_keep_ref's result (up to rows whose mass lands on p, or a token on min-p's bound, within rounding), one
    program a row; scores' rows contiguous, every p < 1."""
    rows, vocab = scores.shape
    out = torch.empty_like(scores)
    aside = torch.empty(rows, CAP, dtype=torch.float32, device=scores.device)
    if rows:
        _top_p_kernel[(rows,)](scores, out, top_p.to(torch.float32).contiguous(), min_p_values(min_p, rows, scores),
                               aside, vocab, scores.stride(0),
                               BLOCK=BLOCK, CAP=CAP, VALUE_STEPS=VALUE_STEPS, num_warps=WARPS)
    return out


def min_p_values(min_p: torch.Tensor | None, rows: int, scores: torch.Tensor) -> torch.Tensor:
    """The kernels' float32 [R] min-p operand: min_p, or zeros (none) where it is None."""
    if min_p is None:
        return torch.zeros(rows, dtype=torch.float32, device=scores.device)
    return min_p.to(scores.device, torch.float32).contiguous()
