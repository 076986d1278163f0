"""A quantized weight matrix as the GGUF file stores it: rows of blocks, one format."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cobatch.quant.formats import QuantFormat, dequantize


@dataclass(slots=True)
class QuantWeight:
    fmt: QuantFormat
    rows: int            # output features (N)
    cols: int            # input features (K)
    raw: torch.Tensor    # uint8 [rows, fmt.row_bytes(cols)]; mmap-backed when it comes from a file

    def __post_init__(self) -> None:
        assert self.raw.dtype == torch.uint8 and self.raw.shape == (self.rows, self.fmt.row_bytes(self.cols)), (
            self.raw.shape, self.rows, self.cols, self.fmt.name)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.raw, self.fmt.ggml_type, self.cols).to(dtype)

    @staticmethod
    def stack_rows(parts: list["QuantWeight"]) -> "QuantWeight":
        """One matrix from several that share format and K (q|k|v, gate|up): one launch instead of several."""
        first = parts[0]
        assert all(p.fmt is first.fmt and p.cols == first.cols for p in parts)
        return QuantWeight(first.fmt, sum(p.rows for p in parts), first.cols, torch.cat([p.raw for p in parts]))
