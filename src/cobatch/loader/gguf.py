"""Open a GGUF file: metadata as plain values, tensors memory-mapped (never copied).

The directory is read by loader/gguf_raw.py (milliseconds, where gguf-py's reader takes seconds on a large
vocabulary); gguf-py supplies the format's constants.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from cobatch.errors import UserError
from cobatch.loader.gguf_raw import RawGGUF
from cobatch.quant.formats import UnsupportedQuantType, format_of
from cobatch.quant.weight import QuantWeight

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor of the file: its name, format, GGUF shape (fastest dimension first) and bytes, memory-mapped."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray        # uint8, read-only, a view of the file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


def _plain(value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None) -> Any:
    """A metadata value as Python: strings decoded as UTF-8 (a field that is not valid UTF-8 raises)."""
    if vtype == GGUFValueType.STRING:
        return value.decode("utf-8")
    if vtype == GGUFValueType.ARRAY and sub_type == GGUFValueType.STRING:
        return [item.decode("utf-8") for item in value]
    return value


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise UserError(f"model path is not a file: {self.path}")
        with open(self.path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise UserError(f"not a GGUF file (bad magic): {self.path}")
        raw = RawGGUF(self.path)          # a truncated or corrupt file is a UserError naming it
        try:
            # the header as gguf-py shows it, then the key-value fields
            self.metadata: dict[str, Any] = {"GGUF.version": raw.version, "GGUF.tensor_count": len(raw.tensors),
                                             "GGUF.kv_count": len(raw.fields)}
            for key, field in raw.fields.items():
                try:
                    value = raw.value(field)
                    self.metadata[key] = _plain(value.value, value.vtype, value.sub_type)
                except (UnicodeDecodeError, UserError):
                    continue  # a field we cannot render (nested arrays, bytes that are not UTF-8) is one we don't use
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                data = np.memmap(self.path, dtype=np.uint8, mode="r")
            self.tensors: dict[str, TensorRecord] = {}
            for t in raw.tensors:
                start = raw.data_start + t.offset
                try:
                    tensor_type = GGMLQuantizationType(t.ggml_type)
                except ValueError:
                    raise UserError(f"{self.path}: tensor {t.name} has unknown ggml type {t.ggml_type}") from None
                self.tensors[t.name] = TensorRecord(t.name, tensor_type, t.dims, t.nbytes, data[start:start + t.nbytes])
        finally:
            raw.close()

    def check_tensor_types(self) -> None:
        """Fail early, with the tensor's name, on a format we cannot decode."""
        for t in self.tensors.values():
            try:
                format_of(t.tensor_type)
            except UnsupportedQuantType as e:
                raise UserError(f"tensor {t.name}: {e}") from None

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self._tensor(name).tensor_type

    def _tensor(self, name: str):
        """The tensor record, or a clear error when the file lacks a tensor its architecture needs."""
        t = self.tensors.get(name)
        if t is None:
            arch = self.metadata.get("general.architecture", "?")
            raise UserError(f"{self.path.name}: no tensor {name}, which a {arch} model needs "
                            "(an incomplete or differently converted file?)")
        return t

    def _raw(self, name: str) -> torch.Tensor:
        data = self._tensor(name).data
        with warnings.catch_warnings():  # the mmap is read-only; we never write through it
            warnings.simplefilter("ignore")
            return torch.from_numpy(np.asarray(data))

    def quant_weight(self, name: str) -> QuantWeight:
        """A 2-D weight as stored: GGUF shape is [K, N] (fastest dim first), rows are N."""
        t = self._tensor(name)
        try:
            fmt = format_of(t.tensor_type)
        except UnsupportedQuantType as e:
            raise UserError(f"tensor {name}: {e}") from None
        cols, rows = int(t.shape[0]), int(np.prod(t.shape[1:], dtype=np.int64))
        raw = self._raw(name).view(torch.uint8).reshape(rows, fmt.row_bytes(cols))
        return QuantWeight(fmt, rows, cols, raw)

    def float_tensor(self, name: str) -> torch.Tensor:
        """A small tensor (norm weight, bias) as float32."""
        t = self._tensor(name)
        if t.tensor_type == GGMLQuantizationType.F32:
            return self._raw(name).view(torch.float32).reshape(-1).clone()
        return self.quant_weight(name).dequantize().reshape(-1)
