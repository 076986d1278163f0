"""Batched sampling: one step's logits for every row -> one token per row, without a host sync.

Every row carries its own parameters. The work is vectorized over the batch; expensive stages (penalties,
top-k/top-p, min-p, random noise, logprobs) run only when some row needs them, decided on
the host from the Python parameters. Nothing here reads device data back: the caller does the one
transfer per step.

Randomness is counter-based: the noise for a token is a hash of (request seed, request step, token id),
so a request's samples do not depend on which other rows share the batch, on the batch order, or on the
device. The hash is exact integer arithmetic (identical bits on CPU and CUDA); the Gumbel transform of it
is float32 `log`, whose last-ulp rounding may differ between devices, so identical logits give the same
token on CPU and CUDA except at float32-level near-ties.

Pipeline per row: raw logits -> penalties (repetition, presence, frequency, then DRY) -> logit bias -> allowed
tokens, grammar mask and bans -> (greedy: argmax) | (temperature -> top-n-sigma -> top-k -> top-p over the
top-k-renormalized distribution -> min-p relative to the most likely token -> typical-p -> XTC, or mirostat in
their place -> dynamic temperature -> Gumbel-max). logprobs are always of the raw logits (no penalties, no
temperature).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cobatch import ops
from cobatch.engine.dry import DEFAULT_BREAKERS, MAX_BREAKER_CHARS, MAX_BREAKERS, MAX_WINDOW, dry_penalties
from cobatch.engine.grammar import apply_token_masks
from cobatch.kernels.greedy import temper_ref, token_noise_key
from cobatch.kernels.top_k import CAP as TOP_K_CAP
from cobatch.kernels.top_p import apply_min_p

MAX_TOP_LOGPROBS = 20            # same cap as the OpenAI API's top_logprobs
MAX_ABS_OPENAI_PENALTY = 2.0     # presence/frequency penalty range of the OpenAI API
MAX_LOGIT_BIAS = 1024            # entries per request (bounds the host work of building the bias)
MAX_ALLOWED_TOKENS = 65536       # allowed_token_ids per request
MAX_BAD_WORDS = 256              # bad_words sequences per request (each checked on the host every step)
MAX_BAD_WORD_TOKENS = 64

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


# --- parameters --------------------------------------------------------------------------------------

@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0          # 0 -> greedy
    top_k: int = 0                    # 0 -> off
    top_p: float = 1.0                # 1 -> off
    min_p: float = 0.0                # 0 -> off
    typical_p: float = 1.0            # 1 -> off: locally typical sampling (HF's typical_p, llama.cpp's typ_p)
    top_n_sigma: float = -1.0         # <= 0 -> off: llama.cpp's top-n-sigma, logits within n std devs of the top
    # llama.cpp's XTC (exclude top choices): on a step drawn with this probability, the tokens of probability
    # >= xtc_threshold but the least likely of them are removed (nothing when fewer than two reach it)
    xtc_probability: float = 0.0      # 0 -> off
    xtc_threshold: float = 0.1        # > 0.5 -> off (at most one token can reach it)
    # llama.cpp's DRY (engine/dry.py): a token extending a repeat of n >= dry_allowed_length context tokens loses
    # dry_multiplier * dry_base ** (n - dry_allowed_length); over the last dry_penalty_last_n tokens (-1: all)
    dry_multiplier: float = 0.0       # 0 -> off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS
    # the tokens whose text holds a breaker: the server and the CLI fill it from dry_sequence_breakers and the
    # tokenizer (dry.BreakerIndex); empty, no token breaks a run
    dry_breaker_ids: frozenset[int] = frozenset()
    # Mirostat (Basu et al. 2021), llama.cpp's: 1 or 2 in place of top-k / top-p / min-p / typical-p / XTC, keeping
    # each step's surprise -log2 p near mirostat_tau by a state mu that each sampled token moves (mirostat_eta)
    mirostat: int = 0                 # 0 -> off
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # llama.cpp's dynamic temperature (its temp-ext sampler): after the filters, the tokens left are tempered by
    # T' in [max(0, T - dynatemp_range), T + dynatemp_range], placed by their entropy (_dynamic_temperature)
    dynatemp_range: float = 0.0       # 0 -> off
    dynatemp_exponent: float = 1.0
    seed: int | None = None           # None -> resolved_seed() draws one per request
    repetition_penalty: float = 1.0   # HF/llama.cpp: logit>0 ? logit/p : logit*p over prompt+output tokens
    presence_penalty: float = 0.0     # OpenAI: logit -= presence * (count>0), over output tokens
    frequency_penalty: float = 0.0    # OpenAI: logit -= frequency * count, over output tokens
    # llama.cpp's penalty_last_n: n > 0, the three penalties above count the last n tokens of prompt and output
    # alike (llama.cpp's); -1, the whole prompt and output for repetition and the output for the others (vLLM's);
    # 0, no penalties
    repeat_last_n: int = -1
    max_tokens: int = 256
    min_tokens: int = 0               # vLLM: no end of turn (nor stop_token_ids) before this many tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # None: none; n>=0: the chosen token's logprob plus the top-n
    prompt_logprobs: int | None = None   # the same for each prompt token (the prefix cache is then not used)
    logit_bias: tuple[tuple[int, float], ...] = ()   # OpenAI: (token id, bias in [-100, 100]) added to logits
    grammar: str | None = None        # an llguidance grammar the output must follow (engine/grammar.py)
    allowed_token_ids: tuple[int, ...] = ()   # vLLM: only these may be sampled (empty: every token)
    bad_words: tuple[tuple[int, ...], ...] = ()   # vLLM: token sequences the output may not contain (bad_word_bans)
    embed: bool = False               # also return the last prompt token's final hidden state (/v1/embeddings)
    prediction: tuple[int, ...] = ()  # OpenAI's predicted output: drafts for speculative decoding (same output)
    adapter: str | None = None        # the LoRA adapter the request runs through, by name (None: the base model)
    priority: int = 0                 # vLLM's: lower runs first, under the engine's priority scheduling policy
    # vLLM's: the request shares prefix-cache blocks only with requests of the same salt (one tenant's)
    cache_salt: str | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first out-of-range field."""
        _check_real("temperature", self.temperature, ">= 0 (0 means greedy)", lambda v: v >= 0)
        _check_int("top_k", self.top_k, ">= 0 (0 means off)", lambda v: v >= 0)
        _check_real("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_real("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_real("typical_p", self.typical_p, "in (0, 1] (1 means off)", lambda v: 0 < v <= 1)
        _check_real("top_n_sigma", self.top_n_sigma, "a number (<= 0 means off)", lambda v: v <= 1e6)
        _check_real("xtc_probability", self.xtc_probability, "in [0, 1] (0 means off)", lambda v: 0 <= v <= 1)
        _check_real("xtc_threshold", self.xtc_threshold, "in [0, 1] (above 0.5 means off)", lambda v: 0 <= v <= 1)
        _check_real("dry_multiplier", self.dry_multiplier, ">= 0 (0 means off)", lambda v: v >= 0)
        _check_real("dry_base", self.dry_base, "in [1, 10]", lambda v: 1 <= v <= 10)
        _check_int("dry_allowed_length", self.dry_allowed_length, ">= 1", lambda v: v >= 1)
        _check_int("dry_penalty_last_n", self.dry_penalty_last_n, ">= -1 (-1: the whole context, 0: off)",
                   lambda v: v >= -1)
        _check_int("mirostat", self.mirostat, "0 (off), 1 or 2", lambda v: v in (0, 1, 2))
        _check_real("mirostat_tau", self.mirostat_tau, "in [0, 100]", lambda v: 0 <= v <= 100)
        _check_real("mirostat_eta", self.mirostat_eta, "in [0, 1]", lambda v: 0 <= v <= 1)
        _check_real("dynatemp_range", self.dynatemp_range, "in [0, 1000] (0 means off)", lambda v: 0 <= v <= 1000)
        _check_real("dynatemp_exponent", self.dynatemp_exponent, "in [0, 1000]", lambda v: 0 <= v <= 1000)
        breakers = self.dry_sequence_breakers
        if not (isinstance(breakers, tuple) and len(breakers) <= MAX_BREAKERS
                and all(isinstance(b, str) and 0 < len(b) <= MAX_BREAKER_CHARS for b in breakers)):
            raise ValueError(f"dry_sequence_breakers must be at most {MAX_BREAKERS} non-empty strings of at most "
                             f"{MAX_BREAKER_CHARS} characters")
        if self.seed is not None:
            _check_int("seed", self.seed, "an integer or None", lambda v: True)
        _check_real("repetition_penalty", self.repetition_penalty, "> 0 (1 means off)", lambda v: v > 0)
        _check_int("repeat_last_n", self.repeat_last_n, ">= -1 (-1: the whole context, 0: no penalties)",
                   lambda v: v >= -1)
        bound = MAX_ABS_OPENAI_PENALTY
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), f"in [-{bound}, {bound}]", lambda v: abs(v) <= bound)
        _check_int("max_tokens", self.max_tokens, ">= 1", lambda v: v >= 1)
        _check_int("min_tokens", self.min_tokens, ">= 0 and <= max_tokens", lambda v: 0 <= v <= self.max_tokens)
        for token in self.stop_token_ids:
            _check_token("stop_token_ids", token, "", vocab_size)
        for token in self.prediction:
            _check_token("prediction", token, "", vocab_size)
        _check_int("priority", self.priority, "an integer (lower runs first)", lambda v: abs(v) < 2 ** 63)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string if given (got {self.cache_salt!r})")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise ValueError(f"adapter must be a LoRA adapter's name (got {self.adapter!r})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool (got {self.ignore_eos!r})")
        if self.logprobs is not None:
            limit = MAX_TOP_LOGPROBS if vocab_size is None else min(MAX_TOP_LOGPROBS, vocab_size)
            _check_int("logprobs", self.logprobs, f"None or in [0, {limit}]", lambda v: 0 <= v <= limit)
        if self.prompt_logprobs is not None:
            limit = MAX_TOP_LOGPROBS if vocab_size is None else min(MAX_TOP_LOGPROBS, vocab_size)
            _check_int("prompt_logprobs", self.prompt_logprobs, f"None or in [0, {limit}]", lambda v: 0 <= v <= limit)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries (got {len(self.logit_bias)})")
        for token, bias in self.logit_bias:
            _check_token("logit_bias", token, "keyed by ", vocab_size)
            _check_real("logit_bias", bias, "values in [-100, 100]", lambda v: -100 <= v <= 100)
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKENS:
            raise ValueError(f"allowed_token_ids must have at most {MAX_ALLOWED_TOKENS} entries")
        for token in self.allowed_token_ids:
            _check_token("allowed_token_ids", token, "a list of ", vocab_size)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must have at most {MAX_BAD_WORDS} entries (got {len(self.bad_words)})")
        for word in self.bad_words:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words entries must be 1 to {MAX_BAD_WORD_TOKENS} tokens long")
            for token in word:
                _check_token("bad_words", token, "sequences of ", vocab_size)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a string or None (got {type(self.grammar).__name__})")

    def resolved_seed(self) -> int:
        """The seed, or a fresh random 63-bit one; call once per request and keep it."""
        return self.seed if self.seed is not None else random.SystemRandom().getrandbits(63)


def _check_token(name: str, token: object, how: str, vocab_size: int | None) -> None:
    """A token id of field `name`: an int in [0, vocab_size) (non-negative without a vocabulary)."""
    ids = "token ids" if vocab_size is None else f"token ids in [0, {vocab_size})"
    _check_int(name, token, how + ids, lambda v: v >= 0 and (vocab_size is None or v < vocab_size))


def _check_real(name: str, value: object, expected: str, in_range: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not in_range(value):
        raise ValueError(f"{name} must be {expected} (got {value!r})")


def _check_int(name: str, value: object, expected: str, in_range: Callable[[int], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not in_range(value):
        raise ValueError(f"{name} must be {expected} (got {value!r})")


@dataclass(slots=True)
class SampleRow:
    """What the engine knows about one row this step."""
    params: SamplingParams
    seed: int                   # the request's resolved seed
    step: int                   # number of tokens this request has sampled so far
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    allowed: torch.Tensor | None = None     # the grammar's packed token mask (engine/grammar.py), if any
    banned: Sequence[int] = ()              # tokens this row may not sample now (ends of turn before min_tokens,
                                            # the last token of a bad word whose rest the output ends with)
    mirostat_mu: float | None = None        # mirostat's state after the steps before (None: its first, 2 tau)


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor                  # int64 [B], on the logits' device
    logprobs: torch.Tensor | None            # float32 [B]: log_softmax(raw logits) at the chosen token
    top_ids: torch.Tensor | None             # int64 [B, n], n = the largest `logprobs` asked for this step
    top_logprobs: torch.Tensor | None        # float32 [B, n]
    mirostat_mu: torch.Tensor | None = None  # float32 [B]: each mirostat row's state after this step (else NaN)


# --- counter-based noise -----------------------------------------------------------------------------
# noise(row, token) = fmix32(row_key(seed, step) ^ token_key(token id)). The row key is mixed on the host
# from Python ints; the per-token hash (kernels/greedy.py: token_noise_key, counter_uniforms) runs on the device,
# with the same bits on the CPU and CUDA.

def _splitmix64(z: int) -> int:
    """SplitMix64's finalizer on a Python int (exact 64-bit arithmetic on the host)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_noise_key(seed: int, step: int) -> int:
    """32-bit key of one (seed, step), computed on the host: a few Python int ops per row per step."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return (mixed ^ (mixed >> 32)) & _MASK32


def row_uniform(seed: int, step: int, stream: int) -> float:
    """A uniform in [0, 1) of one (seed, step), computed on the host: `stream` tells apart the draws one step
    makes (XTC's coin), and none of them is the token noise's. Plain decoding and a speculative draft row of
    the same step draw the same."""
    mixed = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) ^ (stream & _MASK64))
    return (mixed >> 11) * 2.0 ** -53


XTC_STREAM = 1      # row_uniform's stream of XTC's coin


# --- logit transforms --------------------------------------------------------------------------------

def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without waiting on the GPU: a plain torch.tensor(..., device='cuda')
    copies from pageable memory and synchronizes the stream; a pinned, non-blocking copy does not."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _padded_ids(id_lists: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(ids) for ids in id_lists))
    return to_device([list(ids) + [pad] * (width - len(ids)) for ids in id_lists], torch.int64, device)


def needs_penalties(params: SamplingParams) -> bool:
    """Does sampling read the row's tokens (repetition, presence, frequency or DRY penalties)?"""
    return uses_penalties(params) or uses_dry(params)


def uses_penalties(params: SamplingParams) -> bool:
    """Does a row take the repetition, presence or frequency penalty?"""
    return params.repeat_last_n != 0 and (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                                          or params.frequency_penalty != 0.0)


def reads_feedback(params: SamplingParams) -> bool:
    """Does a row's sampling depend on what the steps before it sampled (its tokens, or mirostat's state)? Then
    it is not drafted ahead."""
    return needs_penalties(params) or params.mirostat != 0


def reads_host_feedback(params: SamplingParams) -> bool:
    """Does a row's sampling need, on the host, what the step before it sampled (DRY's token runs)? Then its next
    step is not planned before the host has seen its last token. The repetition, presence and frequency penalties
    count that token on the device, and mirostat takes its state from there (Sampler's `pending`, `pending_mu`)."""
    return uses_dry(params)


def uses_dry(params: SamplingParams) -> bool:
    return params.dry_multiplier > 0 and params.dry_penalty_last_n != 0


def apply_dry(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Subtract each DRY row's penalties (engine/dry.py) over its last dry_penalty_last_n tokens of prompt and
    output (-1: as many as dry.MAX_WINDOW, which bounds the host work a step); float32 [B, V], rows without DRY
    unchanged."""
    entries = []
    for i, r in enumerate(rows):
        p = r.params
        if not uses_dry(p):
            continue
        window = min(p.dry_penalty_last_n if p.dry_penalty_last_n > 0 else MAX_WINDOW, MAX_WINDOW)
        context = _context_tail(r, window)
        entries += [(i, token, -amount) for token, amount in dry_penalties(
            context, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_breaker_ids)]
    return _add_at(logits, entries)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Add each row's logit_bias to its logits (float32 [B, V], a new tensor); rows without one unchanged."""
    return _add_at(logits, [(i, token, bias) for i, r in enumerate(rows) for token, bias in r.params.logit_bias])


def bad_word_bans(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> tuple[int, ...]:
    """The tokens that would complete one of the bad words now: a word's last token, where the output ends
    with the rest of the word (vLLM's bad_words; a one-token word is always banned)."""
    banned = []
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or (len(output_ids) >= head and tuple(output_ids[len(output_ids) - head:]) == tuple(word[:head])):
            banned.append(word[-1])
    return tuple(banned)


def apply_allowed(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """-inf outside each row's allowed_token_ids (float32 [B, V], a new tensor); rows without any unchanged."""
    entries = [(i, token) for i, r in enumerate(rows) for token in r.params.allowed_token_ids]
    if not entries:
        return logits
    restricted = to_device([bool(r.params.allowed_token_ids) for r in rows], torch.bool, logits.device)
    index = to_device(entries, torch.int64, logits.device)
    allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[index[:, 0], index[:, 1]] = True
    return logits.float().masked_fill(restricted[:, None] & ~allowed, -math.inf)


def apply_bans(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """-inf at each row's banned tokens (float32 [B, V], a new tensor); rows without any unchanged."""
    return _add_at(logits, [(i, token, -math.inf) for i, r in enumerate(rows) for token in r.banned])


def _add_at(logits: torch.Tensor, entries: list[tuple[int, int, float]]) -> torch.Tensor:
    """logits (as float32, a new tensor) plus value at each (row, token, value); `logits` itself if none.
    A -inf value stays -inf (a +inf logit plus -inf is NaN, which the sampler turns into -inf)."""
    if not entries:
        return logits
    index = to_device([[i, token] for i, token, _ in entries], torch.int64, logits.device)
    values = to_device([value for _, _, value in entries], torch.float32, logits.device)
    return logits.float().index_put((index[:, 0], index[:, 1]), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow], pending: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Repetition (prompt+output), then frequency and presence (output) penalties; float32 [B, V]. A row with
    repeat_last_n > 0 takes all three over its last repeat_last_n tokens of prompt and output instead.

    Token counts come from padded id tensors scattered on the device; the pad id V lands in an extra
    column that is dropped. Rows without penalties get neutral values (exactly the identity). `pending`: one
    more output token a row, on the device, that its host-side output_ids lack (a step planned before the host
    saw the one before it sample: engine.py).
    """
    batch, vocab = logits.shape
    device = logits.device
    logits = logits.float()
    uses_any = [uses_penalties(r.params) for r in rows]
    windowed = [use and r.params.repeat_last_n > 0 for r, use in zip(rows, uses_any)]
    uses_repetition = [use and r.params.repetition_penalty != 1.0 and not window
                       for r, use, window in zip(rows, uses_any, windowed)]
    # Only ship the ids a row's penalties actually read: a windowed row's last tokens as its "output"
    # (less one where the step's pending token, on the device, is the window's last)
    counted = [_context_tail(r, r.params.repeat_last_n - (pending is not None)) if window
               else r.output_ids if use else () for r, use, window in zip(rows, uses_any, windowed)]
    output_ids = _padded_ids(counted, vocab, device)
    output_counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    if pending is not None:
        output_counts.scatter_add_(1, pending[:, None], torch.ones(batch, 1, dtype=torch.float32, device=device))
    output_counts = output_counts[:, :vocab]
    output_seen = output_counts > 0

    if any(r.params.repetition_penalty != 1.0 for r, use in zip(rows, uses_any) if use):
        prompt_ids = _padded_ids([r.prompt_ids if use else () for r, use in zip(rows, uses_repetition)],
                                 vocab, device)
        seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | output_seen
        penalty = to_device([r.params.repetition_penalty if use else 1.0 for r, use in zip(rows, uses_any)],
                            torch.float32, device)[:, None]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)

    frequency = to_device([r.params.frequency_penalty if use else 0.0 for r, use in zip(rows, uses_any)],
                          torch.float32, device)[:, None]
    presence = to_device([r.params.presence_penalty if use else 0.0 for r, use in zip(rows, uses_any)],
                         torch.float32, device)[:, None]
    return logits - (frequency * output_counts + presence * output_seen.float())


def _context_tail(row: SampleRow, n: int) -> list[int]:
    """The last n tokens of a row's prompt and output together (DRY's window, the penalties' repeat_last_n)."""
    if n <= 0:
        return []
    output = list(row.output_ids[-n:])
    if len(output) == n:
        return output
    return list(row.prompt_ids[max(0, len(row.prompt_ids) - (n - len(output))):]) + output


def filters_apply(vocab: int, top_k: list[int], top_p: list[float], min_p: list[float],
                  typical_p: list[float] | None = None, xtc_threshold: list[float] | None = None,
                  top_n_sigma: list[float] | None = None) -> bool:
    """Whether filter_logits with these per-row settings would remove any token (else the scores pass through)."""
    return (any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p) or any(p > 0.0 for p in min_p)
            or any(p < 1.0 for p in typical_p or ()) or any(t <= 0.5 for t in xtc_threshold or ())
            or any(n > 0 for n in top_n_sigma or ()))


def filter_logits(scores: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float],
                  typical_p: list[float] | None = None, xtc_threshold: list[float] | None = None,
                  top_n_sigma: list[float] | None = None) -> torch.Tensor:
    """Set tokens outside each row's top-n-sigma / top-k / top-p / min-p / typical-p sets to -inf, then apply XTC;
    float32 [R, V] in and out.

    `scores` are tempered logits. Order: top-n-sigma (llama.cpp's place, before top-k; a temperature scales the
    largest logit and the spread alike, so it keeps the same tokens at any), top-k, then top-p over the
    top-k-renormalized distribution (keep the smallest prefix whose mass reaches p), then min-p (keep p >= min_p *
    p_max), then typical-p (HF's TypicalLogitsWarper, in its place after min-p), then XTC (as llama.cpp's, after
    the others). The most likely token always survives top-k, top-p and min-p, so min-p commutes with the other
    two. xtc_threshold: per row, the threshold of a step whose XTC coin came up (else above 0.5: off)."""
    rows, vocab = scores.shape
    device = scores.device
    if top_n_sigma is not None and any(n > 0 for n in top_n_sigma):
        scores = _top_n_sigma(scores, to_device([n if n > 0 else math.inf for n in top_n_sigma], torch.float32,
                                                device))
    scores, min_p = _top_k_top_p(scores, top_k, top_p, min_p)
    if any(p > 0.0 for p in min_p):
        scores = apply_min_p(scores, to_device(list(min_p), torch.float32, device))
    if typical_p is not None and any(p < 1.0 for p in typical_p):
        scores = _typical(scores, to_device([p if p < 1.0 else math.inf for p in typical_p], torch.float32,
                                            device))
    if xtc_threshold is not None and any(t <= 0.5 for t in xtc_threshold):
        scores = _exclude_top_choices(scores, to_device(list(xtc_threshold), torch.float32, device))
    return scores


# A row whose top-k fits one of these widths is filtered from its `width` largest values (_largest_values), not
# from a sort of its whole row (128k values for Llama-3). The width follows from the row's own k alone, so its result
# does not depend on the other rows of the batch.
TOP_K_WIDTHS = (64, 256, 1024, 4096)


def top_k_width(top_k: int, vocab: int) -> int:
    """How many of a row's largest values its top-k / top-p filter reads: the smallest of TOP_K_WIDTHS that holds
    its k, else (top-p alone, or a k beyond them) the whole row."""
    return next((width for width in TOP_K_WIDTHS if 0 < top_k <= width < vocab), vocab)


# Where ops run kernels: rows with top-p alone through ops.top_p_keep, whose kernel finds each row's cut without
# sorting the row (else the whole-row sort of _keep_largest); rows with a top-k of at most TOP_K_CAP through
# ops.top_k_keep, whose kernel finds the k-th value by counts (else torch.topk's prefix). H100, GPU time a call at
# B = 64: top-p 0.9 1,151 -> 336 us, llama.cpp's settings 822 -> 519 (bench/results/sampler_filter_kernels.json).
# On the CPU the torch ways stay (the kernels' references sort every row).
TOP_P_KERNEL = os.environ.get("COBATCH_TOP_P_KERNEL", "1") == "1"
TOP_K_KERNEL = os.environ.get("COBATCH_TOP_K_KERNEL", "1") == "1"
# Those kernels' rows take their min-p in the kernels' output pass, not torch's five launches after the cut:
# llama.cpp's settings at B = 1 / 64 / 256 255 / 519 / 1,342 -> 232 / 367 / 814 GPU us a call (the same file).
MIN_P_IN_KERNELS = os.environ.get("COBATCH_MIN_P_IN_KERNELS", "1") == "1"
TOP_P_ALONE = 0         # _top_k_top_p's groups of those rows (the others' are their widths)
TOP_K_SET = -1


def _top_k_top_p(scores: torch.Tensor, top_k: list[int], top_p: list[float],
                 min_p: list[float]) -> tuple[torch.Tensor, list[float]]:
    """Top-k, then top-p over the top-k-renormalized distribution: each row keeps its `count` largest tokens, the
    lowest ids first among equal values (the order of a stable descending sort), where `count` is k cut to the
    smallest prefix of that order whose mass reaches p. Rows are grouped by `_filter_group`; rows with neither
    filter are not touched. With MIN_P_IN_KERNELS the kernels' groups apply their rows' min-p in the same pass:
    returns the scores and the min-p left to apply (0 for those rows)."""
    rows, vocab = scores.shape
    kernels = ops.runs_kernels(scores)
    groups: dict[int, list[int]] = {}
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        if 0 < k < vocab or p < 1.0:
            groups.setdefault(_filter_group(k, vocab, kernels), []).append(row)
    min_p_left = list(min_p)
    for width, members in groups.items():
        index = None if len(members) == rows else to_device(members, torch.int64, scores.device)
        group = scores if index is None else scores.index_select(0, index)
        if width in (TOP_P_ALONE, TOP_K_SET):
            p_values = to_device([top_p[r] for r in members], torch.float32, scores.device)
            min_p_values = None
            if MIN_P_IN_KERNELS:
                min_p_values = to_device([min_p[r] for r in members], torch.float32, scores.device)
                for r in members:
                    min_p_left[r] = 0.0
        if width == TOP_P_ALONE:
            kept = ops.top_p_keep(group, p_values, min_p_values)
        elif width == TOP_K_SET:
            kept = ops.top_k_keep(group, to_device([top_k[r] for r in members], torch.int32, scores.device),
                                  p_values, min_p_values)
        else:
            kept = _keep_largest(group, width, [top_k[r] for r in members], [top_p[r] for r in members])
        scores = kept if index is None else scores.index_copy(0, index, kept)
    return scores, min_p_left


def _filter_group(top_k: int, vocab: int, kernels: bool) -> int:
    """_top_k_top_p's group of a row with this k (0: none): a kernel's group where ops run kernels and its switch
    is on, else its top_k_width."""
    has_top_k = 0 < top_k < vocab
    if kernels and TOP_P_KERNEL and not has_top_k:
        return TOP_P_ALONE
    if kernels and TOP_K_KERNEL and has_top_k and top_k <= TOP_K_CAP:
        return TOP_K_SET
    return top_k_width(top_k, vocab)


def _keep_largest(scores: torch.Tensor, width: int, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """_top_k_top_p for rows that share one width: the kept count comes from each row's `width` largest values,
    and the kept tokens are those above the count-th value plus the lowest ids of those equal to it; or, where
    the width is the whole row, whose stable sort gives its order too, the first `count` of that order (the
    same tokens, by one scatter instead of the passes over the row that find the ties)."""
    rows, vocab = scores.shape
    device = scores.device
    if width >= vocab:
        largest, order = scores.sort(dim=-1, descending=True, stable=True)
    else:
        largest, order = _largest_values(scores, width), None
    count = to_device([k if 0 < k < width else width for k in top_k], torch.int64, device)
    if any(p < 1.0 for p in top_p):
        kept_by_k = largest
        if any(0 < k < width for k in top_k):        # top-p over the top-k-renormalized distribution
            within_k = torch.arange(width, device=device)[None, :] < count[:, None]
            kept_by_k = largest.masked_fill(~within_k, -math.inf)
        probs = kept_by_k.softmax(dim=-1)
        # Rows with top_p = 1 compare against +inf, so rounding (mass ~ 1) never trims their tail.
        p_per_row = to_device([p if p < 1.0 else math.inf for p in top_p], torch.float32, device)
        count = torch.minimum(count, _prefix_below(probs, p_per_row))
    count = count.clamp(min=1)                          # the largest value always stays
    if order is not None:
        drop_sorted = torch.arange(vocab, device=device)[None, :] >= count[:, None]
        return scores.masked_fill(_unsorted(drop_sorted, order), -math.inf)
    threshold = largest.gather(1, (count - 1)[:, None])
    above = scores > threshold
    ties = scores == threshold
    room = count - above.sum(dim=-1)                    # how many of the tied tokens fit, lowest ids first
    first_ids = torch.arange(vocab, device=device)[None, :] < _prefix_below(ties, room)[:, None]
    return scores.masked_fill(~(above | (ties & first_ids)), -math.inf)


# Cumulative sums over a whole row of 128k values are one slow scan a row on the GPU: _prefix_below sums blocks of
# this many values, then scans the one block where the limit is crossed (top-k 40 at 64 rows of Llama-3's vocabulary:
# 910 -> 616 us of GPU time a call, bench/results/sampler.json).
PREFIX_BLOCK = 4096


def _prefix_below(weights: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` ([R, N], nonnegative; bool counts as 0/1), how many leading entries have a sum of the
    entries before them below `limit` ([R]): the length of the prefix a running sum keeps. The sum before an
    entry is its block's start (a cumulative sum of block sums) plus the entries before it in its block, so it never
    decreases along the row. The whole blocks are summed through a view of the row and the last part block apart,
    so the [R, N] weights are never copied."""
    rows, n = weights.shape
    size = min(n, PREFIX_BLOCK)
    whole = n - n % size
    sums = weights[:, :whole].reshape(rows, -1, size).sum(dim=-1)
    if whole < n:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    block_start = torch.nn.functional.pad(sums.cumsum(dim=-1)[:, :-1], (1, 0))
    crossing = ((block_start < limit[:, None]).sum(dim=-1) - 1).clamp(min=0)   # the last block starting below
    cols = crossing[:, None] * size + torch.arange(size, device=weights.device)
    block = weights.gather(1, cols.clamp(max=n - 1)) * (cols < n)              # past the row: 0
    before = block_start.gather(1, crossing[:, None]) + torch.nn.functional.pad(block.cumsum(dim=-1)[:, :-1], (1, 0))
    return (crossing * size + (before < limit[:, None]).sum(dim=-1)).clamp(max=n)


def _largest_values(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's `width` largest values (fewer than the row's), largest first. (Each 4096-wide block's largest
    first, then the largest of those, was slower on the GPU than torch.topk over the whole row: docs/kernels.md,
    the sampler.)"""
    return scores.topk(width, dim=-1).values


def _unsorted(drop_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """A mask over each row's tokens in `order` (a sort's indices) put back in token order."""
    return torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)


def _top_n_sigma(scores: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Top-n-sigma (Tang et al. 2024): the tokens whose logit is at least the largest less n standard deviations of
    the row's logits (of the tokens still in; inf: keep all)."""
    finite = torch.isfinite(scores)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = torch.where(finite, scores, 0.0).sum(dim=-1, keepdim=True) / count
    spread = (torch.where(finite, (scores - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count).sqrt()
    floor = scores.amax(dim=-1, keepdim=True) - n[:, None] * spread
    return scores.masked_fill(scores < floor, -math.inf)


def _typical(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022): the tokens sorted by how far their surprise -log p is from
    the distribution's entropy, nearest first, are kept up to and including the one whose cumulative probability
    reaches the row's mass (inf: keep all); at least one is kept."""
    log_p = scores.log_softmax(dim=-1)
    p = log_p.exp()
    entropy = -(torch.where(p > 0, p * log_p, torch.zeros_like(p))).sum(dim=-1, keepdim=True)
    distance = torch.where(p > 0, (-log_p - entropy).abs(), torch.full_like(p, math.inf))
    order = distance.argsort(dim=-1, stable=True)
    mass_before = p.gather(1, order).cumsum(dim=-1) - p.gather(1, order)
    drop_sorted = mass_before >= mass[:, None]
    drop_sorted[:, 0] = False
    drop = _unsorted(drop_sorted, order)
    return scores.masked_fill(drop, -math.inf)


def _exclude_top_choices(scores: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """XTC: where two or more tokens left have probability >= the row's threshold, all of them but the least
    likely are removed (a row whose threshold is above 0.5 keeps everything: at most one token reaches it)."""
    p = scores.softmax(dim=-1)
    above = (p >= threshold[:, None]) & (p > 0)         # of the tokens the filters before left
    least = torch.where(above, p, torch.full_like(p, math.inf)).amin(dim=-1, keepdim=True)
    drop = above & (p > least) & (above.sum(dim=-1, keepdim=True) >= 2)
    return scores.masked_fill(drop, -math.inf)


def _mu(row: SampleRow) -> float:
    """Mirostat's state for this step: the row's, or 2 tau before its first (NaN: not a mirostat row)."""
    if not row.params.mirostat:
        return math.nan
    return 2 * row.params.mirostat_tau if row.mirostat_mu is None else row.mirostat_mu


MIROSTAT_V1_M = 100      # the likeliest tokens mirostat 1 fits its Zipf exponent to (the paper's and llama.cpp's m)


def mirostat_v2(scores: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat 2: the tokens whose surprise -log2 p exceeds the row's mu are removed (the likeliest stays)."""
    log_p = scores.log_softmax(dim=-1)
    surprise = -log_p / math.log(2)
    keep = (surprise <= mu[:, None]) | (log_p == log_p.amax(dim=-1, keepdim=True))
    return scores.masked_fill(~keep, -math.inf)


def mirostat_v1(scores: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat 1: the Zipf exponent s of the likeliest m tokens' probabilities (least squares of log(p_i /
    p_i+1) on log((i + 2) / (i + 1))), then top-k with k = (eps 2^mu / (1 - V^-eps))^(1 / s), eps = s - 1."""
    vocab = scores.shape[1]
    m = min(MIROSTAT_V1_M, vocab)
    log_p = scores.log_softmax(dim=-1)
    ordered, order = log_p.sort(dim=-1, descending=True, stable=True)     # ties to the lower id, as top-k's
    top = ordered[:, :m]
    i = torch.arange(m - 1, device=scores.device, dtype=torch.float32)
    t = torch.log((i + 2) / (i + 1))
    b = torch.nan_to_num(top[:, :-1] - top[:, 1:], nan=0.0, posinf=0.0)
    s_hat = (t * b).sum(dim=-1) / (t * t).sum()
    eps = s_hat - 1
    k = ((eps * torch.exp2(mu)) / (1 - vocab ** (-eps))) ** (1 / s_hat)
    k = torch.nan_to_num(k, nan=1.0, posinf=float(vocab)).clamp(min=1, max=vocab).floor()
    drop_sorted = torch.arange(vocab, device=scores.device)[None, :] >= k[:, None]
    drop = _unsorted(drop_sorted, order)
    return scores.masked_fill(drop, -math.inf)


def _xtc_threshold(row: SampleRow) -> float:
    """The row's XTC threshold this step: its own when its coin (row_uniform) comes up, else off (inf)."""
    p = row.params
    if p.xtc_probability <= 0 or p.xtc_threshold > 0.5:
        return math.inf
    return p.xtc_threshold if row_uniform(row.seed, row.step, XTC_STREAM) < p.xtc_probability else math.inf


def _dynamic_temperature(logits: torch.Tensor, filtered: torch.Tensor, rows: list[SampleRow],
                         dynamic: list[bool]) -> torch.Tensor:
    """llama.cpp's dynamic temperature on the `dynamic` rows of `filtered` (their scores after the filters, at the
    base temperature T; -inf: removed): the n tokens left are tempered anew by T' = lo + (hi - lo) * (H / ln n) **
    dynatemp_exponent, where lo = max(0, T - dynatemp_range), hi = T + dynatemp_range and H is the entropy of the
    softmax of their untempered `logits`. So a confident step draws cooler, a flat one hotter. A row with one token
    left keeps it; T' = 0 keeps the likeliest (llama.cpp's temperature 0). Other rows pass through."""
    device = logits.device
    kept = filtered > -math.inf
    raw = torch.where(kept, temper_ref(logits, torch.ones(len(rows), device=device)), -math.inf)
    log_p = torch.log_softmax(raw, dim=-1)
    entropy = -torch.where(kept, log_p.exp() * log_p, 0.0).sum(dim=-1)
    count = kept.sum(dim=-1)
    normalized = entropy / torch.log(count.clamp_min(2).float())
    base = to_device([r.params.temperature for r in rows], torch.float32, device)
    spread = to_device([r.params.dynatemp_range for r in rows], torch.float32, device)
    exponent = to_device([r.params.dynatemp_exponent for r in rows], torch.float32, device)
    low = (base - spread).clamp_min(0.0)
    temperature = (low + (base + spread - low) * normalized.pow(exponent))[:, None]
    # from the row's largest value down, so that a tiny T' sends the others to -inf, never to NaN or +inf
    shifted = raw - raw.max(dim=-1, keepdim=True).values
    tempered = torch.where(temperature > 0, shifted / temperature.clamp_min(1e-30),
                           torch.where(shifted == 0, 0.0, -math.inf))
    retempered = torch.where((count > 1)[:, None], tempered, filtered)
    return torch.where(to_device(dynamic, torch.bool, device)[:, None], retempered, filtered)


# --- the sampler -------------------------------------------------------------------------------------

class Sampler:
    """Callable: (logits [B, V], one SampleRow per row) -> SampleOutput, all on the logits' device."""

    def __init__(self) -> None:
        # Token keys depend only on (vocab size, device): computed once, not per step.
        self._token_keys: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], pending: torch.Tensor | None = None,
                 pending_mu: torch.Tensor | None = None) -> SampleOutput:
        """`pending`: each row's last output token, on the device, where the rows' host-side histories lack it
        (apply_penalties); `pending_mu`: likewise each mirostat row's state after it (NaN: the row's own)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab]; got {tuple(logits.shape)}")
        raw = logits.float()
        device = raw.device
        penalized = apply_penalties(raw, rows, pending) if any(needs_penalties(r.params) for r in rows) else raw
        penalized = apply_dry(penalized, rows) if any(uses_dry(r.params) for r in rows) else penalized
        penalized = apply_logit_bias(penalized, rows)
        penalized = apply_allowed(penalized, rows)
        penalized = apply_token_masks(penalized, [r.allowed for r in rows])
        penalized = apply_bans(penalized, rows)
        # NaN never wins; +inf stays and wins. A sampled row's fallback (_sample turns NaN to -inf itself).
        token_ids = ops.greedy_tokens(penalized)
        sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
        mu = None
        if sampled:
            if len(sampled) == len(rows):
                token_ids, mu = self._sample(penalized, rows, token_ids, pending_mu)
            else:
                index = to_device(sampled, torch.int64, device)
                drawn, drawn_mu = self._sample(penalized.index_select(0, index), [rows[i] for i in sampled],
                                               token_ids.index_select(0, index),
                                               None if pending_mu is None else pending_mu.index_select(0, index))
                token_ids = token_ids.index_copy(0, index, drawn)
                if drawn_mu is not None:
                    mu = torch.full((len(rows),), math.nan, device=device).index_copy(0, index, drawn_mu)

        wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if not wanted:
            return SampleOutput(token_ids, None, None, None, mu)
        log_probs = torch.log_softmax(raw, dim=-1)
        chosen = log_probs.gather(1, token_ids[:, None])[:, 0]
        top_logprobs, top_ids = log_probs.topk(min(max(wanted), raw.shape[1]), dim=-1)
        return SampleOutput(token_ids, chosen, top_ids, top_logprobs, mu)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow], greedy: torch.Tensor,
                pending_mu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gumbel-max over the filtered, tempered logits of rows that all have temperature > 0; `greedy`
        (argmax of the same penalized logits) is the fallback for a row with no candidate left. Returns the
        tokens and, where some row runs mirostat, every row's state after this step (NaN: not mirostat)."""
        device = logits.device
        inverse_temperature = to_device([1.0 / r.params.temperature for r in rows], torch.float32, device)
        row_keys = to_device([row_noise_key(r.seed, r.step) for r in rows], torch.int64, device)
        token_keys = self._token_keys_for(logits.shape[1], device)
        # A row with nothing left (all -inf: bad logits, or every logit overflowing to -inf under a tiny
        # temperature) still gets a valid token, the T -> 0 limit: its greedy token (the raw argmax when no
        # penalty applies).
        mirostat = [r for r in rows if r.params.mirostat]
        filters = dict(top_k=[r.params.top_k for r in rows], top_p=[r.params.top_p for r in rows],
                       min_p=[r.params.min_p for r in rows], typical_p=[r.params.typical_p for r in rows],
                       xtc_threshold=[_xtc_threshold(r) for r in rows],
                       top_n_sigma=[r.params.top_n_sigma for r in rows])
        dynamic = [r.params.dynatemp_range > 0 and not r.params.mirostat for r in rows]
        if not mirostat and not any(dynamic) and not filters_apply(logits.shape[1], **filters):
            # temperature alone (the chat APIs' default): tempered in the pick's own pass over the logits
            return ops.gumbel_tokens(logits, row_keys, token_keys, greedy, inverse_temperature), None
        scores = temper_ref(logits, inverse_temperature)
        filtered = filter_logits(scores, **filters) if len(mirostat) < len(rows) else scores
        if any(dynamic):
            filtered = _dynamic_temperature(logits, filtered, rows, dynamic)
        if mirostat:
            mu = to_device([_mu(r) for r in rows], torch.float32, device)
            if pending_mu is not None:          # the state the step before left on the device, where it left one
                mu = torch.where(torch.isnan(pending_mu), mu, pending_mu)
            versions = [r.params.mirostat for r in rows]
            version = to_device(versions, torch.int64, device)[:, None]
            for v, truncate in ((1, mirostat_v1), (2, mirostat_v2)):      # only the versions some row runs
                if v in versions:
                    filtered = torch.where(version == v, truncate(scores, mu), filtered)
        choice = ops.gumbel_tokens(filtered, row_keys, token_keys, greedy)
        if not mirostat:
            return choice, None
        # mu moves by eta times how far the drawn token's surprise (in the distribution it was drawn from) was
        # from tau
        surprise = -filtered.log_softmax(dim=-1).gather(1, choice[:, None])[:, 0] / math.log(2)
        tau = to_device([r.params.mirostat_tau for r in rows], torch.float32, device)
        eta = to_device([r.params.mirostat_eta for r in rows], torch.float32, device)
        updated = mu - eta * (surprise - tau)
        return choice, torch.where((version[:, 0] > 0) & torch.isfinite(updated), updated, mu)

    def _token_keys_for(self, vocab: int, device: torch.device) -> torch.Tensor:
        cache_key = (vocab, device)
        if cache_key not in self._token_keys:
            self._token_keys[cache_key] = token_noise_key(torch.arange(vocab, dtype=torch.int64, device=device))
        return self._token_keys[cache_key]
