"""Work of a decode step that does not depend on the step's next kernels, run on a second CUDA stream beside them.

At a few rows each launch of a step takes its latency more than its bytes, so two independent chains of them at
once keep more of the GPU busy than one: an MoE layer's shared experts beside its router and routed experts
(models/moe.py), MLA's absorbed query product beside the latent write (models/deepseek.py). The side stream forks
from the current one where the work is enqueued and joins it where the result is used; CUDA graphs capture both
branches. Split-K kernels on it take buffers of their own (kernels/scratch.side_lane). Blocks the allocator hands
out on either stream are next used on that stream only after the other's fork or join, so no record_stream is
needed (nor taken inside a capture). COBATCH_SIDE_STREAM=0 runs the same work in line, for comparisons: the same
kernels on the same inputs, so the same bits.
"""

from __future__ import annotations

import os

import torch

from cobatch.kernels.scratch import device_key, side_lane

SIDE_STREAM = os.environ.get("COBATCH_SIDE_STREAM", "1") != "0"
SIDE_MAX_ROWS = 8       # steps of up to this many rows (the GEMV's): where launches, not bytes, hold the kernels
_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def takes(device: torch.device, n_rows: int) -> bool:
    """Does a step of n_rows rows on `device` run work beside its own stream?"""
    return SIDE_STREAM and device.type == "cuda" and 0 < n_rows <= SIDE_MAX_ROWS


class Beside:
    """fn(*args) enqueued on the device's side stream, from where the current stream is; join() makes the current
    stream wait for it and returns its result."""

    def __init__(self, device: torch.device, fn, *args):
        device = device_key(device)
        self.main = torch.cuda.current_stream(device)
        side = _streams.get(device)
        if side is None:
            side = _streams[device] = torch.cuda.Stream(device)
        self.side = side
        side.wait_stream(self.main)
        with torch.cuda.stream(side), side_lane():
            self.out = fn(*args)

    def join(self):
        self.main.wait_stream(self.side)
        return self.out
