"""act(gate) * up on the fused gate|up projection output: SiLU (llama, qwen, phi) or tanh-GELU (Gemma).

Two layouts of the gate|up output: all gate columns then all up columns (the CPU path, and weights the
Gluon GEMV does not read), or interleaved GATE_UP_GROUP by GATE_UP_GROUP (gate 0..7, up 0..7, gate 8..15, ...).
The second is how fragment-order gate|up weights are packed on CUDA: the GEMV's accumulator gives a lane
rows g and g + 8 of each 16-row tile, so with that row order a lane holds a gate value and its up value and
the GEMV applies act * mul in its epilogue (quant_gemv, ACT). Steps it does not serve (prefill through
cuBLAS) get the interleaved output, which gated_mul reads with interleaved=True.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl, triton


ACTIVATIONS = ("silu", "gelu_tanh")
GATE_UP_GROUP = 8      # rows of gate, then of up, in the interleaved layout (half an mma row tile)


def gate_and_up(x: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gate|up output [..., 2*I] (views), in either layout."""
    if not interleaved:
        half = x.shape[-1] // 2
        return x[..., :half], x[..., half:]
    g = x.unflatten(-1, (-1, 2, GATE_UP_GROUP))
    return g[..., 0, :].flatten(-2), g[..., 1, :].flatten(-2)


def gated_mul_ref(x: torch.Tensor, act: str = "silu", interleaved: bool = False) -> torch.Tensor:
    """x: [N, 2*I] laid out as gate | up (or interleaved, see above) -> act(gate) * up, [N, I]."""
    gate, up = gate_and_up(x, interleaved)
    gate = gate.float()
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return (gate * up.float()).to(x.dtype)


# --- Triton -------------------------------------------------------------------------------------------


@jit
def _gated_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr, GELU: tl.constexpr,
                      INTERLEAVED: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # launched as a programmatic dependent: let the next kernel launch, wait for the previous one
        gdc_launch_dependents()
        gdc_wait()
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    if INTERLEAVED:
        gate_cols = (cols // 8) * 16 + cols % 8       # GATE_UP_GROUP = 8
        up_cols = gate_cols + 8
    else:
        gate_cols = cols
        up_cols = inter + cols
    gate = tl.load(x_ptr + row * x_stride + gate_cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + up_cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:    # tanh-GELU: 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated_mul_triton(x: torch.Tensor, act: str = "silu", out: torch.Tensor | None = None,
                     interleaved: bool = False) -> torch.Tensor:
    assert act in ACTIVATIONS, act
    assert not interleaved or x.shape[-1] % (2 * GATE_UP_GROUP) == 0
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    assert x2.stride(-1) == 1
    out = x.new_empty(*x.shape[:-1], inter) if out is None else out
    out2 = out.view(-1, inter)
    block = 1024
    _gated_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out2, inter, x2.stride(0), out2.stride(0),
                                                                BLOCK=block, GELU=act == "gelu_tanh",
                                                                INTERLEAVED=interleaved, **pdl_launch(x),
                                                                num_warps=4)
    return out
