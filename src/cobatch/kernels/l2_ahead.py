"""The weights read after decode attention, asked into L2 while it runs (behind COBATCH_L2_AHEAD_ROWS: off).

At a few rows a layer's attention reads a few MB of cache, so HBM idles under it while the matrices after it, o and
gate|up, each read tens of MB. Here the attention programs ask L2 for o's planes whole and for a share of gate|up's
with bulk prefetches (`cp.async.bulk.prefetch.L2`: no register, no wait, no launch of their own), each program a
slice of the ranges, so those bytes stream while attention runs instead of after it.

gate|up's share is its first tiles (SHARE of each plane's bytes from the start): the GEMV's CTAs are dealt out in
tile order, so those are the bytes it reads first, and one bulk prefetch covers PIECE contiguous bytes (one range a
K quarter of every tile, 14 thousand prefetches for q8_0's gate|up, was slower: docs/kernels.md).

A plane is described by one row (address, tiles, bytes a tile, whole); the kernel derives the ranges from it
(`issue`, mirrored by `ranges_ref`), so SHARE may change between captures. A prefetch is a hint: no result depends
on it.
"""

from __future__ import annotations

import functools
import os

import torch

from cobatch.kernels.triton_support import jit, tl

# Decode steps of at most ROWS rows prefetch (0: none). SHARE: of gate|up's bytes; O_WHOLE: o's planes whole.
ROWS = int(os.environ.get("COBATCH_L2_AHEAD_ROWS", "0"))
SHARE = float(os.environ.get("COBATCH_L2_AHEAD_SHARE", "0.25"))
O_WHOLE = os.environ.get("COBATCH_L2_AHEAD_O", "1") != "0"

PIECE = 64 * 1024     # bytes a bulk prefetch (its size field holds up to 1 MB); piece i from program i % programs
BLOCK = 128           # ranges a program issues at once (one a thread)
ALIGN = 16            # a bulk copy's address and size unit


def plane_rows(weight, whole: bool) -> list[tuple[int, int, int, int]]:
    """(address, tiles, bytes a tile, whole) of each fragment-order plane of a packed weight; none for a weight
    without them (dense, CPU planes, a stack of parts)."""
    planes = getattr(weight, "planes", None)
    if planes is None or not planes.fragment:
        return []
    rows = []
    for t in planes.tensors():
        tile_bytes = t.stride(0) * t.element_size()
        if t.shape[0] == 0 or tile_bytes % ALIGN or t.data_ptr() % ALIGN or not t.is_contiguous():
            continue                     # not whole 16-byte units: left to HBM
        rows.append((t.data_ptr(), t.shape[0], tile_bytes, int(whole)))
    return rows


def descriptors(whole: list, shared: list, device: torch.device) -> torch.Tensor | None:
    """The int64 [planes, 4] table a layer's attention reads: `whole` weights' planes entire, `shared` weights'
    first SHARE of their bytes (the share is applied at launch). None where no plane qualifies or off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    rows = [r for w in whole for r in plane_rows(w, True)] + [r for w in shared for r in plane_rows(w, False)]
    return torch.tensor(rows, dtype=torch.int64, device=device) if rows else None


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def runs_on(t: torch.Tensor) -> bool:
    """Can the kernels beside `t` issue bulk prefetches (sm_90 and later)?"""
    return t.is_cuda and _hopper(t.device.index if t.device.index is not None else torch.cuda.current_device())


def share_of(o_whole: bool | None = None, share: float | None = None) -> tuple[int, int]:
    """The launch's (whole weights on, gate|up's share in 1/256ths) from the switches."""
    o_whole = O_WHOLE if o_whole is None else o_whole
    share = SHARE if share is None else share
    return int(bool(o_whole)), max(0, min(256, round(share * 256)))


def ranges_ref(table: torch.Tensor, whole_on: int, share_256: int) -> list[tuple[int, int]]:
    """(address, bytes) of every prefetch `issue` makes from `table`: its torch-free mirror, for the tests."""
    out = []
    for addr, tiles, tile_bytes, whole in table.tolist():
        total = tiles * tile_bytes * whole_on if whole else tiles * tile_bytes * share_256 // 256 // ALIGN * ALIGN
        out += [(addr + at, min(PIECE, total - at)) for at in range(0, total, PIECE)]
    return out


def _c(v):
    return tl.constexpr(v) if tl is not None else v


# One bulk prefetch a lane, none where its size is 0.
_ASM_BULK_PREFETCH = _c("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                        "mov.u32 $0, 0; }")
_PIECE, _BLOCK = _c(PIECE), _c(BLOCK)


@jit
def issue(table_ptr, n_planes, whole_on, share_256, program, programs):
    """Program `program` of `programs` asks L2 for its slice of every plane's ranges (ranges_ref's)."""
    lane = tl.arange(0, _BLOCK)
    for p in range(0, n_planes):
        addr = tl.load(table_ptr + 4 * p)
        tiles = tl.load(table_ptr + 4 * p + 1)
        tile_bytes = tl.load(table_ptr + 4 * p + 2)
        whole = tl.load(table_ptr + 4 * p + 3)
        total = tl.where(whole != 0, tiles * tile_bytes * whole_on, tiles * tile_bytes * share_256 // 256 // 16 * 16)
        n = tl.cdiv(total, _PIECE)
        for i0 in range(0, n, programs * _BLOCK):
            i = i0 + program + lane * programs
            at = i.to(tl.int64) * _PIECE
            size = tl.where(i < n, tl.minimum(total - at, _PIECE), 0).to(tl.int32)
            at += addr
            tl.inline_asm_elementwise(_ASM_BULK_PREFETCH, "=r,l,r", [at, size], dtype=tl.int32, is_pure=False,
                                      pack=1)
