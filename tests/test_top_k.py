"""Top-k then top-p without a sort (kernels/top_k.py): the kernel and the sort reference against the set written out
in Python (the k largest tokens, lower ids first among equals, then the nucleus of those k alone), on rows made to
reach every part of the kernel's search: ties at the k-th value, more of them than the kernel sets aside, fewer
finite tokens than k, an empty row, k = 1 and k = CAP, top-k alone. Rows of a few thousand columns run in the
Triton interpreter on the CPU; Llama-3's vocabulary on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from cobatch import ops  # noqa: E402
from cobatch.engine import sampler as sampler_module  # noqa: E402
from cobatch.engine.sampler import Sampler, SampleRow, SamplingParams  # noqa: E402
from cobatch.kernels.top_k import top_k_keep_ref, top_k_keep_triton  # noqa: E402
from cobatch.kernels.top_p import BLOCK, CAP  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE  # noqa: E402
from test_top_p import agrees_up_to_rounding, nucleus  # noqa: E402


def top_k_set(row: list[float], k: int, p: float) -> set[int]:
    """The spec: the k largest finite tokens, the lower id first among equals, then the nucleus of p over them
    (p = 1: all k)."""
    order = sorted((i for i, v in enumerate(row) if v > -math.inf), key=lambda i: (-row[i], i))
    pool = set(order[:k])
    if p >= 1.0:
        return pool
    return nucleus([v if i in pool else -math.inf for i, v in enumerate(row)], p)


def above_min_p(row: list[float], kept, min_p: float) -> set[int]:
    """Of the tokens `kept`, those whose probability is at least min_p times the row's largest."""
    top = max(row)
    return {i for i in kept if math.exp(row[i] - top) >= min_p}


def crafted_rows(n_cols: int, seed: int) -> tuple[torch.Tensor, list[int], list[float]]:
    g = torch.Generator().manual_seed(seed)
    rows, ks, ps = [], [], []

    def add(row: torch.Tensor, k: int, p: float) -> None:
        rows.append(row)
        ks.append(min(k, n_cols - 1))
        ps.append(p)

    add(torch.randn(n_cols, generator=g) * 3, 40, 0.95)                      # llama.cpp's settings
    add(torch.randn(n_cols, generator=g) * 3, 40, 1.0)                       # top-k alone
    add(torch.randn(n_cols, generator=g) * 3, 1, 0.9)                        # k = 1
    add(torch.randn(n_cols, generator=g) * 0.01, CAP, 0.99)                  # k = CAP, nearly flat
    add((torch.randn(n_cols, generator=g) * 32).round() / 4, 50, 0.8)        # steps of 1/4: ties everywhere
    add((torch.randn(n_cols, generator=g) * 32).round() / 4, 300, 1.0)
    add(torch.zeros(n_cols), 7, 1.0)                                          # all tied: the lowest ids
    few_large = torch.zeros(n_cols)
    few_large[[5, n_cols // 2, n_cols - 2]] = 4.0
    add(few_large, 10, 1.0)                                                   # ties at the k-th beyond any copy
    add(few_large.clone(), 10, 0.9)
    sparse = torch.full((n_cols,), -math.inf)
    sparse[[3, 17, n_cols - 1, n_cols // 3, 30]] = torch.tensor([1.0, 2.0, 0.5, 2.0, -1.0])
    add(sparse, 40, 0.95)                                                     # fewer finite tokens than k
    add(torch.full((n_cols,), -math.inf), 40, 0.9)                            # nothing left
    cut_ties = torch.full((n_cols,), -5.0)
    cut_ties[: n_cols // 2 : 7] = 1.0                                         # ties at the cut across blocks
    cut_ties[n_cols - 1] = 3.0
    add(cut_ties, 200, 0.6)
    add(cut_ties.clone(), 20, 1.0)
    add(torch.randn(n_cols, generator=g) * 3, 64, 0.01)                       # the top token alone
    return torch.stack(rows), ks, ps


@pytest.mark.parametrize("n_cols", [37, BLOCK + 1, CAP + 1900])
def test_top_k_keeps_the_set_of_its_definition(n_cols):
    scores, ks, ps = crafted_rows(n_cols, seed=n_cols)
    top_k, top_p = torch.tensor(ks), torch.tensor(ps)
    min_ps = [(0.0, 0.05, 0.2)[row % 3] for row in range(len(ks))]
    for way in (top_k_keep_ref, top_k_keep_triton):
        kept = way(scores.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), torch.tensor(min_ps).to(DEVICE)).cpu()
        for row, (k, p) in enumerate(zip(ks, ps)):
            want = above_min_p(scores[row].tolist(), top_k_set(scores[row].tolist(), k, p), min_ps[row])
            got = set(torch.nonzero(torch.isfinite(kept[row])).flatten().tolist())
            assert got == want, (way.__name__, row, len(got), len(want))
            assert torch.equal(kept[row][list(got)], scores[row][list(got)])
    if n_cols > CAP:
        assert int((scores[7] == 0.0).sum()) > CAP       # the k-th value's ties were too many to set aside


def test_a_rows_top_k_set_does_not_depend_on_the_other_rows():
    scores, ks, ps = crafted_rows(BLOCK + 300, seed=7)
    scores, top_k, top_p = scores.to(DEVICE), torch.tensor(ks, device=DEVICE), torch.tensor(ps, device=DEVICE)
    together = top_k_keep_triton(scores, top_k, top_p)
    for row in range(len(ps)):
        alone = top_k_keep_triton(scores[row:row + 1], top_k[row:row + 1], top_p[row:row + 1])
        assert torch.equal(alone[0], together[row]), row


def test_top_k_reads_row_strides():
    scores, ks, ps = crafted_rows(300, seed=8)
    view = torch.cat([scores, torch.zeros_like(scores)], dim=1).to(DEVICE)[:, :300]
    kept = top_k_keep_triton(view, torch.tensor(ks, device=DEVICE), torch.tensor(ps, device=DEVICE)).cpu()
    for row, (k, p) in enumerate(zip(ks, ps)):
        assert set(torch.nonzero(torch.isfinite(kept[row])).flatten().tolist()) == top_k_set(scores[row].tolist(),
                                                                                           k, p)


def test_ops_top_k_keep_on_the_cpu_is_the_reference():
    scores, ks, ps = crafted_rows(50, seed=9)
    top_k, top_p = torch.tensor(ks), torch.tensor(ps)
    assert torch.equal(ops.top_k_keep(scores, top_k, top_p), top_k_keep_ref(scores, top_k, top_p))


def test_the_sampler_filters_top_k_rows_through_ops_top_k_keep(monkeypatch):
    """Where ops run kernels (made so here), rows with a top-k of at most CAP go through ops.top_k_keep (the
    reference here, the kernel on CUDA), with their top-p or 1 and, with MIN_P_IN_KERNELS, their min-p; the others
    through the other paths: each row keeps the tokens of its definition."""
    monkeypatch.setattr(sampler_module, "TOP_K_KERNEL", True)
    monkeypatch.setattr(sampler_module, "MIN_P_IN_KERNELS", True)
    monkeypatch.setattr(ops, "runs_kernels", lambda scores: True)
    calls = []
    monkeypatch.setattr(ops, "top_k_keep", lambda scores, top_k, top_p, min_p: calls.append(
        (top_k.tolist(), top_p.tolist(), min_p.tolist())) or top_k_keep_ref(scores, top_k, top_p, min_p))
    n_cols = CAP + 300
    g = torch.Generator().manual_seed(13)
    scores = torch.randn(5, n_cols, generator=g) * 3
    top_k, top_p, min_p = [0, 40, CAP + 1, 7, 0], [0.9, 0.8, 0.7, 1.0, 1.0], [0.0, 0.3, 0.05, 0.0, 0.1]
    filtered = sampler_module.filter_logits(scores, top_k, top_p, min_p)
    assert calls == [([40, 7], [pytest.approx(0.8), 1.0], [pytest.approx(0.3), 0.0])]       # rows 1 and 3
    for row, (k, p, least) in enumerate(zip(top_k, top_p, min_p)):
        want = above_min_p(scores[row].tolist(), top_k_set(scores[row].tolist(), k if k else n_cols, p), least)
        assert set(torch.nonzero(torch.isfinite(filtered[row])).flatten().tolist()) == want, row
    assert len(top_k_set(scores[1].tolist(), 40, 0.8)) > len(above_min_p(scores[1].tolist(), range(n_cols), 0.3))


def test_on_the_cpu_the_sampler_keeps_its_torch_ways(monkeypatch):
    """Where ops run no kernels (the CPU), the sampler filters by torch.topk's prefix and the sort, not by the
    kernels' references (which sort every row)."""
    def no_kernel(*args):
        raise AssertionError("a kernel's op called on the CPU")

    monkeypatch.setattr(ops, "top_k_keep", no_kernel)
    monkeypatch.setattr(ops, "top_p_keep", no_kernel)
    g = torch.Generator().manual_seed(14)
    scores = torch.randn(3, 500, generator=g) * 3
    top_k, top_p = [40, 0, 5], [0.9, 0.8, 1.0]
    filtered = sampler_module.filter_logits(scores, top_k, top_p, [0.0] * 3)
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        want = top_k_set(scores[row].tolist(), k if k else 500, p)
        assert set(torch.nonzero(torch.isfinite(filtered[row])).flatten().tolist()) == want, row


@requires_cuda
def test_top_k_kernel_on_llama3s_vocabulary():
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(64, 128256, generator=g) * 3 / 0.7
    scores[8:16] = torch.randn(8, 128256, generator=g) * 0.05                  # k = CAP of a flat row
    scores[16:24, :1000] += 12.0                                              # a peaked head
    ks = ([40, 1, 64, 200, 1000, CAP, 40, 20] * 8)[:64]
    ps = ([0.95, 0.9, 1.0, 0.8, 0.99, 0.5, 1.0] * 10)[:64]
    top_k, top_p = torch.tensor(ks, device="cuda"), torch.tensor(ps, device="cuda")
    got = top_k_keep_triton(scores.cuda(), top_k, top_p).cpu()
    want = top_k_keep_ref(scores.cuda(), top_k, top_p).cpu()
    for row in range(64):
        kept = set(torch.nonzero(torch.isfinite(got[row])).flatten().tolist())
        ref = set(torch.nonzero(torch.isfinite(want[row])).flatten().tolist())
        pool = torch.full_like(scores[row], -math.inf)
        top = scores[row].topk(ks[row]).indices
        pool[top] = scores[row][top]
        assert agrees_up_to_rounding(kept, ref, pool, ps[row]), (row, len(kept), len(ref))


@requires_cuda
def test_sampler_with_the_top_k_kernel_draws_from_the_same_set(monkeypatch):
    """Whole sampler calls with llama.cpp's settings, the kernel's way against torch.topk's: the same tokens where
    the kept sets agree (the same Gumbel noise over the same survivors)."""
    g = torch.Generator().manual_seed(12)
    logits = (torch.randn(32, 128256, generator=g) * 3).cuda()
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    rows = [SampleRow(params, seed=i, step=3, prompt_ids=(), output_ids=()) for i in range(32)]
    monkeypatch.setattr(sampler_module, "TOP_K_KERNEL", False)
    topk_tokens = Sampler()(logits, rows).token_ids.tolist()
    monkeypatch.setattr(sampler_module, "TOP_K_KERNEL", True)
    kernel_tokens = Sampler()(logits, rows).token_ids.tolist()
    assert sum(a == b for a, b in zip(topk_tokens, kernel_tokens)) >= 31
    monkeypatch.setattr(sampler_module, "MIN_P_IN_KERNELS", True)
    min_p_inside = Sampler()(logits, rows).token_ids.tolist()
    assert sum(a == b for a, b in zip(topk_tokens, min_p_inside)) >= 31
