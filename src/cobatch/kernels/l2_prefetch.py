"""Read a weight into L2 while other kernels run, so that its GEMV finds it there.

A decode step's small projections (Llama-3-8B's o: 9.4 MB in Q4_K) cannot stream at the copy bandwidth on
their own: a kernel that moves 9 MB reaches about half of it (bench/results/size-ceiling-2026-11-29*.json).
Decode attention before them leaves DRAM idle much of the time at small batches. So, on a side stream that
joins before the GEMV, a few one-warp programs issue bulk L2 prefetches (sm_90's cp.async.bulk.prefetch,
16 KB a lane) of the weight's planes, with evict_last priority so that the KV tiles streaming past do not
push them out. Nothing is written: the GEMV's results are the same with or without it.

There is no torch reference: on the CPU (and in the interpreter, which has no inline PTX) it does nothing.
COBATCH_L2_PREFETCH names the weights prefetched (comma-separated): "o" (the default: the attention output
projection, read in while decode attention runs), "qkv" (the next layer's q|k|v, read in while the down
projection runs), "0" none.
"""

from __future__ import annotations

import os

import torch

from cobatch.kernels.triton_support import interpreting, jit, tl, triton

PIECE = 16384           # bytes a lane asks for; a multiple of 16, as the instruction requires
LANES = 32              # one warp a program

# One lane's bulk prefetch, if it has bytes to ask for: a hint (evict_last) that the lines stay in L2 before others.
# (A constexpr: a kernel may read no other global.)
ASM_BULK_PREFETCH = """{
 .reg .pred p;
 .reg .b64 pol;
 setp.gt.s32 p, $2, 0;
 createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
 @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
 mov.u32 $0, 0;
}"""
if tl is not None:
    ASM_BULK_PREFETCH = tl.constexpr(ASM_BULK_PREFETCH)


@jit
def _l2_prefetch_kernel(ptr, nbytes, PIECE: tl.constexpr, LANES: tl.constexpr):
    """Program p: bytes [p * LANES * PIECE, (p + 1) * LANES * PIECE) of the buffer, PIECE a lane (less at the
    end, rounded down to 16 bytes)."""
    start = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * PIECE
    size = (tl.minimum(nbytes - start, PIECE) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(ASM_BULK_PREFETCH, "=r,l,r", [ptr + start, size], dtype=tl.int32, is_pure=False,
                              pack=1)


def roles() -> set[str]:
    """The weights COBATCH_L2_PREFETCH names ("o" if unset; "0": none)."""
    return set(os.environ.get("COBATCH_L2_PREFETCH", "o").split(",")) - {"0", ""}


def enabled(t: torch.Tensor, role: str) -> bool:
    """Whether prefetches of the weight `role` ("o", "qkv") run for tensors like t: CUDA, compute capability
    9.0 or later (the bulk prefetch), named in COBATCH_L2_PREFETCH."""
    if not t.is_cuda or interpreting() or triton is None or role not in roles():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def prefetch_to_l2(tensors: list[torch.Tensor]) -> None:
    """Launch the prefetch of each tensor's bytes on the current stream (16-byte aligned ones; others are left)."""
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes < 16 or t.data_ptr() % 16 or not t.is_contiguous():
            continue
        grid = (triton.cdiv(nbytes, LANES * PIECE),)
        _l2_prefetch_kernel[grid](t.view(torch.uint8).reshape(-1) if t.dtype != torch.uint8 else t.reshape(-1),
                                  nbytes, PIECE=PIECE, LANES=LANES, num_warps=1)


class L2Prefetch:
    """An L2 prefetch of some tensors running on a side stream from the point it was started; join() makes the
    current stream wait for it (before the kernel that reads them, so that a captured graph joins its fork)."""

    _streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, tensors: list[torch.Tensor], role: str):
        self.stream = None
        if not tensors or not enabled(tensors[0], role):
            return
        device = tensors[0].device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = self._streams.setdefault(index, torch.cuda.Stream(device))
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            prefetch_to_l2(tensors)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.stream = None
