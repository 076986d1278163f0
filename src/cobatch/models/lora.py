"""The LoRA adapters a model serves, applied per row: one step's rows may each run through a different adapter, or
none, and still share every base weight read (the base projections run once for all of them).

A projection's adapters live in two matrices of fixed shape: A_all [P C R, in] and B_all [out, P C R], for its P
parts (q, k, v of q|k|v; gate, up of gate|up; one for o and down), C adapter slots and rank R. Slot s's pair for
part p takes the R columns from (p C + s - 1) R (its rank's worth; the rest stay zero), B's in its part's rows. A
step then adds, for its rows x,

    y += ((x @ A_all.T) * row_scale) @ B_all.T

where row_scale holds, on each row's own adapter's columns, that adapter's scale, and zero elsewhere: each row gets
its own adapter's x @ A.T @ B.T, the other slots' columns multiplied by zero. On the GPU, with
COBATCH_LORA_KERNELS=1, that is two launches a projection (kernels/lora.py: the shrink, which keeps each row's own
columns and scales them, and the expand, added into y in place), reading the rows' slots from a device tensor
(`stage`), so a decode step with adapters is captured in a CUDA graph like one without, and a row's delta is
bitwise the same whatever the step's rows. Otherwise it is the torch form above (the reference), row_scale built
once a step. The cost is the slots' bytes (about R / in of the base weights each) and 2 P C R flops a weight row,
small beside the base projections.

Adapters can be loaded into free slots and unloaded while serving (`load`, `unload`: the tensors the graphs read are
written in place, between steps). Sized for that (`runtime`), every projection holds slots; otherwise only those the
start-up adapters touch. Base rows get an exact zero (the torch form) or are not written (the kernels): unchanged.
"""

from __future__ import annotations

import os

import torch

from cobatch import ops
from cobatch.config import ModelConfig
from cobatch.errors import UserError
from cobatch.kernels import lora as lora_kernels
from cobatch.loader.lora import Adapter, part_rows, projection_inputs

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# the GPU adds the deltas with kernels/lora.py's two launches with COBATCH_LORA_KERNELS=1; the torch form is the
# default, as they were not faster (bench/results/decode_lora_kernels_ab.md)
KERNELS = os.environ.get("COBATCH_LORA_KERNELS", "0") == "1"
# part -> its index among its projection's parts (a fused part, phi3's qkv or gate_up, is the whole projection)
_PART_INDEX = {"q": 0, "k": 1, "v": 2, "qkv": 0, "o": 0, "gate": 0, "up": 1, "gate_up": 0, "down": 0}
_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}      # projection -> its part count P


class _Stack:
    """One projection of one layer: every slot's pairs."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b       # [P C R, in], [out, P C R]


class LoraSet:
    def __init__(self, cfg: ModelConfig, adapters: list[Adapter], device: torch.device, dtype: torch.dtype,
                 max_rows: int, slots: int = 0, rank: int = 0, runtime: bool = False):
        """adapters: loaded at start. slots, rank: room for this many adapters of up to this rank (at least the
        start-up ones'). runtime: every projection takes adapters (for ones loaded later), not only those the
        start-up adapters touch."""
        if len({a.name for a in adapters}) != len(adapters):
            raise ValueError("two LoRA adapters have the same name")
        self.cfg, self.device, self.dtype, self.max_rows = cfg, device, dtype, max_rows
        self.kernels = device.type == "cuda" and KERNELS        # kernels/lora.py adds the deltas, else torch
        self.capacity = max(slots, len(adapters), 1)
        self.rank = max([rank] + [a.rank for a in adapters])
        self.adapters: list[Adapter | None] = [None] * self.capacity      # slot s holds adapters[s - 1]
        self.slots: dict[str, int] = {}                                     # name -> slot (0: the base model)
        touched = {(layer, part_rows(cfg, part)[0]) for a in adapters for layer, part in a.pairs}
        self.layers = [{p: self._new_stack(p) if runtime and _servable(cfg, p) or (i, p) in touched else None
                        for p in PROJECTIONS} for i in range(cfg.n_layers)]
        c, r = self.capacity, self.rank
        self.slot_scale = torch.zeros(1 + c, dtype=torch.float32, device=device)    # slot -> its adapter's scale
        self._column_slot = torch.arange(c * r, device=device) // r + 1              # a part's column -> its slot
        # each row's adapter slot in the step being run, and its columns' scales per part count (stage)
        self.row_slots = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.row_scale = {n: torch.zeros(max_rows, n * c * r, dtype=dtype, device=device) for n in (1, 2, 3)}
        for adapter in adapters:
            self.load(adapter)

    def _new_stack(self, projection: str) -> _Stack:
        width = _PARTS[projection] * self.capacity * self.rank
        out, inputs = part_rows(self.cfg, projection)[2], projection_inputs(self.cfg, projection)
        if self.kernels:
            lora_kernels.reserve_scratch(self.device, self.max_rows, width, inputs)
        return _Stack(torch.zeros(width, inputs, dtype=self.dtype, device=self.device),
                      torch.zeros(out, width, dtype=self.dtype, device=self.device))

    # --- which adapters -------------------------------------------------------------------------------------
    def slot(self, name: str | None) -> int:
        """The slot of the adapter named so (0: None, the base model); KeyError for a name not loaded."""
        return 0 if name is None else self.slots[name]

    def touches(self, layer: int, projection: str) -> bool:
        return self.layers[layer][projection] is not None

    def load(self, adapter: Adapter) -> int:
        """Put an adapter into a free slot (between steps: the decode graphs read these tensors); its slot."""
        if adapter.name in self.slots:
            raise UserError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        free = next((s for s in range(1, self.capacity + 1) if self.adapters[s - 1] is None), None)
        if free is None:
            raise UserError(f"no room for LoRA adapter {adapter.name!r}: all {self.capacity} slots hold adapters "
                            f"(--max-loras)")
        if adapter.rank > self.rank:
            raise UserError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, over the {self.rank} the slots "
                            f"hold (--max-lora-rank)")
        missing = sorted({part for (layer, part) in adapter.pairs
                          if not self.touches(layer, part_rows(self.cfg, part)[0])})
        if missing:
            raise UserError(f"LoRA adapter {adapter.name!r} adapts {', '.join(missing)}, which this model's adapter "
                            "slots do not cover (load it at start, or serve with runtime LoRA loading)")
        held = [(layer, part, a.to(self.device, self.dtype), b.to(self.device, self.dtype))
                for (layer, part), (a, b) in adapter.pairs.items()]
        if not all(torch.isfinite(a).all() and torch.isfinite(b).all() for _, _, a, b in held):
            raise UserError(f"LoRA adapter {adapter.name!r} has values past {self.dtype}'s range")
        for layer, part, a, b in held:
            projection, first, _ = part_rows(self.cfg, part)
            stack = self.layers[layer][projection]
            col = self._column(free, part)
            stack.a[col:col + a.shape[0]] = a
            stack.b[first:first + b.shape[0], col:col + b.shape[1]] = b
        self.slot_scale[free] = adapter.scale
        self.adapters[free - 1] = adapter
        self.slots[adapter.name] = free
        return free

    def unload(self, name: str) -> None:
        """Empty an adapter's slot (the caller sees that no request runs through it)."""
        slot = self.slots.pop(name)
        for layer in self.layers:
            for projection, stack in layer.items():
                if stack is None:
                    continue
                for part in range(_PARTS[projection]):
                    col = (part * self.capacity + slot - 1) * self.rank
                    stack.a[col:col + self.rank] = 0
                    stack.b[:, col:col + self.rank] = 0
        self.slot_scale[slot] = 0
        self.adapters[slot - 1] = None

    def _column(self, slot: int, part: str) -> int:
        return (_PART_INDEX[part] * self.capacity + slot - 1) * self.rank

    # --- a step ---------------------------------------------------------------------------------------------
    def stage(self, slots: torch.Tensor) -> None:
        """The next step's rows' adapter slots (a device tensor, one a row), before its forward or graph replay:
        each row's column scales, for every part count."""
        n = slots.shape[0]
        if n > self.row_slots.shape[0]:
            raise RuntimeError(f"a step of {n} rows, over the {self.row_slots.shape[0]} the adapters were sized for")
        self.row_slots[:n].copy_(slots, non_blocking=True)
        if self.kernels:
            return          # the kernels read the slots themselves
        rows = self.row_slots[:n]
        own = self._column_slot[None, :] == rows[:, None]
        scale = torch.where(own, self.slot_scale[rows][:, None], 0.0).to(self.dtype)
        width = scale.shape[1]
        for parts, buffer in self.row_scale.items():
            for p in range(parts):
                buffer[:n, p * width:(p + 1) * width] = scale

    def add(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x's rows, [n, out]) plus each row's adapter delta, in place."""
        stack = self.layers[layer][projection]
        if stack is None:
            return y
        n = x.shape[0]
        if self.kernels:
            return lora_kernels.lora_add_triton(x if x.stride(-1) == 1 else x.contiguous(), stack.a, stack.b, y,
                                                self.row_slots[:n], self.slot_scale, self.capacity, self.rank)
        t = torch.mm(x.to(stack.a.dtype), stack.a.T).mul_(self.row_scale[_PARTS[projection]][:n])
        if y.dtype == t.dtype:
            return y.addmm_(t, stack.b.T)
        return y.add_(torch.mm(t, stack.b.T).to(y.dtype))

    def feed_forward(self, layer: int, h: torch.Tensor, gate_up, down, act: str, dtype: torch.dtype) -> torch.Tensor:
        """ops.feed_forward with the adapters' gate|up delta before the activation and down's after. Where they
        touch gate|up its weight is stored plain (LlamaModel: not interleaved for the GEMV's act epilogue)."""
        if self.touches(layer, "gate_up"):
            gu = self.add(layer, "gate_up", h, ops.linear(h, gate_up, dtype=dtype))
            mid = ops.gated_mul(gu, act)
        else:
            mid = ops.gated_linear(h, gate_up, act)
        return self.add(layer, "down", mid, ops.linear(mid, down, dtype=dtype))


def _servable(cfg: ModelConfig, projection: str) -> bool:
    """Can an adapter touch this projection of the model? Not a feed-forward made of experts."""
    return projection in ("qkv", "o") or not cfg.n_experts
