"""Top-p's cut, and the prefix a running sum keeps.

prefix_below: per row, how many leading entries have a sum before them below a limit, from block sums and a scan
of the one block where the limit is crossed (a scan of a whole 128k row is one program a row on the GPU). The
sampler's top-k / top-p use it for the mass and for the ties at a cut.

The cut: for each row of tempered scores, the value at which the mass of a descending walk first reaches p, and how
many of the tokens equal to it the walk takes. Top-p keeps the tokens of a stable descending sort (the lower id
first among equal values) whose mass before them is below p. The last token kept has the largest value v with
mass(scores >= v) >= p, and the walk takes the first ceil((p - mass(scores > v)) / p(v)) of the tokens equal to v.
So the cut needs v, not the order: a program a row walks its float keys from the top bits down, DIGIT_BITS at a
time, each pass a histogram of softmax mass over the next digit of the keys that share the digits chosen so far,
and takes the highest digit whose mass (with all the mass above it) still reaches p. Nine passes over the row (the
max and the sum of exp, then eight 4-bit digits) instead of a sort of every row, which took 0.4-0.66 ms for 64 rows
of Llama-3's 128,256 columns on the H100 (bench/results/sampler.json's profile).

The masses are summed in the program's block order, not the sort's, so at a float32 rounding of the mass the cut
may fall a token apart from the sorted reference's; a row's result depends on its own scores and p alone.
"""

from __future__ import annotations

import os

import torch

from cobatch.kernels.triton_support import jit, tl

BLOCK = 1024            # columns a program loads at once
DIGIT_BITS = 4          # bits of the key decided a pass: a histogram of 16 bins
# The kernel takes top-p-alone rows on CUDA only with COBATCH_TOP_P_KERNEL=1 until whole sampler calls have timed it
# against the sort (bench/sampler.py); otherwise top_p_cut_ref.
TOP_P_KERNEL = os.environ.get("COBATCH_TOP_P_KERNEL") == "1"


# Cumulative sums over a whole row of 128k values are one slow scan a row on the GPU (about 0.2 ms at 64 rows of
# Llama-3's vocabulary): prefix_below sums blocks of this many values, then scans the one block where the limit
# is crossed.
BLOCK_COLUMNS = 4096


def prefix_below(weights: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` ([R, N], nonnegative; bool counts as 0/1), how many leading entries have a sum of the
    entries before them below `limit` ([R]): the length of the prefix a running sum keeps. The sum before an
    entry is its block's start (a cumulative sum of block sums) plus the entries before it in its block, so it never
    decreases along the row."""
    rows, n = weights.shape
    size = min(n, BLOCK_COLUMNS)
    blocks = torch.nn.functional.pad(weights, (0, -n % size)).view(rows, -1, size)
    sums = blocks.sum(dim=-1)
    block_start = torch.nn.functional.pad(sums.cumsum(dim=-1)[:, :-1], (1, 0))
    crossing = ((block_start < limit[:, None]).sum(dim=-1) - 1).clamp(min=0)   # the last block starting below
    block = blocks[torch.arange(rows, device=weights.device), crossing]
    before = block_start.gather(1, crossing[:, None]) + torch.nn.functional.pad(block.cumsum(dim=-1)[:, :-1], (1, 0))
    return (crossing * size + (before < limit[:, None]).sum(dim=-1)).clamp(max=n)


def top_p_cut_ref(scores: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold float32 [R], room int64 [R]) for float32 scores [R, V] (no NaN, at least one finite value a row)
    and top_p float32 [R] in (0, 1): the kept tokens are those above the threshold and the first `room` (lowest
    ids) of those equal to it. From the definition: sort, softmax, and the mass before each position."""
    ordered = scores.sort(dim=-1, descending=True).values
    count = prefix_below(ordered.softmax(dim=-1), top_p).clamp(min=1)
    threshold = ordered.gather(1, (count - 1)[:, None])[:, 0]
    return threshold, count - (ordered > threshold[:, None]).sum(dim=-1)


@jit
def _ordered_key(x):
    """uint32 keys in the order of the float32 values (-0.0 taken as 0.0, so that equal values have equal keys)."""
    bits = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@jit
def _top_p_cut_kernel(scores_ptr, top_p_ptr, threshold_ptr, room_ptr, n_cols, row_stride, BLOCK: tl.constexpr,
                      DIGIT_BITS: tl.constexpr):
    """Program row: top_p_cut_ref's threshold and room from a radix walk over the row's keys (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * row_stride
    BINS: tl.constexpr = 1 << DIGIT_BITS
    # the row's max and its sum of exp, online
    m = float("-inf")
    z = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        z = z * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
        m = m_new
    m_ref = tl.where(m > float("-inf"), m, 0.0)
    target = tl.load(top_p_ptr + row) * z
    bins = tl.arange(0, BINS)
    prefix = tl.zeros((), tl.uint32)
    mass_above = 0.0
    for step in tl.static_range(32 // DIGIT_BITS):
        shift = 32 - DIGIT_BITS * (step + 1)
        hist = tl.zeros([BINS], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf"))
            key = _ordered_key(x)
            if step == 0:
                match = cols < n_cols
            else:
                match = (key >> (shift + DIGIT_BITS)) == (prefix >> (shift + DIGIT_BITS))
            digit = (key >> shift) & (BINS - 1)
            weight = tl.where(match, tl.exp(x - m_ref), 0.0)
            hist += tl.sum(tl.where(digit[:, None] == bins[None, :], weight[:, None], 0.0), axis=0)
        # the mass of each digit and every digit above it, then the highest digit at which it reaches the target
        at_or_above = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0.0), axis=1)
        reaches = mass_above + at_or_above >= target
        lowest_held = tl.min(tl.where(hist > 0, bins, BINS - 1), axis=0)
        # a rounding short of the target at every digit: the lowest digit that holds mass (all of it is kept)
        chosen = tl.where(tl.max(reaches.to(tl.int32), axis=0) > 0, tl.max(tl.where(reaches, bins, 0), axis=0),
                          lowest_held)
        mass_above += tl.sum(tl.where(bins > chosen, hist, 0.0), axis=0)
        prefix = prefix | (chosen.to(tl.uint32) << shift)
    bits = tl.where((prefix >> 31) == 1, prefix & 0x7FFFFFFF, prefix ^ 0xFFFFFFFF)
    threshold = bits.to(tl.float32, bitcast=True)
    tie_weight = tl.exp(threshold - m_ref)
    room = tl.minimum(tl.ceil((target - mass_above) / tie_weight), n_cols * 1.0)
    room = tl.where(m > float("-inf"), tl.maximum(room, 1.0), n_cols * 1.0)
    tl.store(threshold_ptr + row, tl.where(m > float("-inf"), threshold, float("-inf")))
    tl.store(room_ptr + row, room.to(tl.int64))


def top_p_cut_triton(scores: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """top_p_cut_ref's (threshold, room), a program a row."""
    assert scores.dim() == 2 and scores.stride(-1) == 1 and scores.dtype == torch.float32
    rows, n_cols = scores.shape
    assert top_p.shape == (rows,) and top_p.dtype == torch.float32
    threshold = torch.empty(rows, dtype=torch.float32, device=scores.device)
    room = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows:
        _top_p_cut_kernel[(rows,)](scores, top_p, threshold, room, n_cols, scores.stride(0), BLOCK=BLOCK,
                                   DIGIT_BITS=DIGIT_BITS, num_warps=8)
    return threshold, room

