"""Top-p without a sort (kernels/top_p.py): the kernel and the sort reference against the nucleus written out in
Python (float64 masses, the tokens by value with the lower id first among equals), on rows made to reach every
part of the kernel's search: a nucleus of one token, of hundreds of ties, of more tokens than the kernel sets
aside, filtered (-inf) tokens, an empty row. Rows of a few thousand columns run in the Triton interpreter on the
CPU; Llama-3's vocabulary on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from cobatch import ops  # noqa: E402
from cobatch.engine import sampler as sampler_module  # noqa: E402
from cobatch.engine.sampler import Sampler, SampleRow, SamplingParams  # noqa: E402
from cobatch.kernels.top_p import BLOCK, CAP, top_p_keep_ref, top_p_keep_triton  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE  # noqa: E402


def nucleus(row: list[float], p: float) -> set[int]:
    """The spec: order by value, largest first, the lower id first among equals; keep tokens while the mass
    before them is below p (the first always)."""
    order = sorted((i for i, v in enumerate(row) if v > -math.inf), key=lambda i: (-row[i], i))
    if not order:
        return set()
    weights = [math.exp(row[i] - row[order[0]]) for i in order]
    total, before, kept = sum(weights), 0.0, []
    for token, weight in zip(order, weights):
        if kept and before >= p:
            break
        kept.append(token)
        before += weight / total
    return set(kept)


def crafted_rows(n_cols: int, seed: int) -> tuple[torch.Tensor, list[float]]:
    g = torch.Generator().manual_seed(seed)
    rows, ps = [], []

    def add(row: torch.Tensor, p: float) -> None:
        rows.append(row)
        ps.append(p)

    add(torch.randn(n_cols, generator=g) * 3, 0.9)                          # a few hundred tokens
    add(torch.randn(n_cols, generator=g) * 3 / 0.7, 0.95)
    add((torch.randn(n_cols, generator=g) * 32).round() / 4, 0.5)            # steps of 1/4: ties everywhere
    add(torch.zeros(n_cols), 0.3)                                             # all tied: the lowest ids
    add(torch.randn(n_cols, generator=g) * 0.01, 0.99)                        # nearly flat: most of the row
    peaked = torch.randn(n_cols, generator=g)
    peaked[n_cols // 2] = 30.0
    add(peaked, 0.9)                                                          # one token holds it all
    filtered = torch.randn(n_cols, generator=g) * 3
    filtered[::3] = -math.inf
    add(filtered, 0.7)
    add(torch.full((n_cols,), -math.inf), 0.9)                                # nothing left
    cut_ties = torch.full((n_cols,), -5.0)
    cut_ties[: n_cols // 2 : 7] = 1.0                                         # ties at the cut across blocks
    cut_ties[n_cols - 1] = 3.0
    add(cut_ties, 0.6)
    add(torch.randn(n_cols, generator=g) * 3, 0.01)                           # the top token alone
    return torch.stack(rows), ps


@pytest.mark.parametrize("n_cols", [37, BLOCK + 1, CAP + 1900])
def test_top_p_keeps_the_nucleus_of_its_definition(n_cols):
    scores, ps = crafted_rows(n_cols, seed=n_cols)
    top_p = torch.tensor(ps)
    for way in (top_p_keep_ref, top_p_keep_triton):
        kept = way(scores.to(DEVICE), top_p.to(DEVICE)).cpu()
        for row, p in enumerate(ps):
            want = nucleus(scores[row].tolist(), p)
            got = set(torch.nonzero(torch.isfinite(kept[row])).flatten().tolist())
            assert got == want, (way.__name__, row, len(got), len(want))
            assert torch.equal(kept[row][list(got)], scores[row][list(got)])
    if n_cols > CAP:
        assert len(nucleus(scores[4].tolist(), 0.99)) > CAP      # the search's last interval was too wide to set aside


def test_top_p_then_min_p():
    """min-p in the output pass: of the nucleus, the tokens whose probability is at least min_p times the
    largest's."""
    scores, ps = crafted_rows(BLOCK + 1, seed=5)
    min_ps = [(0.05, 0.2, 0.0)[row % 3] for row in range(len(ps))]
    for way in (top_p_keep_ref, top_p_keep_triton):
        kept = way(scores.to(DEVICE), torch.tensor(ps).to(DEVICE), torch.tensor(min_ps).to(DEVICE)).cpu()
        for row, p in enumerate(ps):
            row_values = scores[row].tolist()
            top = max(row_values)
            want = {i for i in nucleus(row_values, p) if math.exp(row_values[i] - top) >= min_ps[row]}
            got = set(torch.nonzero(torch.isfinite(kept[row])).flatten().tolist())
            assert got == want, (way.__name__, row, len(got), len(want))
            assert torch.equal(kept[row][list(got)], scores[row][list(got)])
    assert len(nucleus(scores[0].tolist(), 0.9)) > sum(math.exp(v - float(scores[0].max())) >= 0.05
                                                       for v in scores[0].tolist())      # min-p cut row 0's nucleus


def test_a_rows_nucleus_does_not_depend_on_the_other_rows():
    scores, ps = crafted_rows(BLOCK + 300, seed=7)
    scores, top_p = scores.to(DEVICE), torch.tensor(ps, device=DEVICE)
    together = top_p_keep_triton(scores, top_p)
    for row in range(len(ps)):
        alone = top_p_keep_triton(scores[row:row + 1], top_p[row:row + 1])
        assert torch.equal(alone[0], together[row]), row


def test_top_p_reads_row_strides():
    scores, ps = crafted_rows(300, seed=8)
    wide = torch.cat([scores, torch.zeros_like(scores)], dim=1).to(DEVICE)
    view = wide[:, :300]
    kept = top_p_keep_triton(view, torch.tensor(ps, device=DEVICE)).cpu()
    for row, p in enumerate(ps):
        assert set(torch.nonzero(torch.isfinite(kept[row])).flatten().tolist()) == nucleus(scores[row].tolist(), p)


def test_ops_top_p_keep_on_the_cpu_is_the_reference():
    scores, ps = crafted_rows(50, seed=9)
    assert torch.equal(ops.top_p_keep(scores, torch.tensor(ps)), top_p_keep_ref(scores, torch.tensor(ps)))


def test_the_sampler_filters_top_p_alone_through_ops_top_p_keep(monkeypatch):
    """Where ops run kernels (made so here), rows with top-p alone go through ops.top_p_keep (the reference here,
    the kernel on CUDA) and the others through the top-k paths: each row keeps the tokens of its definition."""
    monkeypatch.setattr(sampler_module, "TOP_P_KERNEL", True)
    monkeypatch.setattr(ops, "runs_kernels", lambda scores: True)
    calls = []
    monkeypatch.setattr(ops, "top_p_keep", lambda scores, top_p, min_p: calls.append(top_p.tolist()) or
                        top_p_keep_ref(scores, top_p, min_p))
    g = torch.Generator().manual_seed(13)
    scores = torch.randn(5, 700, generator=g) * 3
    top_k, top_p = [0, 40, 0, 0, 700], [0.9, 0.8, 1.0, 0.5, 0.7]
    filtered = sampler_module.filter_logits(scores, top_k, top_p, [0.0] * 5)
    assert calls == [[pytest.approx(0.9), pytest.approx(0.5), pytest.approx(0.7)]]     # rows 0, 3 and 4
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        order = sorted(range(700), key=lambda i: (-float(scores[row, i]), i))
        pool = order[:k] if 0 < k < 700 else order
        want = nucleus([float(scores[row, i]) if i in set(pool) else -math.inf for i in range(700)], p)
        assert set(torch.nonzero(torch.isfinite(filtered[row])).flatten().tolist()) == want, row


def agrees_up_to_rounding(got: set[int], want: set[int], row: torch.Tensor, p: float) -> bool:
    """Equal sets, or one token apart where the mass before it lies within float32 rounding of p (the kernel sums
    the masses in another order than the sort's running sum)."""
    if got == want:
        return True
    extra = got ^ want
    if len(extra) != 1:
        return False
    probs = torch.softmax(row.double(), dim=-1)
    (token,) = extra
    before = float(probs[probs > probs[token]].sum())
    return abs(before - p) < 1e-5


@requires_cuda
def test_top_p_kernel_on_llama3s_vocabulary():
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(64, 128256, generator=g) * 3 / 0.7
    scores[8:16] = torch.randn(8, 128256, generator=g) * 0.05                  # nuclei of more than CAP tokens
    scores[16:24, :1000] += 12.0                                              # a peaked head
    ps = ([0.5, 0.8, 0.9, 0.95, 0.99, 0.3] * 11)[:64]
    top_p = torch.tensor(ps, device="cuda")
    got = top_p_keep_triton(scores.cuda(), top_p).cpu()
    want = top_p_keep_ref(scores.cuda(), top_p).cpu()
    for row in range(64):
        kept = set(torch.nonzero(torch.isfinite(got[row])).flatten().tolist())
        ref = set(torch.nonzero(torch.isfinite(want[row])).flatten().tolist())
        assert agrees_up_to_rounding(kept, ref, scores[row], ps[row]), (row, len(kept), len(ref))


@requires_cuda
def test_sampler_with_the_top_p_kernel_draws_from_the_nucleus(monkeypatch):
    """Whole sampler calls with top-p alone, the kernel's way against the sort's: the same tokens where the kept
    sets agree (the same Gumbel noise over the same survivors)."""
    g = torch.Generator().manual_seed(12)
    logits = (torch.randn(32, 128256, generator=g) * 3).cuda()
    rows = [SampleRow(SamplingParams(temperature=0.7, top_p=0.9), seed=i, step=3, prompt_ids=(), output_ids=())
            for i in range(32)]
    monkeypatch.setattr(sampler_module, "TOP_P_KERNEL", False)
    sorted_tokens = Sampler()(logits, rows).token_ids.tolist()
    monkeypatch.setattr(sampler_module, "TOP_P_KERNEL", True)
    kernel_tokens = Sampler()(logits, rows).token_ids.tolist()
    assert sum(a == b for a, b in zip(sorted_tokens, kernel_tokens)) >= 31
