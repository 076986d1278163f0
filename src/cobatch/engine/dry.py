"""DRY ("don't repeat yourself"), the repetition sampler of llama.cpp and text-generation-webui: a token that
would extend a run of tokens already seen earlier in the context is penalized, the more the longer the run.

For a context ending in tokens ... a b c, every earlier place where the context also held ... a b c followed by
some token t makes t a continuation of a repeat of length n (the longest such run over all places). Where
n >= allowed_length, t's logit loses multiplier * base ** (n - allowed_length). Sequence breakers (by default a
newline, a colon, a quote and an asterisk) stop a run: a token whose text holds one is never part of a repeat, so
dialogue turns and list items, which start alike by design, are not penalized.

Host work per row and step, only for rows that ask for it: numpy over the last `penalty_last_n` context tokens
(at most MAX_WINDOW: llama.cpp's -1, the whole context, would make a long context's rows slow every step of the
batch they share), at most MAX_MATCH comparisons deep.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")     # llama.cpp's and text-generation-webui's
MAX_MATCH = 50          # the longest repeat measured (text-generation-webui's cap: base ** n stays finite)
MAX_WINDOW = 8192      # the most context tokens looked back over (the host's work per row and step grows with it)
MAX_BREAKERS = 32
MAX_BREAKER_CHARS = 40


def dry_penalties(context: Sequence[int], multiplier: float, base: float, allowed_length: int,
                  breakers: frozenset[int]) -> list[tuple[int, float]]:
    """(token, amount to subtract from its logit) for every token that would extend a repeat of at least
    allowed_length tokens of `context` (the tokens the penalty looks back over, oldest first)."""
    ids = np.asarray(context, dtype=np.int64)
    if len(ids) < 2 or int(ids[-1]) in breakers:
        return []
    stop = np.fromiter(breakers, dtype=np.int64, count=len(breakers))
    starts = np.nonzero(ids[:-1] == ids[-1])[0]          # earlier places the last token was seen
    follows = ids[starts + 1]
    keep = ~np.isin(follows, stop)
    starts, follows = starts[keep], follows[keep]
    length = np.ones(len(starts), dtype=np.int64)         # the last token matches there
    alive = np.ones(len(starts), dtype=bool)
    for k in range(1, MAX_MATCH):
        if k + 1 > len(ids) or not alive.any():
            break
        previous = int(ids[-(k + 1)])                      # the context's token k before its last
        if previous in breakers:
            break
        before = starts - k
        alive &= before >= 0
        alive &= ids[np.maximum(before, 0)] == previous
        length += alive
    best: dict[int, int] = {}
    for token, n in zip(follows.tolist(), length.tolist()):
        best[token] = max(n, best.get(token, 0))
    return [(token, multiplier * base ** (n - allowed_length)) for token, n in best.items() if n >= allowed_length]


class BreakerIndex:
    """The vocabulary's token texts end to end in one bytes object, so the tokens holding a breaker string are
    found by bytes.find (C speed) instead of a Python loop over every token: a request's own breakers cost
    milliseconds, not a scan of 150k tokens."""

    def __init__(self, token_bytes: Callable[[int], bytes], vocab_size: int):
        texts = [token_bytes(t) for t in range(vocab_size)]
        self.blob = b"".join(texts)
        self.starts = list(np.cumsum([0] + [len(t) for t in texts]))     # token t spans starts[t] .. starts[t + 1]

    def tokens_holding(self, breakers: Sequence[str]) -> frozenset[int]:
        """The tokens whose text holds one of the breaker strings."""
        found = set()
        for breaker in breakers:
            needle = breaker.encode("utf-8")
            at = self.blob.find(needle)
            while at >= 0:
                token = bisect.bisect_right(self.starts, at) - 1
                if at + len(needle) <= self.starts[token + 1]:      # inside one token, not across two
                    found.add(token)
                at = self.blob.find(needle, at + 1)
        return frozenset(found)

