"""DRY (engine/dry.py) against a reference written from its description (text-generation-webui's loop: for each
earlier place of the context's last token, extend the match backwards until tokens differ or the context's
token is a breaker), on seeded random contexts full of repeats; and its place in the sampler."""

from __future__ import annotations

import random

import pytest
import torch

from cobatch.engine.dry import BreakerIndex, dry_penalties
from cobatch.engine.sampler import Sampler, SampleRow, SamplingParams, needs_penalties


def reference_dry(context: list[int], multiplier: float, base: float, allowed: int, breakers: set[int],
                  cap: int = 50) -> dict[int, float]:
    if context[-1] in breakers:
        return {}
    lengths: dict[int, int] = {}
    for i in range(len(context) - 1):
        if context[i] != context[-1] or context[i + 1] in breakers:
            continue
        n = 1
        while n < cap:
            j = i - n
            if j < 0:
                break
            previous = context[-(n + 1)]
            if context[j] != previous or previous in breakers:
                break
            n += 1
        lengths[context[i + 1]] = max(n, lengths.get(context[i + 1], 0))
    return {t: multiplier * base ** (n - allowed) for t, n in lengths.items() if n >= allowed}


@pytest.mark.parametrize("seed", range(8))
def test_penalties_match_the_reference_on_repetitive_contexts(seed):
    rng = random.Random(seed)
    phrases = [[rng.randrange(12) for _ in range(rng.randrange(2, 7))] for _ in range(4)]
    context = []
    while len(context) < 300:
        context += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(12)]
    breakers = {rng.choice([t for t in range(12) if t != context[-1]])} if seed % 2 else set()
    for allowed in (1, 2, 4):
        got = dict(dry_penalties(context, 0.8, 1.75, allowed, frozenset(breakers)))
        want = reference_dry(context, 0.8, 1.75, allowed, breakers)
        assert got.keys() == want.keys(), (allowed, breakers)
        assert all(abs(got[t] - want[t]) <= 1e-9 * want[t] for t in want)
        assert want or allowed > 1, "the context should hold repeats"


def test_a_repeat_is_penalized_by_its_length_and_breakers_stop_it():
    # ... 5 6 7 8 ... 5 6 7: 8 would extend a repeat of 3 (5 6 7) -> 0.5 * 2 ** (3 - 2)
    context = [1, 5, 6, 7, 8, 2, 3, 5, 6, 7]
    assert dry_penalties(context, 0.5, 2.0, 2, frozenset()) == [(8, 1.0)]
    assert dry_penalties(context, 0.5, 2.0, 4, frozenset()) == []             # shorter than allowed
    assert dry_penalties(context, 0.5, 2.0, 2, frozenset({6})) == []          # the run is broken at 6
    assert dry_penalties(context, 0.5, 2.0, 2, frozenset({7})) == []          # the last token is a breaker
    assert dry_penalties(context, 0.5, 2.0, 2, frozenset({8})) == []          # so is the continuation


def test_breakers_are_the_tokens_whose_text_holds_one():
    vocab = [b"a", b"\n", b"x:", b"ab", b"\"q", b"*"]
    index = BreakerIndex(lambda t: vocab[t], len(vocab))
    assert index.tokens_holding(("\n", ":", "\"", "*")) == frozenset({1, 2, 4, 5})
    assert index.tokens_holding(("a\n",)) == frozenset()          # "a" then "\n": across two tokens, not in one


def test_the_sampler_applies_dry_to_its_rows_only():
    history = [1, 5, 6, 7, 8, 2, 3, 5, 6]
    logits = torch.zeros(2, 10)
    logits[:, 7] = 1.0                   # greedy picks 7, which would extend the repeat 5 6 -> 7
    dry = SamplingParams(temperature=0.0, dry_multiplier=2.0, dry_base=1.75, dry_allowed_length=2)
    plain = SamplingParams(temperature=0.0)
    assert needs_penalties(dry) and not needs_penalties(plain)
    rows = [SampleRow(dry, 0, 0, history[:4], history[4:]), SampleRow(plain, 0, 0, history[:4], history[4:])]
    out = Sampler()(logits, rows).token_ids.tolist()
    assert out[0] != 7 and out[1] == 7
    # only the last dry_penalty_last_n tokens are looked at: 3 5 6 holds no earlier 5 6
    short = SamplingParams(temperature=0.0, dry_multiplier=2.0, dry_penalty_last_n=3)
    assert Sampler()(logits[:1], [SampleRow(short, 0, 0, history[:4], history[4:])]).token_ids.tolist() == [7]
    off = SamplingParams(temperature=0.0, dry_multiplier=2.0, dry_penalty_last_n=0)
    assert not needs_penalties(off)
    # a window reaching into the prompt, or past its start: 5 6 ... 5 6 is seen again
    for last_n in (8, 100):
        wide = SamplingParams(temperature=0.0, dry_multiplier=2.0, dry_penalty_last_n=last_n)
        assert Sampler()(logits[:1], [SampleRow(wide, 0, 0, history[:4], history[4:])]).token_ids.tolist() != [7]


@pytest.mark.parametrize("field, value", [("dry_multiplier", -1.0), ("dry_base", 0.5), ("dry_allowed_length", 0),
                                          ("dry_penalty_last_n", -2), ("dry_sequence_breakers", ("",)),
                                          ("dry_sequence_breakers", ("x",) * 33)])
def test_validate_rejects_bad_dry_settings(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
