"""How a model holds its linear layers on each device.

CPU: dequantized once at load to a dense tensor (the reference path). CUDA: repacked quantized blocks
(`PackedWeight`), read by the narrow GEMV / dequant GEMM kernels. Projections that share an input
(q|k|v, gate|up) are stacked into one matrix when their formats agree, so they cost one launch.
"""

from __future__ import annotations

import torch

from cobatch import ops
from cobatch.quant.weight import QuantWeight


class RowStack:
    """Several matrices of different formats that act as one: outputs concatenated."""

    def __init__(self, parts: list[object]):
        self.parts = parts

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([ops.linear(x, p) for p in self.parts], dim=-1)


def _one(w: QuantWeight, device: torch.device, dtype: torch.dtype, keep_dense: bool) -> object:
    if device.type == "cuda":
        from cobatch.kernels.quant_matmul import PackedWeight
        return PackedWeight.from_quant(w, device, dtype, keep_dense=keep_dense)
    return w.dequantize(dtype)


def load_linear(parts: list[QuantWeight], device: torch.device, dtype: torch.dtype,
                keep_dense: bool = False) -> object:
    if device.type != "cuda":
        return torch.cat([p.dequantize(dtype) for p in parts]) if len(parts) > 1 else parts[0].dequantize(dtype)
    if all(p.fmt is parts[0].fmt for p in parts):
        return _one(QuantWeight.stack_rows(parts) if len(parts) > 1 else parts[0], device, dtype, keep_dense)
    return RowStack([_one(p, device, dtype, keep_dense) for p in parts])
