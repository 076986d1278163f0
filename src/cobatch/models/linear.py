"""How a model holds its linear layers on each device.

CPU: dequantized once at load to a dense tensor (the reference path). CUDA: repacked quantized blocks
(`PackedWeight`), read by the narrow GEMV / dequant GEMM kernels. Projections that share an input
(q|k|v, gate|up) are stacked into one matrix when their formats agree, so they cost one launch. A gate|up
projection the GEMV reads has its rows interleaved 8 by 8, so the GEMV applies act(gate) * up itself
(`ops.gated_linear`; kernels/activation.py has the layout).
"""

from __future__ import annotations

import torch

from cobatch import ops
from cobatch.kernels.activation import GATE_UP_GROUP
from cobatch.quant.weight import QuantWeight


class RowStack:
    """Several matrices of different formats that act as one: outputs concatenated."""

    def __init__(self, parts: list[object]):
        self.parts = parts

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([ops.linear(x, p) for p in self.parts], dim=-1)


def _one(w: QuantWeight, device: torch.device, dtype: torch.dtype, keep_dense: bool,
         gate_up_interleaved: bool = False) -> object:
    if device.type == "cuda":
        from cobatch.kernels.quant_matmul import PackedWeight
        return PackedWeight.from_quant(w, device, dtype, keep_dense=keep_dense,
                                       gate_up_interleaved=gate_up_interleaved)
    return w.dequantize(dtype)


def load_linear(parts: list[QuantWeight], device: torch.device, dtype: torch.dtype,
                keep_dense: bool = False) -> object:
    if device.type != "cuda":
        return torch.cat([p.dequantize(dtype) for p in parts]) if len(parts) > 1 else parts[0].dequantize(dtype)
    if all(p.fmt is parts[0].fmt for p in parts):
        return _one(QuantWeight.stack_rows(parts) if len(parts) > 1 else parts[0], device, dtype, keep_dense)
    return RowStack([_one(p, device, dtype, keep_dense) for p in parts])


def gate_up_interleavable(gate: QuantWeight, up: QuantWeight, device: torch.device) -> bool:
    """Will the GEMV read this gate|up pair (CUDA, a fragment format), so that it is worth interleaving?"""
    if torch.device(device).type != "cuda" or gate.fmt is not up.fmt or gate.rows % GATE_UP_GROUP:
        return False
    from cobatch.kernels.quant_matmul import uses_gemv
    return uses_gemv(gate.fmt.name, device)


def load_gate_up(gate: QuantWeight, up: QuantWeight, device: torch.device, dtype: torch.dtype,
                 keep_dense: bool = False) -> object:
    """The fused gate|up projection, for ops.gated_linear: gate rows then up rows, or on the GEMV's formats
    interleaved 8 by 8 (its act*mul epilogue)."""
    if gate_up_interleavable(gate, up, device):
        return _one(QuantWeight.interleave_rows(gate, up, GATE_UP_GROUP), torch.device(device), dtype, keep_dense,
                    gate_up_interleaved=True)
    return load_linear([gate, up], device, dtype, keep_dense)
