"""A quantized weight matrix as the file stores it: rows of blocks, one format, and (FP8 / NVFP4 checkpoints) a
scale per row applied after the blocks are decoded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cobatch.quant.formats import QuantFormat, dequantize, format_of, q5_0_as_q8_0


@dataclass(slots=True)
class QuantWeight:
    fmt: QuantFormat
    rows: int            # output features (N)
    cols: int            # input features (K)
    raw: torch.Tensor    # uint8 [rows, fmt.row_bytes(cols)]; mmap-backed when it comes from a file
    # float32 [rows]: each row's values are multiplied by it after the blocks are decoded (an FP8 checkpoint's
    # per-channel or per-tensor scale, NVFP4's per-tensor one); None for GGUF formats, whose blocks hold all scales
    row_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.raw.dtype == torch.uint8 and self.raw.shape == (self.rows, self.fmt.row_bytes(self.cols)), (
            self.raw.shape, self.rows, self.cols, self.fmt.name)
        assert self.row_scale is None or self.row_scale.shape == (self.rows,)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = dequantize(self.raw, self.fmt, self.cols)
        if self.row_scale is not None:
            values *= self.row_scale.to(values.device, torch.float32)[:, None]
        return values.to(dtype)

    def as_q8_0(self) -> "QuantWeight":
        """This Q5_0 weight as Q8_0, the same values (formats.q5_0_as_q8_0): a copy."""
        assert self.fmt.name == "q5_0" and self.row_scale is None
        return QuantWeight(format_of("q8_0"), self.rows, self.cols, q5_0_as_q8_0(self.raw))

    @staticmethod
    def _joined_scales(parts: list["QuantWeight"]) -> torch.Tensor | None:
        """The row scales of parts stacked (1 for a part without), None if none has any."""
        if all(p.row_scale is None for p in parts):
            return None
        return torch.cat([p.row_scale if p.row_scale is not None else torch.ones(p.rows, device=p.raw.device)
                          for p in parts])

    @staticmethod
    def stack_rows(parts: list["QuantWeight"]) -> "QuantWeight":
        """One matrix from several that share format and K (q|k|v, gate|up): one launch instead of several."""
        first = parts[0]
        assert all(p.fmt is first.fmt and p.cols == first.cols for p in parts)
        return QuantWeight(first.fmt, sum(p.rows for p in parts), first.cols, torch.cat([p.raw for p in parts]),
                           QuantWeight._joined_scales(parts))

    def row_slice(self, start: int, stop: int) -> "QuantWeight":
        """Rows start..stop-1 (a view, no copy)."""
        return QuantWeight(self.fmt, stop - start, self.cols, self.raw[start:stop],
                           None if self.row_scale is None else self.row_scale[start:stop])

    @staticmethod
    def interleave_rows(a: "QuantWeight", b: "QuantWeight", group: int) -> "QuantWeight":
        """a's and b's rows alternating `group` by `group` (a 0..g-1, b 0..g-1, a g..2g-1, ...): how CUDA packs a
        gate|up projection so the GEMV can apply the activation in its epilogue (kernels/activation.py)."""
        assert a.fmt is b.fmt and a.cols == b.cols and a.rows == b.rows and a.rows % group == 0
        raw = torch.stack([a.raw.reshape(-1, group, a.raw.shape[1]), b.raw.reshape(-1, group, b.raw.shape[1])], 1)
        scales = QuantWeight._joined_scales([a, b])
        if scales is not None:
            scales = torch.stack([scales[:a.rows].reshape(-1, group), scales[a.rows:].reshape(-1, group)], 1)
            scales = scales.reshape(-1)
        return QuantWeight(a.fmt, 2 * a.rows, a.cols, raw.reshape(2 * a.rows, -1), scales)
