"""Tensor formats: one descriptor per ggml type, and per pre-quantized checkpoint format (FP8, NVFP4), each with
a torch reference dequantization.

GGUF block layouts follow ggml (mirrored by gguf-py's `gguf/quants.py`, which the tests compare against). The
checkpoint formats are laid out as blocks too, so one QuantWeight holds either (loader/hf.py builds them):
  fp8_e4m3  one OCP e4m3 byte per value (blocks of 1); the checkpoint's per-tensor or per-channel scale is the
            weight's row scale (QuantWeight.row_scale).
  nvfp4     blocks of 16 values: the e4m3 block scale (1 byte), then 8 bytes of e2m1 values, two a byte, the
            even element in the low nibble (ModelOpt's `weight` byte order); the f32 per-tensor scale
            (`weight_scale_2`) is the row scale.
Every decoder takes uint8 blocks [n_blocks, type_size] and returns float32 [n_blocks, block_size],
using whole-tensor torch ops so the same code runs on CPU or GPU. The float32 arithmetic is done in
the same order as ggml/gguf-py, so results are bit-identical to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import gguf
import torch

T = gguf.GGMLQuantizationType
QK_K = 256  # weights per K-quant super-block

# Rows are decoded in chunks of about this many output elements, so the float32 temporaries of a
# decoder stay small next to the output even for a 151936x896 embedding.
_CHUNK_ELEMENTS = 1 << 21


class UnsupportedQuantType(ValueError):
    """A tensor uses a ggml type that cobatch cannot decode."""


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str
    ggml_type: gguf.GGMLQuantizationType | None     # None: a checkpoint format GGUF has no type for
    block_size: int
    type_size: int
    dequant_blocks: Callable[[torch.Tensor], torch.Tensor]

    def row_bytes(self, n_cols: int) -> int:
        if n_cols < 0 or n_cols % self.block_size:
            raise ValueError(f"{self.name}: a row of {n_cols} values is not a whole number "
                             f"of {self.block_size}-value blocks")
        return n_cols // self.block_size * self.type_size


# ---------------------------------------------------------------- shared bit-level helpers

def _reinterpret(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View bytes [..., k] as `dtype`; copy first when the bytes are misaligned for it (odd offsets)."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return torch.empty_like(raw, memory_format=torch.contiguous_format).copy_(raw).view(dtype)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of every block, as float32 [n_blocks, 1]."""
    return _reinterpret(blocks[:, offset:offset + 2], torch.float16).float()


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Split each byte into 8/bits fields, low bits first: [..., k] -> [..., 8 // bits, k].

    The field index lands in front of the byte index because ggml stores "all low nibbles, then
    all high nibbles" (likewise for 2-bit and 1-bit planes)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _pack_bits_32(bits: torch.Tensor) -> torch.Tensor:
    """Bits [..., 32 k] (0 or 1) -> bytes [..., 4 k]: each 32 as a little-endian u32 whose bit i is bit i (Q5_0's and
    Q5_1's high-bit word)."""
    b = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32, device=bits.device)
    return b.sum(-1).to(torch.uint8)


def _merge_high(low: torch.Tensor, high: torch.Tensor, low_bits: int) -> torch.Tensor:
    """Join separately stored high bits onto the low bits of each value."""
    return low | (high << low_bits)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: twelve bytes hold eight 6-bit sub-block scales and eight 6-bit mins.

    Bytes 0-3 / 4-7 carry scales / mins 0-3 in their low 6 bits and the top 2 bits of
    scales / mins 4-7 in their high 2 bits; bytes 8-11 carry the low nibbles of scales 4-7 (low)
    and mins 4-7 (high)."""
    sc, mn, low4 = packed.reshape(-1, 3, 4).unbind(1)
    scales = torch.cat([sc & 63, _merge_high(low4 & 15, sc >> 6, 4)], dim=-1)
    mins = torch.cat([mn & 63, _merge_high(low4 >> 4, mn >> 6, 4)], dim=-1)
    return scales, mins


def _pack_k_scales_mins(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Inverse of `_k_scales_mins` (used to build valid random blocks)."""
    return torch.cat([
        scales[:, :4] | ((scales[:, 4:] >> 4) << 6),
        mins[:, :4] | ((mins[:, 4:] >> 4) << 6),
        (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4),
    ], dim=-1)


def _scale_minus_min(d: torch.Tensor, scales: torch.Tensor, dmin: torch.Tensor, mins: torch.Tensor,
                     q: torch.Tensor) -> torch.Tensor:
    """K-quant affine decode per sub-block: (d * scale) * q - dmin * min, in ggml's operation order."""
    return (d * scales.float()).unsqueeze(-1) * q.float() - (dmin * mins.float()).unsqueeze(-1)


# ---------------------------------------------------------------- decoders

def _float_blocks(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _reinterpret(blocks, dtype).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _legacy_32_codes(blocks: torch.Tensor, *, has_min: bool, has_high_bit: bool) -> torch.Tensor:
    """The unsigned codes [n, 32] of Q4_0, Q4_1, Q5_0, Q5_1 blocks: f16 d, [f16 m], [32 high bits as a
    little-endian u32], 16 nibble bytes."""
    n = blocks.shape[0]
    offset = 4 if has_min else 2
    q = _unpack(blocks[:, -16:], 4).reshape(n, 32)
    if has_high_bit:  # bit i of the u32 belongs to value i: byte-major, so swap _unpack's order
        high = _unpack(blocks[:, offset:offset + 4], 1).transpose(-1, -2).reshape(n, 32)
        q = _merge_high(q, high, 4)
    return q


def _legacy_32(blocks: torch.Tensor, *, has_min: bool, has_high_bit: bool) -> torch.Tensor:
    """Q4_0, Q4_1, Q5_0, Q5_1 values: d times the code, plus m (with a min) or less the zero point."""
    q = _legacy_32_codes(blocks, has_min=has_min, has_high_bit=has_high_bit)
    if has_min:
        return _f16(blocks, 0) * q.float() + _f16(blocks, 2)
    zero_point = 16 if has_high_bit else 8
    return _f16(blocks, 0) * (q.float() - zero_point)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # scales[16] (scale low nibble, min high nibble), qs[64] (2-bit), f16 d, f16 dmin
    n = blocks.shape[0]
    packed_scales = blocks[:, :16]
    q = _unpack(blocks[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    out = _scale_minus_min(_f16(blocks, 80), packed_scales & 15, _f16(blocks, 82), packed_scales >> 4, q)
    return out.reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # hmask[32] (1-bit plane), qs[64] (2-bit), scales[12] (16 signed 6-bit), f16 d
    n = blocks.shape[0]
    low = _unpack(blocks[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    high = _unpack(blocks[:, :32], 1).reshape(n, 16, 16)
    # ggml subtracts 4 where the hmask bit is CLEAR (the set bit means "no offset")
    q = low.float() - 4 * (high ^ 1).float()
    scales = _merge_high(_unpack(blocks[:, 96:104], 4).reshape(n, 16), _unpack(blocks[:, 104:108], 2).reshape(n, 16), 4)
    return ((_f16(blocks, 108) * (scales.float() - 32)).unsqueeze(-1) * q).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # f16 d, f16 dmin, scales[12], qs[128] (4-bit, 8 sub-blocks of 32)
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    q = _unpack(blocks[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    return _scale_minus_min(_f16(blocks, 0), scales, _f16(blocks, 2), mins, q).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # like Q4_K, plus a 1-bit high plane qh[32] before qs[128]
    n = blocks.shape[0]
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    low = _unpack(blocks[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    q = _merge_high(low, _unpack(blocks[:, 16:48], 1), 4)
    return _scale_minus_min(_f16(blocks, 0), scales, _f16(blocks, 2), mins, q).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # ql[128] (low nibbles), qh[64] (2-bit high), scales[16] (int8), f16 d
    n = blocks.shape[0]
    low = _unpack(blocks[:, :128].reshape(n, 2, 64), 4).reshape(n, 8, 32)
    high = _unpack(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
    q = (_merge_high(low, high, 4).float() - 32).reshape(n, 16, 16)
    scales = blocks[:, 192:208].view(torch.int8).float()
    return ((_f16(blocks, 208) * scales).unsqueeze(-1) * q).reshape(n, QK_K)


_DECODERS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: partial(_float_blocks, dtype=torch.float32),
    T.F16: partial(_float_blocks, dtype=torch.float16),
    T.BF16: partial(_float_blocks, dtype=torch.bfloat16),
    T.Q8_0: _q8_0,
    T.Q4_0: partial(_legacy_32, has_min=False, has_high_bit=False),
    T.Q4_1: partial(_legacy_32, has_min=True, has_high_bit=False),
    T.Q5_0: partial(_legacy_32, has_min=False, has_high_bit=True),
    T.Q5_1: partial(_legacy_32, has_min=True, has_high_bit=True),
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


def q5_0_as_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 rows (uint8 [rows, blocks * 22]) as Q8_0 rows holding the same values exactly: each block's f16 d,
    then its 32 codes minus 16 (-16..15) as int8. 1.0625 bytes a weight instead of 0.6875, for the kernels
    that read Q8_0 but not Q5_0 (the routed expert GEMV)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, 22)
    codes = _legacy_32_codes(blocks, has_min=False, has_high_bit=True).to(torch.int16) - 16
    return torch.cat([blocks[:, :2], codes.to(torch.int8).view(torch.uint8)], 1).reshape(rows, -1)


# e2m1 (OCP MX FP4): sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 are these magnitudes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _fp8_e4m3(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float8_e4m3fn).float()


def nvfp4_blocks(codes: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 tensors (uint8 e2m1 pairs [rows, cols / 2], float8_e4m3fn scales [rows, cols / 16]) ->
    the nvfp4 format's rows of 9-byte blocks [rows, cols / 16 * 9]: each block's scale, then its 8 code bytes."""
    rows = codes.shape[0]
    blocks = torch.cat([block_scale.view(torch.uint8).reshape(-1, 1), codes.view(torch.uint8).reshape(-1, 8)], 1)
    return blocks.reshape(rows, -1)


def unpack_int4_words(words: torch.Tensor) -> torch.Tensor:
    """int32 words of 8 4-bit values each, value k at bits 4 k (compressed-tensors', GPTQ's and AWQ's packing) ->
    uint8 [..., 8 n] the values, in word order then bit order."""
    assert words.dtype == torch.int32
    as_bytes = words.contiguous().view(torch.uint8)       # little-endian: byte b holds values 2 b, 2 b + 1
    return torch.stack((as_bytes & 0xF, as_bytes >> 4), -1).reshape(*words.shape[:-1], -1)


def int4_blocks(nibbles: torch.Tensor, scale: torch.Tensor, group: int, offset: torch.Tensor | None = None
                ) -> torch.Tensor:
    """4-bit values (uint8 [rows, cols], 0..15) with a scale per `group` values of a row ([rows, cols / group]) ->
    the same values in GGUF blocks of 32: without `offset`, symmetric ones stored as q + 8 (each value the scale
    times the nibble less 8) as q4_0 blocks [rows, cols / 32 * 18], each block's scale (f16) then 16 bytes, byte
    j holding values j (low nibble) and j + 16 (high); with `offset` ([rows, cols / group], each value the scale
    times the nibble plus the offset) as q4_1 blocks [rows, cols / 32 * 20], scale and offset (f16) then the same
    16 bytes. q4_0 reads a nibble as q + 8 too, so its values are exact; so are the scales and offsets where f16
    holds them as given (an offset computed from a scale and a zero point is rounded to f16 once, as q4_K's is
    when its planes are packed as q4_1's). `group` and cols divide by 32."""
    rows, cols = nibbles.shape
    assert cols % 32 == 0 and group % 32 == 0
    blocks = nibbles.reshape(rows, -1, 32)
    qs = blocks[..., :16] | (blocks[..., 16:] << 4)
    sides = [scale] if offset is None else [scale, offset]
    per_block = [v.float().repeat_interleave(group // 32, dim=1)[:, :cols // 32].to(torch.float16) for v in sides]
    halves = [v.contiguous().view(torch.uint8).reshape(rows, -1, 2) for v in per_block]
    return torch.cat([*halves, qs], -1).reshape(rows, -1)


def int8_q8_0_blocks(values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric INT8 values (int8 [rows, cols]) with a scale per `group` values of a row ([rows, cols / group])
    -> the same values as q8_0 blocks [rows, cols / 32 * 34]: each 32 values' scale (f16), then the 32 bytes.
    Exact where f16 holds the scales as given. `group` and cols divide by 32."""
    rows, cols = values.shape
    assert values.dtype == torch.int8 and cols % 32 == 0 and group % 32 == 0
    d = scale.float().repeat_interleave(group // 32, dim=1)[:, :cols // 32].to(torch.float16)
    return torch.cat([d.contiguous().view(torch.uint8).reshape(rows, -1, 2),
                      values.contiguous().view(torch.uint8).reshape(rows, -1, 32)], -1).reshape(rows, -1)


def _nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale = blocks[:, :1].view(torch.float8_e4m3fn).float()
    codes = _unpack(blocks[:, 1:], 4).transpose(-1, -2).reshape(n, 16)    # element 2i low nibble, 2i + 1 high
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)[(codes & 7).long()]
    return scale * torch.where(codes >= 8, -magnitude, magnitude)


FORMATS: dict[gguf.GGMLQuantizationType, QuantFormat] = {
    t: QuantFormat(t.name.lower(), t, *gguf.GGML_QUANT_SIZES[t], decode) for t, decode in _DECODERS.items()
}
# Formats of pre-quantized checkpoints (read by loader/hf.py), beside the GGUF ones
CHECKPOINT_FORMATS: dict[str, QuantFormat] = {
    "fp8_e4m3": QuantFormat("fp8_e4m3", None, 1, 1, _fp8_e4m3),
    "nvfp4": QuantFormat("nvfp4", None, 16, 9, _nvfp4),
}
# The one table of every format, by name
FORMAT_TABLE: dict[str, QuantFormat] = {**{fmt.name: fmt for fmt in FORMATS.values()}, **CHECKPOINT_FORMATS}


def format_of(ggml_type: QuantFormat | gguf.GGMLQuantizationType | int | str) -> QuantFormat:
    if isinstance(ggml_type, QuantFormat):
        return ggml_type
    if isinstance(ggml_type, str):
        fmt, label = FORMAT_TABLE.get(ggml_type.lower()), ggml_type.upper()
    else:
        try:
            known = T(int(ggml_type))
            fmt, label = FORMATS.get(known), known.name
        except ValueError:
            fmt, label = None, str(ggml_type)
    if fmt is None:
        supported = ", ".join(name.upper() for name in FORMAT_TABLE)
        raise UnsupportedQuantType(f"unsupported tensor type {label} (supported: {supported})")
    return fmt


def dequantize(raw: torch.Tensor, ggml_type: QuantFormat | gguf.GGMLQuantizationType | int | str,
               n_cols: int) -> torch.Tensor:
    """uint8 [..., row_bytes] -> float32 [..., n_cols]. Never writes into `raw` (it may be a read-only mmap)."""
    fmt = format_of(ggml_type)
    row_bytes = fmt.row_bytes(n_cols)
    if raw.dtype != torch.uint8 or raw.shape[-1] != row_bytes:
        raise ValueError(f"{fmt.name}: expected uint8 rows of {row_bytes} bytes for {n_cols} values, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    rows = raw.reshape(-1, row_bytes)
    out = torch.empty(rows.shape[0], n_cols, dtype=torch.float32, device=raw.device)
    step = max(1, _CHUNK_ELEMENTS // max(n_cols, 1))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        out[start:start + step] = fmt.dequant_blocks(chunk.reshape(-1, fmt.type_size)).view(chunk.shape[0], n_cols)
    return out.reshape(*raw.shape[:-1], n_cols)


# ---------------------------------------------------------------- random and quantized data

@dataclass(frozen=True)
class _ScaleFields:
    d: int                        # byte offset of the f16 (super-)block scale
    min: int | None = None        # byte offset of the f16 min (Q4_1/Q5_1) or dmin (K-quants)
    min_per_d: float = 0.0        # min field = min_per_d * d, which centres the unsigned quants on 0


_SCALE_FIELDS: dict[T, _ScaleFields] = {
    T.Q8_0: _ScaleFields(0), T.Q4_0: _ScaleFields(0), T.Q5_0: _ScaleFields(0),
    T.Q4_1: _ScaleFields(0, 2, -7.5), T.Q5_1: _ScaleFields(0, 2, -15.5),  # value = d*q + m
    # K-quants: value = d*sc*q - dmin*m; with m == sc, dmin = mean(q)*d centres each sub-block
    T.Q2_K: _ScaleFields(80, 82, 1.5), T.Q3_K: _ScaleFields(108), T.Q4_K: _ScaleFields(0, 2, 7.5),
    T.Q5_K: _ScaleFields(0, 2, 15.5), T.Q6_K: _ScaleFields(208),
}


def _write_scales(blocks: torch.Tensor, fields: _ScaleFields, d: torch.Tensor) -> None:
    blocks[:, fields.d:fields.d + 2] = d.to(torch.float16).view(torch.uint8)
    if fields.min is not None:
        blocks[:, fields.min:fields.min + 2] = (d * fields.min_per_d).to(torch.float16).view(torch.uint8)


def random_quantized(ggml_type, rows: int, cols: int, generator: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    """Valid random blocks, uint8 [rows, row_bytes], whose values have std ~ `scale` and mean ~ 0."""
    fmt = format_of(ggml_type)
    row_bytes = fmt.row_bytes(cols)
    if fmt.block_size == 1:
        values = torch.randn(rows, cols, generator=generator) * scale
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[fmt.ggml_type]
        return values.to(dtype).view(torch.uint8).reshape(rows, row_bytes)
    n_blocks = rows * cols // fmt.block_size
    blocks = torch.randint(0, 256, (n_blocks, fmt.type_size), dtype=torch.uint8, generator=generator)
    if fmt.ggml_type == T.Q2_K:  # tie each sub-block min to its scale (see _SCALE_FIELDS)
        blocks[:, :16] = (blocks[:, :16] & 15) * 17
    elif fmt.ggml_type in (T.Q4_K, T.Q5_K):
        scales, _ = _k_scales_mins(blocks[:, 4:16])
        blocks[:, 4:16] = _pack_k_scales_mins(scales, scales)
    # Decode a sample at d = 1 to learn the spread the random bits give, then set d to hit `scale`.
    fields = _SCALE_FIELDS[fmt.ggml_type]
    sample = blocks[:4096]
    _write_scales(sample, fields, torch.ones(sample.shape[0], 1))
    unit_std = fmt.dequant_blocks(sample).std().item()
    jitter = torch.rand(n_blocks, 1, generator=generator) + 0.5  # blocks differ in scale, like real weights
    _write_scales(blocks, fields, jitter * (scale / max(unit_std, 1e-12)))
    return blocks.reshape(rows, row_bytes)
