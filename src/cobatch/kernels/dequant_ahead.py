"""Dequantize the next weight while cuBLAS multiplies this one: the dense path of a prefill, overlapped.

Past the GEMM's token range a packed weight's matmul dequantizes the whole matrix into a scratch and cuBLAS
multiplies it (packed_weight's DEQUANT_CUBLAS). The multiply is bound by the tensor cores and the dequantize pass by
memory, so on one GPU they overlap: while the compute stream multiplies weight i, a side stream dequantizes weight
i + 1 (`PackedWeight.next_dense`, its successor in the forward's order, linked at load by `link`) into the other of
two scratch matrices. The values are the pass's either way, so the bits are the same.

Two events a matrix keep the streams apart: `ready` (recorded on the side stream after its dequantize pass; the
compute stream waits for it before the multiply that reads it) and `free` (recorded on the compute stream after
the last multiply that read it; the side stream waits for it before writing the matrix again). Off inside a
CUDA-graph capture and on the CPU: there the matrix is dequantized where it is used, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from cobatch.kernels.scratch import DeviceScratch, device_key


# How far along the chain a pass ahead looks for the next dense-path weight: at 512 tokens gate|up runs the GEMM,
# so o's multiply dequantizes down's matrix ahead.
LOOK_AHEAD = 3


@dataclass(eq=False)
class _Matrix:
    """One of the two scratch matrices: the weight (and dtype) whose values it holds or will hold."""
    scratch: DeviceScratch
    holds: tuple[int, torch.dtype] | None = None
    ready: torch.cuda.Event | None = None      # its dequantize pass done (side stream)
    free: torch.cuda.Event | None = None       # the last multiply that read it done (compute stream)


@dataclass(eq=False)
class _DeviceState:
    side: torch.cuda.Stream
    matrices: list[_Matrix] = field(default_factory=list)
    last: int = 0                               # the matrix the latest multiply read


class DequantAhead:
    """The two scratch matrices of one process, and a side stream per device."""

    def __init__(self):
        self.scratches = (DeviceScratch(torch.uint8), DeviceScratch(torch.uint8))
        self._states: dict[torch.device, _DeviceState] = {}

    def reserve(self, device: torch.device, nbytes: int) -> None:
        """Grow both matrices to nbytes (at load)."""
        for s in self.scratches:
            s.reserve(device, nbytes)

    def _state(self, device: torch.device) -> _DeviceState:
        device = device_key(device)
        state = self._states.get(device)
        if state is None:
            state = _DeviceState(torch.cuda.Stream(device))
            state.matrices = [_Matrix(s) for s in self.scratches]
            self._states[device] = state
        return state

    @staticmethod
    def _view(m: _Matrix, device: torch.device, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        return m.scratch.get(device, rows * cols * 2).view(dtype).view(rows, cols)

    def multiply(self, weight, x: torch.Tensor, out: torch.Tensor,
                 dequantize: Callable[[object, torch.Tensor], torch.Tensor]) -> None:
        """out = x @ W.T for a packed weight on the dense path: W from the matrix dequantized ahead if it holds
        this weight in x's dtype (the compute stream waits for its pass), else dequantized now into the matrix
        the latest multiply did not read. Then, on the side stream, weight.next_dense's values into the other
        matrix, if its plan will take the dense path at x's rows. `dequantize(weight, matrix)` fills a matrix."""
        device, dtype = x.device, x.dtype
        state, compute = self._state(device), torch.cuda.current_stream(device)
        key = (id(weight), dtype)
        found = [i for i, m in enumerate(state.matrices) if m.holds == key]
        i = found[0] if found else 1 - state.last
        m = state.matrices[i]
        if m.ready is not None:
            compute.wait_event(m.ready)            # its pass ahead (or, about to be overwritten, one still running)
        if not found:
            m.holds = None
            dequantize(weight, self._view(m, device, weight.rows, weight.cols, dtype))
        w = self._view(m, device, weight.rows, weight.cols, dtype)
        torch.mm(x, w.t(), out=out)
        m.holds, m.free, state.last = key, _recorded(compute), i
        self._ahead(state, weight.next_dense, x.shape[0], device, dtype, dequantize)

    def _ahead(self, state: _DeviceState, weight, n_tok: int, device: torch.device, dtype: torch.dtype,
               dequantize: Callable[[object, torch.Tensor], torch.Tensor]) -> None:
        for _ in range(LOOK_AHEAD):          # the next matmul on the dense path (a GEMM's weight between is passed)
            if weight is None or weight.takes_dense_path(n_tok):
                break
            weight = weight.next_dense
        if weight is None or not weight.takes_dense_path(n_tok):
            return
        m = state.matrices[1 - state.last]
        if m.holds == (id(weight), dtype):
            return
        with torch.cuda.stream(state.side):
            if m.free is not None:
                state.side.wait_event(m.free)
            dequantize(weight, self._view(m, device, weight.rows, weight.cols, dtype))
            m.ready = _recorded(state.side)
        m.holds = (id(weight), dtype)


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def usable(x: torch.Tensor) -> bool:
    """On CUDA, outside a graph capture (the side stream's work would need forking into the capture)."""
    return x.is_cuda and not torch.cuda.is_current_stream_capturing()


def link(weights: Iterable) -> None:
    """Set each packed weight's next_dense to the packed weight after it (stacks of parts, as a mixed q|k|v, are
    their parts in order): the forward's order of the matmuls, which the passes ahead follow. A weight without
    planes (dense, CPU) breaks nothing: it is skipped."""
    flat = []
    for w in weights:
        parts = getattr(w, "parts", None)
        flat.extend(parts if parts else [w])
    flat = [w for w in flat if hasattr(w, "next_dense")]
    for a, b in zip(flat, flat[1:]):
        a.next_dense = b
