"""Top-p's cut (kernels/top_p.py): the running-sum prefix against a plain Python loop, the sorted reference against
the definition written out, and the radix-walk kernel against both, in the Triton interpreter on the CPU and at
Llama-3's vocabulary on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from cobatch import ops  # noqa: E402
from cobatch.kernels import top_p as top_p_kernels  # noqa: E402
from cobatch.kernels.top_p import top_p_cut_ref, top_p_cut_triton  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE  # noqa: E402


def test_prefix_below_is_the_prefix_a_running_sum_keeps(monkeypatch):
    monkeypatch.setattr(top_p_kernels, "BLOCK_COLUMNS", 8)         # rows of several blocks and a partial last one
    generator = torch.Generator().manual_seed(23)
    weights = torch.rand(6, 29, generator=generator)
    limits = torch.tensor([0.0, 0.3, 4.0, 7.77, float(weights[4].sum()) + 1.0, math.inf])
    ties = weights > 0.5
    rooms = torch.tensor([0, 1, 3, 8, 9, 100])
    for values, bounds in ((weights, limits), (ties, rooms)):
        counts = top_p_kernels.prefix_below(values, bounds).tolist()
        for row in range(values.shape[0]):
            running, expected = 0.0, 0
            for value in values[row].tolist():        # entries kept while the sum before them is below the limit
                if running >= float(bounds[row]):
                    break
                expected += 1
                running += float(value)
            assert counts[row] == expected, (row, counts[row], expected)


def definition_count(row: list[float], p: float) -> tuple[int, list[float]]:
    """How many tokens top-p keeps, from its definition in float64: order by value (then id), keep each token whose
    mass before it is below p. Also the mass before each position."""
    ordered = sorted(row, reverse=True)
    top = ordered[0]
    weights = [math.exp(v - top) for v in ordered]
    total = sum(weights)
    before, running = [], 0.0
    for w in weights:
        before.append(running)
        running += w / total
    return sum(b < p for b in before), before


def kept_count(scores: torch.Tensor, threshold: torch.Tensor, room: torch.Tensor) -> list[int]:
    return ((scores > threshold[:, None]).sum(dim=-1) + room).tolist()


def cut_rows(n_cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that test the walk: spread and peaked scores, all negative ones, a tie straddling the cut, -inf tails,
    one finite value, -0.0 beside 0.0, values near the tempering's stand-in for +inf, and p from 0.01 to 0.999."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n_cols, generator=g) * 3, torch.randn(n_cols, generator=g) * 0.3,
            -torch.rand(n_cols, generator=g) * 50 - 1]
    tied = torch.full((n_cols,), -4.0)
    tied[: n_cols // 3] = 1.0                           # a third of the row ties at the top: the cut lies among them
    tail = torch.randn(n_cols, generator=g)
    tail[7:] = -math.inf
    single = torch.full((n_cols,), -math.inf)
    single[n_cols - 1] = 2.0
    zeros = torch.zeros(n_cols)
    zeros[::2] = -0.0
    huge = torch.randn(n_cols, generator=g)
    huge[3] = huge[5] = torch.finfo(torch.float32).max / 4
    rows += [tied, tail, single, zeros, huge]
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.25, 0.6, 0.01, 0.7, 0.999])
    return torch.stack(rows), top_p


@pytest.mark.parametrize("n_cols", [300, 2 * top_p_kernels.BLOCK + 77])
def test_top_p_cut_ref_is_the_definition(n_cols):
    scores, top_p = cut_rows(n_cols, seed=n_cols)
    counts = kept_count(scores, *top_p_cut_ref(scores, top_p))
    for row, p, count in zip(scores.tolist(), top_p.tolist(), counts):
        want, _ = definition_count(row, p)
        assert count == max(want, 1), (p, count, want)


@pytest.mark.parametrize("n_cols", [300, 2 * top_p_kernels.BLOCK + 77])
def test_top_p_cut_kernel_matches_the_reference(n_cols):
    """Rows chosen so that no mass before a token lies within float32 rounding of p: the kernel's cut is the
    reference's, threshold and room."""
    scores, top_p = cut_rows(n_cols, seed=n_cols)
    want_threshold, want_room = top_p_cut_ref(scores, top_p)
    threshold, room = top_p_cut_triton(scores.to(DEVICE), top_p.to(DEVICE))
    assert threshold.cpu().tolist() == want_threshold.tolist()
    assert room.cpu().tolist() == want_room.tolist()
    tied_row = 3
    assert want_threshold[tied_row] == 1.0 and 1 < want_room[tied_row] < n_cols // 3


def assert_cut_within_rounding(scores: torch.Tensor, top_p: torch.Tensor, counts: list[int]) -> None:
    """Each row's kept count is the definition's, or a token off where the mass before the cut is p to 1e-5."""
    for row, p, count in zip(scores.cpu().tolist(), top_p.tolist(), counts):
        want, before = definition_count(row, p)
        assert abs(count - want) <= 1 and all(abs(before[i] - p) < 1e-5 for i in range(min(count, want),
                                                                                        max(count, want))), (p, count)


@requires_cuda
def test_top_p_cut_kernel_at_llama3_vocabulary():
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(64, 128256, generator=g) * torch.linspace(0.5, 4.0, 64)[:, None]
    scores[5, 1000:] = -math.inf
    top_p = torch.linspace(0.05, 0.98, 64)
    threshold, room = top_p_cut_triton(scores.cuda(), top_p.cuda())
    assert_cut_within_rounding(scores, top_p, kept_count(scores, threshold.cpu(), room.cpu()))
    assert_cut_within_rounding(scores, top_p, kept_count(scores, *top_p_cut_ref(scores, top_p)))


def test_ops_top_p_cut_takes_the_kernel_only_when_switched_on(monkeypatch):
    scores, top_p = cut_rows(300, seed=4)
    calls = []
    monkeypatch.setattr(top_p_kernels, "top_p_cut_triton", lambda *a: calls.append(a) or top_p_cut_ref(*a))
    ops.top_p_cut(scores.to(DEVICE), top_p.to(DEVICE))
    assert not calls
    monkeypatch.setattr(top_p_kernels, "TOP_P_KERNEL", True)
    ops.top_p_cut(scores.to(DEVICE), top_p.to(DEVICE))
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
