"""The weights decode attention asks into L2 (kernels/l2_ahead.py): which bytes, and that a hint changes no result.

The ranges are checked against the planes' own bytes on the CPU (ranges_ref is what the kernel's `issue` walks);
the kernel itself runs on Hopper only (bulk prefetches), where its output must keep every bit.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cobatch.kernels import l2_ahead
from cobatch.kernels.quant_pack import pack_planes
from cobatch.quant.formats import format_of, random_quantized

from conftest import requires_hopper


def packed(fmt_name: str, rows: int, cols: int, seed: int, device: str = "cpu"):
    """A stand-in for a PackedWeight: fragment-order planes of random blocks."""
    fmt = format_of(fmt_name)
    raw = random_quantized(fmt.ggml_type, rows, cols, torch.Generator().manual_seed(seed))
    return SimpleNamespace(planes=pack_planes(fmt, rows, cols, raw, torch.device(device), fragment=True))


def plane_spans(weight) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in weight.planes.tensors()]


def table_of(whole: list, shared: list) -> torch.Tensor:
    rows = [r for w in whole for r in l2_ahead.plane_rows(w, True)] + \
        [r for w in shared for r in l2_ahead.plane_rows(w, False)]
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_K", "q6_K"])
def test_a_whole_weight_is_asked_for_every_byte_once(fmt_name):
    w = packed(fmt_name, 64, 512, seed=1)
    got = sorted(l2_ahead.ranges_ref(table_of([w], []), whole_on=1, share_256=0))
    covered = []
    for addr, size in got:       # adjacent pieces merged back into spans
        if covered and covered[-1][0] + covered[-1][1] == addr:
            covered[-1] = (covered[-1][0], covered[-1][1] + size)
        else:
            covered.append((addr, size))
    assert covered == sorted(plane_spans(w))
    assert all(addr % 16 == 0 and size % 16 == 0 for addr, size in got)


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_a_shared_weight_is_asked_for_its_first_share_of_each_plane(share):
    w = packed("q8_0", 512, 1024, seed=2)
    got = l2_ahead.ranges_ref(table_of([], [w]), whole_on=1, share_256=round(share * 256))
    for addr, n in plane_spans(w):
        mine = [r for r in got if addr <= r[0] < addr + n]
        want = int(n * share) // 16 * 16
        assert mine[0][0] == addr and sum(size for _, size in mine) == want
        assert all(a + size == b for (a, size), (b, _) in zip(mine, mine[1:]))       # one contiguous prefix
        assert all(size <= l2_ahead.PIECE and size % 16 == 0 for _, size in mine)


def test_switches_off_ask_for_nothing():
    w = packed("q8_0", 16, 512, seed=3)
    table = table_of([w], [w])
    assert l2_ahead.ranges_ref(table, whole_on=0, share_256=0) == []
    assert l2_ahead.share_of(o_whole=False, share=0.0) == (0, 0)
    assert l2_ahead.share_of(o_whole=True, share=2.0) == (1, 256)
    assert l2_ahead.descriptors([w], [w], torch.device("cpu")) is None      # CPU: no kernel to ask


def test_weights_without_fragment_planes_add_no_rows():
    assert l2_ahead.plane_rows(torch.zeros(4, 4), True) == []
    assert l2_ahead.plane_rows(SimpleNamespace(planes=None), True) == []


@requires_hopper
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("lens", [[511], [513] * 16, [1, 4096, 0, 77, 2048, 300, 5, 9000]])
def test_decode_attention_asking_for_the_next_weights_keeps_every_bit(lens, pdl):
    """Eager and replayed in a CUDA graph: o (4096 x 4096 q8_0) whole and gate|up (a 4096 x 4096 q4_K stand-in)
    in part asked into L2 by every program, against no ask."""
    from cobatch.kernels.attention import DecodeConfig, paged_attention_ref, paged_decode_attention
    from kernel_checks import assert_matches, paged_setup
    q, k_cache, v_cache, meta = paged_setup(lens, [1] * len(lens), 32, 8, 128, torch.bfloat16, seed=len(lens),
                                            capacity=9216)
    o, gate_up = packed("q8_0", 4096, 4096, 4, "cuda"), packed("q4_K", 4096, 4096, 5, "cuda")
    table = l2_ahead.descriptors([o], [gate_up], q.device)
    assert table is not None and table.shape[0] >= 4
    cfg, scale = replace(DecodeConfig(), pdl=pdl), 128 ** -0.5
    plain = paged_decode_attention(q, k_cache, v_cache, meta, scale, cfg=cfg)
    ahead = paged_decode_attention(q, k_cache, v_cache, meta, scale, cfg=cfg, l2_next=table)
    assert torch.equal(ahead, plain)
    assert_matches(ahead, paged_attention_ref(q, k_cache, v_cache, meta, scale))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = paged_decode_attention(q, k_cache, v_cache, meta, scale, cfg=cfg, l2_next=table)
    replayed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, plain)
