"""Open a GGUF file with gguf-py: metadata as plain values, tensors memory-mapped (never copied)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType

from cobatch.errors import UserError
from cobatch.quant.formats import UnsupportedQuantType, format_of
from cobatch.quant.weight import QuantWeight

GGUF_MAGIC = b"GGUF"


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
        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # gguf-py raises assorted errors on damaged files
            raise UserError(f"cannot read GGUF file {self.path} (truncated or corrupt?): {e}") from None
        size = self.path.stat().st_size
        self.tensors = {t.name: t for t in self._reader.tensors}
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise UserError(f"GGUF file is truncated: tensor {t.name} extends past the end of {self.path}")
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            try:
                self.metadata[key] = field.contents()
            except Exception:
                continue  # a field gguf-py can't render is one we don't use

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
        cols, rows = int(t.shape[0]), int(np.prod(t.shape[1:]))
        raw = self._raw(name).view(torch.uint8).reshape(rows, fmt.row_bytes(cols))
        return QuantWeight(fmt, rows, cols, raw)

    def float_tensor(self, name: str) -> torch.Tensor:
        """A small tensor (norm weight, bias) as float32."""
        t = self._tensor(name)
        if t.tensor_type == GGMLQuantizationType.F32:
            return self._raw(name).view(torch.float32).reshape(-1).clone()
        return self.quant_weight(name).dequantize().reshape(-1)
