"""Sampler tests: exact checks against hand computations, and distribution checks (chi-square at p ~ 1e-4)
against target probabilities computed here in float64 from the definitions, never by the sampler.

Many independent draws are taken in one call as many rows (one seed or one step per row), which is
both fast and exactly how the engine batches requests.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from cobatch.engine import sampler as sampler_module
from cobatch.engine.sampler import (
    MAX_TOP_LOGPROBS,
    Sampler,
    SampleRow,
    SamplingParams,
    apply_penalties,
    filter_logits,
    row_noise_key,
)
from cobatch.kernels.greedy import counter_uniforms, fmix32, token_noise_key

# Logits of a small vocabulary with well-separated probabilities (no top-p boundary lands near a cut).
SMALL_LOGITS = [1.5, 0.9, 0.6, 0.2, 0.0, -0.4, -1.0, -2.0]
DRAWS = 20_000


# --- independent references --------------------------------------------------------------------------

def reference_fmix32(h: int) -> int:
    """MurmurHash3 fmix32 written the textbook way (wrapping 32-bit multiplies)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def reference_probs(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> list[float]:
    """Target distribution from the definitions: softmax(logits/T); keep the top-k; then the smallest prefix
    of the top-k-renormalized distribution whose mass reaches top_p; then p >= min_p * p_max; renormalize."""
    scaled = [x / temperature for x in logits]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    kept = order[:top_k] if top_k else order
    kept_mass = sum(probs[i] for i in kept)
    nucleus, mass_before = [], 0.0
    for i in kept:
        if top_p < 1.0 and mass_before >= top_p:
            break
        assert top_p == 1.0 or abs(mass_before - top_p) > 1e-3, "test data too close to a top-p cut"
        nucleus.append(i)
        mass_before += probs[i] / kept_mass
    final = [i for i in nucleus if probs[i] >= min_p * max(probs)]
    total = sum(probs[i] for i in final)
    return [probs[i] / total if i in final else 0.0 for i in range(len(probs))]


def chi_square_critical(dof: int, z: float = 3.719) -> float:
    """Upper chi-square quantile at p ~ 1e-4 (Wilson-Hilferty; slightly conservative for small dof)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def assert_matches_distribution(tokens: torch.Tensor, expected: list[float]) -> None:
    counts = torch.bincount(tokens, minlength=len(expected)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, f"filtered token {token} was sampled {count} times"
    support = [(c, p * len(tokens)) for c, p in zip(counts, expected) if p > 0]
    if len(support) < 2:
        return
    statistic = sum((c - e) ** 2 / e for c, e in support)
    assert statistic < chi_square_critical(len(support) - 1), (statistic, counts, expected)


# --- helpers -------------------------------------------------------------------------------------------

def make_row(params: SamplingParams, seed: int = 0, step: int = 0, prompt_ids=(), output_ids=()) -> SampleRow:
    return SampleRow(params=params, seed=seed, step=step, prompt_ids=list(prompt_ids), output_ids=list(output_ids))


def draw_many(logits: list[float], params: SamplingParams, n: int = DRAWS, seed_base: int = 12345) -> torch.Tensor:
    """n independent draws: one row per seed, all with the same logits."""
    batch = torch.tensor([logits], dtype=torch.float32).expand(n, -1)
    rows = [SampleRow(params, seed_base + i, 7, (), ()) for i in range(n)]
    return Sampler()(batch, rows).token_ids


def random_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


# --- counter-based noise --------------------------------------------------------------------------------

def test_fmix32_matches_textbook_murmur3_on_tensors_and_ints():
    rng = random.Random(1)
    values = [0, 1, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF] + [rng.getrandbits(32) for _ in range(2000)]
    expected = [reference_fmix32(v) for v in values]
    assert fmix32(torch.tensor(values, dtype=torch.int64)).tolist() == expected
    assert [fmix32(v) for v in values[:50]] == expected[:50]


def test_counter_uniforms_are_in_open_unit_interval_and_uniform():
    row_keys = torch.tensor([row_noise_key(seed, step) for seed in range(20) for step in range(10)])
    u = counter_uniforms(row_keys, token_noise_key(torch.arange(1000)))
    assert u.shape == (200, 1000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    expected = u.numel() / 20
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < chi_square_critical(19)


def test_noise_key_uses_the_whole_seed_and_step():
    keys = {row_noise_key(seed, step) for seed in (0, 1, 1 << 32, 1 << 62, (1 << 63) - 1) for step in (0, 1, 1 << 33)}
    assert len(keys) == 15


# --- greedy --------------------------------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = random_logits(16, 100, seed=0)
    rows = [make_row(SamplingParams(temperature=0.0, top_k=i % 5, top_p=0.5, min_p=0.1), seed=i) for i in range(16)]
    out = Sampler()(logits, rows)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_greedy_rows_stay_argmax_inside_a_mixed_batch():
    logits = random_logits(12, 50, seed=1)
    rows = [make_row(SamplingParams(temperature=0.0 if i % 2 else 1.3, top_k=10 * (i % 3)), seed=i) for i in range(12)]
    out = Sampler()(logits, rows).token_ids.tolist()
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[i] for i in range(1, 12, 2)] == [argmax[i] for i in range(1, 12, 2)]


def test_bf16_logits_are_accepted():
    logits = random_logits(4, 30, seed=2).to(torch.bfloat16)
    rows = [make_row(SamplingParams(temperature=0.0))] * 4
    assert Sampler()(logits, rows).token_ids.tolist() == logits.float().argmax(dim=-1).tolist()


# --- penalties ------------------------------------------------------------------------------------------

def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]] * 4)
    rows = [
        # prompt {0, 1}, output 3,3,4: repetition over {0,1,3,4}, then counts 3->2, 4->1
        make_row(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
                 prompt_ids=[0, 1], output_ids=[3, 3, 4]),
        make_row(SamplingParams(), prompt_ids=[0, 1, 2], output_ids=[4, 4]),                 # no penalties
        make_row(SamplingParams(repetition_penalty=0.5), prompt_ids=[5, 2, 2], output_ids=[1]),
        make_row(SamplingParams(presence_penalty=-1.0, frequency_penalty=1.0),
                 prompt_ids=[0, 1, 2], output_ids=[2, 2, 2, 5]),
    ]
    expected = torch.tensor([
        # 2/2, -1*2, 0.5, -0.5*2 - 0.25*2 - 0.5, 3/2 - 0.25 - 0.5, 0
        [1.0, -2.0, 0.5, -2.0, 0.75, 0.0],
        [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
        # penalty < 1 boosts the seen tokens {1, 2, 5}: -1*0.5, 0.5/0.5, 0*0.5
        [2.0, -0.5, 1.0, -0.5, 3.0, 0.0],
        # prompt is not counted: token 2: 0.5 - 3 + 1, token 5: 0 - 1 + 1
        [2.0, -1.0, -1.5, -0.5, 3.0, 0.0],
    ])
    torch.testing.assert_close(apply_penalties(logits, rows), expected, rtol=0, atol=1e-6)


def test_penalties_over_the_last_tokens_match_hand_computation():
    """repeat_last_n (llama.cpp's penalty_last_n): all three penalties count the window's tokens, prompt ones too;
    0 turns them off; a pending token (on the device) is the window's last."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]] * 3)
    params = dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = [
        # the last 4 of prompt [0, 1, 2] + output [3, 3, 4]: 2, 3, 3, 4 (0 and 1 fall out)
        make_row(SamplingParams(repeat_last_n=4, **params), prompt_ids=[0, 1, 2], output_ids=[3, 3, 4]),
        make_row(SamplingParams(repeat_last_n=0, **params), prompt_ids=[0, 1, 2], output_ids=[3, 3, 4]),
        # the last 2 of the prompt [5, 2, 2]: token 2 counted twice, from the prompt
        make_row(SamplingParams(repeat_last_n=2, **params), prompt_ids=[5, 2, 2], output_ids=[]),
    ]
    expected = torch.tensor([
        # token 2: 0.5/2 - 0.25 - 0.5; token 3: -0.5*2 - 0.5 - 0.5; token 4: 3/2 - 0.25 - 0.5
        [2.0, -1.0, -0.5, -2.0, 0.75, 0.0],
        [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
        # token 2: 0.5/2 - 0.5 - 0.5
        [2.0, -1.0, -0.75, -0.5, 3.0, 0.0],
    ])
    torch.testing.assert_close(apply_penalties(logits, rows), expected, rtol=0, atol=1e-6)
    # with the step's last token pending on the device (4 for the first row), the host's window is one shorter:
    # 3, 3, 4 and the pending 4
    pending = torch.tensor([4, 0, 0])
    first = apply_penalties(logits[:1], rows[:1], pending[:1])
    # token 3: -0.5*2 - 0.5 - 0.5; token 4: 3/2 - 0.5 - 0.5; token 2 out of the window
    torch.testing.assert_close(first, torch.tensor([[2.0, -1.0, 0.5, -2.0, 0.5, 0.0]]), rtol=0, atol=1e-6)


def test_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    row = make_row(params, prompt_ids=[0, 1], output_ids=[3, 3, 4])
    assert Sampler()(logits, [row]).token_ids.tolist() == [0]      # penalized: [1.0, -2, 0.5, -2, 0.75, 0]


def test_logit_bias_steers_greedy_and_sampled_rows_and_only_its_own_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9], [2.0, -1.0, 0.5, 1.9]])
    banned = make_row(SamplingParams(temperature=0.0, logit_bias=((0, -100.0),)))
    plain = make_row(SamplingParams(temperature=0.0))
    assert Sampler()(logits, [banned, plain]).token_ids.tolist() == [3, 0]   # 2.0 - 100 < 1.9
    # A sampled row: the bias shifts the distribution exactly as adding it to the logits by hand does.
    params = SamplingParams(temperature=1.0, logit_bias=((1, 3.0), (3, -1.5)))
    shifted = [2.0, -1.0 + 3.0, 0.5, 1.9 - 1.5]
    assert_matches_distribution(draw_many([2.0, -1.0, 0.5, 1.9], params), reference_probs(shifted, 1.0))
    # Logprobs stay those of the raw logits (what the model said), like the penalties.
    out = Sampler()(logits[:1], [make_row(SamplingParams(temperature=0.0, logprobs=0, logit_bias=((1, 50.0),)))])
    assert out.token_ids.tolist() == [1]
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits[0], -1)[1:2])


def test_banned_tokens_are_never_sampled_and_only_in_their_row():
    logits = torch.tensor([[5.0, 4.0, -1.0, 0.0]] * 3)
    greedy = SampleRow(SamplingParams(temperature=0.0), 0, 0, (), (), banned=(0,))
    sampled = [SampleRow(SamplingParams(temperature=2.0), s, 0, (), (), banned=(0, 1)) for s in range(200)]
    out = Sampler()(torch.cat([logits[:2], logits[:1].expand(200, -1)]),
                    [greedy, make_row(SamplingParams(temperature=0.0))] + sampled).token_ids.tolist()
    assert out[:2] == [1, 0]
    assert set(out[2:]) == {2, 3}        # temperature 2 spreads the draws over every token left


# --- filters and temperature ------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.7, 0.0),
    (1.0, 0, 1.0, 0.3),
    (0.7, 5, 0.8, 0.05),
    (1.6, 6, 0.9, 0.15),
    (0.5, 0, 1.0, 0.0),
    (2.5, 0, 1.0, 0.0),
])
def test_filtered_sampling_matches_target_distribution(temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = reference_probs(SMALL_LOGITS, temperature, top_k, top_p, min_p)
    assert_matches_distribution(draw_many(SMALL_LOGITS, params), expected)


def test_filters_never_pick_a_removed_token_on_a_large_vocab():
    vocab, n = 400, 1500
    logits = random_logits(1, vocab, seed=3, scale=3.0).expand(n, -1)
    probs = torch.softmax(logits[0].double() / 0.8, dim=-1)
    top10 = set(torch.topk(probs, 10).indices.tolist())
    for params, allowed in [
        (SamplingParams(temperature=0.8, top_k=10), top10),
        (SamplingParams(temperature=0.8, min_p=0.2), set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())),
    ]:
        rows = [make_row(params, seed=i, step=i % 3) for i in range(n)]
        assert set(Sampler()(logits, rows).token_ids.tolist()) <= allowed


def test_filter_off_keeps_every_token_while_neighbours_are_filtered():
    # On a long, peaked vocabulary the float32 cumulative mass reaches 1.0 well before the tail; a row with
    # top_p = 1 must not lose that tail just because its neighbour's top-p forced the sort.
    scores = random_logits(2, 30_000, seed=12, scale=4.0)
    filtered = filter_logits(scores, top_k=[0, 0], top_p=[1.0, 0.9], min_p=[0.0, 0.0])
    assert torch.equal(filtered[0], scores[0])
    assert bool(torch.isinf(filtered[1]).any())
    probs = torch.softmax(scores[1].double(), dim=-1)
    assert float(probs[torch.isfinite(filtered[1])].sum()) >= 0.9


def reference_top_k_top_p(scores: list[float], top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, from their definitions: order the tokens by value, largest first, the
    lower id first among equal values; keep the first k (all if k is 0); renormalize over them and keep the
    smallest prefix whose mass reaches p (p = 1: all of them)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if top_k > 0:
        order = order[:top_k]
    if top_p >= 1.0:
        return set(order)
    weights = [math.exp(scores[i] - scores[order[0]]) for i in order]
    total, mass_before, kept = sum(weights), 0.0, []
    for token, weight in zip(order, weights):
        if mass_before >= top_p:
            break
        kept.append(token)
        mass_before += weight / total
    return set(kept)


# Rows across every top-k width (64, 256, 1024, 4096, then the whole row), with top-p and without.
TOP_K_TOP_P_ROWS = [(1, 1.0), (5, 1.0), (40, 0.95), (64, 1.0), (65, 0.9), (300, 1.0), (1024, 0.5), (2000, 1.0),
                    (5000, 0.99), (0, 0.8), (0, 0.3), (0, 1.0), (40, 1.0)]


def test_top_k_and_top_p_keep_the_tokens_of_their_definitions_ties_included():
    vocab = 6000
    # Scores in steps of 1/4: hundreds of tokens tie with the k-th value, so the lowest ids must win among them.
    scores = (random_logits(len(TOP_K_TOP_P_ROWS), vocab, seed=21, scale=8.0) * 4).round() / 4
    filtered = filter_logits(scores, [k for k, _ in TOP_K_TOP_P_ROWS], [p for _, p in TOP_K_TOP_P_ROWS],
                             [0.0] * len(TOP_K_TOP_P_ROWS))
    for row, (k, p) in enumerate(TOP_K_TOP_P_ROWS):
        kept = set(torch.nonzero(torch.isfinite(filtered[row])).flatten().tolist())
        assert kept == reference_top_k_top_p(scores[row].tolist(), k, p), (k, p)
        assert torch.equal(filtered[row][list(kept)], scores[row][list(kept)])
    assert torch.equal(filtered[-1][torch.isfinite(filtered[-1])].sort().values, scores[-1].topk(40).values.sort().values)


def test_a_rows_top_k_and_top_p_do_not_depend_on_the_other_rows():
    vocab = 6000
    scores = random_logits(len(TOP_K_TOP_P_ROWS), vocab, seed=22, scale=3.0)
    together = filter_logits(scores, [k for k, _ in TOP_K_TOP_P_ROWS], [p for _, p in TOP_K_TOP_P_ROWS],
                             [0.0] * len(TOP_K_TOP_P_ROWS))
    for row, (k, p) in enumerate(TOP_K_TOP_P_ROWS):
        alone = filter_logits(scores[row:row + 1], [k], [p], [0.0])
        assert torch.equal(alone[0], together[row]), (k, p)


def test_prefix_below_is_the_prefix_a_running_sum_keeps(monkeypatch):
    monkeypatch.setattr(sampler_module, "PREFIX_BLOCK", 8)         # rows of several blocks and a partial last one
    generator = torch.Generator().manual_seed(23)
    weights = torch.rand(6, 29, generator=generator)
    limits = torch.tensor([0.0, 0.3, 4.0, 7.77, float(weights[4].sum()) + 1.0, math.inf])
    ties = weights > 0.5
    rooms = torch.tensor([0, 1, 3, 8, 9, 100])
    for values, bounds in ((weights, limits), (ties, rooms)):
        counts = sampler_module._prefix_below(values, bounds).tolist()
        for row in range(values.shape[0]):
            running, expected = 0.0, 0
            for value in values[row].tolist():        # entries kept while the sum before them is below the limit
                if running >= float(bounds[row]):
                    break
                expected += 1
                running += float(value)
            assert counts[row] == expected, (row, counts[row], expected)


def test_largest_values_are_the_sorted_rows_head():
    scores = (random_logits(3, 3 * 4096 + 5, seed=24, scale=4.0) * 2).round()    # ties
    for width in (1, 40, 256, 300):
        assert torch.equal(sampler_module._largest_values(scores, width), scores.sort(dim=-1, descending=True).values[:, :width])


def reference_typical(probs: list[float], mass: float) -> list[float]:
    """Locally typical sampling (Meister et al. 2022) from its definition: H = -sum p log p; order the tokens by
    |-log p - H|, nearest first; keep them until their probability sums to `mass` (the token that reaches it
    included); renormalize."""
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    order = sorted(range(len(probs)), key=lambda i: (abs(-math.log(probs[i]) - entropy), i))
    kept, total = [], 0.0
    for i in order:
        assert abs(total - mass) > 1e-3, "test data too close to a typical-p cut"
        if total >= mass:
            break
        kept.append(i)
        total += probs[i]
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def reference_xtc(probs: list[float], threshold: float) -> list[float]:
    """llama.cpp's XTC from its description: when two or more tokens have probability >= threshold, every one
    of them but the least likely is removed; renormalize."""
    above = [i for i, p in enumerate(probs) if p >= threshold]
    if len(above) < 2:
        return list(probs)
    least = min(above, key=lambda i: probs[i])
    kept = [p if (i not in above or i == least) else 0.0 for i, p in enumerate(probs)]
    return [p / sum(kept) for p in kept]


def reference_top_n_sigma(logits: list[float], temperature: float, n: float) -> list[float]:
    """Top-n-sigma (Tang et al. 2024) from its definition: keep the tokens whose logit is at least the largest
    less n population standard deviations of the logits; softmax(logits / T) over them."""
    mean = sum(logits) / len(logits)
    sigma = math.sqrt(sum((x - mean) ** 2 for x in logits) / len(logits))
    kept = [x >= max(logits) - n * sigma for x in logits]
    assert all(abs(x - (max(logits) - n * sigma)) > 1e-3 for x in logits), "test data too close to the cut"
    weights = [math.exp(x / temperature) if k else 0.0 for x, k in zip(logits, kept)]
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize("temperature, n", [(1.0, 1.0), (1.5, 1.0), (0.8, 1.6)])
def test_top_n_sigma_matches_its_definition_at_any_temperature(temperature, n):
    params = SamplingParams(temperature=temperature, top_n_sigma=n)
    expected = reference_top_n_sigma(SMALL_LOGITS, temperature, n)
    assert 1 < sum(p > 0 for p in expected) < len(SMALL_LOGITS)
    assert_matches_distribution(draw_many(SMALL_LOGITS, params), expected)


@pytest.mark.parametrize("temperature, typical_p", [(1.0, 0.5), (1.0, 0.9), (0.7, 0.8)])
def test_typical_sampling_matches_its_definition(temperature, typical_p):
    params = SamplingParams(temperature=temperature, typical_p=typical_p)
    expected = reference_typical(reference_probs(SMALL_LOGITS, temperature), typical_p)
    assert sum(p > 0 for p in expected) < len(SMALL_LOGITS)        # the cut removes something
    assert_matches_distribution(draw_many(SMALL_LOGITS, params), expected)


def reference_dynamic_temperature(logits: list[float], kept: list[int], temperature: float, spread: float,
                                  exponent: float) -> list[float]:
    """llama.cpp's temp-ext sampler (dynatemp) as its source reads, on the tokens `kept` by the filters before it:
    entropy of their softmax (untempered) over its maximum ln n, mapped into [max(0, T - spread), T + spread] by
    the power `exponent`; the kept tokens' logits divided by that temperature."""
    low, high = max(0.0, temperature - spread), temperature + spread
    weights = [math.exp(logits[i]) for i in kept]
    probs = [w / sum(weights) for w in weights]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    dynamic = low + (high - low) * (entropy / math.log(len(kept))) ** exponent
    scaled = {i: math.exp(logits[i] / dynamic) for i in kept}
    return [scaled[i] / sum(scaled.values()) if i in scaled else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize("temperature, spread, exponent, top_k", [(1.0, 0.5, 1.0, 0), (0.8, 0.8, 2.0, 0),
                                                                  (1.0, 0.6, 0.5, 4)])
def test_dynamic_temperature_matches_llama_cpp_definition(temperature, spread, exponent, top_k):
    params = SamplingParams(temperature=temperature, dynatemp_range=spread, dynatemp_exponent=exponent, top_k=top_k)
    kept = sorted(range(len(SMALL_LOGITS)), key=lambda i: -SMALL_LOGITS[i])[:top_k or len(SMALL_LOGITS)]
    expected = reference_dynamic_temperature(SMALL_LOGITS, kept, temperature, spread, exponent)
    # the test means something: the dynamic temperature moves the distribution away from plain T
    plain = reference_probs(SMALL_LOGITS, temperature, top_k=top_k)
    assert max(abs(a - b) for a, b in zip(expected, plain)) > 0.02
    assert_matches_distribution(draw_many(SMALL_LOGITS, params), expected)


def test_dynamic_temperature_near_zero_keeps_the_likeliest_and_skips_other_rows():
    # T = range puts the low end at 0; a large exponent maps this row's entropy (0.92 of its maximum) to
    # T' ~ 0.01, so the likeliest token is drawn every time, where T = 0.5 alone draws another one 29 % of the time
    flat = [1.0, 0.0, 0.0, 0.0]
    tokens = draw_many(flat, SamplingParams(temperature=0.5, dynatemp_range=0.5, dynatemp_exponent=50.0), n=500)
    assert set(tokens.tolist()) == {0}
    assert set(draw_many(flat, SamplingParams(temperature=0.5), n=500).tolist()) == {0, 1, 2, 3}
    # entropy 0 in float32 (the others' probabilities underflow): T' = 0 keeps the likeliest alone, no NaN
    peaked = torch.tensor([[200.0, 0.0, -1.0, -math.inf]])
    rows = [SampleRow(SamplingParams(temperature=0.5, dynatemp_range=0.5), 1, 0, (), ())]
    out = sampler_module._dynamic_temperature(peaked, peaked * 2, rows, [True])
    assert out.tolist() == [[0.0, -math.inf, -math.inf, -math.inf]]
    # in one batch, a row without dynatemp draws exactly what it draws alone
    logits = torch.tensor([SMALL_LOGITS, SMALL_LOGITS], dtype=torch.float32)
    plain, dynamic = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, dynatemp_range=0.9)
    for step in range(50):
        mixed = Sampler()(logits, [SampleRow(plain, 7, step, (), ()), SampleRow(dynamic, 8, step, (), ())])
        alone = Sampler()(logits[:1], [SampleRow(plain, 7, step, (), ())])
        assert mixed.token_ids[0] == alone.token_ids[0]


def test_xtc_removes_the_top_choices_on_the_steps_its_coin_picks():
    probs = reference_probs(SMALL_LOGITS, 1.0)
    assert sum(p >= 0.1 for p in probs) >= 3                        # several top choices to remove
    always = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1)
    assert_matches_distribution(draw_many(SMALL_LOGITS, always), reference_xtc(probs, 0.1))
    # with probability 0.4: a mixture of the two (the coin is the row's own, from its seed and step)
    sometimes = SamplingParams(temperature=1.0, xtc_probability=0.4, xtc_threshold=0.1)
    mixture = [0.4 * a + 0.6 * b for a, b in zip(reference_xtc(probs, 0.1), probs)]
    assert_matches_distribution(draw_many(SMALL_LOGITS, sometimes), mixture)
    # above 0.5 no two tokens can reach the threshold: plain sampling, draw for draw
    off = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.6)
    assert torch.equal(draw_many(SMALL_LOGITS, off, n=2000), draw_many(SMALL_LOGITS, SamplingParams(), n=2000))
    # threshold 0 after top-k 2: the two left reach it, so the second likeliest is always the one drawn
    assert set(draw_many(SMALL_LOGITS, SamplingParams(temperature=1.0, top_k=2, xtc_probability=1.0,
                                                      xtc_threshold=0.0), n=200).tolist()) == {1}
    # after top-k, XTC's probabilities are those of the tokens left (llama.cpp's order: XTC after the filters)
    top3 = SamplingParams(temperature=1.0, top_k=3, xtc_probability=1.0, xtc_threshold=0.3)
    assert_matches_distribution(draw_many(SMALL_LOGITS, top3),
                                reference_xtc(reference_probs(SMALL_LOGITS, 1.0, top_k=3), 0.3))


def reference_mirostat_v2(probs: list[float], mu: float) -> list[float]:
    """Mirostat 2 from the paper's algorithm 2: keep the tokens of surprise -log2 p <= mu (the likeliest at
    least), renormalize."""
    top = max(range(len(probs)), key=lambda i: probs[i])
    kept = [p if (-math.log2(p) <= mu or i == top) else 0.0 for i, p in enumerate(probs)]
    return [p / sum(kept) for p in kept]


def reference_mirostat_v1(probs: list[float], mu: float, m: int = 100) -> list[float]:
    """Mirostat 1 from the paper's algorithm 1: the Zipf exponent s of the likeliest m probabilities (least squares
    through the origin of log(p_i / p_i+1) on log((i + 2) / (i + 1))), k = (eps 2^mu / (1 - V^-eps))^(1 / s)
    with eps = s - 1, then top-k, renormalized."""
    ordered = sorted(probs, reverse=True)[:m]
    t = [math.log((i + 2) / (i + 1)) for i in range(len(ordered) - 1)]
    b = [math.log(ordered[i] / ordered[i + 1]) for i in range(len(ordered) - 1)]
    s = sum(x * y for x, y in zip(t, b)) / sum(x * x for x in t)
    eps = s - 1
    k = max(1, int((eps * 2 ** mu / (1 - len(probs) ** -eps)) ** (1 / s)))
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))[:k]
    kept = [p if i in order else 0.0 for i, p in enumerate(probs)]
    return [p / sum(kept) for p in kept]


@pytest.mark.parametrize("version, tau", [(2, 1.2), (2, 1.6), (1, 1.0), (1, 2.0)])
def test_mirostat_truncates_as_its_definition_at_the_first_step(version, tau):
    """A request's first step runs at mu = 2 tau (llama.cpp's start), top-k / top-p and the rest unused."""
    probs = reference_probs(SMALL_LOGITS, 1.0)
    reference = reference_mirostat_v2 if version == 2 else reference_mirostat_v1
    expected = reference(probs, 2 * tau)
    assert 1 < sum(p > 0 for p in expected) < len(probs)          # the cut is inside the vocabulary
    params = SamplingParams(temperature=1.0, top_k=1, mirostat=version, mirostat_tau=tau)
    assert_matches_distribution(draw_many(SMALL_LOGITS, params), expected)


def test_mirostat_moves_its_state_by_the_drawn_tokens_surprise():
    probs = reference_probs(SMALL_LOGITS, 1.0)
    params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=1.0, mirostat_eta=0.25)
    rows = [make_row(params, seed=5), SampleRow(params, 7, 3, (), (), mirostat_mu=3.0), make_row(SamplingParams())]
    out = Sampler()(torch.tensor([SMALL_LOGITS] * 3), rows)
    for row, token, mu in zip(rows[:2], out.token_ids.tolist(), out.mirostat_mu.tolist()):
        start = 2.0 if row.mirostat_mu is None else row.mirostat_mu
        drawn_from = reference_mirostat_v2(probs, start)
        assert drawn_from[token] > 0
        assert abs(mu - (start - 0.25 * (-math.log2(drawn_from[token]) - 1.0))) < 1e-5
    assert math.isnan(out.mirostat_mu[2])                              # not a mirostat row


def test_temperature_sharpens_and_flattens():
    top_share = {}
    for temperature in (0.05, 0.5, 1.0, 2.0, 50.0):
        tokens = draw_many(SMALL_LOGITS, SamplingParams(temperature=temperature), n=5000)
        top_share[temperature] = float((tokens == 0).float().mean())
    assert top_share[0.05] > 0.99                                       # ~greedy
    assert top_share[0.5] > top_share[1.0] > top_share[2.0] > top_share[50.0]
    assert abs(top_share[50.0] - 1 / len(SMALL_LOGITS)) < 0.03          # ~uniform


# --- seeds, steps, batch invariance -------------------------------------------------------------------------

def test_same_seed_and_step_give_the_same_token():
    logits = random_logits(1, 1000, seed=4, scale=0.5).expand(64, -1)
    params = SamplingParams(temperature=1.0)
    rows = [make_row(params, seed=99, step=5)] * 64
    first = Sampler()(logits, rows).token_ids
    assert len(set(first.tolist())) == 1
    assert torch.equal(Sampler()(logits, rows).token_ids, first)
    # ...while other seeds at that step spread over the near-uniform vocabulary.
    others = Sampler()(logits, [make_row(params, seed=s, step=5) for s in range(64)]).token_ids
    assert len(set(others.tolist())) > 40


def test_steps_of_one_request_are_independent_draws():
    probs = [0.4, 0.3, 0.2, 0.1]
    logits = [math.log(p) for p in probs]
    n = 10_000
    batch = torch.tensor([logits]).expand(2 * n, -1)
    params = SamplingParams(temperature=1.0)
    rows = [make_row(params, seed=seed, step=step) for seed in range(n) for step in (3, 4)]
    tokens = Sampler()(batch, rows).token_ids.view(n, 2)
    # (token at step 3, token at step 4) must follow the product distribution p_i * p_j.
    joint = torch.bincount(tokens[:, 0] * 4 + tokens[:, 1], minlength=16).tolist()
    expected = [n * probs[i] * probs[j] for i in range(4) for j in range(4)]
    statistic = sum((c - e) ** 2 / e for c, e in zip(joint, expected))
    assert statistic < chi_square_critical(15), (statistic, joint)
    # One request's successive steps are themselves a sample of the target distribution.
    one_request = Sampler()(batch[:n], [make_row(params, seed=2024, step=s) for s in range(n)]).token_ids
    assert_matches_distribution(one_request, probs)


def _varied_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.2, top_p=0.6),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=1.1, top_k=50, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, logprobs=5),
        SamplingParams(temperature=1.0, typical_p=0.7),
        SamplingParams(temperature=1.2, top_n_sigma=1.5),
        SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05),
        SamplingParams(temperature=0.9, dry_multiplier=0.8, dry_allowed_length=1),
        SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=4.0),
        SamplingParams(temperature=1.0, mirostat=1, mirostat_tau=4.0),
    ]


def test_a_rows_token_does_not_depend_on_its_batch():
    vocab = 300
    targets = random_logits(len(_varied_params()), vocab, seed=5, scale=1.5)
    target_params = _varied_params()
    other_params = list(reversed(_varied_params())) * 3
    others = random_logits(len(other_params), vocab, seed=6, scale=3.0)
    target_rows = [make_row(p, seed=1000 + i, step=i, prompt_ids=range(i, 40 + i), output_ids=[1, 2, 2, 7 * i])
                   for i, p in enumerate(target_params)]
    other_rows = [make_row(p, seed=i, step=3, prompt_ids=range(200), output_ids=range(0, 120, 3))
                  for i, p in enumerate(other_params)]
    sampler = Sampler()
    alone = [sampler(targets[i:i + 1], [row]).token_ids.item() for i, row in enumerate(target_rows)]

    order = list(range(len(target_rows) + len(other_rows)))
    random.Random(7).shuffle(order)
    all_logits = torch.cat([targets, others])
    all_rows = target_rows + other_rows
    batched = sampler(all_logits[order], [all_rows[j] for j in order]).token_ids.tolist()
    position = {j: pos for pos, j in enumerate(order)}
    assert [batched[position[i]] for i in range(len(target_rows))] == alone

    # Alone, a plain row skips sorting/penalties/min-p; in a batch they run for its neighbours. Same token.
    plain_alone = [sampler(targets[i:i + 1], [make_row(target_params[0], seed=s, step=s)]).token_ids.item()
                   for i, s in enumerate(range(8))]
    mixed_rows = [make_row(target_params[0], seed=s, step=s) for s in range(8)] + other_rows
    assert sampler(torch.cat([targets[:8], others]), mixed_rows).token_ids[:8].tolist() == plain_alone


# --- logprobs ---------------------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits(6, 64, seed=8)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.5, top_k=5, logprobs=7),
              SamplingParams(temperature=1.0, repetition_penalty=1.8, logprobs=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.0, presence_penalty=1.0, min_p=0.1, logprobs=1),
              SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    rows = [make_row(p, seed=i, prompt_ids=[1, 2, 3], output_ids=[4, 4]) for i, p in enumerate(params)]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    chosen = reference.gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs.double(), chosen, rtol=0, atol=1e-5)
    assert out.top_ids.shape == (6, 7)                                   # n = the largest request
    top_values, top_ids = torch.topk(reference, 7, dim=-1)
    assert out.top_ids.tolist() == top_ids.tolist()
    torch.testing.assert_close(out.top_logprobs.double(), top_values, rtol=0, atol=1e-5)


def test_logprobs_zero_gives_an_empty_top_list():
    out = Sampler()(random_logits(2, 10, seed=9), [make_row(SamplingParams(logprobs=0))] * 2)
    assert out.top_ids.shape == (2, 0) and out.logprobs.shape == (2,)


# --- bad logits ---------------------------------------------------------------------------------------------

def test_degenerate_logits_still_give_valid_tokens():
    inf, nan = math.inf, math.nan
    logits = torch.tensor([
        [-inf] * 6,                                   # nothing finite at all
        [nan, 1.0, nan, 0.5, -inf, nan],              # NaNs never win
        [0.0, 1.0, inf, 0.5, -inf, 2.0],              # +inf wins
        [-500.0, -400.0, -300.0, -450.0, -600.0, -350.0],   # all overflow to -inf at T=1e-37: greedy limit
    ] * 2)
    rows = [make_row(SamplingParams(temperature=0.0))] * 4 + [
        make_row(SamplingParams(temperature=1.0, top_k=2, top_p=0.5, min_p=0.1), seed=1),
        make_row(SamplingParams(temperature=1.0, top_k=1), seed=2),
        make_row(SamplingParams(temperature=0.3, top_p=0.9, min_p=0.5), seed=3),
        make_row(SamplingParams(temperature=1e-37, top_k=3), seed=4),
    ]
    tokens = Sampler()(logits, rows).token_ids.tolist()
    assert 0 <= tokens[0] < 6 and 0 <= tokens[4] < 6
    assert tokens[1] == tokens[5] == 1
    assert tokens[2] == tokens[6] == 2
    assert tokens[3] == tokens[7] == 2


# --- validation ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.01), ("min_p", 1.5), ("typical_p", 0.0), ("typical_p", 1.2),
    ("xtc_probability", -0.1), ("xtc_probability", 1.5), ("xtc_threshold", -0.1), ("xtc_threshold", 1.1),
    ("mirostat", 3), ("mirostat", True), ("mirostat_tau", -1.0), ("mirostat_eta", 2.0),
    ("dynatemp_range", -0.1), ("dynatemp_range", math.inf), ("dynatemp_range", 1e308), ("dynatemp_exponent", -1.0),
    ("seed", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repeat_last_n", -2), ("repeat_last_n", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("frequency_penalty", math.nan),
    ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 257), ("stop_token_ids", (1, -2)), ("ignore_eos", 1),
    ("logprobs", -1), ("logprobs", MAX_TOP_LOGPROBS + 1), ("prompt_logprobs", -1), ("prompt_logprobs", 1.5),
    ("logit_bias", ((1, 100.5),)), ("logit_bias", ((-1, 1.0),)), ("logit_bias", ((1, math.nan),)),
    ("logit_bias", ((1.5, 1.0),)), ("logit_bias", tuple((i, 1.0) for i in range(1025))),
])
def test_validate_rejects_out_of_range_values(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_validate_checks_ids_against_the_vocabulary():
    SamplingParams(stop_token_ids=(0, 9), logprobs=5).validate(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(10,)).validate(vocab_size=10)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=5).validate(vocab_size=4)
    SamplingParams(logit_bias=((9, -100.0), (0, 100.0))).validate(vocab_size=10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((10, 1.0),)).validate(vocab_size=10)


def test_validate_accepts_the_edges():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=1.0, seed=-5, repetition_penalty=0.5,
                   presence_penalty=-2.0, frequency_penalty=2.0, max_tokens=1, logprobs=MAX_TOP_LOGPROBS).validate()


def test_resolved_seed():
    assert SamplingParams(seed=42).resolved_seed() == 42
    drawn = {SamplingParams().resolved_seed() for _ in range(8)}
    assert len(drawn) == 8 and all(0 <= s < 1 << 63 for s in drawn)


# --- no host sync ---------------------------------------------------------------------------------------------

def test_sampler_never_reads_device_data_back(monkeypatch):
    logits = random_logits(len(_varied_params()), 50, seed=10)
    rows = [make_row(p, seed=i, step=i, prompt_ids=[1, 2], output_ids=[3]) for i, p in enumerate(_varied_params())]
    sampler = Sampler()

    def forbidden(*args, **kwargs):
        raise AssertionError("the sampler read a tensor back to the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = sampler(logits, rows)
    monkeypatch.undo()
    assert out.token_ids.shape == (len(rows),)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
def test_cuda_matches_cpu_and_does_not_synchronize():
    logits = random_logits(len(_varied_params()) * 4, 2000, seed=11)
    rows = [make_row(p, seed=i, step=i, prompt_ids=[1, 2], output_ids=[3]) for i, p in enumerate(_varied_params() * 4)]
    on_cpu = Sampler()(logits, rows)
    sampler = Sampler()
    device_logits = logits.cuda()
    sampler(device_logits, rows)      # warm-up: token keys, pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")   # any stream/device sync inside the call raises
    try:
        on_gpu = sampler(device_logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert on_gpu.token_ids.device.type == "cuda"
    assert on_gpu.token_ids.cpu().tolist() == on_cpu.token_ids.tolist()


def test_a_pending_token_counts_as_the_history_that_lacks_it():
    """A step planned ahead gives its rows histories without the token the step before samples, and that token on
    the device: the penalties count it there, and draw what the full history draws."""
    logits = random_logits(6, 50, seed=21, scale=2.0)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.7),
              SamplingParams(temperature=0.9, seed=3, presence_penalty=1.2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=4, frequency_penalty=1.5, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, presence_penalty=2.0), SamplingParams(temperature=0.7, seed=5)]
    histories = [[3, 7, 7, 12], [9], [1, 2], [30, 31, 30], [5, 5], [4]]
    last = logits.argmax(dim=-1)            # each row's pending token: its own likeliest, so the penalty bites
    full = [make_row(p, seed=i, step=2, prompt_ids=[1, 2], output_ids=h + [int(last[i])])
            for i, (p, h) in enumerate(zip(params, histories))]
    short = [make_row(p, seed=i, step=2, prompt_ids=[1, 2], output_ids=h)
             for i, (p, h) in enumerate(zip(params, histories))]
    want = Sampler()(logits, full)
    assert torch.equal(Sampler()(logits, short, pending=last).token_ids, want.token_ids)
    assert not torch.equal(Sampler()(logits, short).token_ids, want.token_ids)      # without it: other draws


def test_a_pending_mirostat_state_is_the_one_the_row_would_carry():
    """A step planned ahead gives its mirostat rows their state as the step before left it, on the device: it
    draws and moves on as the row carrying that state would; NaN leaves a row its own."""
    logits = random_logits(3, 40, seed=23, scale=2.0)
    params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=2.0, mirostat_eta=0.5)
    states = [3.1, 1.2, None]
    carried = [make_row(params, seed=i, step=4) for i in range(3)]
    for row, state in zip(carried, states):
        row.mirostat_mu = state
    want = Sampler()(logits, carried)
    stale = [make_row(params, seed=i, step=4) for i in range(3)]          # the host's states, one step behind
    stale[0].mirostat_mu, stale[1].mirostat_mu = 9.0, 0.1
    got = Sampler()(logits, stale, pending_mu=torch.tensor([3.1, 1.2, math.nan]))
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.mirostat_mu, want.mirostat_mu)


def test_bad_word_bans_the_token_that_would_complete_it():
    from cobatch.engine.sampler import bad_word_bans
    words = ((7,), (1, 2, 3), (4, 5))
    assert bad_word_bans(words, ()) == (7,)                  # a one-token word: always
    assert bad_word_bans(words, (9, 1, 2)) == (7, 3)          # the output ends with 1 2: 3 would complete it
    assert bad_word_bans(words, (1, 2, 9)) == (7,)
    assert bad_word_bans(words, (2, 4)) == (7, 5)


def test_allowed_token_ids_leave_only_those_tokens():
    """Greedy and sampled rows alike pick only among a row's allowed_token_ids; a row without the field is
    untouched in the same batch."""
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    allowed = (4, 17, 30)
    rows = [make_row(SamplingParams(temperature=0.0, allowed_token_ids=allowed)),
            make_row(SamplingParams(temperature=1.0, allowed_token_ids=allowed), seed=5),
            make_row(SamplingParams(temperature=0.0))]
    for step in range(20):
        for r in rows:
            r.step = step
        out = Sampler()(logits, rows).token_ids.tolist()
        assert out[0] == max(allowed, key=lambda t: logits[0, t]) and out[1] in allowed
        assert out[2] == int(logits[2].argmax())
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(3, 50)).validate(vocab_size=vocab)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=((1, 99),)).validate(vocab_size=vocab)
