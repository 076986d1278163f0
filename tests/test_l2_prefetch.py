"""Weights read into L2 on a side stream before their GEMV (kernels/l2_prefetch.py).

The prefetch writes nothing, so what can go wrong is the plumbing: the side stream's fork and join (in eager
steps and inside a captured decode graph), tensors it must leave alone, and the switch. On the CPU it is a
no-op; the kernel itself is compiled for sm_90 in test_kernels_compile.py and run here on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from cobatch import ops
from cobatch.kernels import l2_prefetch
from conftest import requires_cuda


def test_cpu_weights_are_not_prefetched(monkeypatch):
    monkeypatch.setenv("COBATCH_L2_PREFETCH", "o,qkv")
    ahead = ops.prefetch_weight(torch.randn(8, 8), 1, "o")
    assert ahead.stream is None
    ahead.join()                          # a no-op, and may be called again
    ahead.join()


def test_the_switch_names_the_weights(monkeypatch):
    monkeypatch.delenv("COBATCH_L2_PREFETCH", raising=False)
    assert l2_prefetch.roles() == {"o"}
    monkeypatch.setenv("COBATCH_L2_PREFETCH", "o,qkv")
    assert l2_prefetch.roles() == {"o", "qkv"}
    monkeypatch.setenv("COBATCH_L2_PREFETCH", "0")
    assert l2_prefetch.roles() == set()


@requires_cuda
@pytest.mark.parametrize("nbytes", [16, 1000, 16384 * 32 + 48, 9 << 20])
def test_prefetch_leaves_the_bytes_alone(nbytes):
    g = torch.Generator(device="cuda").manual_seed(nbytes)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    before = t.clone()
    l2_prefetch.prefetch_to_l2([t, t.view(-1)[16:], t.view(-1)[1:]])     # aligned, aligned view, unaligned
    torch.cuda.synchronize()
    assert torch.equal(t, before)


@requires_cuda
def test_gemv_after_a_prefetch_in_a_captured_graph(monkeypatch):
    """Fork (prefetch on the side stream) and join inside a CUDA graph, around other work: replays give the
    GEMV's bits without the prefetch."""
    from cobatch.kernels.quant_matmul import PackedWeight
    from test_quant_gemv import make_weight
    monkeypatch.setenv("COBATCH_L2_PREFETCH", "o")
    w = PackedWeight.from_quant(make_weight("q4_k", 4096, 4096, seed=5), "cuda", torch.bfloat16)
    assert w.narrow_planes(1) and not w.narrow_planes(10 ** 6)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(6))
    want = w.matmul(x)
    y = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        ahead = ops.prefetch_weight(w, 1, "o")
        assert ahead.stream is not None
        torch.mul(x, 2.0, out=y)           # what attention would be doing meanwhile
        ahead.join()
        return w.matmul(y * 0.5)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
