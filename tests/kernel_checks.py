"""Helpers shared by the kernel tests: the device to run on, NaN-poisoned outputs, per-dtype tolerances."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (rtol, atol) per output dtype: both sides compute in f32 and round once, so bf16/f16 may differ by an ulp.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def poisoned(shape, dtype, device=DEVICE) -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel fails to write makes the comparison fail."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None,
                   equal_nan: bool = False) -> None:
    rtol, atol = TOLERANCE[dtype or ref.dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, equal_nan=equal_nan)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_same_cache(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Cache writes are copies, so bitwise equal on the GPU. The interpreter truncates f32 -> bf16 where the
    GPU and torch round to nearest even, so there it may miss by one bf16 ulp."""
    if got.dtype == torch.float8_e4m3fn:     # compared as floats (assert_close has no fp8); see check_kv_write
        got, ref = got.float(), ref.float()
    if got.is_cuda or got.dtype != torch.bfloat16:
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got, ref, rtol=8e-3, atol=1e-6, equal_nan=True)


def assert_graph_replay_matches(matmul, x: torch.Tensor, out: torch.Tensor, replays: int = 3) -> None:
    """`matmul(x, out=out)` captured once in a CUDA graph, replayed with new x: each replay writes every
    element of `out` (poisoned before) and equals an eager call. Catches host syncs or allocations inside the
    capture and split-K counters that are not re-armed."""
    matmul(x, out=out)                                       # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(x, out=out)
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, matmul(x.clone()))
