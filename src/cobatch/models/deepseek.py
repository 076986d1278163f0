"""DeepSeek (llama.cpp's deepseek2: V2, V2-Lite, V3, R1, Kimi-K2, Moonlight) as one flat batched forward:
multi-head latent attention (MLA) and DeepSeek's mixture of experts, after some dense leading layers.

MLA, per layer and token (h the normed hidden state, H heads):
    q = W_q h, or W_qb rmsnorm(W_qa h) with a q LoRA       -> per head q_nope | q_rope
    c_kv | k_rope = W_kv_a h;  c_kv = rmsnorm(c_kv)          one latent per token, shared by all heads
    k_nope = W_UK c_kv, v = W_UV c_kv per head               (W_UK | W_UV: attn_kv_b, or attn_k_b / attn_v_b)
    rope on q_rope and k_rope (adjacent pairs), attention, W_o
The cache keeps c_kv | k_rope (one "head" of kv_lora_rank + rope dims) and attention runs absorbed: W_UK
folded into the query, W_UV applied to the attention's latent output, so each cached row is read once per step
for all heads and nothing per head is ever decompressed (kernels/mla_attention.py).

DeepSeek's router: scores softmax (V2) or sigmoid (V3) of the router logits; V3 chooses experts by
score + correction bias (exp_probs_b) but weighs them by the score; with groups only the experts of the top
groups compete (a group's worth: its best score under softmax, its two best biased ones under sigmoid); the
chosen weights are renormalized where the file says so, then times expert_weights_scale. The shared experts
run on every token beside them; the experts run through models/moe.py's machinery.

YaRN (DeepSeek's): the frequencies as YaRN stretches them, cos and sin unscaled, and the q.k scale times
mscale^2 with mscale = 1 + yarn_log_multiplier * ln(factor) (HF's yarn_get_mscale with mscale_all_dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cobatch import ops
from cobatch.batch import AttentionMetadata
from cobatch.config import ModelConfig
from cobatch.errors import UserError
from cobatch.kernels.moe_routing import RouterRule
from cobatch.kernels.packed_experts import ROUTED_MAX_ROWS
from cobatch.kernels.rope import rope_cos_sin, yarn_freq_factors
from cobatch.loader.gguf import GGUFFile
from cobatch.models import side_stream
from cobatch.models.linear import WeightLoader, load_gate_up
from cobatch.models.moe import MoeFeedForward, route_on_device


class DeepseekMoe(MoeFeedForward):
    """The routed experts (and the shared ones) of models/moe.py, routed as DeepSeek routes."""

    def __init__(self, cfg: ModelConfig, gguf: GGUFFile, prefix: str, device: torch.device, dtype: torch.dtype,
                 keep_dense: bool = False):
        super().__init__(cfg, gguf, prefix, device, dtype, keep_dense)
        self.rule = deepseek_rule(cfg)
        bias = prefix + "exp_probs_b.bias"
        self.bias = gguf.float_tensor(bias).to(device) if bias in gguf.tensors else None


def deepseek_rule(cfg: ModelConfig) -> RouterRule:
    """DeepSeek's router (module doc) as kernels/moe_routing.py runs it: HF's, with its 1e-20 in the sum."""
    return RouterRule(cfg.n_experts_used, cfg.expert_weights_norm, cfg.expert_gating, cfg.expert_groups,
                      cfg.expert_groups_used, cfg.expert_weights_scale, eps=1e-20)


@dataclass(slots=True)
class MlaLayer:
    attn_norm: torch.Tensor
    q_kv_a: object                    # [q | c_kv | k_rope] or [q_a | c_kv | k_rope]: the projections of h, fused
    q_a_norm: torch.Tensor | None     # with a q LoRA: its norm, then q_b
    q_b: object | None
    kv_a_norm: torch.Tensor
    k_up: torch.Tensor                # W_UK [H, qk_nope, kv_lora_rank], folded into the query
    v_up: torch.Tensor                # W_UV [H, v_head, kv_lora_rank], applied to the latent output
    o: object
    ffn_norm: torch.Tensor
    gate_up: object | None            # a dense leading layer's feed-forward
    down: object | None
    moe: DeepseekMoe | None = None


def _up_projections(gguf: GGUFFile, prefix: str, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, rank], W_UV [H, v, rank]) float32, from attn_kv_b ([H (nope + v), rank], HF's kv_b_proj)
    or from llama.cpp's split attn_k_b ([H, rank, nope]: stored transposed) and attn_v_b ([H, v, rank])."""
    mla, heads = cfg.mla, cfg.n_heads
    if prefix + "attn_kv_b.weight" in gguf.tensors:
        kv_b = gguf.quant_weight(prefix + "attn_kv_b.weight").dequantize(torch.float32)
        kv_b = kv_b.view(heads, mla.qk_nope_dim + mla.v_head_dim, mla.kv_lora_rank)
        return kv_b[:, :mla.qk_nope_dim].contiguous(), kv_b[:, mla.qk_nope_dim:].contiguous()
    k_b = gguf.quant_weight(prefix + "attn_k_b.weight").dequantize(torch.float32)
    v_b = gguf.quant_weight(prefix + "attn_v_b.weight").dequantize(torch.float32)
    return (k_b.view(heads, mla.kv_lora_rank, mla.qk_nope_dim).transpose(1, 2).contiguous(),
            v_b.view(heads, mla.v_head_dim, mla.kv_lora_rank))


def yarn_mscale(cfg: ModelConfig) -> float:
    """DeepSeek's YaRN magnitude correction of q.k (squared into the scale), 1 without YaRN."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("type") != "yarn" or scaling["factor"] <= 1:
        return 1.0
    return 1.0 + cfg.yarn_log_multiplier * math.log(scaling["factor"])


def _rope_table(cfg: ModelConfig, n_pos: int) -> torch.Tensor:
    scaling = cfg.rope_scaling or {}
    factors = None
    if scaling.get("type") == "yarn":
        factors = yarn_freq_factors(cfg.rope_dim, cfg.rope_theta, scaling["factor"], scaling["original_context"],
                                    scaling["beta_fast"], scaling["beta_slow"])
    elif scaling:
        raise UserError(f"deepseek2 with rope scaling {scaling['type']!r}: cobatch runs DeepSeek with YaRN or none")
    return rope_cos_sin(cfg.rope_dim, n_pos, cfg.rope_theta, factors)


class DeepseekModel:
    def __init__(self, cfg: ModelConfig, gguf: GGUFFile, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_positions: int | None = None, progress=None,
                 keep_dense: bool = False):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        dev, mla = self.device, cfg.mla
        load = WeightLoader(gguf, dev, dtype, keep_dense)
        vec, lin = load.vec, load.linear

        self.layers: list[MlaLayer] = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            k_up, v_up = _up_projections(gguf, p, cfg)
            moe = cfg.moe_layer(i)
            self.layers.append(MlaLayer(
                attn_norm=vec(p + "attn_norm.weight"),
                q_kv_a=lin(p + ("attn_q_a.weight" if mla.q_lora_rank else "attn_q.weight"), p + "attn_kv_a_mqa.weight"),
                q_a_norm=vec(p + "attn_q_a_norm.weight") if mla.q_lora_rank else None,
                q_b=lin(p + "attn_q_b.weight") if mla.q_lora_rank else None,
                kv_a_norm=vec(p + "attn_kv_a_norm.weight"),
                k_up=k_up.to(dev, dtype), v_up=v_up.to(dev, dtype),
                o=lin(p + "attn_output.weight"),
                ffn_norm=vec(p + "ffn_norm.weight"),
                gate_up=None if moe else load_gate_up(gguf.quant_weight(p + "ffn_gate.weight"),
                                                      gguf.quant_weight(p + "ffn_up.weight"), dev, dtype, keep_dense),
                down=None if moe else lin(p + "ffn_down.weight"),
                moe=DeepseekMoe(cfg, gguf, p, dev, dtype, keep_dense) if moe else None,
            ))
            if progress is not None:
                progress(1)
        # Captured in CUDA graphs as llama's MoE models are (steps of up to ROUTED_MAX_ROWS rows): the router is torch
        # code without a host sync, the experts route on the device, attention and the latent write are kernels.
        moes = self._moes = [layer.moe for layer in self.layers if layer.moe is not None]
        self.graph_safe = all(m.routed for m in moes)
        self.graph_max_rows: int | None = ROUTED_MAX_ROWS if moes and self.graph_safe else None
        self.tp = None             # tensor parallelism does not shard MLA (llm._open refuses it)
        self.embed = gguf.quant_weight("token_embd.weight").dequantize(dtype).to(dev)
        self.vocab_rows = self.embed.shape[0]      # the token ids a prompt may hold
        head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        self.lm_head = self.embed if head == "token_embd.weight" and dev.type == "cpu" else lin(head)
        self.final_norm = vec("output_norm.weight")
        self.cos_sin = _rope_table(cfg, max_positions or cfg.context_length).to(dev)
        self.scale = mla.qk_head_dim ** -0.5 * yarn_mscale(cfg) ** 2

    def step_graph_holds(self, rows: int) -> bool:
        """Can a CUDA graph hold a step of `rows` rows with prefill chunks (engine/cuda_graphs.StepGraphs)? Where
        the experts route on the device (models/moe.py); the MLA prefill kernel zeroes the padding rows' output,
        so they route finite values."""
        return route_on_device(self._moes, rows)

    def attention(self, layer: MlaLayer, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  cache: torch.Tensor) -> torch.Tensor:
        """MLA of rows h [N, d] (module doc), this step's latents written to the cache -> [N, d]."""
        cfg, mla = self.cfg, self.cfg.mla
        n, heads = h.shape[0], cfg.n_heads
        q_kv_a = ops.linear(h, layer.q_kv_a)
        q, kv_a = q_kv_a[:, :-mla.latent_dim], q_kv_a[:, -mla.latent_dim:]
        if layer.q_b is not None:
            q = ops.linear(ops.rms_norm(q.contiguous(), layer.q_a_norm, cfg.rms_eps)[0], layer.q_b)
        q = q.reshape(n, heads, mla.qk_head_dim)
        # W_UK absorbed into the query; at a few rows on the side stream, beside the latent write (side_stream.py)
        absorb = ("nhd,hdr->nhr", q[..., :mla.qk_nope_dim], layer.k_up)
        beside = side_stream.Beside(h.device, torch.einsum, *absorb) if side_stream.takes(h.device, n) else None
        # the latent row [rms_norm(c_kv) | rotated k_rope] into the cache, and the queries' rope dims rotated
        q_rope = ops.mla_latent(q[..., mla.qk_nope_dim:], kv_a, layer.kv_a_norm, cfg.rms_eps, positions, self.cos_sin,
                                False, cache, meta.slot_mapping)
        q_latent = beside.join() if beside else torch.einsum(*absorb)
        latent_out = ops.mla_attention(q_latent, q_rope, cache, meta, self.scale)
        # W_UV, written as o's input (in o's operand dtype and column order where the kernel takes it)
        out, order = ops.mla_value(latent_out, layer.v_up, layer.o, h.dtype)
        return ops.linear(out, layer.o, dtype=h.dtype, x_order=order)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        """token_ids, positions: [N] -> final-normed hidden states [N, d_model]. k_caches: the latent caches
        (v_caches is empty: MLA keeps no V)."""
        cfg = self.cfg
        x = self.embed[token_ids]
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = ops.rms_norm(x, layer.attn_norm, cfg.rms_eps, residual)
            x = self.attention(layer, h, positions, meta, k_caches[i])
            h, residual = ops.rms_norm(x, layer.ffn_norm, cfg.rms_eps, residual)
            if layer.moe is not None:
                x = layer.moe(h)
            else:
                x = ops.feed_forward(h, layer.gate_up, layer.down, cfg.activation)
        out, _ = ops.rms_norm(x, self.final_norm, cfg.rms_eps, residual)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear(hidden, self.lm_head).float()
