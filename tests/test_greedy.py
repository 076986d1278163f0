"""Token picks (kernels/greedy.py): greedy tokens against a plain Python scan (the first column of each row's
largest value, NaN as -inf), and Gumbel-max against the same scan over the scores less log(-log u) of the
sampler's counter noise in torch. Rows of a few chunks run in the Triton interpreter on the CPU; Llama-3's
vocabulary on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from cobatch import ops  # noqa: E402
from cobatch.kernels.greedy import (CHUNK, counter_uniforms, greedy_tokens_ref, greedy_tokens_triton,  # noqa: E402
                                   gumbel_tokens_ref, gumbel_tokens_triton, token_noise_key)
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE  # noqa: E402


def first_max(row: list[float]) -> int:
    """The spec, written out: scan left to right, move only on a strictly larger value, NaN never larger."""
    best, best_col = -math.inf, 0
    for col, value in enumerate(row):
        if not math.isnan(value) and value > best:
            best, best_col = value, col
    return best_col


def crafted_rows(n_cols: int, seed: int) -> torch.Tensor:
    """Random rows, then rows made to catch a wrong tie, NaN or infinity rule, and maxima at chunk edges."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n_cols, generator=g) for _ in range(3)]

    def row_of(fill: float, **at: float) -> torch.Tensor:
        r = torch.full((n_cols,), fill)
        for col, value in at.items():
            r[int(col.removeprefix("c"))] = value
        return r

    last, edge = n_cols - 1, min(CHUNK, n_cols - 1)
    rows += [
        row_of(0.0),                                               # all equal: column 0
        row_of(-math.inf),                                         # all -inf: column 0
        row_of(math.nan),                                          # all NaN: column 0
        row_of(-1.0, **{f"c{edge}": 5.0, f"c{last}": 5.0}),       # a tie across chunks: the first
        row_of(-1.0, **{f"c{last}": 5.0, "c3": 4.0}),              # the max in the last (partial) chunk
        row_of(1.0, **{"c0": math.nan, f"c{edge}": math.inf, f"c{last}": math.inf}),   # +inf wins, first one
        row_of(math.nan, **{f"c{last}": -3.0}),                    # one number among NaNs
        row_of(0.0, **{"c2": -0.0, "c0": -0.0}),                   # -0.0 == 0.0: column 0
        row_of(-2.0, **{"c7": 3.0, "c9": 3.0}),                    # a tie inside one block
        row_of(0.0, **{"c1": math.nan, "c5": 2.0}),                # a NaN in the max's own block
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_cols", [37, CHUNK + 1, 2 * CHUNK + 500])
def test_greedy_tokens_kernel_and_reference(dtype, n_cols):
    logits = crafted_rows(n_cols, seed=n_cols).to(DEVICE, dtype)
    want = [first_max(row) for row in logits.float().cpu().tolist()]
    assert greedy_tokens_ref(logits).tolist() == want
    assert greedy_tokens_triton(logits).tolist() == want


def test_greedy_tokens_reads_row_strides():
    """A view of every other row of a wider tensor (the rows' stride is not their width)."""
    wide = crafted_rows(CHUNK + 3, seed=5).repeat_interleave(2, dim=0).to(DEVICE)
    view = wide[::2, : CHUNK + 1]
    assert greedy_tokens_triton(view).tolist() == [first_max(row) for row in view.cpu().tolist()]


def test_ops_greedy_tokens_on_the_cpu_is_the_reference():
    logits = crafted_rows(50, seed=2)
    assert ops.greedy_tokens(logits).tolist() == [first_max(row) for row in logits.tolist()]


def noised_first_max(scores: torch.Tensor, row_keys: torch.Tensor, token_keys: torch.Tensor,
                     fallback: torch.Tensor) -> list[int]:
    """The scan over each row's scores less log(-log u), u from the torch noise, in float32 as the sampler makes it;
    a row with no finite score takes its fallback."""
    noised = scores.cpu() - torch.log(-torch.log(counter_uniforms(row_keys.cpu(), token_keys.cpu())))
    return [first_max(row) if any(v > -math.inf for v in row) else spare
            for row, spare in zip(noised.tolist(), fallback.tolist())]


def gumbel_case(rows: int, n_cols: int, seed: int):
    """Scores as the sampler hands them over: tempered, NaN-free, some tokens filtered out (-inf), one row all out."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n_cols, generator=g) * 3
    scores[torch.rand(rows, n_cols, generator=g) < 0.3] = -math.inf
    scores[1] = -math.inf
    row_keys = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64)
    fallback = torch.randint(0, n_cols, (rows,), generator=g, dtype=torch.int64)
    return (scores.to(DEVICE), row_keys.to(DEVICE), token_noise_key(torch.arange(n_cols)).to(DEVICE),
            fallback.to(DEVICE))


@pytest.mark.parametrize("n_cols", [37, CHUNK + 900])
def test_gumbel_tokens_kernel_and_reference(n_cols):
    scores, row_keys, token_keys, fallback = gumbel_case(6, n_cols, seed=n_cols)
    want = noised_first_max(scores, row_keys, token_keys, fallback)
    assert want[1] == fallback[1].item()                  # nothing left: the fallback
    assert gumbel_tokens_ref(scores, row_keys, token_keys, fallback).tolist() == want
    assert gumbel_tokens_triton(scores, row_keys, token_keys, fallback).tolist() == want


def tempered_by_hand(logits: torch.Tensor, inverse_temperature: torch.Tensor) -> torch.Tensor:
    """The sampler's tempering, value by value: times 1 / T in float32; NaN out (-inf); +inf, or an overflow to it,
    becomes the largest float32 over 4 (so that noise added to it stays finite)."""
    huge = torch.finfo(torch.float32).max / 4
    out = []
    for row, scale in zip(logits.float().cpu().tolist(), inverse_temperature.cpu().tolist()):
        values = (torch.tensor(row) * torch.tensor(scale, dtype=torch.float32)).tolist()
        out.append([-math.inf if math.isnan(v) else huge if v == math.inf else v for v in values])
    return torch.tensor(out)


@pytest.mark.parametrize("n_cols", [37, CHUNK + 900])
def test_gumbel_tokens_temper_raw_logits_in_the_same_pass(n_cols):
    """Logits with NaN, infinities and values that overflow under a small temperature, tempered by the kernel."""
    _, row_keys, token_keys, fallback = gumbel_case(6, n_cols, seed=n_cols + 1)
    g = torch.Generator().manual_seed(n_cols)
    logits = torch.randn(6, n_cols, generator=g) * 3
    logits[0, 5], logits[2, n_cols - 1], logits[3, 7] = math.nan, math.inf, -math.inf
    logits[4, 9] = logits[4, n_cols - 2] = 1e37                  # both overflow to +inf at T = 0.01: the first wins
    logits[1] = math.nan                                         # nothing left: the fallback
    inverse_temperature = torch.tensor([1.0, 1.25, 1 / 0.7, 2.0, 100.0, 0.5], dtype=torch.float32)
    want = noised_first_max(tempered_by_hand(logits, inverse_temperature), row_keys, token_keys, fallback)
    assert want[1] == fallback[1].item() and want[2] == n_cols - 1 and want[4] == 9
    logits, inverse_temperature = logits.to(DEVICE), inverse_temperature.to(DEVICE)
    assert gumbel_tokens_ref(logits, row_keys, token_keys, fallback, inverse_temperature).tolist() == want
    assert gumbel_tokens_triton(logits, row_keys, token_keys, fallback, inverse_temperature).tolist() == want


def test_gumbel_tokens_follow_the_row_keys():
    """Equal scores: the noise alone chooses, so rows with other keys choose other tokens, equal keys the same."""
    n_cols = 500
    scores = torch.zeros(4, n_cols, device=DEVICE)
    row_keys = torch.tensor([7, 8, 7, 2**32 - 1], dtype=torch.int64, device=DEVICE)
    fallback = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)
    tokens = gumbel_tokens_triton(scores, row_keys, token_noise_key(torch.arange(n_cols)).to(DEVICE),
                                  fallback).tolist()
    assert tokens[0] == tokens[2] and len({tokens[0], tokens[1], tokens[3]}) == 3


@requires_cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_greedy_tokens_at_llama3_vocabulary(batch):
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, 128256, generator=g) * 4
    logits[:, 128255] = logits.max() + 1              # the last column wins in every row...
    logits[::2, 4096 * 7] = logits.max()              # ...but a tie in even rows is won by the earlier one
    logits[1::4, 1000] = math.nan
    logits = logits.cuda()
    assert torch.equal(greedy_tokens_triton(logits), greedy_tokens_ref(logits))
    assert greedy_tokens_triton(logits)[0].item() == 4096 * 7


@requires_cuda
def test_gumbel_tokens_at_llama3_vocabulary():
    case = gumbel_case(64, 128256, seed=3)
    assert gumbel_tokens_triton(*case).tolist() == gumbel_tokens_ref(*case).tolist()
    logits = case[0].clone()
    logits[1] = math.nan
    logits[3, 1000] = math.inf
    inverse_temperature = torch.linspace(0.5, 3.0, 64, device="cuda")
    tempered = (logits, *case[1:], inverse_temperature)
    assert gumbel_tokens_triton(*tempered).tolist() == gumbel_tokens_ref(*tempered).tolist()
