"""The L2 prefetch hint (kernels/l2_prefetch.py): its chunk table covers a weight's planes byte for byte, and the
hint runs only where it is asked for. The kernel itself compiles for sm_90 in test_kernels_compile.py; on the GPU,
test_gpu_engine.py checks that decode steps with it give the same tokens as without."""

from __future__ import annotations

import torch

from cobatch import ops
from cobatch.kernels import l2_prefetch


def covered(table: torch.Tensor) -> list[tuple[int, int]]:
    """The table's chunks merged into (start, end) byte ranges."""
    spans: list[tuple[int, int]] = []
    for addr, size in sorted(table.tolist()):
        if spans and spans[-1][1] == addr:
            spans[-1] = (spans[-1][0], addr + size)
        else:
            spans.append((addr, addr + size))
    return spans


def test_chunk_table_covers_each_plane_once_in_aligned_chunks():
    g = torch.Generator().manual_seed(0)
    planes = [torch.randint(0, 255, (37, 512), dtype=torch.uint8, generator=g),     # 18,944 bytes
              torch.randn(37, 8, generator=g).to(torch.float16),                    # 592 bytes
              torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g)]       # 1,000: a ragged end
    table = l2_prefetch.chunk_table(planes, chunk=4096)
    assert table.dtype == torch.int64 and table.shape[1] == 2
    sizes = table[:, 1]
    assert bool((sizes > 0).all()) and bool((sizes <= 4096).all()) and bool((sizes % 16 == 0).all())
    assert bool((table[:, 0] % 16 == 0).all())
    want = sorted((p.data_ptr(), p.data_ptr() + (p.nbytes + 15) // 16 * 16) for p in planes)
    assert covered(table) == want
    assert table.shape[0] == 5 + 1 + 1


def test_prefetch_is_asked_for_only_at_few_rows(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "UPTO_ROWS", 8)
    assert [l2_prefetch.wanted(n) for n in (0, 1, 8, 9, 64)] == [False, True, True, False, False]
    monkeypatch.setattr(l2_prefetch, "UPTO_ROWS", 0)
    assert not l2_prefetch.wanted(1)


def test_prefetch_does_nothing_on_the_cpu(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "UPTO_ROWS", 64)
    issued = []
    monkeypatch.setattr(l2_prefetch, "prefetch", issued.append)

    class Packed:                      # a weight with a chunk table, as PackedWeight holds on CUDA
        l2_chunks = torch.zeros(1, 2, dtype=torch.int64)

    ops.prefetch(Packed(), torch.zeros(4, 8))
    assert issued == []
