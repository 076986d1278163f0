"""The torch dequantizers against gguf-py's numpy reference (an independent implementation of ggml's layouts)."""

from __future__ import annotations

import functools
import struct
import warnings

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from cobatch.model_files import ModelNotFound, qwen_coder_path, smollm2_path
from cobatch.quant import formats
from cobatch.quant.formats import FORMATS, UnsupportedQuantType, dequantize, format_of, random_quantized
from cobatch.quant.quantize import quantize

T = gguf.GGMLQuantizationType
ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]

# Byte offsets of the f16 fields in each block, transcribed from ggml's block_* structs (ggml-common.h).
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def reference(raw: torch.Tensor, ggml_type: T) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw.numpy(), ggml_type), dtype=np.float32))


def assert_bit_identical(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


def test_table_covers_the_thirteen_formats():
    assert sorted(FORMATS, key=int) == sorted(ALL_TYPES, key=int)
    for t, fmt in FORMATS.items():
        assert fmt.ggml_type == t and fmt.name == t.name.lower()
        assert (fmt.block_size, fmt.type_size) == gguf.GGML_QUANT_SIZES[t]


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(ggml_type):
    gen = torch.Generator().manual_seed(1234 + int(ggml_type))
    rows, cols, scale = 16, 1024, 0.02
    raw = random_quantized(ggml_type, rows, cols, gen, scale=scale)
    assert raw.dtype == torch.uint8 and raw.shape == (rows, format_of(ggml_type).row_bytes(cols))
    ours = dequantize(raw, ggml_type, cols)
    assert_bit_identical(ours, reference(raw, ggml_type).reshape(rows, cols))
    assert torch.isfinite(ours).all()
    assert scale / 3 < ours.std().item() < scale * 3
    assert abs(ours.mean().item()) < scale / 3


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q2_K, T.Q6_K], ids=lambda t: t.name)
def test_random_blocks_follow_the_requested_scale(ggml_type):
    raw = random_quantized(ggml_type, 8, 512, torch.Generator().manual_seed(7), scale=1.5)
    std = reference(raw, ggml_type).std().item()
    assert 0.5 < std < 4.5


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_arbitrary_bit_patterns_match_gguf_py(ggml_type):
    fmt = format_of(ggml_type)
    gen = torch.Generator().manual_seed(99 + int(ggml_type))
    rows, cols = 12, 512
    raw = torch.randint(0, 256, (rows, fmt.row_bytes(cols)), dtype=torch.uint8, generator=gen)
    if ggml_type in F16_FIELDS:
        # Clearing the top exponent bit keeps each f16 scale finite (|x| < 2); all other bits stay random.
        blocks = raw.view(-1, fmt.type_size)
        for offset in F16_FIELDS[ggml_type]:
            blocks[:, offset + 1] &= 0xBF
    ours = dequantize(raw, ggml_type, cols)
    assert_bit_identical(ours, reference(raw, ggml_type).reshape(rows, cols))
    if ggml_type in F16_FIELDS:
        assert torch.isfinite(ours).all()


def test_q5_0_rows_as_q8_0_hold_the_same_values():
    """The routed expert GEMV reads Q8_0, not Q5_0: a Q5_0 stack converted (formats.q5_0_as_q8_0) decodes, by
    gguf-py, to exactly what gguf-py decodes from the Q5_0 bytes; every code and high bit random."""
    rows, cols = 6, 1408                 # DeepSeek-V2-Lite's expert width: not whole 256-blocks
    raw = torch.randint(0, 256, (rows, format_of(T.Q5_0).row_bytes(cols)), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(11))
    raw.view(-1, 22)[:, 1] &= 0xBF       # finite f16 scales
    as_q8 = formats.q5_0_as_q8_0(raw)
    assert as_q8.shape == (rows, format_of(T.Q8_0).row_bytes(cols))
    assert_bit_identical(reference(as_q8, T.Q8_0).reshape(rows, cols), reference(raw, T.Q5_0).reshape(rows, cols))


def test_chunked_decode_and_leading_dims(monkeypatch):
    raw = random_quantized(T.Q4_K, 10, 512, torch.Generator().manual_seed(3))
    whole = dequantize(raw, T.Q4_K, 512)
    monkeypatch.setattr(formats, "_CHUNK_ELEMENTS", 3 * 512)  # 3 rows per chunk: 10 rows end in a partial chunk
    assert_bit_identical(dequantize(raw, T.Q4_K, 512), whole)
    assert_bit_identical(dequantize(raw.view(2, 5, -1), "q4_k", 512), whole.view(2, 5, 512))
    assert_bit_identical(dequantize(raw[3], T.Q4_K, 512), whole[3])


def test_misaligned_bytes_decode_the_same():
    # A row slice of a byte buffer can start at any offset; f16/f32 fields must still read correctly.
    raw = random_quantized(T.F32, 4, 64, torch.Generator().manual_seed(5))
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), raw.flatten()])[1:].view(4, -1)
    assert shifted.storage_offset() == 1
    assert_bit_identical(dequantize(shifted, T.F32, 64), reference(raw, T.F32))
    raw = random_quantized(T.Q5_0, 4, 64, torch.Generator().manual_seed(5))
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), raw.flatten()])[1:].view(4, -1)
    assert_bit_identical(dequantize(shifted, T.Q5_0, 64), reference(raw, T.Q5_0).view(4, 64))


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


@functools.cache
def _tensor_index(path_fn) -> dict[str, tuple[T, tuple[int, ...], np.ndarray]]:
    """name -> (type, ne, raw bytes) from a GGUF file's header, skipping metadata.

    gguf.GGUFReader would do, but it spends ~8 s turning Qwen's 151k-token vocabulary into numpy
    views; only the tensor directory matters here, and the dequantization reference is still gguf-py."""
    data = np.memmap(path_fn(), mode="r")
    buf = memoryview(data)
    pos = 0

    def read(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def read_str() -> str:
        nonlocal pos
        length = read("Q")
        pos += length
        return bytes(buf[pos - length:pos]).decode()

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:  # string
            read_str()
        elif vtype == 9:  # array
            item_type, count = read("IQ")
            if item_type in _SCALAR_SIZES:
                pos = pos + count * _SCALAR_SIZES[item_type]
            else:
                for _ in range(count):
                    skip_value(item_type)
        else:
            pos = pos + _SCALAR_SIZES[vtype]

    assert bytes(buf[:4]) == b"GGUF"
    pos = 4
    _version, n_tensors, n_kv = read("IQQ")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = read_str(), read("I")
        if key == "general.alignment":
            alignment = read("I")
        else:
            skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = read_str()
        ne = read("Q" * read("I"))
        ne = ne if isinstance(ne, tuple) else (ne,)
        infos.append((name, T(read("I")), ne, read("Q")))
    data_start = -(-pos // alignment) * alignment
    index, end = {}, 0
    for name, ggml_type, ne, offset in infos:
        n_rows, row_bytes = int(np.prod(ne[1:])), format_of(ggml_type).row_bytes(ne[0])
        start, end = data_start + offset, max(end, data_start + offset + n_rows * row_bytes)
        index[name] = (ggml_type, ne, data[start:start + n_rows * row_bytes].reshape(n_rows, row_bytes))
    assert 0 <= data.size - end < alignment, "tensor directory does not reach the end of the file"
    return index


def _model(path_fn):
    try:
        return _tensor_index(path_fn)
    except ModelNotFound as exc:
        pytest.skip(str(exc))


REAL_MODELS = {
    "smollm2": (smollm2_path, [T.Q4_1, T.Q8_0, T.F32]),
    "qwen_coder": (qwen_coder_path, [T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.F32]),
}


@pytest.mark.parametrize("model,ggml_type", [(m, t) for m, (_, ts) in REAL_MODELS.items() for t in ts],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_real_tensors_match_gguf_py(model, ggml_type):
    index = _model(REAL_MODELS[model][0])
    names = [name for name, (t, _, _) in index.items() if t == ggml_type]
    assert names, f"{model} has no {ggml_type.name} tensor"
    for name in (names[0], names[len(names) // 2], names[-1]):
        _, ne, data = index[name]
        start = data.shape[0] // 3
        rows = data[start:start + 24]  # read-only memmap: decoding must not write into it
        assert not rows.flags.writeable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns about non-writable arrays
            raw = torch.from_numpy(rows)
        ours = dequantize(raw, ggml_type, ne[0])
        assert_bit_identical(ours, reference(raw, ggml_type).reshape(ours.shape))
        assert torch.isfinite(ours).all(), name


def test_format_of_accepts_enum_int_and_name():
    assert format_of(T.Q4_K) is format_of(int(T.Q4_K)) is format_of("q4_k") is format_of("Q4_K")
    assert format_of("bf16").ggml_type == T.BF16


@pytest.mark.parametrize("bad,label", [(T.IQ2_XS, "IQ2_XS"), (int(T.Q8_1), "Q8_1"), ("q1_x", "Q1_X"), (9999, "9999")])
def test_format_of_rejects_unknown_types(bad, label):
    with pytest.raises(UnsupportedQuantType, match=f"unsupported tensor type {label} \\(supported: .*Q6_K") as info:
        format_of(bad)
    assert isinstance(info.value, ValueError)


def test_row_bytes():
    assert format_of(T.Q4_K).row_bytes(4864) == 19 * 144
    assert format_of(T.Q8_0).row_bytes(896) == 28 * 34
    assert format_of(T.F16).row_bytes(7) == 14
    with pytest.raises(ValueError):
        format_of(T.Q4_K).row_bytes(896 + 32)
    with pytest.raises(ValueError):
        format_of(T.Q4_0).row_bytes(48)
    with pytest.raises(ValueError):
        dequantize(torch.zeros(2, 100, dtype=torch.uint8), T.Q8_0, 64)


# Worst-case rounding error per block, as a fraction of the block's largest |value|.
QUANTIZE_TOLERANCE = {T.F32: 0.0, T.F16: 1e-3, T.BF16: 8e-3, T.Q8_0: 1 / 127, T.Q4_0: 1 / 8, T.Q4_1: 1 / 15,
                      T.Q5_0: 1 / 16, T.Q5_1: 1 / 31}


@pytest.mark.parametrize("ggml_type", list(QUANTIZE_TOLERANCE), ids=lambda t: t.name)
def test_quantize_round_trip(ggml_type):
    values = torch.randn(6, 256, generator=torch.Generator().manual_seed(11))
    restored = dequantize(quantize(values, ggml_type), ggml_type, 256)
    blocks = values.view(-1, 32)
    error = (restored.view(-1, 32) - blocks).abs()
    assert (error <= blocks.abs().amax(1, keepdim=True) * QUANTIZE_TOLERANCE[ggml_type] * 1.01).all()


def test_quantize_reports_types_gguf_py_cannot_make():
    with pytest.raises(UnsupportedQuantType, match="Q6_K"):
        quantize(torch.zeros(1, 256), T.Q6_K)
