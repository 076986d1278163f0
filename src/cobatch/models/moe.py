"""A mixture-of-experts feed-forward: each token is routed to the top-k of n experts (Mixtral, Qwen2/3-MoE).

The router is a small float32 matrix; softmax over all experts, top-k, optionally renormalized (as
llama.cpp's build_moe_ffn does per architecture). The experts run per expert on the rows routed to it, so a
step reads only the experts its tokens chose, each once, whatever the batch (ds4's "routed experts run per
sequence", grouped by expert). On CUDA each expert is a packed quantized weight and goes through the same
narrow GEMV as the dense layers; counting the rows each expert got is a host sync per layer, so MoE
models run their decode steps without CUDA graphs (LlamaModel.graph_safe).

A token's output sums its experts' contributions in expert-id order, so a row's result does not depend on
which other rows share the step.
"""

from __future__ import annotations

import torch

from cobatch import ops
from cobatch.config import ModelConfig
from cobatch.loader.gguf import GGUFFile
from cobatch.models.linear import load_linear
from cobatch.quant.weight import QuantWeight


def _expert_rows(w: QuantWeight, n_experts: int) -> list[QuantWeight]:
    """A stacked [n_experts * rows, cols] expert tensor as one QuantWeight per expert (views, no copy)."""
    rows = w.rows // n_experts
    return [QuantWeight(w.fmt, rows, w.cols, w.raw[e * rows:(e + 1) * rows]) for e in range(n_experts)]


class MoeFeedForward:
    def __init__(self, cfg: ModelConfig, gguf: GGUFFile, prefix: str, device: torch.device, dtype: torch.dtype,
                 keep_dense: bool = False):
        n = cfg.n_experts
        self.top_k, self.normalize = cfg.n_experts_used, cfg.expert_weights_norm
        self.router = gguf.quant_weight(prefix + "ffn_gate_inp.weight").dequantize(torch.float32).to(device)
        gates = _expert_rows(gguf.quant_weight(prefix + "ffn_gate_exps.weight"), n)
        ups = _expert_rows(gguf.quant_weight(prefix + "ffn_up_exps.weight"), n)
        downs = _expert_rows(gguf.quant_weight(prefix + "ffn_down_exps.weight"), n)
        self.gate_up = [load_linear([g, u], device, dtype, keep_dense) for g, u in zip(gates, ups)]
        self.down = [load_linear([d], device, dtype, keep_dense) for d in downs]
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if cfg.shared_expert_ffn_dim:
            self.shared_gate_up = load_linear([gguf.quant_weight(prefix + "ffn_gate_shexp.weight"),
                                               gguf.quant_weight(prefix + "ffn_up_shexp.weight")], device, dtype,
                                              keep_dense)
            self.shared_down = load_linear([gguf.quant_weight(prefix + "ffn_down_shexp.weight")], device, dtype,
                                           keep_dense)
            if prefix + "ffn_gate_inp_shexp.weight" in gguf.tensors:   # a sigmoid gate on the shared expert
                self.shared_gate = gguf.float_tensor(prefix + "ffn_gate_inp_shexp.weight").to(device)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, expert ids [N, k]) for rows h [N, d]."""
        probs = torch.softmax(h.float() @ self.router.T, dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(h)
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        # (row, slot) pairs grouped by expert, rows ascending within each: a stable sort of the flat ids. The
        # per-expert counts are the layer's one host sync.
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=len(self.gate_up)).tolist()
        pair_rows, pair_slots = order // self.top_k, order % self.top_k
        start = 0
        for e, count in enumerate(counts):  # expert-id order: each row adds its experts in that order
            if count == 0:
                continue
            rows, slot = pair_rows[start:start + count], pair_slots[start:start + count]
            start += count
            y = ops.linear(ops.gated_mul(ops.linear(h[rows], self.gate_up[e])), self.down[e])
            out.index_add_(0, rows, y.float() * weights[rows, slot, None])
        if self.shared_gate_up is not None:
            y = ops.linear(ops.gated_mul(ops.linear(h, self.shared_gate_up)), self.shared_down).float()
            if self.shared_gate is not None:
                y = y * torch.sigmoid(h.float() @ self.shared_gate.float())[:, None]
            out += y
        return out.to(h.dtype)
