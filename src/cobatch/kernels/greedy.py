"""Each row's token from its scores: the greedy token (the first index of the row's largest value, a NaN never
chosen), and Gumbel-max sampling, which is the greedy token of the scores minus log(-log u), u the sampler's
counter-based noise (a pure function of the row's key and the token id, so the CPU and CUDA draw the same).

torch's way is a launch per elementwise step over the whole [B, V] float32 tensor: nan_to_num then argmax for the
greedy token (on the H200 29 us at B = 1 and 54 us at B = 64 of a Llama-3-8B step of 128256 columns,
bench/results/decode.json's breakdown: argmax reduces a long row in few blocks), and for a sampled row about 15 more
over int64 and float32 copies of the tensor to hash, log and subtract. Here a row is cut into chunks of CHUNK
columns, one program a chunk (the noise made in registers where the row samples; the chunk's max and the first
column holding it), and one program a row then picks the first chunk holding the row's max: the same token, since
the max and first-index rules are exact and the noise's arithmetic is the reference's, operation for operation.
Where a sampled step has no filter (temperature alone: the chat APIs' default), the chunk programs also temper the
raw logits as they load them (temper_ref: one multiply by 1 / T, NaN and +inf mapped), so no tempered [R, V] copy
is written and read back.
Measured alone (bench/results/sampler.json, H100): greedy B = 1 28.9 -> 4.8 us, B = 64 61.2 -> 14.9, B = 256
146.8 -> 47.6; Gumbel-max B = 64 854.6 -> 31.1.
"""

from __future__ import annotations

import math

import torch

from cobatch.kernels.triton_support import jit, next_pow2, tl, triton

CHUNK = 4096        # columns a program scans (32 programs a row at Llama-3's vocabulary)
BLOCK = 1024        # columns a program loads at once
_MASK32 = 0xFFFFFFFF


# --- the counter-based noise, in torch --------------------------------------------------------------------
# Values in [0, 2^32) held in int64 tensors (or Python ints), with no overflow anywhere: the CPU and CUDA agree.

def _mul32(x, constant: int):
    """(x * constant) mod 2^32. A constant >= 2^31 is used as its negative twin constant - 2^32 (same
    residue) so the product stays inside int64; & then takes the two's-complement residue."""
    signed = constant - (1 << 32) if constant >= 1 << 31 else constant
    return (x * signed) & _MASK32


def fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection on [0, 2^32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def token_noise_key(token_ids: torch.Tensor) -> torch.Tensor:
    """32-bit key of each token id (int64 tensor)."""
    return fmix32(_mul32(token_ids, 0x1B873593) ^ 0x5BD1E995)


def counter_uniforms(row_keys: torch.Tensor, token_keys: torch.Tensor) -> torch.Tensor:
    """Uniform u in (0, 1), float32 [R, V], a pure function of (row key, token key).

    23 hash bits + 0.5 fill the float32 mantissa exactly, so u is never 0 or 1 and -log(-log u) is finite.
    """
    bits = fmix32(row_keys[:, None] ^ token_keys[None, :]) >> 9
    return (bits.to(torch.float32) + 0.5) * (2.0 ** -23)


# --- the torch references ------------------------------------------------------------------------------

def greedy_tokens_ref(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: argmax of each row, NaN as -inf (+inf wins; a row of -inf or NaN gives 0)."""
    return torch.nan_to_num(logits.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf).argmax(dim=-1)


# Stand-in for +inf after tempering: large enough to dominate, small enough that adding Gumbel noise or
# subtracting the row max cannot overflow into inf/NaN.
FLOAT32_HUGE = torch.finfo(torch.float32).max / 4


def temper_ref(logits: torch.Tensor, inverse_temperature: torch.Tensor) -> torch.Tensor:
    """The sampler's scores: float32 [R, V] logits times each row's 1 / temperature (float32 [R]), NaN as -inf and
    +inf (or an overflow under a small temperature) as FLOAT32_HUGE, so softmax and min-p stay NaN-free."""
    return torch.nan_to_num(logits.float() * inverse_temperature[:, None], nan=-math.inf, posinf=FLOAT32_HUGE,
                            neginf=-math.inf)


def gumbel_tokens_ref(scores: torch.Tensor, row_keys: torch.Tensor, token_keys: torch.Tensor,
                      fallback: torch.Tensor, inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: Gumbel-max over float32 scores [R, V] without NaN (-inf: out), each row's noise keyed by its
    row key (int64 [R]) and the tokens' keys (int64 [V], token_noise_key); a row with nothing left (all -inf)
    takes its fallback (int64 [R]). inverse_temperature given: `scores` are logits, tempered first (temper_ref)."""
    if inverse_temperature is not None:
        scores = temper_ref(scores, inverse_temperature)
    choice = (scores - torch.log(-torch.log(counter_uniforms(row_keys, token_keys)))).argmax(dim=-1)
    return torch.where(scores.amax(dim=-1) > -math.inf, choice, fallback)


# --- Triton ----------------------------------------------------------------------------------------------

@jit
def _fmix32(h):
    """fmix32 on uint32 values (multiplies wrap mod 2^32)."""
    h = h ^ (h >> 16)
    h = h * tl.full((), 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full((), 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@jit
def _chunk_max_kernel(logits_ptr, row_keys_ptr, token_keys_ptr, inverse_temperature_ptr, max_ptr, index_ptr, n_cols,
                      row_stride, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NOISE: tl.constexpr,
                      TEMPER: tl.constexpr, HUGE: tl.constexpr):
    """Program (row, chunk): the chunk's largest value (NaN never) and the first column holding it; with NOISE,
    of the values minus log(-log u), u the row's counter noise (counter_uniforms, computed the same way); with
    TEMPER, the values tempered first as temper_ref does (one multiply, then NaN and +inf mapped)."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = chunk * CHUNK
    best = float("-inf")
    best_col = start
    if NOISE:
        row_key = tl.load(row_keys_ptr + row).to(tl.uint32)
    if TEMPER:
        inverse_temperature = tl.load(inverse_temperature_ptr + row)
    for offset in tl.static_range(0, CHUNK, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if TEMPER:
            x = x * inverse_temperature
            x = tl.where(x != x, float("-inf"), tl.where(x == float("inf"), HUGE, x))
        if NOISE:
            token_key = tl.load(token_keys_ptr + cols, mask=inside, other=0).to(tl.uint32)
            u = ((_fmix32(row_key ^ token_key) >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)    # exact, as in torch
            x = x - tl.log(-tl.log(u))
        # tl.max skips NaNs (its propagate_nan is off) and a NaN equals nothing, so a NaN is never chosen
        block_best = tl.max(x, axis=0)
        # the first column of the block holding its max (argmax's own tie rule is not relied on)
        block_col = tl.min(tl.where(x == block_best, cols, n_cols + CHUNK), axis=0)
        # strictly larger: an equal value further on never displaces an earlier column
        take = block_best > best
        best_col = tl.where(take, block_col, best_col)
        best = tl.where(take, block_best, best)
    tl.store(max_ptr + row * n_chunks + chunk, best)
    tl.store(index_ptr + row * n_chunks + chunk, best_col)


@jit
def _row_pick_kernel(max_ptr, index_ptr, fallback_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr,
                     FALLBACK: tl.constexpr):
    """Program row: the column of the first chunk whose max is the row's; with FALLBACK, a row whose max is -inf
    (nothing left: noise is finite, so only a score of -inf stays -inf) takes fallback[row]."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    mask = chunks < n_chunks
    best = tl.load(max_ptr + row * n_chunks + chunks, mask=mask, other=float("-inf"))
    cols = tl.load(index_ptr + row * n_chunks + chunks, mask=mask, other=0)
    row_best = tl.max(best, axis=0)
    # chunks are in column order, so the smallest column among the chunks at the max is the first
    big = tl.max(cols, axis=0) + 1
    token = tl.min(tl.where(mask & (best == row_best), cols, big), axis=0).to(tl.int64)
    if FALLBACK:
        token = tl.where(row_best > float("-inf"), token, tl.load(fallback_ptr + row))
    tl.store(out_ptr + row, token)


def _pick(scores: torch.Tensor, row_keys: torch.Tensor | None, token_keys: torch.Tensor | None,
          fallback: torch.Tensor | None, inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The two launches: each row's first column at its max, of the scores or (keys given) of the noised scores
    (inverse_temperature given: of the tempered logits), or (fallback given) the row's fallback where its max is
    -inf."""
    assert scores.dim() == 2 and scores.stride(-1) == 1
    rows, n_cols = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    if n_cols == 0:
        raise ValueError("tokens of rows without columns")
    noise = row_keys is not None
    if noise:
        assert row_keys.shape == (rows,) and token_keys.shape == (n_cols,) and token_keys.stride(0) == 1
    n_chunks = triton.cdiv(n_cols, CHUNK)
    best = torch.empty(rows, n_chunks, dtype=torch.float32, device=scores.device)
    index = torch.empty(rows, n_chunks, dtype=torch.int32, device=scores.device)
    temper = inverse_temperature is not None
    if temper:
        assert inverse_temperature.shape == (rows,) and inverse_temperature.dtype == torch.float32
    _chunk_max_kernel[(rows, n_chunks)](scores, row_keys if noise else scores, token_keys if noise else scores,
                                        inverse_temperature if temper else scores, best, index, n_cols,
                                        scores.stride(0), n_chunks, CHUNK=CHUNK, BLOCK=min(BLOCK, CHUNK), NOISE=noise,
                                        TEMPER=temper, HUGE=FLOAT32_HUGE, num_warps=4)
    if fallback is not None:
        assert fallback.shape == (rows,) and fallback.dtype == torch.int64
    _row_pick_kernel[(rows,)](best, index, fallback if fallback is not None else out, out, n_chunks,
                              CHUNKS=max(2, next_pow2(n_chunks)), FALLBACK=fallback is not None, num_warps=1)
    return out


def greedy_tokens_triton(logits: torch.Tensor) -> torch.Tensor:
    """greedy_tokens_ref's result from a [B, V] tensor (any float dtype, rows contiguous), in two launches."""
    return _pick(logits, None, None, None)


def gumbel_tokens_triton(scores: torch.Tensor, row_keys: torch.Tensor, token_keys: torch.Tensor,
                         fallback: torch.Tensor, inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """gumbel_tokens_ref's result, in two launches and no [R, V] temporary (tempering included)."""
    return _pick(scores, row_keys, token_keys, fallback, inverse_temperature)
