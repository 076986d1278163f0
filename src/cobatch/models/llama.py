"""The llama family (llama, mistral, mixtral, qwen2/3 and their MoE variants, phi3, gemma2/3) as one flat
forward over a batch of rows.

Rows from different sequences sit at different positions; attention goes through the paged KV cache.
All math goes through `cobatch.ops`, so the same code runs the torch references on the CPU and the
Triton kernels on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cobatch import ops
from cobatch.batch import AttentionMetadata
from cobatch.config import ModelConfig
from cobatch.kernels.operand_order import NATURAL
from cobatch.kernels.packed_experts import ROUTED_MAX_ROWS
from cobatch.kernels.rope import llama3_freq_factors, rope_cos_sin, yarn_attn_factor, yarn_freq_factors
from cobatch.loader.weights import WeightSource
from cobatch.loader.lora import Adapter
from cobatch.models.linear import WeightLoader, after_attention, load_gate_up
from cobatch.models.lora import LoraSet
from cobatch.models.moe import MoeFeedForward, route_on_device


@dataclass(slots=True)
class Layer:
    attn_norm: torch.Tensor
    qkv: object                  # fused q|k|v projection (see models/linear.py)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # qwen3 per-head norms
    k_norm: torch.Tensor | None
    o: object
    ffn_norm: torch.Tensor
    gate_up: object | None       # fused gate|up projection (dense feed-forward)
    down: object | None
    moe: MoeFeedForward | None = None   # routed experts instead of gate_up / down
    post_attn_norm: torch.Tensor | None = None   # gemma: on the attention output, before the residual add
    post_ffn_norm: torch.Tensor | None = None    # gemma: on the feed-forward output, likewise
    window: int = 0              # sliding window of a local layer (0: global)


def _gate_up(prefix: str, gguf: WeightSource, device: torch.device, dtype: torch.dtype, keep_dense: bool,
             interleave: bool = True) -> object:
    """The fused gate|up projection: phi3 stores it so (in ffn_up, gate first), the others as two tensors.
    interleave=False keeps gate rows then up rows whatever reads them (a LoRA adapter adds to them by row)."""
    if prefix + "ffn_gate.weight" not in gguf.tensors:
        fused = gguf.quant_weight(prefix + "ffn_up.weight")
        half = fused.rows // 2
        gate, up = fused.row_slice(0, half), fused.row_slice(half, fused.rows)
    else:
        gate, up = gguf.quant_weight(prefix + "ffn_gate.weight"), gguf.quant_weight(prefix + "ffn_up.weight")
    return load_gate_up(gate, up, device, dtype, keep_dense, interleave)


def _rope_table(cfg: ModelConfig, gguf: WeightSource, n_pos: int) -> torch.Tensor:
    """cos|sin of the (global) layers' rotation, with the file's rope scaling applied."""
    factors, linear_factor, attn_factor = None, 1.0, cfg.rope_attn_factor
    scaling = cfg.rope_scaling or {}
    if "rope_freqs.weight" in gguf.tensors:
        factors = gguf.float_tensor("rope_freqs.weight")
    elif "rope_factors_long.weight" in gguf.tensors:
        # phi3 LongRoPE: the long factors when the context goes past the original one (as llama.cpp chooses,
        # by the context it runs with), else the short ones.
        long = n_pos > cfg.rope_original_context
        factors = gguf.float_tensor("rope_factors_long.weight" if long else "rope_factors_short.weight")
    elif scaling.get("type") == "llama3":
        factors = llama3_freq_factors(cfg.rope_dim, cfg.rope_theta, scaling["factor"], scaling["low_freq_factor"],
                                      scaling["high_freq_factor"], scaling["original_context"])
    elif scaling.get("type") == "yarn":
        factors = yarn_freq_factors(cfg.rope_dim, cfg.rope_theta, scaling["factor"], scaling["original_context"],
                                    scaling["beta_fast"], scaling["beta_slow"])
        attn_factor *= yarn_attn_factor(scaling["factor"])
    if scaling.get("type") == "linear":     # positions divided, whatever per-frequency factors apply
        linear_factor = scaling["factor"]
    return rope_cos_sin(cfg.rope_dim, n_pos, cfg.rope_theta, factors, linear_factor, attn_factor)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, gguf: WeightSource, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_positions: int | None = None, progress=None,
                 keep_dense: bool = False, adapters: list[Adapter] = (), adapter_rows: int = 0,
                 adapter_slots: int = 0, adapter_rank: int = 0, runtime_adapters: bool = False):
        """adapters: LoRA adapters requests may run through (models/lora.py), for steps of up to adapter_rows;
        room for adapter_slots of rank adapter_rank, and with runtime_adapters for adapters loaded later."""
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        dev = self.device
        load = WeightLoader(gguf, dev, dtype, keep_dense)
        vec, lin = load.vec, load.linear

        self.layers: list[Layer] = []
        adapted_gate_up = ({layer for a in adapters for layer, part in a.pairs if part in ("gate", "up", "gate_up")}
                           | (set(range(cfg.n_layers)) if runtime_adapters else set()))
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=vec(p + "attn_norm.weight"),
                qkv=(lin(p + "attn_qkv.weight") if p + "attn_qkv.weight" in gguf.tensors     # phi3: stored fused
                     else lin(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")),
                qkv_bias=torch.cat([vec(p + f"attn_{x}.bias") for x in "qkv"]) if cfg.qkv_bias else None,
                q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None,
                o=after_attention(lin(p + "attn_output.weight")),
                ffn_norm=vec(p + "ffn_norm.weight"),
                gate_up=None if cfg.n_experts else _gate_up(p, gguf, dev, dtype, keep_dense,
                                                            interleave=i not in adapted_gate_up),
                down=None if cfg.n_experts else lin(p + "ffn_down.weight"),
                moe=MoeFeedForward(cfg, gguf, p, dev, dtype, keep_dense) if cfg.n_experts else None,
                post_attn_norm=vec(p + "post_attention_norm.weight") if cfg.post_norms else None,
                post_ffn_norm=vec(p + "post_ffw_norm.weight") if cfg.post_norms else None,
                window=cfg.layer_window(i),
            ))
            if progress is not None:
                progress(1)
        # The embedding is a gather, not a matmul: keep it dense. Tied models reuse it as the output head.
        # MoE: steps of up to ROUTED_MAX_ROWS rows route on the device and can be captured; where the experts'
        # format has no routed kernel, routing needs a host sync per layer (models/moe.py), which a captured
        # CUDA graph cannot hold.
        moes = self._moes = [layer.moe for layer in self.layers if layer.moe is not None]
        self.graph_safe = all(m.routed for m in moes)
        self.graph_max_rows: int | None = None
        if moes and self.graph_safe:
            self.graph_max_rows = ROUTED_MAX_ROWS
        self.embed = gguf.quant_weight("token_embd.weight").dequantize(dtype).to(dev)
        self.vocab_rows = self.embed.shape[0]
        # Tensor parallel (cobatch.parallel): the group this rank's shard belongs to; its collectives join the
        # ranks' partial results. None on one device: the forward below is then exactly the unsharded one.
        self.tp = None
        head = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        # Tied head on the CPU path: the dense embedding already is the head's weight; don't hold it twice.
        self.lm_head = self.embed if head == "token_embd.weight" and dev.type == "cpu" else lin(head)
        self.final_norm = vec("output_norm.weight")

        n_pos = max_positions or cfg.context_length
        self.cos_sin = _rope_table(cfg, gguf, n_pos).to(dev)
        # gemma3's sliding-window layers rotate with their own base and no scaling (gemma2's like the others).
        own_table = cfg.sliding_window and (cfg.rope_theta_local != cfg.rope_theta or cfg.rope_scaling)
        self.cos_sin_local = (rope_cos_sin(cfg.rope_dim, n_pos, cfg.rope_theta_local).to(dev) if own_table
                              else self.cos_sin)
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.lora = (LoraSet(cfg, list(adapters), dev, dtype, adapter_rows, adapter_slots, adapter_rank,
                             runtime_adapters) if adapters or runtime_adapters else None)

    def step_graph_holds(self, rows: int) -> bool:
        """Can a CUDA graph hold a step of `rows` rows with prefill chunks (engine/cuda_graphs.StepGraphs)? Not
        with adapters (staged a row each for the decode graphs), nor where an MoE layer would route them with a
        host sync (models/moe.py)."""
        return self.lora is None and route_on_device(self._moes, rows)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        """token_ids, positions: [N] -> final-normed hidden states [N, d_model]."""
        cfg = self.cfg
        n = token_ids.shape[0]
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        x = self.embed[token_ids] if self.tp is None else self.tp.embed(self.embed, token_ids)
        if cfg.embed_scale != 1.0:       # gemma rounds the scale to the dtype first, granite does not
            x = x * (torch.tensor(cfg.embed_scale, dtype=x.dtype) if cfg.embed_scale_in_dtype else cfg.embed_scale)
        residual = None
        dtype = x.dtype
        lora = self.lora
        for i, layer in enumerate(self.layers):
            # each normed or attended x in the dtype its weight's kernels read (ops.operand_dtype), so they need
            # not convert it; their outputs and the residual stream in the model's dtype
            # and where qkv's and gate|up's GEMM streams it, in its planes' column order (ops.operand_order), unless
            # an adapter reads the same rows
            order = ops.operand_order(layer.qkv, n, dtype) if lora is None else NATURAL
            h, residual = ops.rms_norm(x, layer.attn_norm, cfg.rms_eps, residual,
                                       out_dtype=ops.operand_dtype(layer.qkv, n, dtype), out_order=order)
            qkv = ops.linear(h, layer.qkv, dtype=dtype, x_order=order)
            if lora is not None:
                qkv = lora.add(i, "qkv", h, qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q = qkv[:, :q_size].reshape(n, cfg.n_heads, cfg.head_dim)
            k = qkv[:, q_size:q_size + kv_size].reshape(n, cfg.n_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size:].reshape(n, cfg.n_kv_heads, cfg.head_dim)
            cos_sin = self.cos_sin_local if layer.window else self.cos_sin
            qk_norm = (layer.q_norm, layer.k_norm, cfg.rms_eps) if layer.q_norm is not None else None
            order = (ops.operand_order(layer.o, n, dtype) if lora is None and ops.attention_orders(cfg.head_dim)
                     else NATURAL)
            attn = ops.rope_attention(q, k, v, positions, cos_sin, cfg.rope_neox, k_caches[i], v_caches[i], meta,
                                      self.scale, layer.window, cfg.attn_softcap,
                                      out_dtype=ops.operand_dtype(layer.o, n, dtype), qk_norm=qk_norm,
                                      out_order=order)
            attn = attn.reshape(n, q_size)
            x = ops.linear(attn, layer.o, dtype=dtype, x_order=order)
            if lora is not None:
                x = lora.add(i, "o", attn, x)
            if self.tp is not None:
                x = self.tp.all_reduce(x)
            if layer.post_attn_norm is not None:
                x, _ = ops.rms_norm(x, layer.post_attn_norm, cfg.rms_eps)
            if cfg.residual_scale != 1.0:   # granite
                x = x * cfg.residual_scale
            order = ops.operand_order(layer.gate_up, n, dtype) if lora is None else NATURAL   # MoE: no gate_up
            h, residual = ops.rms_norm(x, layer.ffn_norm, cfg.rms_eps, residual,
                                       out_dtype=ops.operand_dtype(layer.gate_up, n, dtype), out_order=order)
            if layer.moe is not None:
                x = layer.moe(h)
            elif lora is not None and (lora.touches(i, "gate_up") or lora.touches(i, "down")):
                x = lora.feed_forward(i, h, layer.gate_up, layer.down, cfg.activation, dtype)
            else:
                x = ops.feed_forward(h, layer.gate_up, layer.down, cfg.activation, dtype=dtype, h_order=order)
            if self.tp is not None:
                x = self.tp.all_reduce(x)
            if layer.post_ffn_norm is not None:
                x, _ = ops.rms_norm(x, layer.post_ffn_norm, cfg.rms_eps)
            if cfg.residual_scale != 1.0:
                x = x * cfg.residual_scale
        out, _ = ops.rms_norm(x, self.final_norm, cfg.rms_eps, residual)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden, self.lm_head)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        logits = logits.float()
        if self.cfg.logit_scale != 1.0:     # granite
            logits = logits / self.cfg.logit_scale
        if self.cfg.final_softcap:      # gemma2
            logits = self.cfg.final_softcap * torch.tanh(logits / self.cfg.final_softcap)
        return logits
