"""The LoRA shrink and expand kernels (kernels/lora.py) against their torch reference and a plain float product,
on the CPU through the interpreter (tiny shapes) and on CUDA."""

from __future__ import annotations

import pytest
import torch

from cobatch.kernels.lora import lora_add_triton, lora_delta_ref, reserve_scratch
from conftest import requires_cuda

# parts x capacity x rank = 2 x 3 x 16 = 96 slot columns (two shrink column blocks); 1100 inputs: three K splits
PARTS, CAPACITY, RANK, IN, OUT = 2, 3, 16, 1100, 200
SCALES = torch.tensor([0.0, 2.0, 0.5, 1.5])


def _slots_and_inputs(n: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = PARTS * CAPACITY * RANK
    a = (torch.randn(width, IN, generator=g) * 0.05).bfloat16()
    b = (torch.randn(OUT, width, generator=g) * 0.05).bfloat16()
    a[:, :].view(PARTS, CAPACITY, RANK, IN)[:, 2, 12:] = 0       # slot 3 of rank 12: its last columns empty
    b.view(OUT, PARTS, CAPACITY, RANK)[:, :, 2, 12:] = 0
    x = torch.randn(n, IN, generator=g).bfloat16()
    slots = torch.tensor([(i * 7 + seed + 1) % (CAPACITY + 1) for i in range(n)])
    return (t.to(device) for t in (x, a, b, slots, SCALES))


def _plain_delta(x, a, b, slots, scales) -> torch.Tensor:
    """Each row through its own slot, written out per row in float64: nothing shared with the kernels."""
    out = torch.zeros(x.shape[0], b.shape[0], dtype=torch.float64)
    for r, s in enumerate(slots.tolist()):
        if s == 0:
            continue
        cols = [p * CAPACITY * RANK + (s - 1) * RANK + j for p in range(PARTS) for j in range(RANK)]
        u = a.double()[cols] @ x[r].double() * float(scales[s])
        out[r] = b.double()[:, cols] @ u
    return out


@pytest.mark.parametrize("n", [1, 6, 37])
def test_reference_is_each_row_through_its_own_adapter(n):
    x, a, b, slots, scales = _slots_and_inputs(n, "cpu")
    want = _plain_delta(x, a, b, slots, scales)
    got = lora_delta_ref(x, a, b, slots, scales, CAPACITY, RANK).double()
    assert (got - want).norm() / want.norm() < 1e-2            # the intermediate rounded to bf16
    assert got[slots == 0].eq(0).all()


def _check_kernels(device: str, n: int):
    x, a, b, slots, scales = _slots_and_inputs(n, device, seed=n)
    reserve_scratch(torch.device(device), 64, a.shape[0], IN)
    # into float32 zeros: the delta itself, unrounded
    got = lora_add_triton(x, a, b, torch.zeros(n, OUT, device=device), slots, scales, CAPACITY, RANK)
    want = lora_delta_ref(x, a, b, slots, scales, CAPACITY, RANK)
    plain = _plain_delta(x.cpu(), a.cpu(), b.cpu(), slots.cpu(), scales.cpu())
    assert (got.cpu().double() - plain).norm() / plain.norm() < 1e-2
    assert (got - want).norm() / want.norm() < 1e-2
    # into bf16 rows: base rows untouched bit for bit (negative zeros too), the others rounded once (nearest even)
    y0 = torch.randn(n, OUT, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    y0[:, :5] = -0.0
    y = lora_add_triton(x, a, b, y0.clone(), slots, scales, CAPACITY, RANK)
    base = slots == 0
    assert base.any() or n == 1
    assert torch.equal(y[base].view(torch.int16), y0[base].view(torch.int16))
    rounded = (y0[~base].float() + got[~base]).bfloat16()
    if device == "cuda":
        assert torch.equal(y[~base], rounded)
    else:       # the interpreter rounds float32 to bf16 toward zero: within one bf16 step
        assert torch.allclose(y[~base].float(), rounded.float(), rtol=2 ** -7, atol=0)
    # batch invariant: each row as in a step of its own
    for r in (0, n - 1):
        alone = lora_add_triton(x[r:r + 1], a, b, torch.zeros(1, OUT, device=device), slots[r:r + 1], scales,
                                CAPACITY, RANK)
        assert torch.equal(alone[0], got[r]), r


@pytest.mark.parametrize("n", [5, 37])
def test_kernels_match_the_reference_and_leave_base_rows_alone(n):
    _check_kernels("cuda" if torch.cuda.is_available() else "cpu", n)


@requires_cuda
@pytest.mark.parametrize("n", [1, 16, 64, 200])
def test_gpu_kernels_match_the_reference_and_leave_base_rows_alone(n):
    _check_kernels("cuda", n)


@requires_cuda
def test_gpu_kernels_replay_in_a_cuda_graph_with_new_slots():
    x, a, b, slots, scales = _slots_and_inputs(24, "cuda")
    reserve_scratch(torch.device("cuda"), 64, a.shape[0], IN)
    y = torch.zeros(24, OUT, device="cuda")
    lora_add_triton(x, a, b, y, slots, scales, CAPACITY, RANK)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.zero_()
        lora_add_triton(x, a, b, y, slots, scales, CAPACITY, RANK)
    for shift in range(3):          # new slots each replay: the graph reads them from the device
        slots.copy_(slots.roll(1))
        graph.replay()
        want = lora_delta_ref(x, a, b, slots, scales, CAPACITY, RANK)
        assert (y - want).norm() / want.norm() < 1e-2, shift
