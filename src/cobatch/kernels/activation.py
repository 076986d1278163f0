"""SiLU(gate) * up on the fused gate|up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2*I] laid out as gate | up -> [N, I]."""
    half = x.shape[-1] // 2
    return (F.silu(x[..., :half].float()) * x[..., half:].float()).to(x.dtype)
