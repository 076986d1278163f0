"""Routing an MoE step's rows to its experts on the device, with no host sync (so a decode step that runs
experts can be captured in a CUDA graph).

Routing itself (`route_triton`: the logits, then one kernel that chooses and weighs a row's experts by the
router's `RouterRule`) has its own kernels: a row's experts and weights must not depend on the other rows of
the step, which cuBLAS does not promise for the logits.

A step of N rows, each routed to k experts, makes P = N k (row, expert) pairs. `expert_slots` sorts them by
expert (stable: rows ascending within an expert) and cuts each expert's run into "slots" of at most one
token tile of the kernel that runs them: the GEMV's (8 pairs, 16 above 8 rows) by default, or the mid-batch
GEMM's (32 or 64 pairs: packed_experts.routed_slot_size). The experts of the step come first, ascending, then
empty slots up to a bound known without looking at the ids (`slot_bound`). The routed GEMV (quant_gemv,
ROUTED) or GEMM (quant_gemm, ROUTED) runs one group of CTAs per slot, over that slot's pairs, with that
expert's weights: up to 8 rows, each chosen expert's weights are read once per step; above, once per slot of
its rows (as a dense GEMV reads its weights once per 16-token tile).

`combine` sums each row's k expert outputs weighted by the router, in ascending expert id, in float32: the
order the eager path (models/moe.py) adds them in, so a row's result does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cobatch.kernels.quant_gemv import token_tile
from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, jit, pdl_launch, tl, triton


@dataclass(frozen=True, slots=True)
class RouterRule:
    """How a router's logits choose a row's k experts and weigh them. Qwen-MoE, Mixtral, OLMoE: the top k of the
    softmax, renormalized or not. DeepSeek (models/deepseek.py): softmax (V2) or sigmoid (V3) scores, chosen by
    score + a correction bias where the file has one but weighed by the score; with groups only the experts of
    the `groups_used` best groups compete (a group's worth: its best choice value under softmax, the sum of its
    two best under sigmoid); renormalized with `eps` added to the sum, then times `scale`."""
    k: int
    normalize: bool
    gating: str = "softmax"     # or "sigmoid"
    groups: int = 0             # 0: no group limit
    groups_used: int = 0
    scale: float = 1.0
    eps: float = 0.0


def choose_ref(logits: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [N, k], expert ids int64 [N, k]) of a router's float32 logits [N, n_experts] by `rule`."""
    scores = logits.softmax(-1) if rule.gating == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if rule.groups:
        grouped = choice.view(choice.shape[0], rule.groups, -1)
        if rule.gating == "softmax":
            group_score = grouped.max(-1).values
        else:
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best = group_score.topk(rule.groups_used, -1).indices
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = choice.topk(rule.k, dim=-1).indices
    weights = scores.gather(1, ids)
    if rule.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + rule.eps)
    return weights * rule.scale, ids


def route_ref(h: torch.Tensor, router: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """choose_ref on the logits h @ router.T (router: float32 [n_experts, d])."""
    return choose_ref(h.float() @ router.T, rule, bias)


ROUTER_BLOCK_K = 4096     # the most router columns one program loads at once


@jit
def _router_logits_kernel(h_ptr, w_ptr, out_ptr, d, n_experts, h_stride, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):     # fixed blocks, one reduction tree per block: the same sums for any N
        k = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + row * h_stride + k, mask=k < d, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * d + k[None, :], mask=(e[:, None] < n_experts) & (k[None, :] < d), other=0.0)
        acc += tl.sum(w * h[None, :], axis=1)
    tl.store(out_ptr + row * n_experts + e, acc, mask=e < n_experts)


@jit
def _choose_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, n_experts, scale, eps, BLOCK_E: tl.constexpr,
                   K: tl.constexpr, BLOCK_KK: tl.constexpr, NORMALIZE: tl.constexpr, SIGMOID: tl.constexpr,
                   BIAS: tl.constexpr, GROUPS: tl.constexpr, GROUPS_USED: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """One row of choose_ref: scores, the group limit, the top k (ties go to the lower id, groups too) and their
    weights, in one program."""
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    e = tl.arange(0, BLOCK_E)
    valid = e < n_experts
    x = tl.load(logits_ptr + row * n_experts + e, mask=valid, other=float("-inf"))
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        score = p / tl.sum(p, axis=0)
    choice = score
    if BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPS > 0:
        group = e // GROUP_SIZE
        g = tl.arange(0, BLOCK_G)
        worth = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for j in tl.static_range(GROUPS):      # each group's worth: its best choice (sigmoid: its two best)
            mine = tl.where(group == j, choice, float("-inf"))
            top = tl.max(mine, axis=0)
            if SIGMOID and GROUP_SIZE > 1:
                first = tl.min(tl.where(mine == top, e, BLOCK_E), axis=0)
                top += tl.max(tl.where(e == first, float("-inf"), mine), axis=0)
            worth = tl.where(g == j, top, worth)
        kept = e < 0
        for j in tl.static_range(GROUPS_USED):
            best = tl.max(worth, axis=0)
            best_g = tl.min(tl.where(worth == best, g, BLOCK_G), axis=0)
            kept = kept | (group == best_g)
            worth = tl.where(g == best_g, float("-inf"), worth)
        choice = tl.where(kept, choice, float("-inf"))
    slot = tl.arange(0, BLOCK_KK)
    chosen_w = tl.zeros([BLOCK_KK], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_KK], dtype=tl.int32)
    total = 0.0
    for j in tl.static_range(K):        # the j-th largest choice; its weight is its score
        best = tl.max(choice, axis=0)
        best_id = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)
        w = tl.sum(tl.where(e == best_id, score, 0.0), axis=0)
        chosen_w = tl.where(slot == j, w, chosen_w)
        chosen_id = tl.where(slot == j, best_id, chosen_id)
        total += w
        choice = tl.where(e == best_id, float("-inf"), choice)
    if NORMALIZE:
        chosen_w = chosen_w / (total + eps)
    chosen_w = chosen_w * scale
    tl.store(weights_ptr + row * K + slot, chosen_w, mask=slot < K)
    tl.store(ids_ptr + row * K + slot, chosen_id.to(tl.int64), mask=slot < K)


def router_logits_triton(h: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """float32 [N, n_experts] = h @ router.T, each row summed in the same order whatever N (what _choose_kernel
    reads, for every RouterRule)."""
    n, d = h.shape
    n_experts = router.shape[0]
    assert h.stride(-1) == 1 and router.is_contiguous()
    logits = torch.empty(n, n_experts, dtype=torch.float32, device=h.device)
    if n == 0:
        return logits
    # One (row, expert) logit per program, its whole row of the router in one load where d <= 4096: the
    # latency of one load per program. (8 experts per program in 256-wide K steps took 14.7 us per layer on
    # the Qwen3-30B-A3B shape, B = 1: 16 programs, 8 dependent steps each; the layer's GEMV takes 10.)
    _router_logits_kernel[(n, n_experts)](h, router, logits, d, n_experts, h.stride(0), BLOCK_E=1,
                                          BLOCK_K=min(ROUTER_BLOCK_K, triton.next_power_of_2(d)), **pdl_launch(h),
                                          num_warps=4)
    return logits


def route_triton(h: torch.Tensor, router: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """As route_ref, in two kernels (the logits, spread over the experts; then each row's choice, _choose_kernel),
    and a row's result does not depend on the other rows of the call. cuBLAS does not promise that (it picks
    its algorithm, hence its summation order, by the shape), and a routed row must not change experts with
    its batch."""
    n, n_experts = h.shape[0], router.shape[0]
    assert rule.k <= n_experts and (not rule.groups or (n_experts % rule.groups == 0
                                                        and rule.k <= rule.groups_used * n_experts // rule.groups))
    logits = router_logits_triton(h, router)
    weights = torch.empty(n, rule.k, dtype=torch.float32, device=h.device)
    ids = torch.empty(n, rule.k, dtype=torch.int64, device=h.device)
    # One warp per row where the experts fit 8 per lane: its reductions (2 a chosen expert, 2-3 a group) are
    # then shuffles, with no shared-memory round trip and barrier each.
    block_e = triton.next_power_of_2(n_experts)
    _choose_kernel[(n,)](logits, logits if bias is None else bias, weights, ids, n_experts, rule.scale, rule.eps,
                         BLOCK_E=block_e, K=rule.k, BLOCK_KK=triton.next_power_of_2(rule.k), NORMALIZE=rule.normalize,
                         SIGMOID=rule.gating == "sigmoid", BIAS=bias is not None, GROUPS=rule.groups,
                         GROUPS_USED=rule.groups_used, GROUP_SIZE=n_experts // max(rule.groups, 1),
                         BLOCK_G=triton.next_power_of_2(max(rule.groups, 1)), **pdl_launch(h),
                         num_warps=1 if block_e <= 256 else 4)
    return weights, ids


@dataclass(slots=True)
class ExpertSlots:
    pair_rows: torch.Tensor    # [P] int64: the input row of each pair, pairs sorted by expert
    slot_expert: torch.Tensor  # [S] int32: the expert of each slot (0 for an empty slot)
    slot_start: torch.Tensor   # [S] int32: its first pair
    slot_count: torch.Tensor   # [S] int32: its number of pairs, at most slot_size (0: empty)
    row_pairs: torch.Tensor    # [N, k] int64: each row's pairs, in ascending expert id
    row_weights: torch.Tensor  # [N, k] float32: the router weights in the same order
    slot_size: int             # the routed kernel's token tile (the GEMV's 8 or 16, or the GEMM's 32 or 64)

    @property
    def n_slots(self) -> int:
        return self.slot_expert.shape[0]


def slot_size(n_rows: int) -> int:
    """An expert's run of pairs is cut into slots of the GEMV's token tile for the step: with up to 8 rows
    every expert's run fits one slot; above, runs longer than 16 take several."""
    return token_tile(n_rows)


def slot_bound(n_rows: int, k: int, n_experts: int, size: int | None = None) -> int:
    """Slots a step can need, known without looking at the ids: each used expert (at most min(n_experts, P))
    takes ceil(count / size) slots, and the counts sum to P = n_rows k. size: slot_size(n_rows) if not given."""
    n_pairs, size = n_rows * k, size or slot_size(n_rows)
    used = min(n_experts, n_pairs)
    return min(used * -(-n_rows // size), -(-n_pairs // size) + used)


def expert_slots_ref(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, size: int | None = None
                     ) -> ExpertSlots:
    """ids, weights: [N, k] (a row's k ids distinct) -> the slots of `size` pairs at most (slot_size(N) if not
    given), written plainly (host loops: the test oracle of the kernel; the CPU path never routes)."""
    n, k = ids.shape
    size = size or slot_size(n)
    flat = ids.reshape(-1).cpu()
    order = torch.sort(flat, stable=True).indices
    sorted_ids = flat[order].tolist()
    expert, start, count = [], [], []
    p = 0
    while p < len(sorted_ids):               # each expert's run, cut into slots of `size`
        run_end = p
        while run_end < len(sorted_ids) and sorted_ids[run_end] == sorted_ids[p]:
            run_end += 1
        for s0 in range(p, run_end, size):
            expert.append(sorted_ids[p]), start.append(s0), count.append(min(size, run_end - s0))
        p = run_end
    n_slots = slot_bound(n, k, n_experts, size)
    pad = n_slots - len(expert)
    expert, start, count = expert + [0] * pad, start + [n * k] * pad, count + [0] * pad
    position = torch.empty_like(order)
    position[order] = torch.arange(n * k)
    row_pairs, perm = position.view(n, k).sort(dim=1)    # a row's pairs by position = by expert id
    dev = ids.device
    as_i32 = (lambda v: torch.tensor(v, dtype=torch.int32, device=dev))
    return ExpertSlots((order // k).to(dev), as_i32(expert), as_i32(start), as_i32(count), row_pairs.to(dev),
                       weights.float().gather(1, perm.to(dev)), size)


@jit
def _slots_kernel(ids_ptr, w_ptr, pair_rows_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, row_pairs_ptr,
                  row_weights_ptr, n_pairs, n_experts, n_slots, K: tl.constexpr, CHUNK: tl.constexpr,
                  Q: tl.constexpr, QE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                  SIZE: tl.constexpr, MAX_PER_EXPERT: tl.constexpr, PDL: tl.constexpr):
    """Program i: the sorted position ("rank") of pairs i*CHUNK.. (a stable counting sort: the pairs before a
    pair have a lower expert id, or the same id and a lower index), comparing them with Q pairs at a time, and
    their place in their row's expert-id order. Program 0 also lays out the slots: each used expert's run (its
    pairs counted QE at a time) cut into slots of SIZE pairs."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    big = 1 << 30
    p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    p_ok = p < n_pairs
    id_p = tl.load(ids_ptr + p, mask=p_ok, other=big).to(tl.int32)
    rank = tl.zeros([CHUNK], dtype=tl.int32)
    for q0 in range(0, n_pairs, Q):
        q = q0 + tl.arange(0, Q)
        id_q = tl.load(ids_ptr + q, mask=q < n_pairs, other=big).to(tl.int32)
        before = (id_q[None, :] < id_p[:, None]) | ((id_q[None, :] == id_p[:, None]) & (q[None, :] < p[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    row = p // K
    tl.store(pair_rows_ptr + rank, row.to(tl.int64), mask=p_ok)
    in_row = tl.zeros([CHUNK], dtype=tl.int32)     # the row's experts with a lower id (a row's ids are distinct)
    for j in tl.static_range(K):
        other = tl.load(ids_ptr + row * K + j, mask=p_ok, other=big).to(tl.int32)
        in_row += (other < id_p).to(tl.int32)
    tl.store(row_pairs_ptr + row * K + in_row, rank.to(tl.int64), mask=p_ok)
    tl.store(row_weights_ptr + row * K + in_row, tl.load(w_ptr + p, mask=p_ok, other=0.0), mask=p_ok)
    if tl.program_id(0) == 0:
        e = tl.arange(0, BLOCK_E)
        count = tl.zeros([BLOCK_E], dtype=tl.int32)
        for q0 in range(0, n_pairs, QE):
            q = q0 + tl.arange(0, QE)
            id_q = tl.load(ids_ptr + q, mask=q < n_pairs, other=-1).to(tl.int32)
            count += tl.sum((id_q[None, :] == e[:, None]).to(tl.int32), axis=1)
        n_own = (count + SIZE - 1) // SIZE           # the slots of each expert (0 if unused)
        first = tl.cumsum(n_own, axis=0) - n_own     # used experts, ascending, take slots 0, 1, ...
        start = tl.cumsum(count, axis=0) - count
        for i in tl.static_range(MAX_PER_EXPERT):
            mine = (i < n_own) & (e < n_experts)
            tl.store(slot_expert_ptr + first + i, e, mask=mine)
            tl.store(slot_start_ptr + first + i, start + i * SIZE, mask=mine)
            tl.store(slot_count_ptr + first + i, tl.minimum(count - i * SIZE, SIZE), mask=mine)
        s = tl.arange(0, BLOCK_S)                   # the rest are empty (disjoint from the stores above)
        empty = (s >= tl.sum(n_own, axis=0)) & (s < n_slots)
        tl.store(slot_expert_ptr + s, tl.zeros([BLOCK_S], dtype=tl.int32), mask=empty)
        tl.store(slot_start_ptr + s, tl.zeros([BLOCK_S], dtype=tl.int32) + n_pairs, mask=empty)
        tl.store(slot_count_ptr + s, tl.zeros([BLOCK_S], dtype=tl.int32), mask=empty)


def expert_slots_triton(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, size: int | None = None
                        ) -> ExpertSlots:
    """As expert_slots_ref, in one launch and without a host sync."""
    n, k = ids.shape
    n_pairs, size = n * k, size or slot_size(n)
    n_slots = slot_bound(n, k, n_experts, size)
    dev = ids.device
    pair_rows = torch.empty(n_pairs, dtype=torch.int64, device=dev)
    slot_expert, slot_start, slot_count = (torch.empty(n_slots, dtype=torch.int32, device=dev) for _ in range(3))
    row_pairs = torch.empty(n, k, dtype=torch.int64, device=dev)
    row_weights = torch.empty(n, k, dtype=torch.float32, device=dev)
    chunk, block_e = 32, triton.next_power_of_2(n_experts)
    # A prefill chunk's thousands of pairs are compared 256 at a time (a decode step's few in one block), and
    # program 0 counts them in blocks of up to 8192 (expert, pair) tests; the bounds are powers of two, so
    # steps of any size share a few compiled variants.
    q = min(256, max(chunk, triton.next_power_of_2(n_pairs)))
    qe = max(chunk, min(q, 8192 // block_e))
    _slots_kernel[(triton.cdiv(n_pairs, chunk),)](
        ids.contiguous(), weights.float().contiguous(), pair_rows, slot_expert, slot_start, slot_count, row_pairs,
        row_weights, n_pairs, n_experts, n_slots, K=k, CHUNK=chunk, Q=q, QE=qe, BLOCK_E=block_e,
        BLOCK_S=triton.next_power_of_2(n_slots), SIZE=size, MAX_PER_EXPERT=triton.next_power_of_2(-(-n // size)),
        **pdl_launch(ids), num_warps=4)
    return ExpertSlots(pair_rows, slot_expert, slot_start, slot_count, row_pairs, row_weights, size)


def expert_slots(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, size: int | None = None
                 ) -> ExpertSlots:
    """The slots of a step's routing, of `size` pairs at most (the GEMV's token tile for the step if not given):
    one kernel on CUDA, the reference elsewhere."""
    if ids.is_cuda:
        return expert_slots_triton(ids, weights, n_experts, size)
    return expert_slots_ref(ids, weights, n_experts, size)


def combine_ref(y: torch.Tensor, slots: ExpertSlots, out_dtype: torch.dtype,
                shared: torch.Tensor | None = None) -> torch.Tensor:
    """y: [P, d] the experts' outputs per pair -> [N, d]: sum over j of row_weights[:, j] * y[row_pairs[:, j]], in
    float32, plus the shared experts' output `shared` [N, d] (any dtype, widened to float32) where there is one."""
    out = torch.zeros(slots.row_pairs.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(slots.row_pairs.shape[1]):
        out += y[slots.row_pairs[:, j]].float() * slots.row_weights[:, j, None]
    if shared is not None:
        out += shared.float()
    return out.to(out_dtype)


@jit
def _combine_kernel(y_ptr, pairs_ptr, w_ptr, shared_ptr, out_ptr, d, y_stride, shared_stride, out_stride,
                    K: tl.constexpr, SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):     # ascending expert id, as combine_ref and the eager path
        pair = tl.load(pairs_ptr + row * K + j)
        w = tl.load(w_ptr + row * K + j)
        y = tl.load(y_ptr + pair * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        prod = y * w
        acc += prod
    if SHARED:                       # the shared experts' output, added last
        acc += tl.load(shared_ptr + row * shared_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_triton(y: torch.Tensor, slots: ExpertSlots, out_dtype: torch.dtype,
                   shared: torch.Tensor | None = None) -> torch.Tensor:
    """combine_ref in one launch: the shared experts' add and the store in out_dtype included."""
    n, k = slots.row_pairs.shape
    d = y.shape[1]
    out = torch.empty(n, d, dtype=out_dtype, device=y.device)
    if shared is not None:
        assert shared.shape == (n, d) and shared.stride(1) == 1, "shared: [N, d], rows contiguous"
    block = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(n, triton.cdiv(d, block))](y, slots.row_pairs, slots.row_weights,
                                                y if shared is None else shared, out, d, y.stride(0),
                                                0 if shared is None else shared.stride(0), out.stride(0), K=k,
                                                SHARED=shared is not None, BLOCK=block, **pdl_launch(y), num_warps=4,
                                                enable_fp_fusion=False)   # product rounded, then added
    return out
