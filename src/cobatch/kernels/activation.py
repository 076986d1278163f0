"""act(gate) * up on the fused gate|up projection output: SiLU (llama, qwen, phi) or tanh-GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl, triton


ACTIVATIONS = ("silu", "gelu_tanh")


def gated_mul_ref(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """x: [N, 2*I] laid out as gate | up -> act(gate) * up, [N, I]."""
    half = x.shape[-1] // 2
    gate = x[..., :half].float()
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return (gate * x[..., half:].float()).to(x.dtype)


# --- Triton -------------------------------------------------------------------------------------------


@jit
def _gated_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr, GELU: tl.constexpr,
                      PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # launched as a programmatic dependent: let the next kernel launch, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:    # tanh-GELU: 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated_mul_triton(x: torch.Tensor, act: str = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    assert act in ACTIVATIONS, act
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    assert x2.stride(-1) == 1
    out = x.new_empty(*x.shape[:-1], inter) if out is None else out
    out2 = out.view(-1, inter)
    block = 1024
    _gated_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out2, inter, x2.stride(0), out2.stride(0),
                                                                BLOCK=block, GELU=act == "gelu_tanh",
                                                                **pdl_launch(x), num_warps=4)
    return out
