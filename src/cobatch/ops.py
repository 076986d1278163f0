"""One entry per model operation: the Triton kernel on CUDA, the torch reference on the CPU.

The model code calls only these, so it is the same on both devices. Set COBATCH_TORCH_OPS=1 to force
the torch references on CUDA too (a debugging aid: the GPU path must agree with them).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from cobatch.batch import AttentionMetadata
from cobatch.kernels.activation import silu_mul_ref
from cobatch.kernels.attention import paged_attention_ref
from cobatch.kernels.kv_write import kv_write_ref
from cobatch.kernels.norm import rms_norm_ref
from cobatch.kernels.rope import rope_ref

_FORCE_TORCH = os.environ.get("COBATCH_TORCH_OPS") == "1"


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda and not _FORCE_TORCH


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_ref(x, weight, eps, residual)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
         neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_ref(q, k, positions, cos_sin, neox)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    kv_write_ref(k, v, k_cache, v_cache, slot_mapping)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float) -> torch.Tensor:
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_mul_ref(x)


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """weight: a dense tensor [N, K] (CPU path, float weights) or a packed quantized weight (GPU)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight.to(x.dtype) if weight.dtype != x.dtype else weight)
    return weight.matmul(x)
