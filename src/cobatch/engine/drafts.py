"""Where a decoding sequence's drafts come from, and how they fared: the sequence's own tokens (prompt lookup,
TokenIndex and propose), a request's predicted output (Prediction), and the decayed tallies that pause drafting
when drafts keep failing (DraftRecord). engine/speculative.py says how the drafts are run and checked."""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NgramSpec:
    num_tokens: int          # drafts per step (k)
    max_ngram: int = 3       # the longest suffix looked up first ...
    min_ngram: int = 2       # ... down to this one (1-grams matched too often for their drafts to hold)
    disable_by_batch_size: int | None = None    # no drafts while more requests than this are running

    def __post_init__(self):
        if not 1 <= self.num_tokens <= 15:
            raise ValueError(f"num_speculative_tokens must be in [1, 15] (got {self.num_tokens})")
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16 (got {self.min_ngram}, "
                             f"{self.max_ngram})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1 (got {self.disable_by_batch_size})")

    @staticmethod
    def from_config(config: dict) -> "NgramSpec":
        """vLLM's --speculative-config: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
        "prompt_lookup_min": m, "disable_by_batch_size": b}. Raises ValueError naming what is wrong."""
        method = config.get("method", "ngram")
        if method not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative method {method!r} is not supported (ngram, or draft_model with a model)")
        keys = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
        unknown = set(config) - {"method", *keys}
        if unknown:
            raise ValueError(f"unknown speculative-config keys: {', '.join(sorted(unknown))}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative-config needs num_speculative_tokens")
        values = [config.get(k, d) for k, d in zip(keys, (0, 3, 2, None))]
        if not all(v is None or isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError("speculative-config values must be integers")
        return NgramSpec(*values)


@dataclass(frozen=True, slots=True)
class DraftModelSpec:
    """Drafts from a smaller model of the same vocabulary (engine/draft_model.py)."""
    model: str               # its GGUF file or checkpoint folder
    num_tokens: int          # drafts per step (k)
    disable_by_batch_size: int | None = None    # no drafts while more requests than this are running

    def __post_init__(self):
        if not 1 <= self.num_tokens <= 15:
            raise ValueError(f"num_speculative_tokens must be in [1, 15] (got {self.num_tokens})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1 (got {self.disable_by_batch_size})")

    @staticmethod
    def from_config(config: dict) -> "DraftModelSpec":
        """vLLM's --speculative-config for a draft model: {"model": PATH, "num_speculative_tokens": k,
        "method": "draft_model", "disable_by_batch_size": b}. Raises ValueError naming what is wrong."""
        keys = ("model", "num_speculative_tokens", "disable_by_batch_size")
        if config.get("method", "draft_model") != "draft_model":
            raise ValueError(f"speculative method {config['method']!r} with a model: only draft_model takes one")
        unknown = set(config) - {"method", *keys}
        if unknown:
            raise ValueError(f"unknown speculative-config keys for a draft model: {', '.join(sorted(unknown))}")
        if not isinstance(config.get("model"), str) or "num_speculative_tokens" not in config:
            raise ValueError("a draft model's speculative-config needs model (a path) and num_speculative_tokens")
        values = [config.get(k) for k in keys[1:]]
        if not all(v is None or isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError("speculative-config values must be integers")
        return DraftModelSpec(config["model"], *values)


# Drafts that keep failing cost their rows' attention and activations: a sequence whose
# recent drafts were mostly rejected stops drafting, and tries again every PROBE_EVERY tokens.
RECENT_DECAY = 0.8           # per draft step: the weight of earlier drafts in the running tallies
MIN_KEPT_SHARE = 0.3         # below this share of recent drafts kept, stop drafting ...
PROBE_EVERY = 8              # ... except every this many tokens


@dataclass(slots=True)
class DraftRecord:
    """A sequence's recent drafts: decayed tallies of drafted and kept tokens."""
    drafted: float = 0.0
    kept: float = 0.0

    def add(self, drafted: int, kept: int) -> None:
        self.drafted = RECENT_DECAY * self.drafted + drafted
        self.kept = RECENT_DECAY * self.kept + kept

    def worth_drafting(self, num_output: int) -> bool:
        failing = self.drafted >= 4 and self.kept < MIN_KEPT_SHARE * self.drafted
        return not failing or num_output % PROBE_EVERY == 0


class TokenIndex:
    """A sequence's tokens as 4-byte words, grown as tokens arrive, so a suffix lookup is one bytes.rfind
    (C speed) instead of a Python scan of up to the whole context every step."""

    __slots__ = ("_bytes",)

    def __init__(self) -> None:
        self._bytes = bytearray()

    def sync(self, tokens: list[int]) -> bytes:
        have = len(self._bytes) // 4
        if have < len(tokens):
            self._bytes += array("i", tokens[have:]).tobytes()
        return self._bytes


# Drafting from a request's prediction when the server has no --speculative-config: up to 7 drafts (a step of 8
# rows on CUDA), suffixes of 3 tokens down to 1 (a prediction is the text expected next, so even one token
# locates it well; drafts that fail pause drafting as any others do).
PREDICTION_SPEC = NgramSpec(num_tokens=7, max_ngram=3, min_ngram=1)


class Prediction:
    """A request's predicted output as a draft source. While the output so far is a prefix of the prediction,
    the drafts are its next tokens. Once the output departs from it (an edit), they are the tokens that follow
    the latest occurrence in it of the output's last n tokens: looked for from where the previous drafts
    started on (the output moves through the prediction in order), else from its start."""

    __slots__ = ("tokens", "_bytes", "_matched", "_on_track", "_cursor")

    def __init__(self, tokens: tuple[int, ...] | list[int]):
        self.tokens = list(tokens)
        self._bytes = array("i", self.tokens).tobytes()
        self._matched = 0          # output tokens that equal the prediction's first ones (while on track)
        self._on_track = True
        self._cursor = 0           # where in the prediction the previous drafts started

    def propose(self, token_ids: list[int], prompt_len: int, spec: NgramSpec, limit: int) -> list[int]:
        limit = min(limit, spec.num_tokens)
        n_out = len(token_ids) - prompt_len
        if limit <= 0:
            return []
        while self._on_track and self._matched < n_out:
            i = self._matched
            if i < len(self.tokens) and token_ids[prompt_len + i] == self.tokens[i]:
                self._matched += 1
            else:
                self._on_track = False
        if self._on_track:
            self._cursor = n_out
            return self.tokens[n_out:n_out + limit]
        for n in range(min(spec.max_ngram, len(token_ids)), spec.min_ngram - 1, -1):
            pattern = array("i", token_ids[-n:]).tobytes()
            for start in (4 * self._cursor, 0):
                at = self._find(pattern, start)
                if at is not None and at + n < len(self.tokens):
                    self._cursor = at + n
                    return self.tokens[at + n:at + n + limit]
        return []

    def _find(self, pattern: bytes, start: int) -> int | None:
        """The first token-aligned occurrence of pattern at or after byte `start`, as a token index."""
        i = self._bytes.find(pattern, start)
        while i >= 0 and i % 4:
            i = self._bytes.find(pattern, i + 1)
        return None if i < 0 else i // 4


def propose(tokens: list[int], index: TokenIndex, spec: NgramSpec, limit: int) -> list[int]:
    """Up to min(spec.num_tokens, limit) drafts: what followed the latest earlier occurrence of the longest
    suffix n-gram (max_ngram down to min_ngram) that has one; [] if none has."""
    limit = min(limit, spec.num_tokens)
    if limit <= 0 or len(tokens) < 2:
        return []
    data = index.sync(tokens)
    hay_end = len(data) - 4            # occurrences must end before the last token: a draft must follow them
    for n in range(min(spec.max_ngram, len(tokens) - 1), spec.min_ngram - 1, -1):
        pattern = bytes(data[len(data) - 4 * n:])
        end = hay_end
        while True:
            i = data.rfind(pattern, 0, end)
            if i < 0:
                break
            if i % 4 == 0:             # aligned to a token: a real occurrence
                start = i // 4 + n
                return tokens[start:start + limit]
            end = i + len(pattern) - 1     # look for one that starts earlier
    return []
