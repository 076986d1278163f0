"""How a model holds its linear layers on each device.

CPU: dequantized once at load to a dense tensor (the reference path). CUDA: repacked quantized blocks
(`PackedWeight`), read by the narrow GEMV / dequant GEMM kernels. Projections that share an input
(q|k|v, gate|up) are stacked into one matrix when their formats agree, so they cost one launch; where they do
not (a *_K_M file's Q6_K attn_v beside Q4_K q and k), each run of one format is one matrix and writes its
columns of the output in place (`RowStack`). A gate|up
projection the GEMV reads has its rows interleaved 8 by 8, so the GEMV applies act(gate) * up itself
(`ops.gated_linear`; kernels/activation.py has the layout).
"""

from __future__ import annotations

import dataclasses

import torch

from cobatch import ops
from cobatch.kernels.activation import GATE_UP_GROUP
from cobatch.kernels.quant_pack import PackedPlanes
from cobatch.quant.weight import QuantWeight


class RowStack:
    """Several matrices of different formats that act as one, their outputs side by side: each part writes its
    own columns of one output (no concatenation pass after them)."""

    def __init__(self, parts: list[object]):
        self.parts = parts
        self.part_rows = [_rows(p) for p in parts]
        self.rows = sum(self.part_rows)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty(x2.shape[0], self.rows, dtype=x.dtype, device=x.device) if out is None else out
        out2 = out.view(x2.shape[0], self.rows)
        start = 0
        for part, rows in zip(self.parts, self.part_rows):
            ops.linear(x2, part, out=out2[:, start:start + rows])
            start += rows
        return out.reshape(*x.shape[:-1], self.rows)


def _rows(weight: object) -> int:
    return weight.shape[0] if isinstance(weight, torch.Tensor) else weight.rows


def format_runs(parts: list[QuantWeight]) -> list[list[QuantWeight]]:
    """parts grouped into runs of consecutive matrices of one format, in order: each run stacks into one matrix."""
    runs: list[list[QuantWeight]] = []
    for p in parts:
        if runs and runs[-1][0].fmt is p.fmt and runs[-1][0].cols == p.cols:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _one(w: QuantWeight, device: torch.device, dtype: torch.dtype, keep_dense: bool,
         gate_up_interleaved: bool = False) -> object:
    if device.type == "cuda":
        from cobatch.kernels.packed_weight import PackedWeight
        return PackedWeight.from_quant(w, device, dtype, keep_dense=keep_dense,
                                       gate_up_interleaved=gate_up_interleaved)
    return w.dequantize(dtype)


def load_linear(parts: list[QuantWeight], device: torch.device, dtype: torch.dtype,
                keep_dense: bool = False) -> object:
    if device.type != "cuda":
        return torch.cat([p.dequantize(dtype) for p in parts]) if len(parts) > 1 else parts[0].dequantize(dtype)
    runs = [_one(QuantWeight.stack_rows(run) if len(run) > 1 else run[0], device, dtype, keep_dense)
            for run in format_runs(parts)]
    return runs[0] if len(runs) == 1 else RowStack(runs)


class WeightLoader:
    """A model's tensors from its weight source (a GGUF file, a checkpoint folder, a tensor-parallel shard), on one
    device and in one dtype: what each model's constructor reads its layers through."""

    def __init__(self, source, device: torch.device, dtype: torch.dtype, keep_dense: bool = False):
        self.source, self.device, self.dtype, self.keep_dense = source, device, dtype, keep_dense

    def vec(self, name: str) -> torch.Tensor:
        """A small tensor (a norm's weight, a bias) in the model's dtype."""
        return self.source.float_tensor(name).to(self.device, self.dtype)

    def linear(self, *names: str) -> object:
        """The named matrices' rows stacked into one projection (load_linear)."""
        return load_linear([self.source.quant_weight(n) for n in names], self.device, self.dtype, self.keep_dense)


def after_attention(projection: object) -> object:
    """Mark a projection whose input decode attention writes (o): its GEMV may then launch as a programmatic
    dependent at every token tile (quant_gemv.GEMV_PDL_AFTER_ATTENTION). Dense CPU tensors are left as they are."""
    for part in getattr(projection, "parts", [projection]):
        if hasattr(part, "follows_attention"):
            part.follows_attention = True
    return projection


def gate_up_interleavable(gate: QuantWeight, up: QuantWeight, device: torch.device) -> bool:
    """Will the GEMV read this gate|up pair (CUDA, a fragment format), so that it is worth interleaving?"""
    if torch.device(device).type != "cuda" or gate.fmt is not up.fmt or gate.rows % GATE_UP_GROUP:
        return False
    from cobatch.kernels.matmul_plans import uses_gemv
    return uses_gemv(gate.fmt.name, device)


def load_gate_up(gate: QuantWeight, up: QuantWeight, device: torch.device, dtype: torch.dtype,
                 keep_dense: bool = False, interleave: bool = True) -> object:
    """The fused gate|up projection, for ops.gated_linear: gate rows then up rows, or on the GEMV's formats
    interleaved 8 by 8 (its act*mul epilogue) unless interleave=False."""
    if interleave and gate_up_interleavable(gate, up, device):
        return _one(QuantWeight.interleave_rows(gate, up, GATE_UP_GROUP), torch.device(device), dtype, keep_dense,
                    gate_up_interleaved=True)
    return load_linear([gate, up], device, dtype, keep_dense)


def resident_bytes(model: object) -> dict[str, int]:
    """Bytes of weights a model holds on its device, by kind: "quantized" (packed planes the kernels read),
    "dense" (embeddings, norms, tables, dequantized fallback matrices) and "bf16_copies" (dequantized copies of
    quantized weights, kept only with --dense-large-batch). Each storage is counted once: an expert's view
    shares its stack's planes."""
    from cobatch.kernels.packed_weight import PackedWeight
    device = torch.device(getattr(model, "device", "cpu"))
    totals = {"quantized": 0, "dense": 0, "bf16_copies": 0}
    storages: set[tuple[str, int]] = set()
    visited: set[int] = set()

    def count(t: torch.Tensor, kind: str) -> None:
        key = (str(t.device), t.untyped_storage().data_ptr())
        if t.device.type == device.type and key not in storages:
            storages.add(key)
            totals[kind] += t.untyped_storage().nbytes()

    def walk(obj: object) -> None:
        if id(obj) in visited or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            count(obj, "dense")
        elif isinstance(obj, PackedPlanes):
            for t in obj.tensors():
                count(t, "quantized")
        elif isinstance(obj, PackedWeight):
            walk(obj.planes)
            if obj.dense is not None:
                count(obj.dense, "dense")
            if obj.resident_dense is not None:
                count(obj.resident_dense, "bf16_copies")
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)
        elif dataclasses.is_dataclass(obj):          # (slots dataclasses have no __dict__)
            for field in dataclasses.fields(obj):
                walk(getattr(obj, field.name))
        elif hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                walk(item)

    walk(model)
    return totals
