"""Helpers shared by the kernel tests: the device to run on, NaN-poisoned outputs, per-dtype tolerances."""

from __future__ import annotations

import torch

from cobatch.batch import AttentionMetadata

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


def paged_setup(seq_lens: list[int], q_lens: list[int], n_q: int, n_kv: int, head_dim: int, dtype,
                seed: int, block_size: int = 16, capacity: int | None = None, kv_dtype=None):
    """Random q, random caches (in kv_dtype, default dtype), and each sequence's blocks scattered over the pool
    in random order. The chunk's own K/V count as already written (the caches are random everywhere)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    capacity = capacity or max(max(seq_lens), 1)
    block_tables = torch.zeros(len(seq_lens), (capacity + block_size - 1) // block_size, dtype=torch.int32)
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    shape = (num_blocks, block_size, n_kv, head_dim)
    k_cache = torch.randn(shape, generator=g).to(DEVICE, kv_dtype or dtype)
    v_cache = torch.randn(shape, generator=g).to(DEVICE, kv_dtype or dtype)
    n_rows = sum(q_lens)
    q = torch.randn(n_rows, n_q, head_dim, generator=g).to(DEVICE, dtype)
    query_start = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n_rows,), -1, dtype=torch.int64, device=DEVICE),
        query_start=query_start.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE), max_query_len=max(q_lens), max_seq_len=capacity)
    return q, k_cache, v_cache, meta
