"""How the scheduler (engine/scheduler.py) cuts prompts into prefill chunks beside decode rows."""

from __future__ import annotations

from cobatch.engine.kv_cache import BlockManager
from cobatch.engine.sampler import SamplingParams
from cobatch.engine.scheduler import Scheduler
from cobatch.engine.sequence import Sequence


def _decoder(name: str, first_token: int) -> Sequence:
    """A sequence past its 4-token prompt, with one sampled token to run."""
    seq = Sequence(name, 4, SamplingParams(), 0, list(range(first_token, first_token + 5)))
    seq.num_computed = 4
    return seq


def _prompt(name: str, first_token: int, n_tokens: int) -> Sequence:
    return Sequence(name, n_tokens, SamplingParams(), 0, list(range(first_token, first_token + n_tokens)))


def _rows(prefill_chunk: int, *seqs: Sequence) -> dict[str, int]:
    scheduler = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_step_tokens=64, prefill_chunk=prefill_chunk)
    for seq in seqs:
        scheduler.add(seq)
    return {seq.request_id: rows for seq, rows in scheduler.plan().items}


def test_a_cut_prompt_ends_the_step_on_a_multiple_of_the_chunk():
    """Three decoders and a 40-token prompt, 16-row chunks: the prompt's chunk is 13 rows, so the step has 16
    rows (one prefill graph's size) and not 19; a second long prompt then takes a whole chunk (rows 17-32)."""
    decoders = [_decoder(f"d{i}", 100 * i) for i in range(3)]
    assert _rows(16, *decoders, _prompt("long", 900, 40)) == {"d0": 1, "d1": 1, "d2": 1, "long": 13}
    decoders = [_decoder(f"d{i}", 100 * i) for i in range(3)]
    got = _rows(16, *decoders, _prompt("a", 900, 40), _prompt("b", 1900, 40))
    assert got == {"d0": 1, "d1": 1, "d2": 1, "a": 13, "b": 16}


def test_a_prompt_that_fits_is_not_cut():
    """A 10-token prompt beside three decoders runs whole (13 rows), and a long one after it fills the step up to
    the chunk's multiple (3 rows: 16), never less than one row."""
    decoders = [_decoder(f"d{i}", 100 * i) for i in range(3)]
    got = _rows(16, *decoders, _prompt("short", 900, 10), _prompt("long", 1900, 40))
    assert got == {"d0": 1, "d1": 1, "d2": 1, "short": 10, "long": 3}
    decoders = [_decoder(f"d{i}", 100 * i) for i in range(3)]
    got = _rows(16, *decoders, _prompt("short", 900, 13), _prompt("long", 1900, 40))
    assert got == {"d0": 1, "d1": 1, "d2": 1, "short": 13, "long": 16}
    assert _rows(16, _prompt("alone", 900, 40)) == {"alone": 16}
