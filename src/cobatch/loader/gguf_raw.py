"""The metadata and tensor directory of a GGUF file, read straight from its bytes.

gguf-py's reader makes a numpy view per string, and takes seconds (tens of seconds on a busy machine) on a
50k-150k-token vocabulary; this reader takes milliseconds. It keeps every record's exact bytes, so the test-model
writer (cobatch.testing.gguf_writer) copies fields and tensors from it, and loader/gguf.py reads models through it.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType

from cobatch.errors import UserError


def aligned(n: int, alignment: int) -> int:
    """n rounded up to a multiple of alignment."""
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True)
class MetadataValue:
    """One metadata value as GGUFWriter.add_key_value takes it. Strings stay bytes so that they
    are copied exactly, whatever their encoding."""
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True, slots=True)
class RawField:
    name: str
    vtype: GGUFValueType
    sub_type: GGUFValueType | None   # item type of an array
    start: int                       # the key-value record is file[start:end]
    value_start: int                 # after the key and type tag (for an array: at its item type)
    end: int
    count: int = 1                   # items of an array


@dataclass(frozen=True, slots=True)
class RawTensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]            # GGUF order: fastest first
    record: bytes                    # the tensor-info record without its trailing 8-byte data offset
    offset: int                      # relative to the data section
    nbytes: int


# struct formats of the scalar value types
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}


class RawGGUF:
    """The metadata and tensor directory of a little-endian GGUF (v2/v3), read straight from the
    bytes. gguf-py's reader makes a numpy view per string and takes seconds on a 150k-token
    vocabulary; this takes milliseconds, and keeps every record's exact bytes for copying."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else b""
        try:
            self._parse()
        except Exception as e:
            self.close()
            if isinstance(e, UserError):
                raise
            raise UserError(f"cannot read GGUF file {self.path} (truncated or corrupt?): {e}") from None

    def close(self) -> None:
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()

    def __enter__(self) -> "RawGGUF":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _parse(self) -> None:
        buf = self._buf
        if buf[:4] != b"GGUF":
            raise UserError(f"not a GGUF file (bad magic): {self.path}")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if self.version not in (2, 3):
            raise UserError(f"{self.path}: GGUF version {self.version} is not supported (2 or 3)")
        offset = 24
        self.fields: dict[str, RawField] = {}
        for _ in range(n_kv):
            start = offset
            key, offset = self._string(offset)
            vtype = GGUFValueType(struct.unpack_from("<I", buf, offset)[0])
            offset += 4
            value_start, sub_type, count = offset, None, 1
            if vtype == GGUFValueType.ARRAY:
                sub_type = GGUFValueType(struct.unpack_from("<I", buf, offset)[0])
                count = struct.unpack_from("<Q", buf, offset + 4)[0]
            offset = self._skip(offset, vtype)
            name = key.decode("utf-8")
            self.fields[name] = RawField(name, vtype, sub_type, start, value_start, offset, count)
        self.tensors: list[RawTensorInfo] = []
        for _ in range(n_tensors):
            start = offset
            name, offset = self._string(offset)
            n_dims = struct.unpack_from("<I", buf, offset)[0]
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offset + 4)
            ggml_type, data_offset = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            if ggml_type not in gguf.GGML_QUANT_SIZES:
                raise UserError(f"{self.path}: tensor {name.decode()} has unknown ggml type {ggml_type}")
            block_size, type_size = gguf.GGML_QUANT_SIZES[T(ggml_type)]
            nbytes = math.prod(dims) // block_size * type_size
            self.tensors.append(RawTensorInfo(name.decode("utf-8"), ggml_type, tuple(dims),
                                              bytes(buf[start:offset - 8]), data_offset, nbytes))
        alignment = self.fields.get("general.alignment")
        self.alignment = int(self.value(alignment).value) if alignment else gguf.GGUF_DEFAULT_ALIGNMENT
        self.data_start = aligned(offset, self.alignment)
        size = len(buf)
        for t in self.tensors:
            if self.data_start + t.offset + t.nbytes > size:
                raise UserError(f"GGUF file is truncated: tensor {t.name} extends past the end of {self.path}")

    def _string(self, offset: int) -> tuple[bytes, int]:
        n = struct.unpack_from("<Q", self._buf, offset)[0]
        end = offset + 8 + n
        if end > len(self._buf):
            raise ValueError(f"string at byte {offset} runs past the end of the file")
        return bytes(self._buf[offset + 8:end]), end

    def _skip(self, offset: int, vtype: GGUFValueType) -> int:
        """The offset just past a value of type vtype at offset."""
        if vtype in SCALAR_FORMATS:
            return offset + struct.calcsize("<" + SCALAR_FORMATS[vtype])
        if vtype == GGUFValueType.STRING:
            return offset + 8 + struct.unpack_from("<Q", self._buf, offset)[0]
        sub_type = GGUFValueType(struct.unpack_from("<I", self._buf, offset)[0])
        count = struct.unpack_from("<Q", self._buf, offset + 4)[0]
        offset += 12
        if sub_type in SCALAR_FORMATS:
            return offset + count * struct.calcsize("<" + SCALAR_FORMATS[sub_type])
        for _ in range(count):
            offset = self._skip(offset, sub_type)
        return offset

    def raw(self, field: RawField) -> bytes:
        return bytes(self._buf[field.start:field.end])

    def value(self, field: RawField) -> MetadataValue:
        buf, offset = self._buf, field.value_start
        if field.vtype in SCALAR_FORMATS:
            return MetadataValue(struct.unpack_from("<" + SCALAR_FORMATS[field.vtype], buf, offset)[0], field.vtype)
        if field.vtype == GGUFValueType.STRING:
            return MetadataValue(self._string(offset)[0], field.vtype)
        items_start = offset + 12
        if field.sub_type in SCALAR_FORMATS:
            fmt = SCALAR_FORMATS[field.sub_type]
            items = list(struct.unpack_from(f"<{field.count}{fmt}", buf, items_start))
        elif field.sub_type == GGUFValueType.STRING:
            items, offset = [], items_start
            for _ in range(field.count):
                item, offset = self._string(offset)
                items.append(item)
        else:
            raise UserError(f"metadata field {field.name}: nested arrays are not supported")
        return MetadataValue(items, field.vtype, field.sub_type)

    def copy_tensor_data(self, tensor: RawTensorInfo, out: BinaryIO) -> None:
        start = self.data_start + tensor.offset
        view = memoryview(self._buf)
        try:
            for pos in range(start, start + tensor.nbytes, 1 << 24):
                out.write(view[pos:min(pos + (1 << 24), start + tensor.nbytes)])
        finally:
            view.release()
