"""An fp8 (e4m3) KV cache in the Triton kernels: its values widened to f16 as tiles load, encoded as they are
written, on every GPU.

Triton has e4m3 (`tl.float8e4nv`) from compute capability 8.9 (Ada, Hopper) only: on Ampere (A100, A10, RTX 30xx)
a kernel whose pointer or value is e4m3 does not compile. There the kernels get the cache as its bytes
(`kernel_view`: a uint8 view of the same memory) and do the conversions with integer operations, to the same
values:
  - widening (`widen_words`, mode BITS): an e4m3 byte moved under an f16's sign and exponent reads as its value
    times 2^-8 (f16's exponent bias is 8 more than e4m3's), exactly, subnormals included; times 256 it is the value;
  - encoding (`to_cache`, on a uint8 pointer): round to nearest even at e4m3's 3 mantissa bits, saturating at
    +-448, as the native conversion (cvt.rn.satfinite) and kv_write.to_cache_dtype do.
Where Triton has e4m3, `widen_words` converts with `cvt.rn.f16x2.e4m3x2` (PTX) and `to_cache` with Triton's own
conversion; the interpreter (CPU tests) takes either way. COBATCH_SOFT_FP8=1 takes the integer way everywhere
(to test it on a GPU that has the native one). The references are kv_write.to_cache_dtype and torch's e4m3.
"""

from __future__ import annotations

import functools
import os

import torch

from cobatch.kernels.triton_support import interpreting, jit, tl

# KV cache dtypes stored in 8 bits (vLLM's --kv-cache-dtype fp8 = e4m3, no scale): half the bytes to read
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0        # the largest finite e4m3fn
_FP8_MAX = tl.constexpr(FP8_MAX)

# widen_words' modes: Triton's e4m3 byte by byte (the interpreter), the PTX conversion a word at a time (sm_89+),
# integer bit moves (any GPU; the only one on a uint8 view)
BYTES, PTX, BITS = 1, 2, 3


@functools.cache
def _native_on(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def native(device: torch.device) -> bool:
    """Do the kernels on this device take e4m3 tensors as they are (Triton's float8e4nv)? The interpreter does;
    a GPU from compute capability 8.9. COBATCH_SOFT_FP8=1: no, anywhere."""
    if os.environ.get("COBATCH_SOFT_FP8") == "1":
        return False
    if interpreting() or device.type != "cuda":
        return True
    return _native_on(device.index if device.index is not None else torch.cuda.current_device())


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a kernel takes it: an e4m3 cache as its bytes where the kernels have no e4m3 type."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES and not native(cache.device) else cache


def words_mode(cache: torch.Tensor, width: int, enabled: bool) -> int:
    """The kernels' FP8_WORDS for rows of `width` values of this cache: 0 (not an fp8 cache, or the words not
    enabled: loaded as e4m3 bytes), else a widen_words mode. Without native e4m3 the words are the only way,
    so the rows must be whole words."""
    if cache.dtype not in FP8_DTYPES:
        return 0
    if not native(cache.device):
        if width % 4:
            raise ValueError(f"an fp8 cache on this GPU needs rows of whole 32-bit words ({width} values)")
        return BITS
    if not enabled or width % 4:
        return 0
    return BYTES if interpreting() else PTX


# cvt.rn.f16x2.e4m3x2 widens two e4m3 bytes (the low one into the low half): four bytes of a word, in order.
_ASM_E4M3_WORD = tl.constexpr("{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
                               "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")


@jit
def _e4m3_byte(w, shift: tl.constexpr):
    return ((w >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@jit
def _e4m3_byte_bits(w, shift: tl.constexpr):
    """Byte `shift // 8` of words w as f16 by bit moves: its sign to bit 15, its exponent and mantissa to bits
    13..7 (value times 2^-8, exact), then times 256."""
    b = (w >> shift) & 0xFF
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@jit
def widen_words(w, MODE: tl.constexpr):
    """int32 words [N, W] of e4m3 bytes -> f16 [N, 4 W], byte i of word j at column 4 j + i, by MODE (BYTES, PTX
    or BITS: the same values)."""
    if MODE == 2:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(_ASM_E4M3_WORD, "=h,=h,=h,=h,r", [w],
                                                   (tl.float16, tl.float16, tl.float16, tl.float16), True, 1)
    elif MODE == 3:
        b0, b1, b2, b3 = _e4m3_byte_bits(w, 0), _e4m3_byte_bits(w, 8), _e4m3_byte_bits(w, 16), _e4m3_byte_bits(w, 24)
    else:
        b0, b1, b2, b3 = _e4m3_byte(w, 0), _e4m3_byte(w, 8), _e4m3_byte(w, 16), _e4m3_byte(w, 24)
    # join adds a minor dim: (b0 | b2, b1 | b3) then their join puts b0 b1 b2 b3 side by side
    x = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(x, (x.shape[0], x.shape[1] * 4))


@jit
def e4m3_codes(x):
    """float32 values -> their e4m3 bytes (uint8) by integer rounding: to nearest even at 3 mantissa bits,
    saturating at +-448 (NaN is not a cache value). Below 2^-6, the subnormals: the value in units of 2^-9,
    rounded by adding 2^23 (one rounding of an exact sum), 8 carrying into the first normal code. Above, the
    f32 bits rounded at bit 20 carry into the exponent, which is rebased from 127 to 7."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), _FP8_MAX)
    small = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    return (tl.where(a < 0.015625, small, normal) | sign).to(tl.uint8)


@jit
def to_cache(x, ptr):
    """x as the cache at ptr stores it: its dtype, or, on a uint8 view of an fp8 cache, e4m3 bytes."""
    if ptr.dtype.element_ty == tl.uint8:
        return e4m3_codes(x.to(tl.float32))
    return x.to(ptr.dtype.element_ty)
