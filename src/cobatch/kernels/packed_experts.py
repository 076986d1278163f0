"""The experts of one MoE projection, packed as one stacked weight, for the routed GEMV.

All n experts share format and shape (GGUF stores them as one 3-D tensor), so their fragment-order planes
are packed as one matrix of n * rows rows, expert e owning row tiles e * rows / 16 onwards. One routed launch
(quant_gemv, ROUTED) then runs every expert a step chose, each over its run of (row, expert) pairs
(moe_routing.py): a fixed grid and no host sync, so it can be captured in a CUDA graph. `experts[e]` is a
PackedWeight view of one expert (no copy), for steps of many rows (prefill), which run expert by expert.

A step whose experts average more pairs than the GEMV's 16-token tile runs the routed mid-batch GEMM instead
(quant_gemm, ROUTED; COBATCH_MOE_GEMM=0 turns it off): slots of 32 or 64 pairs (routed_slot_size), so an expert's
weights are read once per 64 of its rows rather than per 16, and a prefill chunk of any size is one launch a
projection, with no host sync and no loop over experts in Python. It runs the GEMM's ring kernel where the
stack's shape allows it (routed_config; COBATCH_MOE_GEMM_RING=0: the plain kernel). On the H200
(bench/results/moe_experts.json, one DeepSeek-V2-Lite layer's experts): 256 rows 0.31 ms in the ring of one
warpgroup, against 0.40 in the plain kernel and 0.47 in routed slices of the GEMV; 2048 rows 1.26 ms in the
persistent ring, against 1.71 plain and 3.44 in routed slices. Whole prefills of that model cut to 8 layers:
bench/results/moe_prefill_deepseek_v2_lite.json.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from cobatch.kernels import quant_gemm, quant_gemv, quant_pack
from cobatch.kernels.matmul_plans import loads_ahead, plan_for, uses_gemv, uses_quant_gemm
from cobatch.kernels.moe_routing import ExpertSlots, slot_size
from cobatch.kernels.packed_weight import PackedWeight, reserve_scratch
from cobatch.kernels.quant_pack import FRAGMENT_FORMATS, PACKED_FORMATS, ROW_PAD, PackedPlanes, pack_planes
from cobatch.quant.weight import QuantWeight

# Steps of up to this many rows route on the device. Every decode step up to this batch can be captured in
# a CUDA graph; bigger steps (prefill chunks) run expert by expert, through the dequant GEMM where an expert
# gets many rows. (Measured on the H200 up to 64: bench/results/moe-decode-2026-11-29-* at 5a66009^.)
ROUTED_MAX_ROWS = 256


# Steps whose experts average more than a GEMV token tile of pairs run the routed GEMM (module docstring)
ROUTED_GEMM = os.environ.get("COBATCH_MOE_GEMM", "1") != "0"
# A routed GEMM slot holds at most this many pairs: an expert's last slot is part empty, so bigger slots waste
# more MMA work on the expert runs of a prefill chunk (about 190 pairs an expert at 2048 rows of 6 of 64).
ROUTED_GEMM_MAX_SLOT = 64
ROUTED_GEMM_RING = os.environ.get("COBATCH_MOE_GEMM_RING", "1") != "0"
# The routed GEMM's configs, fastest first, for steps of up to ROUTED_MAX_ROWS rows (decode, captured in graphs)
# and for bigger ones (prefill chunks), as timed on one DeepSeek-V2-Lite layer (module docstring): a stack takes
# the first that its shape allows (routed_config). The plain kernel's come last, as they run without a ring.
_RING = quant_gemm.GemmConfig(RING=8, CHUNKS=2, LAG=True, AHEAD=True)
ROUTED_CONFIGS = (replace(_RING, NW=4), replace(_RING, NW=8), quant_gemm.GemmConfig(NW=8), quant_gemm.GemmConfig(NW=4))
ROUTED_CONFIGS_WIDE = (replace(_RING, NW=8, PERSIST=1), replace(_RING, NW=4, PERSIST=1), quant_gemm.GemmConfig(NW=8),
                       quant_gemm.GemmConfig(NW=4))


def routed_slot_size(n_rows: int, k: int, n_experts: int, gemm: bool) -> int:
    """The slot size of a routed step of n_rows rows, each to k of n_experts experts: the GEMV's token tile
    (moe_routing.slot_size), or, where `gemm` (the step's stacks can run the routed GEMM) and ROUTED_GEMM and the
    experts average more pairs than 16, the GEMM's token tile for that average, at most ROUTED_GEMM_MAX_SLOT.
    A function of the step's shape only: a row's kernel, and so its bits, does not depend on the other rows'
    routes."""
    average = -(-n_rows * k // n_experts)
    if not (gemm and ROUTED_GEMM) or average <= quant_gemv.token_tile(n_rows):
        return slot_size(n_rows)
    return quant_gemm.token_tile(min(average, ROUTED_GEMM_MAX_SLOT))


def gemm_slots(size: int) -> bool:
    """Are slots of `size` pairs the routed GEMM's (bigger than any GEMV token tile) rather than the GEMV's?"""
    return size > quant_gemv.token_tile(size)


def routed_config(planes: PackedPlanes, rows: int, configs) -> quant_gemm.GemmConfig | None:
    """The first of `configs` that experts of `rows` rows in these planes can run: a CTA's rows divide an
    expert's, a loop iteration's chunks divide K (quant_gemm.steps), and a ring's stages fit an SM twice at the
    biggest slot's token tile; rings only with ROUTED_GEMM_RING."""
    n_chunks = planes.qs.shape[1] // 512
    for cfg in configs:
        if rows % cfg.rows_per_cta() or n_chunks % cfg.steps_per_iteration():
            continue
        if cfg.RING and (not ROUTED_GEMM_RING
                         or quant_gemm.ring_stages(cfg, planes.fmt_id, ROUTED_GEMM_MAX_SLOT) < 2):
            continue
        return cfg
    return None


def stackable(fmt_name: str, rows: int) -> bool:
    """Can experts of this format and row count be stacked for the routed GEMV (on CUDA)? Its formats are the
    fragment-order ones; an expert must own whole row pads, so that expert views start at a row tile."""
    return PACKED_FORMATS.get(fmt_name) in FRAGMENT_FORMATS and rows % ROW_PAD == 0


def without_split_k(plan: quant_gemv.GemvPlan, n_chunks: int) -> quant_gemv.GemvPlan:
    """A routed launch has a group of CTAs per slot, enough to fill the GPU; split-K's partial buffers and
    extra CTAs (mostly idle ones, for slots that got few rows) would only cost. Each warp then walks all of K:
    its loads go up to 4 steps ahead (loads_ahead), as many as the plan's or more. A plan already so comes back as
    it is: a table entry for a stack's per-expert shape holds its routed configs as bench/model_gemv_plans.py timed
    them. A U that leaves a tail (the deep default's under matmul_plans.GEMV_TAILS) gives way to the largest power of
    two up to it that divides the warp's steps: routed GEMVs running the tail, loads 4 ahead whatever the steps,
    were level at 1 and 8 rows and 3.6 % slower at 64 (bench/results/moe_routed_gemv_tails_ab.md)."""
    def routed(c: quant_gemv.GemvConfig) -> quant_gemv.GemvConfig:
        steps = n_chunks // c.W
        u = max(c.U if steps % c.U == 0 else loads_ahead(steps, most=c.U), loads_ahead(steps))
        return replace(c, split_k=1, U=u)
    return quant_gemv.GemvPlan(routed(plan.default), tuple((bound, routed(c)) for bound, c in plan.upto))


class PackedExperts:
    def __init__(self, fmt_name: str, n_experts: int, rows: int, cols: int, planes: PackedPlanes, plan,
                 gate_up_interleaved: bool = False):
        self.fmt_name, self.n_experts, self.rows, self.cols = fmt_name, n_experts, rows, cols
        self.planes, self.plan = planes, plan
        self.routed_plan = without_split_k(plan.narrow, planes.qs.shape[1] // 512)    # the routed GEMV's
        # the routed GEMM's configs (None where it cannot run), for decode steps and for wider ones: a CTA takes
        # a slot and 16 NW of its expert's rows
        self.routed_gemm = self.routed_gemm_wide = None
        if uses_quant_gemm(planes.qs.device) and PACKED_FORMATS[fmt_name] in quant_gemm.FORMATS:
            self.routed_gemm = routed_config(planes, rows, ROUTED_CONFIGS)
            self.routed_gemm_wide = routed_config(planes, rows, ROUTED_CONFIGS_WIDE)
        tiles = rows // 16
        self.experts = [PackedWeight(fmt_name, rows, cols, planes=planes.row_tiles(e * tiles, (e + 1) * tiles),
                                     plan=plan, gate_up_interleaved=gate_up_interleaved) for e in range(n_experts)]

    @classmethod
    def from_quant(cls, w: QuantWeight, n_experts: int, device: torch.device,
                   gate_up_interleaved: bool = False) -> "PackedExperts | None":
        """w: the experts stacked expert-major, [n_experts * rows, cols]. None where the routed GEMV cannot
        serve them: a format without fragment planes, or experts whose rows are not whole row pads.
        gate_up_interleaved: each expert is a gate|up pair, rows interleaved 8 by 8 (routed_matmul's act)."""
        rows = w.rows // n_experts
        if (not uses_gemv(w.fmt.name, device) or not stackable(w.fmt.name, rows)
                or not quant_pack.weight_packable(w.fmt.name, w.row_scale)):
            return None
        planes = pack_planes(w.fmt, w.rows, w.cols, w.raw, device, fragment=True, row_scale=w.row_scale)
        self = cls(w.fmt.name, n_experts, rows, w.cols, planes,
                   plan_for(w.fmt.name, rows, w.cols, planes.cols_pad, gemv=True), gate_up_interleaved)
        reserve_scratch(device, self.plan, rows, rows, w.cols)      # for the expert-by-expert path
        return self

    def replan(self) -> None:
        """The plans of the table in force (COBATCH_QUANT_CONFIGS), as at load: for benchmarks comparing tables."""
        self.plan = plan_for(self.fmt_name, self.rows, self.cols, self.planes.cols_pad, gemv=True)
        self.routed_plan = without_split_k(self.plan.narrow, self.planes.qs.shape[1] // 512)
        for expert in self.experts:
            expert.plan = self.plan
        reserve_scratch(self.planes.qs.device, self.plan, self.rows, self.rows, self.cols)

    def reserve_routed(self, max_pairs: int) -> None:
        """Grow the ring's f16 x scratch for routed steps of up to max_pairs pairs (at load: the decode steps
        that CUDA graphs capture must not grow it)."""
        if self.routed_gemm is not None and self.routed_gemm.streams_x():
            quant_gemm.reserve_x_scratch(self.planes.qs.device, quant_gemm.x_scratch_rows(max_pairs) * self.cols)

    def routed_matmul(self, x: torch.Tensor, slots: ExpertSlots, act: str | None = None,
                      wide: bool = False) -> torch.Tensor:
        """x [P, cols], one row per (row, expert) pair in slot order -> [P, rows]: each pair's row times its
        expert, by the routed GEMV, or by the routed GEMM where the slots are bigger than the GEMV's token tile
        (routed_slot_size), in its config for steps of more than ROUTED_MAX_ROWS rows where `wide`. Fixed launch
        shape for a given P: no host sync. act (gate|up experts packed interleaved): act(gate) * up instead,
        [P, rows / 2], applied in the kernel's epilogue."""
        assert x.shape[0] == slots.pair_rows.shape[0] and x.stride(-1) == 1
        assert act is None or self.experts[0].gate_up_interleaved
        out = torch.empty(x.shape[0], self.rows // 2 if act else self.rows, dtype=x.dtype, device=x.device)
        routing = quant_gemv.Routing(slots.slot_expert, slots.slot_start, slots.slot_count, slots.slot_size,
                                     self.rows)
        if gemm_slots(slots.slot_size):
            config = self.routed_gemm_wide if wide else self.routed_gemm
            assert config is not None, "slots of the routed GEMM on experts it cannot run"
            quant_gemm.launch(self.planes, x, out, config, out, out, act=act, routing=routing)
        else:
            quant_gemv.launch(self.planes, x, out, self.routed_plan, out, out, routing, act=act)
        return out

    @property
    def nbytes(self) -> int:
        return self.planes.nbytes
