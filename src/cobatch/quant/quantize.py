"""float -> GGUF blocks, in torch: how a float checkpoint is quantized once at load (on the GPU when there is one).

q8_0, q4_1 and q5_1 follow ggml's reference quantizers (quantize_row_q8_0_ref / _q4_1_ref / _q5_1_ref, mirrored
bit for bit by gguf-py, which the tests compare against). q4_K and q5_K follow quantize_row_q4_K_ref / _q5_K_ref
without an importance matrix: each 32-value sub-block gets the (scale, min) of make_qkx2_quants' search (candidate
scales around the min-max one, each refined by a weighted least-squares fit, the one of least weighted squared error
kept, weights |x| + rms), then the eight scales and mins are themselves quantized to 6 bits against the super-block's
f16 d and dmin.
Everything is whole-tensor torch ops over chunks of rows, so a 4096 x 14336 matrix is a few launches on a GPU.
Other ggml types go through gguf-py (numpy, on the CPU).
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import torch

from cobatch.quant.formats import T, UnsupportedQuantType, _pack_bits_32, _pack_k_scales_mins, format_of

# Rows are quantized in chunks of about this many values (float32 temporaries of a few times that): small on the
# CPU, large on a GPU, where q4_K's 21 search steps are a few dozen launches per chunk.
_CHUNK_VALUES = {"cpu": 1 << 20, "cuda": 1 << 25}


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf / ggml's nearest_int (halves away from zero); torch.round rounds halves to even."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _over(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """numerator / t, rounded once as C rounds it (torch's `scalar / tensor` multiplies by t's reciprocal)."""
    return torch.full_like(t, numerator) / t


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), _over(1.0, d))


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its f16 bytes [n, 2]."""
    return x.to(torch.float16).view(torch.uint8).reshape(x.shape[0], 2)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 2, k] values 0..15 -> [n, k] bytes: the first half in the low nibbles (ggml's order)."""
    q = q.to(torch.uint8)
    return q[:, 0] | (q[:, 1] << 4)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(1, keepdim=True) / 127
    q = _round_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], 1)


def _min_max_levels(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, min, q) of each 32-block: q in 0..nmax from the block's min and max (quantize_row_q4_1_ref / _q5_1_ref)."""
    blocks = x.reshape(-1, 32)
    lo, hi = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    d = (hi - lo) / nmax
    return d, lo, torch.trunc((blocks - lo) * _inverse(d) + 0.5).clamp(0, nmax)


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_max_levels(x, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _nibbles(q.reshape(-1, 2, 16))], 1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_max_levels(x, 31)
    fifth = _pack_bits_32((q.to(torch.int32) >> 4) & 1)          # bit j of the little-endian word: value j's
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), fifth, _nibbles((q % 16).reshape(-1, 2, 16))], 1)


def make_qkx2_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float = -1.0, rdelta: float = 0.1,
                     nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) of each row of x [n, k] such that x ~ scale * q - min, q in 0..nmax, by llama.cpp's
    make_qkx2_quants (use_mad = false): start from the min-max scale, then try iscale = (nmax + rmin + rdelta * i)
    / (max - min) for i = 0..nstep, refit each rounding by weighted least squares, and keep a fit when its weighted
    squared error is strictly lower. As in ggml, a kept fit's min is the offset later candidates round against.
    Both returned [n, 1]; min >= 0 (ggml stores it subtracted)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    lo = x.amin(1, keepdim=True).clamp(max=0)
    hi = x.amax(1, keepdim=True)
    flat = hi == lo
    sum_w, sum_x = weights.sum(1, keepdim=True), (weights * x).sum(1, keepdim=True)

    def levels(iscale, offset):
        return _round_away(iscale * (x - offset)).clamp(0, nmax)

    def error(scale, offset, q):
        return (weights * (scale * q + offset - x) ** 2).sum(1, keepdim=True)

    iscale = _over(nmax, torch.where(flat, torch.ones_like(hi), hi - lo))
    scale = _over(1.0, iscale)
    best = error(scale, lo, levels(iscale, lo))
    for i in range(nstep + 1):
        span = hi - lo
        step = float(np.float32(rmin) + np.float32(rdelta) * np.float32(i) + np.float32(nmax))   # C's float sum
        q = levels(_over(step, torch.where(span == 0, torch.ones_like(span), span)), lo)
        sum_l, sum_l2, sum_xl = ((weights * q).sum(1, keepdim=True), (weights * q * q).sum(1, keepdim=True),
                                 (weights * q * x).sum(1, keepdim=True))
        det = sum_w * sum_l2 - sum_l * sum_l
        fits = det > 0
        det = torch.where(fits, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0          # a positive min is clamped to 0 and the scale refit alone
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)),
                                 this_scale)
        this_min = torch.where(positive, zero, this_min)
        err = error(this_scale, this_min, q)
        better = fits & (err < best) & ~flat
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    return torch.where(flat, zero, scale), -lo


def _k_levels(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, ...]:
    """A K-quant's super-blocks: (d, dmin as f16 [n, 1], 6-bit scales and mins [n, 8], levels q [n, 8, 32] in
    0..nmax), as quantize_row_q4_K_ref / _q5_K_ref compute them."""
    sub = x.reshape(-1, 8, 32)
    n = sub.shape[0]
    flat = sub.reshape(-1, 32)
    rms = (flat * flat).mean(1, keepdim=True).sqrt()
    scales, mins = make_qkx2_quants(flat, rms + flat.abs(), nmax=nmax, rmin=rmin, nstep=nstep)
    scales, mins = scales.view(n, 8), mins.view(n, 8)
    max_scale, max_min = scales.amax(1, keepdim=True), mins.amax(1, keepdim=True)
    ls = _round_away(torch.where(max_scale > 0, _over(63.0, max_scale), 0) * scales).clamp(max=63).to(torch.uint8)
    lm = _round_away(torch.where(max_min > 0, _over(63.0, max_min), 0) * mins).clamp(max=63).to(torch.uint8)
    d, dmin = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    # the quants against the scales as stored (6-bit, against f16 d / dmin), as ggml recomputes them
    sub_d = (d.float() * ls.float()).unsqueeze(-1)
    sub_m = (dmin.float() * lm.float()).unsqueeze(-1)
    q = _round_away((sub + sub_m) / torch.where(sub_d == 0, torch.ones_like(sub_d), sub_d)).clamp(0, nmax)
    return d, dmin, ls, lm, torch.where(sub_d == 0, torch.zeros_like(q), q)


def _k_head(d: torch.Tensor, dmin: torch.Tensor, ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """A K-quant super-block's first 16 bytes: its f16 d and dmin, then the eight 6-bit scales and mins."""
    n = d.shape[0]
    return torch.cat([d.view(torch.uint8).view(n, 2), dmin.view(torch.uint8).view(n, 2),
                      _pack_k_scales_mins(ls, lm)], 1)


def _k_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Levels [n, 8, 32] -> [n, 128] bytes: 64-value chunk c's byte l holds sub-block 2c's value l in its low
    nibble, 2c + 1's in its high nibble (the low 4 bits of each)."""
    n = q.shape[0]
    return _nibbles((q % 16).reshape(n * 4, 2, 32)).reshape(n, 128)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, ls, lm, q = _k_levels(x, nmax=15, rmin=-1.0, nstep=20)
    return torch.cat([_k_head(d, dmin, ls, lm), _k_nibbles(q)], 1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, ls, lm, q = _k_levels(x, nmax=31, rmin=-0.5, nstep=15)
    # byte l of qh: bit i the fifth bit of sub-block i's value l
    qh = (((q.to(torch.int64) >> 4) & 1) << torch.arange(8, device=q.device)[:, None]).sum(1).to(torch.uint8)
    return torch.cat([_k_head(d, dmin, ls, lm), qh, _k_nibbles(q)], 1)


_TORCH_QUANTIZERS = {T.Q8_0: _q8_0, T.Q4_1: _q4_1, T.Q5_1: _q5_1, T.Q4_K: _q4_k, T.Q5_K: _q5_k}
TORCH_QUANTIZED = tuple(t.name.lower() for t in _TORCH_QUANTIZERS)      # what --quantization can ask for


def quantize(values: torch.Tensor, ggml_type) -> torch.Tensor:
    """float [..., cols] -> uint8 [..., row_bytes], on values' device. q8_0 / q4_1 / q4_K in torch (chunks of
    rows in float32, so a bf16 matrix never has a float32 copy of the whole); other types via gguf-py."""
    fmt = format_of(ggml_type)
    cols = values.shape[-1]
    row_bytes = fmt.row_bytes(cols)
    rows = values.reshape(-1, cols)
    quantizer = _TORCH_QUANTIZERS.get(fmt.ggml_type)
    if quantizer is None:
        array = values.detach().to("cpu", torch.float32).numpy()
        try:
            data = gguf.quants.quantize(array, fmt.ggml_type)
        except NotImplementedError:
            raise UnsupportedQuantType(f"cannot quantize to {fmt.ggml_type.name}") from None
        data = np.ascontiguousarray(data).view(np.uint8)
        return torch.from_numpy(data.reshape(*values.shape[:-1], row_bytes))
    out = torch.empty(rows.shape[0], row_bytes, dtype=torch.uint8, device=values.device)
    step = max(1, _CHUNK_VALUES.get(values.device.type, 1 << 20) // max(cols, 1))
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = quantizer(rows[start:start + step].float()).view(-1, row_bytes)
    return out.reshape(*values.shape[:-1], row_bytes)

