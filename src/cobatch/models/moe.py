"""A mixture-of-experts feed-forward: each token is routed to the top-k of n experts (Mixtral, Qwen2/3-MoE).

The router is a small float32 matrix; softmax over all experts, top-k, optionally renormalized (as
llama.cpp's build_moe_ffn does per architecture). A step reads only the experts its tokens chose, each
once, whatever the batch (ds4's "routed experts run per sequence", grouped by expert). Two ways to run them:
  - routed (CUDA, steps of up to ROUTED_MAX_ROWS rows: every decode step): the (row, expert) pairs are
    grouped by expert on the device (kernels/moe_routing.py) and each projection is one launch of the
    routed GEMV over all experts stacked (kernels/packed_experts.py). No host sync, so decode steps are
    captured in CUDA graphs like a dense model's.
    Bigger steps (prefill chunks) may run it slice by slice (COBATCH_MOE_PREFILL=routed). Steps whose experts
    average more than 16 pairs (big decode batches, and prefill chunks whole) run the routed mid-batch GEMM in
    slots of up to 64 pairs (packed_experts.routed_slot_size; COBATCH_MOE_GEMM=0 turns it off).
  - expert by expert (the CPU, prefill chunks, and formats the routed GEMV does not read): each expert that got
    rows runs on them through ops.linear; counting those rows is a host sync.

A token's output sums its experts' contributions in float32 in expert-id order, both ways, so a row's
result does not depend on which other rows share the step.
"""

from __future__ import annotations

import os

import torch

from cobatch import ops
from cobatch.config import ModelConfig
from cobatch.kernels import packed_experts
from cobatch.kernels.activation import GATE_UP_GROUP
from cobatch.kernels.moe_routing import RouterRule, expert_slots
from cobatch.kernels.packed_weight import PackedWeight, as_q8_0_on
from cobatch.kernels.scratch import side_lane
from cobatch.loader.weights import WeightSource
from cobatch.models import side_stream
from cobatch.models.linear import load_gate_up, load_linear
from cobatch.quant.weight import QuantWeight


# Steps of more than ROUTED_MAX_ROWS rows (prefill chunks) whose stacks cannot run the routed GEMM (or with
# COBATCH_MOE_GEMM=0) run expert by expert, or with COBATCH_MOE_PREFILL=routed the routed path slice by slice (each
# slice reads the experts it chose again): 783 and 197 ms for 64 prompts of 128 tokens on DeepSeek-V2-Lite cut to 8
# layers, against 79 ms in the routed GEMM (bench/results/moe_prefill_deepseek_v2_lite.json).
ROUTED_PREFILL = os.environ.get("COBATCH_MOE_PREFILL", "experts") == "routed"


def _expert_rows(w: QuantWeight, n_experts: int) -> list[QuantWeight]:
    """A stacked [n_experts * rows, cols] expert tensor as one QuantWeight per expert (views, no copy)."""
    rows = w.rows // n_experts
    return [QuantWeight(w.fmt, rows, w.cols, w.raw[e * rows:(e + 1) * rows]) for e in range(n_experts)]


def route_on_device(moes: list["MoeFeedForward"], n_rows: int) -> bool:
    """Do all these MoE layers run a step of n_rows rows on the routed path whole (no host sync, so a CUDA graph
    may hold it)?"""
    return all(moe.routes_on_device(n_rows) for moe in moes)


class MoeFeedForward:
    def __init__(self, cfg: ModelConfig, gguf: WeightSource, prefix: str, device: torch.device, dtype: torch.dtype,
                 keep_dense: bool = False):
        n = self.n_experts = cfg.n_experts
        self.rule = RouterRule(cfg.n_experts_used, cfg.expert_weights_norm)   # k experts a row, by the router
        self.bias = None     # DeepSeek-V3's correction of the choice (models/deepseek.py)
        self.router = gguf.quant_weight(prefix + "ffn_gate_inp.weight").dequantize(torch.float32).to(device)
        gate, up, down = (gguf.quant_weight(prefix + f"ffn_{x}_exps.weight") for x in ("gate", "up", "down"))
        self.routed_gate_up = self.routed_down = None
        # Q5_0 as Q8_0 where COBATCH_Q5_0_AS_Q8_0=1 asks for it (packed_weight.AS_Q8_0: for comparisons)
        gate, up, down = (as_q8_0_on(w, device) for w in (gate, up, down))
        if device.type == "cuda" and gate.fmt is up.fmt and packed_experts.stackable(gate.fmt.name, gate.rows // n):
            # Interleaving the whole stacks 8 rows by 8 interleaves each expert's gate and up rows (an expert
            # owns whole groups of 8): expert e's fused gate|up is rows 2 e ffn.. of the result, laid out for
            # the GEMV's act*mul epilogue.
            gate_up = packed_experts.PackedExperts.from_quant(QuantWeight.interleave_rows(gate, up, GATE_UP_GROUP),
                                                              n, device, gate_up_interleaved=True)
            down_stack = packed_experts.PackedExperts.from_quant(down, n, device)
            if gate_up is not None and down_stack is not None:
                self.routed_gate_up, self.routed_down = gate_up, down_stack
        # can both stacks run the routed GEMM (packed_experts.ROUTED_GEMM)?
        self.routed_gemm = (self.routed_gate_up is not None and self.routed_gate_up.routed_gemm is not None
                            and self.routed_down.routed_gemm is not None)
        if self.routed_gemm:
            for stack in (self.routed_gate_up, self.routed_down):
                stack.reserve_routed(packed_experts.ROUTED_MAX_ROWS * self.rule.k)
        if self.routed_gate_up is not None:     # the expert-by-expert path reads the same planes
            self.gate_up, self.down = self.routed_gate_up.experts, self.routed_down.experts
        else:
            self.gate_up = [load_gate_up(g, u, device, dtype, keep_dense)
                            for g, u in zip(_expert_rows(gate, n), _expert_rows(up, n))]
            self.down = [load_linear([d], device, dtype, keep_dense) for d in _expert_rows(down, n)]
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if cfg.shared_expert_ffn_dim:
            self.shared_gate_up = load_gate_up(gguf.quant_weight(prefix + "ffn_gate_shexp.weight"),
                                               gguf.quant_weight(prefix + "ffn_up_shexp.weight"), device, dtype,
                                               keep_dense)
            self.shared_down = load_linear([gguf.quant_weight(prefix + "ffn_down_shexp.weight")], device, dtype,
                                           keep_dense)
            if prefix + "ffn_gate_inp_shexp.weight" in gguf.tensors:   # a sigmoid gate on the shared expert
                self.shared_gate = gguf.float_tensor(prefix + "ffn_gate_inp_shexp.weight").to(device)
        self.shared_beside = self._reserve_shared_beside(device)

    def _reserve_shared_beside(self, device: torch.device) -> bool:
        """May the shared experts run on the side stream (models/side_stream.py)? On packed weights whose GEMV
        takes its steps, their split-K buffers reserved there."""
        if not (side_stream.takes(device, 1) and self.shared_gate_up is not None):
            return False
        parts = [p for w in (self.shared_gate_up, self.shared_down) for p in getattr(w, "parts", [w])]
        if not all(isinstance(p, PackedWeight) and p.narrow_upto() >= side_stream.SIDE_MAX_ROWS for p in parts):
            return False
        with side_lane():
            for p in parts:
                p.reserve_narrow_scratch(side_stream.SIDE_MAX_ROWS)
        return True

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, expert ids [N, k]) for rows h [N, d]."""
        return ops.moe_route(h, self.router, self.rule, self.bias)

    @property
    def routed(self) -> bool:
        """Do steps of up to ROUTED_MAX_ROWS rows run without a host sync?"""
        return self.routed_gate_up is not None

    def routes_on_device(self, n_rows: int) -> bool:
        """Does a step of n_rows rows run the routed path whole (no host sync, so a CUDA graph may hold it)?"""
        return self.routed and (n_rows <= packed_experts.ROUTED_MAX_ROWS or self._gemm_slots(n_rows))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.shared_beside and self.routes_on_device(h.shape[0]) and side_stream.takes(h.device, h.shape[0]):
            # forked first, so that the shared experts run beside the router and the routed experts
            shared = side_stream.Beside(h.device, self._shared, h)
            weights, ids = self.route(h)
            return self._routed(h, weights, ids, shared)
        weights, ids = self.route(h)
        shared = self._shared(h)
        if self.routes_on_device(h.shape[0]):
            return self._routed(h, weights, ids, shared)
        if self.routed and ROUTED_PREFILL:
            # a prefill chunk in slices of the routed path's rows: no host sync and no loop over experts in Python
            step = packed_experts.ROUTED_MAX_ROWS
            return torch.cat([self._routed(h[a:a + step], weights[a:a + step], ids[a:a + step],
                                           None if shared is None else shared[a:a + step])
                              for a in range(0, h.shape[0], step)])
        out = self._expert_by_expert(h, weights, ids)
        if shared is not None:
            out += shared.float()
        return out.to(h.dtype)

    def _shared(self, h: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output [N, d] (h's dtype, or float32 through Qwen2-MoE's sigmoid gate), added to the
        routed experts' float32 sum last."""
        if self.shared_gate_up is None:
            return None
        y = ops.feed_forward(h, self.shared_gate_up, self.shared_down)
        if self.shared_gate is not None:
            y = y.float() * torch.sigmoid(h.float() @ self.shared_gate.float())[:, None]
        return y

    def _slot_size(self, n_rows: int) -> int:
        return packed_experts.routed_slot_size(n_rows, self.rule.k, self.n_experts, self.routed_gemm)

    def _gemm_slots(self, n_rows: int) -> bool:
        """Does a step of n_rows rows run the routed GEMM (at any size: its grid holds a whole prefill chunk)?"""
        return packed_experts.gemm_slots(self._slot_size(n_rows))

    def _routed(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: torch.Tensor | side_stream.Beside | None) -> torch.Tensor:
        """[N, d] in h's dtype: all experts of the step in two routed launches, grouped on the device, and their
        combine adding the shared experts' output (so no float32 sum is stored, added to and cast apart), joined
        from the side stream there when it was made beside them."""
        slots = expert_slots(ids, weights, self.n_experts, self._slot_size(h.shape[0]))
        wide = h.shape[0] > packed_experts.ROUTED_MAX_ROWS         # a prefill chunk: the GEMM's wide config
        y = self.routed_gate_up.routed_matmul(h[slots.pair_rows], slots, act="silu", wide=wide)  # act*mul in it
        down = self.routed_down.routed_matmul(y, slots, wide=wide)
        if isinstance(shared, side_stream.Beside):
            shared = shared.join()
        return ops.moe_combine(down, slots, h.dtype, shared)

    def _expert_by_expert(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 [N, d]: each expert that got rows, on its rows, in expert-id order."""
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        # (row, slot) pairs grouped by expert, rows ascending within each: a stable sort of the flat ids. The
        # per-expert counts are the layer's one host sync.
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=len(self.gate_up)).tolist()
        pair_rows, pair_slots = order // self.rule.k, order % self.rule.k
        start = 0
        for e, count in enumerate(counts):  # expert-id order: each row adds its experts in that order
            if count == 0:
                continue
            rows, slot = pair_rows[start:start + count], pair_slots[start:start + count]
            start += count
            y = ops.feed_forward(h[rows], self.gate_up[e], self.down[e])
            out.index_add_(0, rows, y.float() * weights[rows, slot, None])
        return out
