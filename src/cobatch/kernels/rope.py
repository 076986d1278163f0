"""Rotary position embedding with one position per row (rows of a batch sit at unrelated positions).

Two layouts: NORM rotates adjacent pairs (x[2i], x[2i+1]) -- llama-arch GGUFs store Q/K permuted for it;
NEOX rotates halves (x[i], x[i + rot/2]) -- qwen2/qwen3. Only the first rot_dim dims of a head rotate.
"""

from __future__ import annotations

import math

import torch


def rope_cos_sin(rot_dim: int, max_pos: int, theta: float, freq_factors: torch.Tensor | None = None,
                 linear_factor: float = 1.0) -> torch.Tensor:
    """float32 [max_pos, rot_dim]: cos in [:, :rot_dim/2], sin in [:, rot_dim/2:]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    if freq_factors is not None:        # llama3-style scaling ships as per-frequency divisors
        inv_freq = inv_freq / freq_factors.double()
    pos = torch.arange(max_pos, dtype=torch.float64) / linear_factor
    angles = torch.outer(pos, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def llama3_freq_factors(rot_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> torch.Tensor:
    """The divisors llama3 rope scaling applies to each frequency (as HF / llama.cpp compute them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float64)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
             neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [N, Hq, D], k: [N, Hk, D], positions: int [N] -> rotated (q, k), same dtypes."""
    rot = cos_sin.shape[1]
    half = rot // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rot].float()
        x1, x2 = (xr[..., :half], xr[..., half:]) if neox else (xr[..., 0::2], xr[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat([o1, o2], -1) if neox else torch.stack([o1, o2], -1).flatten(-2)
        return torch.cat([out.to(x.dtype), x[..., rot:]], -1)

    return rotate(q), rotate(k)
