"""Scratch buffers that kernels on one stream share: one per device, which only grows.

A buffer is grown at load, never inside a CUDA-graph capture. One it outgrows stays allocated: graphs captured
before the growth (another model loaded in the same process, say) still address it, and were its memory handed
to new tensors (the next model's weights), their replays would write into them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def device_key(device: torch.device | str) -> torch.device:
    """The device with its index ('cuda' -> 'cuda:N', the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DeviceScratch:
    """A flat buffer of `dtype` per device, grown to the most elements asked for; zeroed: allocated as zeros
    (split-K counters, which every kernel leaves at 0)."""

    def __init__(self, dtype: torch.dtype, zeroed: bool = False):
        self.dtype, self.zeroed = dtype, zeroed
        self._by_device: dict[torch.device, torch.Tensor] = {}
        self._outgrown: list[torch.Tensor] = []     # kept alive: captured graphs may still address them

    def reserve(self, device: torch.device | str, elems: int) -> None:
        device = device_key(device)
        have = self._by_device.get(device)
        if have is None or have.numel() < elems:
            if have is not None:
                self._outgrown.append(have)
            make = torch.zeros if self.zeroed else torch.empty
            self._by_device[device] = make(max(elems, 1), dtype=self.dtype, device=device)

    def get(self, device: torch.device | str, elems: int | None = None) -> torch.Tensor:
        """The first `elems` elements (grown to hold them; default: the whole buffer, reserved before)."""
        if elems is not None:
            self.reserve(device, elems)
        buf = self._by_device[device_key(device)]
        return buf if elems is None else buf[:elems]


class SplitScratch:
    """The split-K reduction's buffers, one partial-sum buffer and one counter array per device, shared by every
    quantized kernel that splits K (the Triton matmul, the Gluon GEMV and GEMM, the CUDA C++ GEMM).

    Kernels on one stream run one after another, so they can share them; every counter is back at 0 when a
    kernel ends. Grown at load (packed_weight.reserve_scratch), never inside a CUDA-graph capture. Kernels on a
    side stream (an MoE layer's shared experts beside its routed ones) take a second set, within side_lane()."""
    partial = DeviceScratch(torch.float32)
    count = DeviceScratch(torch.int32, zeroed=True)
    side_partial = DeviceScratch(torch.float32)
    side_count = DeviceScratch(torch.int32, zeroed=True)
    on_side = False

    @classmethod
    def _buffers(cls) -> tuple[DeviceScratch, DeviceScratch]:
        return (cls.side_partial, cls.side_count) if cls.on_side else (cls.partial, cls.count)

    @classmethod
    def reserve(cls, device: torch.device, partial_elems: int, tiles: int) -> None:
        partial, count = cls._buffers()
        partial.reserve(device, partial_elems)
        count.reserve(device, tiles)

    @classmethod
    def get(cls, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        partial, count = cls._buffers()
        return partial.get(device), count.get(device)


@contextmanager
def side_lane():
    """Within: the split-K kernels enqueued (and reservations made) take SplitScratch's side set."""
    SplitScratch.on_side = True
    try:
        yield
    finally:
        SplitScratch.on_side = False
