"""The dense path's passes ahead (kernels/dequant_ahead.py): the forward's chain of matmuls, and on CUDA the same
bits as dequantizing each matrix where it is used, whatever order the weights come in."""

from __future__ import annotations

import torch

from cobatch.kernels import dequant_ahead, matmul_plans, packed_weight, quant_gemv
from cobatch.kernels.packed_weight import PackedWeight
from cobatch.models.linear import RowStack

from conftest import requires_cuda
from test_quant_gemv import make_weight


class _Weight:
    rows = 8

    def __init__(self, name: str):
        self.name, self.next_dense = name, None


def test_link_follows_the_forward_order_through_stacks_and_past_dense_tensors():
    qk, v, o, gate_up, down, qkv2 = (_Weight(n) for n in ("qk", "v", "o", "gate_up", "down", "qkv2"))
    dense = torch.zeros(2, 2)              # a CPU model's weight: no planes, no link
    dequant_ahead.link([RowStack([qk, v]), o, dense, gate_up, down, qkv2])
    chain, w = [], qk
    while w is not None:
        chain.append(w.name)
        w = w.next_dense
    assert chain == ["qk", "v", "o", "gate_up", "down", "qkv2"]


def _dense_plan() -> matmul_plans.MatmulPlan:
    """The GEMV up to 16 rows, then dequantize + cuBLAS (no GEMM range)."""
    return matmul_plans.MatmulPlan(quant_gemv.GemvPlan(quant_gemv.GemvConfig()), matmul_plans.DEQUANT_CUBLAS, 16)


@requires_cuda
def test_passes_ahead_give_the_bits_of_dequantizing_in_place(monkeypatch):
    """A chain of four weights of three formats (one of them reached past a GEMV call on the chain, as down is
    past gate|up's GEMM at 512 rows), multiplied in order, twice, then out of order and one weight twice in a
    row: every result equals the one dequantized where it is used, and after each multiply the other matrix
    holds the next dense-path weight."""
    shapes = [("q8_0", 1024, 1024), ("q4_k", 1024, 1024), ("q6_k", 1024, 1024), ("q8_0", 1024, 1024)]
    weights = [PackedWeight.from_quant(make_weight(f, r, c, seed=60 + i, device="cuda"), "cuda", plan=_dense_plan())
               for i, (f, r, c) in enumerate(shapes)]
    for pw in weights:
        packed_weight.reserve_scratch(torch.device("cuda"), pw.plan, pw.planes.rows_pad, pw.rows, pw.cols)
    gemv_only = PackedWeight.from_quant(make_weight("q8_0", 1024, 1024, seed=70, device="cuda"), "cuda",
                                        plan=matmul_plans.MatmulPlan(quant_gemv.GemvPlan(quant_gemv.GemvConfig()),
                                                                     matmul_plans.DEQUANT_CUBLAS, 4096))
    dequant_ahead.link([weights[0], weights[1], gemv_only, weights[2], weights[3]])
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(300, 1024, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    order = [0, 1, 2, 3, 0, 1, 2, 3, 2, 0, 3, 3, 1]

    def run():
        return [weights[i].matmul(xs[k % 3]) for k, i in enumerate(order)]

    monkeypatch.setattr(packed_weight, "DEQUANT_AHEAD", False)
    want = run()
    monkeypatch.setattr(packed_weight, "DEQUANT_AHEAD", True)
    ahead = packed_weight._AHEAD
    got, held = [], []
    for k, i in enumerate(order):
        got.append(weights[i].matmul(xs[k % 3]))
        state = ahead._state(torch.device("cuda"))
        held.append(state.matrices[1 - state.last].holds)
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.isfinite(w).all() and torch.equal(g, w)
    # after weights[1] (its next, the GEMV-only weight, passed over) the other matrix holds weights[2]
    expected = {0: weights[1], 1: weights[2], 2: weights[3]}
    for (k, i), h in zip(enumerate(order), held):
        if i in expected:
            assert h == (id(expected[i]), torch.bfloat16), (k, i)


@requires_cuda
def test_a_capture_dequantizes_in_place(monkeypatch):
    """Inside a CUDA-graph capture the matmul takes the dense scratch, not the side stream, and its replays give
    the eager bits."""
    monkeypatch.setattr(packed_weight, "DEQUANT_AHEAD", True)
    pw = PackedWeight.from_quant(make_weight("q8_0", 512, 1024, seed=80, device="cuda"), "cuda", plan=_dense_plan())
    packed_weight.reserve_scratch(torch.device("cuda"), pw.plan, pw.planes.rows_pad, pw.rows, pw.cols)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    want = pw.matmul(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = pw.matmul(x)
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_not_usable_on_the_cpu():
    assert not dequant_ahead.usable(torch.zeros(2, 2))
