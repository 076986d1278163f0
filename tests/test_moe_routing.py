"""Routing MoE rows on the device (kernels/moe_routing.py) and the routed GEMV and GEMM over stacked experts
(kernels/packed_experts.py, quant_gemv and quant_gemm ROUTED).

The slots are checked against a plain-Python grouping of the pairs; the combine kernel against its torch
reference (CPU, interpreter); the routed GEMV and GEMM, on CUDA, bitwise against each expert's own GEMV or
GEMM on its rows.
"""

from __future__ import annotations

import pytest
import torch

from cobatch.kernels.moe_routing import RouterRule, combine_ref, combine_triton, expert_slots, slot_bound
from cobatch.kernels.quant_gemm import GemmConfig
from cobatch.quant.weight import QuantWeight

from conftest import requires_cuda
from test_quant_gemv import make_weight


def random_routing(n_rows: int, n_experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n_rows)])
    return ids, torch.rand(n_rows, k, generator=g)


@pytest.mark.parametrize("n_rows, n_experts, k, size", [(1, 8, 2, None), (5, 8, 3, None), (6, 4, 2, None),
                                                       (40, 16, 4, None), (3, 64, 8, None), (64, 8, 2, None),
                                                       (64, 8, 2, 32), (300, 16, 3, 64)])
def test_slots_group_the_pairs_by_expert(n_rows, n_experts, k, size):
    ids, weights = random_routing(n_rows, n_experts, k, seed=n_rows * 100 + n_experts)
    s = expert_slots(ids, weights, n_experts, size)
    # The grouping, written plainly: for each expert that got rows, ascending, its rows ascending, cut into
    # slots of the size asked for, else of the GEMV's token tile.
    size = size or (8 if n_rows <= 8 else 16)
    used = sorted({int(e) for e in ids.flatten()})
    runs = {e: [r for r in range(n_rows) if e in ids[r].tolist()] for e in used}
    pieces = [(e, runs[e][i:i + size]) for e in used for i in range(0, len(runs[e]), size)]
    assert s.slot_size == size and len(pieces) <= s.n_slots == slot_bound(n_rows, k, n_experts, size)
    assert s.slot_expert[:len(pieces)].tolist() == [e for e, _ in pieces]
    assert s.slot_count.tolist() == [len(rows) for _, rows in pieces] + [0] * (s.n_slots - len(pieces))
    pair_rows = s.pair_rows.tolist()
    for slot, (e, rows) in enumerate(pieces):
        start = int(s.slot_start[slot])
        assert pair_rows[start:start + len(rows)] == rows
    # Each row's pairs, in ascending expert id, with the router weight of that expert.
    for r in range(n_rows):
        experts = sorted(ids[r].tolist())
        assert [int(s.slot_expert[_slot_of(s, p)]) for p in s.row_pairs[r].tolist()] == experts
        assert all(pair_rows[p] == r for p in s.row_pairs[r].tolist())
        want = [float(weights[r, ids[r].tolist().index(e)]) for e in experts]
        assert s.row_weights[r].tolist() == pytest.approx(want, abs=0)


def test_slot_bound_covers_the_worst_routing():
    """Every row choosing the same k experts puts N pairs on each: the most slots a step can need."""
    for n_rows, k, n_experts, size in [(1, 8, 128, None), (8, 8, 128, None), (9, 2, 4, None), (64, 8, 128, None),
                                       (256, 8, 128, None), (33, 4, 8, None), (2048, 6, 64, 64), (100, 2, 8, 32)]:
        size_used = size or (8 if n_rows <= 8 else 16)
        worst_same = k * -(-n_rows // size_used)
        assert slot_bound(n_rows, k, n_experts, size) >= worst_same
        ids = torch.stack([torch.arange(k)] * n_rows)
        assert expert_slots(ids, torch.ones(n_rows, k), n_experts, size).slot_count.gt(0).sum() == worst_same


def test_routed_gemm_slots_only_where_asked_and_experts_average_over_16_pairs(monkeypatch):
    """The routed GEMM takes a step (slots of 32 or 64 pairs) only with COBATCH_MOE_GEMM and stacks it can run,
    and only where the step's experts average more pairs than the GEMV's 16-token tile; the size is a function
    of the step's shape, never of its routes."""
    from cobatch.kernels import packed_experts
    from cobatch.kernels.packed_experts import routed_slot_size
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", False)
    assert [routed_slot_size(n, 6, 64, True) for n in (1, 9, 256, 2048)] == [8, 16, 16, 16]
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM", True)
    assert [routed_slot_size(n, 6, 64, False) for n in (1, 2048)] == [8, 16]     # stacks the GEMM cannot run
    # DeepSeek-V2-Lite (6 of 64): 16 pairs an expert up to 170 rows, then the GEMM's tiles; Mixtral (2 of 8)
    assert [routed_slot_size(n, 6, 64, True) for n in (1, 64, 170, 171, 256, 341, 342, 2048)] == \
        [8, 16, 16, 32, 32, 32, 64, 64]
    assert [routed_slot_size(n, 2, 8, True) for n in (8, 64, 65, 128, 129, 4096)] == [8, 16, 32, 32, 64, 64]


def test_routed_gemm_config_is_the_fastest_the_stack_can_run(monkeypatch):
    """A decode step's rows take the ring of one warpgroup, a prefill chunk's the persistent ring of two (the
    order bench/results/moe_experts.json measured); a stack whose rows or K the ring cannot split, or whose ring
    does not fit twice, falls back to the plain kernel; COBATCH_MOE_GEMM_RING=0 keeps to the plain kernel."""
    from types import SimpleNamespace as NS

    from cobatch.kernels import packed_experts, quant_pack
    from cobatch.kernels.packed_experts import ROUTED_CONFIGS, ROUTED_CONFIGS_WIDE, routed_config
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM_RING", True)

    def planes(chunks: int, fmt=quant_pack.Q8_0):
        return NS(qs=torch.empty(0, chunks * 512), fmt_id=fmt)

    v2_lite_down = planes(44)                   # 1408 columns of q8_0: 44 chunks a 16-row tile
    got = routed_config(v2_lite_down, 2048, ROUTED_CONFIGS)
    wide = routed_config(v2_lite_down, 2048, ROUTED_CONFIGS_WIDE)
    assert (got.RING, got.CHUNKS, got.NW, got.PERSIST, got.LAG, got.AHEAD) == (8, 2, 4, 0, True, True)
    assert (wide.RING, wide.NW, wide.PERSIST) == (8, 8, 1)
    assert routed_config(v2_lite_down, 1408 + 64, ROUTED_CONFIGS_WIDE).NW == 4     # not whole 128-row blocks
    assert routed_config(planes(22), 2048, ROUTED_CONFIGS) is None      # 22 chunks: no 4-chunk iterations
    assert routed_config(v2_lite_down, 1408 + 32, ROUTED_CONFIGS) is None       # not whole 64-row blocks
    monkeypatch.setattr(packed_experts, "ROUTED_GEMM_RING", False)
    assert routed_config(v2_lite_down, 2048, ROUTED_CONFIGS) == GemmConfig(NW=8)
    assert routed_config(v2_lite_down, 2048, ROUTED_CONFIGS_WIDE) == GemmConfig(NW=8)


def _slot_of(s, pair: int) -> int:
    starts, counts = s.slot_start.tolist(), s.slot_count.tolist()
    return next(i for i, (a, c) in enumerate(zip(starts, counts)) if a <= pair < a + c)


def test_combine_kernel_matches_reference():
    ids, weights = random_routing(7, 8, 3, seed=3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = expert_slots(ids.to(dev), weights.to(dev), 8)
    y = torch.randn(21, 300, generator=torch.Generator().manual_seed(5)).bfloat16().to(dev)
    want = combine_ref(y, s, torch.float32)
    got = combine_triton(y, s, torch.float32)
    assert torch.equal(got, want)      # the same f32 products added in the same order
    # and the reference is the weighted sum it claims to be
    rows = torch.stack([sum(float(weights[r, j]) * y[_pair(s, r, int(ids[r, j]))].float() for j in range(3))
                        for r in range(7)])
    assert torch.allclose(want, rows, rtol=1e-5, atol=1e-5)


def test_combine_adds_the_shared_experts_output_last():
    """With the shared experts' output (bf16, as their feed-forward returns it) the kernel stores, in the model's
    dtype, the bits the eager path gets: the routed sum in float32, plus the shared output widened, then cast."""
    ids, weights = random_routing(5, 8, 3, seed=6)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = expert_slots(ids.to(dev), weights.to(dev), 8)
    g = torch.Generator().manual_seed(7)
    y = torch.randn(15, 200, generator=g).bfloat16().to(dev)
    shared = torch.randn(5, 200, generator=g).bfloat16().to(dev)
    eager = combine_ref(y, s, torch.float32)
    eager += shared.float()
    want = eager.to(torch.bfloat16)
    assert torch.equal(combine_ref(y, s, torch.bfloat16, shared), want)
    got = combine_triton(y, s, torch.bfloat16, shared)
    if got.is_cuda:
        assert torch.equal(got, want)
    else:     # the interpreter truncates float32 to bf16 where the GPU and torch round: one bf16 ulp at most
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-6)
    assert not torch.allclose(combine_triton(y, s, torch.bfloat16).float(), want.float(), atol=1e-2)   # it counts


def _pair(s, row: int, expert: int) -> int:
    return next(p for p in s.row_pairs[row].tolist() if int(s.slot_expert[_slot_of(s, p)]) == expert)


# --- the routed GEMV and GEMM (CUDA) -------------------------------------------------------------------------

# The routed GEMM's ring kernel: a CTA an item (empty slots skipped, LAG's tail guarded), the warpgroups apart, and
# the persistent grid (empty slots run as any item)
RING_CONFIGS = [GemmConfig(NW=8, RING=4, CHUNKS=2, LAG=True), GemmConfig(NW=8, RING=4, CHUNKS=2, LAG=True, APART=True),
                GemmConfig(NW=8, RING=8, CHUNKS=2, LAG=True, AHEAD=True, PERSIST=1),
                GemmConfig(NW=4, RING=8, CHUNKS=2, LAG=True, AHEAD=True)]
ROUTED_CASES = ([(fmt, n_rows, None, None) for fmt in ("q8_0", "q4_0", "q4_k", "q6_k") for n_rows in (1, 3, 8, 13, 40)]
                + [(fmt, n_rows, size, None) for fmt in ("q8_0", "q4_k", "q6_k", "q5_0", "nvfp4")
                   for n_rows, size in ((40, 32), (100, 64), (300, 64))]
                + [(fmt, 300, size, ring) for fmt in ("q8_0", "q4_k", "nvfp4") for size in (64, 128)
                   for ring in RING_CONFIGS])


@requires_cuda
@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k", "q6_k", "nvfp4"])
def test_routed_gemv_in_the_leaner_loops_gives_the_bits_of_the_plain_one(fmt_name, monkeypatch):
    """quant_gemv.GEMV_CLAMP_X and GEMV_FOLD_STEPS in the routed GEMV: a slot's token columns past its pairs read
    its last pair's x, never another slot's (nor a row before the first); every pair keeps its bits."""
    from cobatch.kernels import quant_gemv
    from cobatch.kernels.packed_experts import PackedExperts
    n_experts, k, rows, cols = 12, 3, 256, 512
    experts = PackedExperts.from_quant(make_weight(fmt_name, n_experts * rows, cols, seed=7), n_experts,
                                       torch.device("cuda"), gate_up_interleaved=True)
    for n_rows in (1, 3, 13):
        ids, weights = random_routing(n_rows, n_experts, k, seed=n_rows)
        s = expert_slots(ids.cuda(), weights.cuda(), n_experts, None)
        xp = torch.randn(n_rows, cols, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()[s.pair_rows]
        plain_and_lean = []
        for on in (False, True):
            monkeypatch.setattr(quant_gemv, "GEMV_CLAMP_X", on)
            monkeypatch.setattr(quant_gemv, "GEMV_FOLD_STEPS", on)
            plain_and_lean.append(experts.routed_matmul(xp, s, act="silu"))
        assert torch.equal(*plain_and_lean), n_rows


@requires_cuda
@pytest.mark.parametrize("fmt_name, n_rows, size, ring", ROUTED_CASES)
def test_routed_kernels_equal_each_experts_own(fmt_name, n_rows, size, ring):
    """The routed GEMV (slots of its token tile: size None) and the routed GEMM (slots of 32 to 128 pairs; the
    plain kernel, or the ring kernel in config `ring`): each pair's row bitwise what its expert's own GEMV or GEMM
    gives it with the same config (a GEMM row's bits do not depend on the token tile), with the act*mul epilogue
    (gate|up experts packed interleaved) and without; the GEMM's empty slots store nothing; one expert against the
    float reference on its GGUF bytes."""
    from cobatch.kernels.packed_experts import PackedExperts
    n_experts, k, rows, cols = 12, 3, 256, 512
    stacked = make_weight(fmt_name, n_experts * rows, cols, seed=7)
    experts = PackedExperts.from_quant(stacked, n_experts, torch.device("cuda"), gate_up_interleaved=True)
    assert experts is not None
    if ring is not None:
        experts.routed_gemm = ring
    config = experts.routed_plan if size is None else experts.routed_gemm
    assert config is not None
    ids, weights = random_routing(n_rows, n_experts, k, seed=n_rows)
    s = expert_slots(ids.cuda(), weights.cuda(), n_experts, size)
    if size:
        assert s.slot_size == size and int(s.slot_count.eq(0).sum()) > 0      # empty slots past the used ones
    x = torch.randn(n_rows, cols, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    xp = x[s.pair_rows]
    for act in ("silu", None):
        got = experts.routed_matmul(xp, s, act=act)
        want = torch.full_like(got, float("nan"))
        for slot in range(s.n_slots):
            start, count, e = (int(v[slot]) for v in (s.slot_start, s.slot_count, s.slot_expert))
            if count:
                want[start:start + count] = experts.experts[e].matmul(xp[start:start + count], config=config, act=act)
        assert not want.isnan().any()
        assert torch.equal(got, want), act
    e, count = int(s.slot_expert[0]), int(s.slot_count[0])
    own = slice(e * rows, (e + 1) * rows)
    ref = xp[:count].float() @ QuantWeight(stacked.fmt, rows, cols, stacked.raw[own], None if stacked.row_scale is None
                                           else stacked.row_scale[own]).dequantize().cuda().T
    assert ((got[:count].float() - ref).norm() / ref.norm()).item() < 1e-2


@requires_cuda
@pytest.mark.parametrize("n_rows, size", [(4, None), (40, 32)])
def test_routed_kernels_replay_in_a_cuda_graph_with_new_routes(n_rows, size):
    """The routed GEMV (slots of the GEMV's token tile) and the routed GEMM (32-pair slots)."""
    from cobatch.kernels.packed_experts import PackedExperts
    n_experts, k, rows, cols = 8, 2, 128, 256
    experts = PackedExperts.from_quant(make_weight("q8_0", n_experts * rows, cols, seed=3), n_experts,
                                       torch.device("cuda"))
    experts.reserve_routed(n_rows * k)   # as a model does at load: a capture must not grow the GEMM's x scratch
    x = torch.randn(n_rows, cols, generator=torch.Generator().manual_seed(2)).bfloat16().cuda()
    ids = torch.zeros(n_rows, k, dtype=torch.int64, device="cuda")
    weights = torch.ones(n_rows, k, device="cuda")

    def step():
        s = expert_slots(ids, weights, n_experts, size)
        return experts.routed_matmul(x[s.pair_rows], s), s

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, slots = step()
    for seed in range(3):       # new routes each replay: the graph reads them from the device
        new_ids, _ = random_routing(n_rows, n_experts, k, seed=seed)
        ids.copy_(new_ids)
        graph.replay()
        want, want_slots = step()
        assert torch.equal(slots.pair_rows, want_slots.pair_rows)
        assert torch.equal(out, want)


ROUTES = {   # Qwen-MoE / Mixtral rules, and DeepSeek's (V2: softmax, groups of 20; V3: sigmoid, a bias, 8 groups)
    "softmax-normalized": (8, RouterRule(2, True), 300), "softmax": (60, RouterRule(4, False), 300),
    "softmax-128": (128, RouterRule(8, True), 300),
    "long-rows": (8, RouterRule(2, False), 4096 + 300),      # d > one load: the K loop
    "v2-groups": (160, RouterRule(6, True, "softmax", 8, 3, 16.0, 1e-20), 320),
    "v3-biased": (256, RouterRule(8, True, "sigmoid", 8, 4, 2.5, 1e-20), 320),
    "sigmoid-groups-of-one": (8, RouterRule(3, False, "sigmoid", 8, 5, 1.5), 64),
}


@pytest.mark.parametrize("name", list(ROUTES))
def test_route_kernels_match_reference_and_ignore_the_batch(name):
    from cobatch.kernels.moe_routing import ROUTER_BLOCK_K, route_ref, route_triton
    n_experts, rule, d = ROUTES[name]
    assert d < ROUTER_BLOCK_K or d % ROUTER_BLOCK_K      # a partial block is masked
    g = torch.Generator().manual_seed(n_experts + d)
    router = torch.randn(n_experts, d, generator=g) * 0.2
    h = torch.randn(9, d, generator=g)
    # V3's bias is large next to its scores' spread, as trained ones are: it changes choices, not weights
    bias = torch.randn(n_experts, generator=g) * 0.5 if name == "v3-biased" else None
    if torch.cuda.is_available():
        router, h = router.cuda(), h.cuda()
        bias = None if bias is None else bias.cuda()
    w, ids = route_triton(h, router, rule, bias)
    w_ref, ids_ref = route_ref(h, router, rule, bias)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    if rule.normalize:
        assert torch.allclose(w.sum(-1), torch.full((9,), rule.scale, device=w.device), rtol=1e-5)
    if rule.groups:          # each row's experts lie in its groups_used groups
        groups = (ids // (n_experts // rule.groups)).tolist()
        assert all(len(set(row)) <= rule.groups_used for row in groups)
    for r in (0, 4, 8):      # a row alone (first, middle, last) gives the same bits as inside the batch
        w1, ids1 = route_triton(h[r:r + 1], router, rule, bias)
        assert torch.equal(ids1[0], ids[r]) and torch.equal(w1[0], w[r])


def test_route_reference_limits_groups_and_corrects_the_choice_only():
    """choose_ref on hand-made logits: the groups' worths pick the groups (sigmoid: the two best of each), the
    bias moves the choice but the weights stay the scores."""
    from cobatch.kernels.moe_routing import choose_ref
    logits = torch.tensor([[4.0, -4.0, 3.0, 2.9, 0.0, 0.1, -1.0, 3.5]])     # 4 groups of 2
    rule = RouterRule(2, False, "sigmoid", 4, 2)
    # worths: 4 - 4 -> s(4) + s(-4) = 1.0; s(3) + s(2.9) = 1.90; s(0) + s(0.1) = 1.02; s(-1) + s(3.5) = 1.24
    w, ids = choose_ref(logits, rule)
    assert sorted(ids[0].tolist()) == [2, 7]          # groups 1 and 3; 0 (the best expert's) is out
    assert torch.allclose(w[0], torch.sigmoid(logits[0, ids[0]]))
    bias = torch.zeros(8)
    bias[3] = 1.0                                      # expert 3 now beats 2 within group 1
    w, ids = choose_ref(logits, rule, bias)
    assert sorted(ids[0].tolist()) == [3, 7] and torch.allclose(w[0], torch.sigmoid(logits[0, ids[0]]))


def test_router_logits_ignore_the_batch():
    """The logits every router starts from (route_triton on CUDA): h @ router.T, and a row's bits alone
    equal its bits in a batch of 7 (an empty step too)."""
    from cobatch.kernels.moe_routing import router_logits_triton
    g = torch.Generator().manual_seed(21)
    router, h = torch.randn(16, 320, generator=g) * 0.2, torch.randn(7, 320, generator=g).to(torch.bfloat16)
    if torch.cuda.is_available():
        router, h = router.cuda(), h.cuda()
    logits = router_logits_triton(h, router)
    assert logits.dtype == torch.float32 and torch.allclose(logits, h.float() @ router.T, rtol=1e-5, atol=1e-5)
    for r in (0, 6):
        assert torch.equal(router_logits_triton(h[r:r + 1], router)[0], logits[r])
    assert router_logits_triton(h[:0], router).shape == (0, 16)


@pytest.mark.parametrize("n_rows, n_experts, k, size", [(1, 8, 2, None), (5, 8, 3, None), (6, 4, 2, None),
                                                       (40, 16, 4, None), (3, 64, 8, None), (64, 128, 8, None),
                                                       (64, 8, 2, None), (200, 16, 4, None), (130, 8, 2, 32),
                                                       (300, 64, 6, 64)])
def test_slots_kernel_matches_reference(n_rows, n_experts, k, size):
    """Also a prefill chunk's slots for the routed GEMM: 1,800 pairs, compared 256 at a time."""
    from cobatch.kernels.moe_routing import expert_slots_ref, expert_slots_triton
    ids, weights = random_routing(n_rows, n_experts, k, seed=n_rows + n_experts)
    if torch.cuda.is_available():
        ids, weights = ids.cuda(), weights.cuda()
    want = expert_slots_ref(ids, weights, n_experts, size)
    got = expert_slots_triton(ids, weights, n_experts, size)
    for field in ("pair_rows", "slot_expert", "slot_start", "slot_count", "row_pairs", "row_weights"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.slot_size == want.slot_size
