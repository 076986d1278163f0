"""Triton is optional: the CPU path runs on the torch references alone.

Kernel modules decorate with `jit` and use `tl` inside kernel bodies only, so they import cleanly without
Triton (the bodies are never run then). `from __future__ import annotations` in those modules keeps
`tl.constexpr` annotations from being evaluated at import.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    jit = triton.jit
except ImportError:  # pragma: no cover - exercised only where triton is not installed
    triton = tl = None

    def jit(fn):
        return fn

try:  # programmatic dependent launch (Hopper+): only called under a USE_PDL constexpr, never interpreted
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU test path)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array) on a 1-element 1-d array,
    which numpy >= 2.4 refuses; every loop with a run-time bound (range(start, end)) then fails. Index
    through .item() instead. Touches only the interpreter's patching of tl.tensor."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_cobatch_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    patched._cobatch_fixed = True
    interpreter._patch_lang_tensor = patched


if triton is not None:
    _fix_interpreter_scalar_index()


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Upcast dot operands to f32? The interpreter's bf16 tl.dot returns garbage (triton 3.6, numpy has no
    bf16), and an f32 KV cache needs IEEE f32 dots rather than tf32 to match the reference."""
    return interpreting() or dtype == torch.float32


@functools.cache
def _pdl_on_device(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _pdl_supported(t: torch.Tensor) -> bool:
    """May kernels on t's device be launched as programmatic dependents (Hopper and later)?
    COBATCH_PDL=0 turns it off everywhere (to measure without it, or to rule it out)."""
    if not t.is_cuda or interpreting() or os.environ.get("COBATCH_PDL") == "0":
        return False
    return _pdl_on_device(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch arguments for a kernel with a `PDL` constexpr. When true, the kernel calls gdc_wait before it
    touches any tensor another kernel writes, and gdc_launch_dependents where the next kernel may start
    (not before its main loop if it is long: a chain would get resident all at once).

    Programmatic dependent launch lets a kernel's CTAs start while the previous kernel finishes: launch
    latency and prologues overlap the predecessor's tail. Correctness rests on the wait: it returns once the
    previous kernel has completed and its writes are visible, and since that kernel waited for its own
    predecessor, for everything before it too."""
    pdl = _pdl_supported(t)
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    """Multiprocessors of t's device; a small fixed number under the interpreter (keeps CPU tests fast)."""
    if not t.is_cuda:
        return 4
    return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@jit
def split_k_total(part, partial_ptr, count_ptr, tile, split, offs, SPLITS: tl.constexpr, TILE: tl.constexpr):
    """Deterministic split-K (no float atomics): each of a tile's SPLITS programs stores its partial `part` (TILE
    values, at offs); the last to arrive sums them in split order, so a result's bits do not depend on the timing,
    and re-arms the tile's counter for the next launch (CUDA-graph replays start from 0). Returns (whether this
    program is that last one, the sum: meaningful only there)."""
    tl.store(partial_ptr + (tile * SPLITS + split) * TILE + offs, part)
    tl.debug_barrier()                  # all threads' partial stores precede the release below
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLITS - 1
    total = tl.zeros_like(part)
    if last:
        for s in range(SPLITS):
            total += tl.load(partial_ptr + (tile * SPLITS + s) * TILE + offs, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last, total
