"""The LoRA adapters a model serves, applied per row: one step's rows may each run through a different adapter, or
none, and still share every base weight read (the base projections run once for all of them).

Each projection's adapters are stacked at load into two small matrices: A_all [M, in], every (adapter, part)'s A
one under the other, and B_all [out, M], each B in its part's rows (q, k, v of q|k|v; gate, up of gate|up) and its
adapter's columns, zero elsewhere. A table [1 + adapters, M] holds each adapter's scale on its own columns (row 0,
the base model, none). A step then adds, for its rows x,

    y += ((x @ A_all.T) * table[row's adapter]) @ B_all.T

which is each row's own adapter's x @ A.T @ B.T exactly, the other adapters' columns multiplied by zero: two dense
matmuls of fixed shapes, so a decode step with adapters is captured in a CUDA graph like one without, the rows'
adapters a device tensor its replays read (`stage`). Their cost is the adapters' bytes (about r / in of the base
weights each) and 2 M flops a weight row, small beside the base projections.

A row through an adapter is not batch invariant: its delta comes from the BLAS, whose summation order may change
with the number of rows. Base rows get an exact zero and are unchanged.
"""

from __future__ import annotations

import torch

from cobatch import ops
from cobatch.config import ModelConfig
from cobatch.loader.lora import Adapter, part_rows, projection_inputs

PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Stack:
    """One projection of one layer, every adapter that touches it."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, table: torch.Tensor):
        self.a, self.b, self.table = a, b, table       # [M, in], [out, M], [1 + adapters, M]


def _stack(cfg: ModelConfig, adapters: list[Adapter], layer: int, projection: str, device: torch.device,
           dtype: torch.dtype) -> _Stack | None:
    pieces = []          # (slot, first row, A, B)
    for slot, adapter in enumerate(adapters, start=1):
        for (at, part), (a, b) in adapter.pairs.items():
            proj, first, _ = part_rows(cfg, part)
            if at == layer and proj == projection:
                pieces.append((slot, first, a, b))
    if not pieces:
        return None
    width = sum(a.shape[0] for _, _, a, _ in pieces)
    out = part_rows(cfg, projection)[2]       # (the whole projection is a part of itself)
    a_all = torch.zeros(width, projection_inputs(cfg, projection))
    b_all = torch.zeros(out, width)
    table = torch.zeros(1 + len(adapters), width)
    col = 0
    for slot, first, a, b in pieces:
        r = a.shape[0]
        a_all[col:col + r] = a
        b_all[first:first + b.shape[0], col:col + r] = b
        table[slot, col:col + r] = adapters[slot - 1].scale
        col += r
    return _Stack(a_all.to(device, dtype), b_all.to(device, dtype), table.to(device, dtype))


class LoraSet:
    def __init__(self, cfg: ModelConfig, adapters: list[Adapter], device: torch.device, dtype: torch.dtype,
                 max_rows: int):
        if len({a.name for a in adapters}) != len(adapters):
            raise ValueError("two LoRA adapters have the same name")
        self.adapters = adapters
        self.slots = {a.name: i for i, a in enumerate(adapters, start=1)}     # 0: the base model
        self.layers = [{p: _stack(cfg, adapters, i, p, device, dtype) for p in PROJECTIONS}
                       for i in range(cfg.n_layers)]
        # each row's adapter slot in the step being run (stage); the decode graphs read its first rows
        self.row_slots = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def slot(self, name: str | None) -> int:
        """The slot of the adapter named so (0: None, the base model); KeyError for a name not loaded."""
        return 0 if name is None else self.slots[name]

    def touches(self, layer: int, projection: str) -> bool:
        return self.layers[layer][projection] is not None

    def stage(self, slots: torch.Tensor) -> None:
        """The next step's rows' adapter slots (a device tensor, one a row), before its forward or graph replay."""
        n = slots.shape[0]
        if n > self.row_slots.shape[0]:
            raise RuntimeError(f"a step of {n} rows, over the {self.row_slots.shape[0]} the adapters were sized for")
        self.row_slots[:n].copy_(slots, non_blocking=True)

    def add(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x's rows, [n, out]) plus each row's adapter delta, in place."""
        stack = self.layers[layer][projection]
        if stack is None:
            return y
        n = x.shape[0]
        t = ops.linear(x.to(stack.a.dtype), stack.a) * stack.table.index_select(0, self.row_slots[:n])
        y += ops.linear(t, stack.b).to(y.dtype)
        return y

    def feed_forward(self, layer: int, h: torch.Tensor, gate_up, down, act: str, dtype: torch.dtype) -> torch.Tensor:
        """ops.feed_forward with the adapters' gate|up delta before the activation and down's after. Where they
        touch gate|up its weight is stored plain (LlamaModel: not interleaved for the GEMV's act epilogue)."""
        if self.touches(layer, "gate_up"):
            gu = self.add(layer, "gate_up", h, ops.linear(h, gate_up, dtype=dtype))
            mid = ops.gated_mul(gu, act)
        else:
            mid = ops.gated_linear(h, gate_up, act)
        return self.add(layer, "down", mid, ops.linear(mid, down, dtype=dtype))
