"""A Hugging Face checkpoint's config.json as the GGUF metadata and tensor names the models read.

The families map onto the GGUF architectures (llama.cpp's convert_hf_to_gguf.py does the same renaming), so
ModelConfig.from_metadata and models/ see one description whatever the source. What differs is stated where it
is handled: HF keeps q/k unpermuted (rotate_half), so every HF family rotates halves (NEOX) but DeepSeek, whose
rope dims rotate adjacent pairs in both (HF's complex or interleaved rope); gemma's RMSNorm weights are stored
less 1 (HF computes x * (1 + w)); gemma's q scale and gemma3's local rope base are in the config rather than
inferred; granite's four multipliers are config fields that become the GGUF keys llama.cpp writes. DeepSeek-V2
and V3 map onto llama.cpp's deepseek2 as its convert_hf_to_gguf.py writes it: the MLA widths, the router's kind
(V3: sigmoid and a correction bias, e_score_correction_bias), its groups and scale, and YaRN's log multiplier
(0.1 mscale_all_dim).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from cobatch.config import GEMMA_SWA_PATTERN, ModelConfig
from cobatch.errors import UserError

# architectures entry -> (HF model_type, GGUF arch)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"), "MistralForCausalLM": ("mistral", "llama"),
    "MixtralForCausalLM": ("mixtral", "llama"), "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"), "Qwen2MoeForCausalLM": ("qwen2_moe", "qwen2moe"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3moe"), "Phi3ForCausalLM": ("phi3", "phi3"),
    "Gemma2ForCausalLM": ("gemma2", "gemma2"), "Gemma3ForCausalLM": ("gemma3_text", "gemma3"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "deepseek2"), "DeepseekV3ForCausalLM": ("deepseek_v3", "deepseek2"),
    "GraniteForCausalLM": ("granite", "granite"),
}
# granite's multipliers: config.json's name -> the GGUF key (after `granite.`)
GRANITE_SCALES = {"embedding_multiplier": "embedding_scale", "attention_multiplier": "attention.scale",
                  "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True, slots=True)
class TensorSource:
    """Where a GGUF-named tensor comes from: one HF tensor, or several stacked by rows (a layer's experts)."""
    names: tuple[str, ...]
    plus_one: bool = False       # gemma norms: HF stores w - 1


def architecture(config: Mapping[str, Any]) -> tuple[str, str]:
    """(HF model_type, GGUF arch) of a config.json, or a UserError naming the unsupported entry."""
    entries = config.get("architectures") or []
    for entry in entries:
        if entry in ARCHITECTURES:
            return ARCHITECTURES[entry]
    named = ", ".join(map(str, entries)) or f"none (model_type {config.get('model_type')!r})"
    raise UserError(f"unsupported architecture {named} (supported: {', '.join(ARCHITECTURES)})")


def _rope(config: Mapping[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """rope_scaling (transformers 4) or rope_parameters (5; gemma3's one per layer type) as one dict, with
    rope_theta: the global layers' (or layer_type's)."""
    params = dict(config.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.update(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def metadata(config: Mapping[str, Any], model_type: str, arch: str, name: str) -> dict[str, Any]:
    """GGUF-style metadata (`{arch}.embedding_length`, ...) for config.json."""
    d_model, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or d_model // n_heads)
    rope = _rope(config)
    md: dict[str, Any] = {
        "general.architecture": arch, "general.name": name,
        f"{arch}.embedding_length": d_model, f"{arch}.attention.head_count": n_heads,
        f"{arch}.attention.head_count_kv": int(config.get("num_key_value_heads") or n_heads),
        f"{arch}.attention.key_length": head_dim, f"{arch}.block_count": int(config["num_hidden_layers"]),
        f"{arch}.feed_forward_length": int(config.get("intermediate_size") or 0),
        f"{arch}.vocab_size": int(config["vocab_size"]),
        f"{arch}.context_length": int(config.get("max_position_embeddings") or 4096),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        f"{arch}.rope.freq_base": float(rope["rope_theta"]),
        f"{arch}.rope.dimension_count": int(head_dim * float(config.get("partial_rotary_factor", 1.0))),
    }
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind in ("llama3", "linear", "yarn"):
        md.update({f"{arch}.rope.scaling.type": kind, f"{arch}.rope.scaling.factor": float(rope["factor"])})
        for gguf_key, hf_key in (("original_context_length", "original_max_position_embeddings"),
                                 ("low_freq_factor", "low_freq_factor"), ("high_freq_factor", "high_freq_factor"),
                                 ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if rope.get(hf_key) is not None:
                md[f"{arch}.rope.scaling.{gguf_key}"] = rope[hf_key]
    elif kind in ("longrope", "su"):
        # phi3 LongRoPE: the factor lists become the rope_factors_* tensors (loader/hf.py); q and k scaled as
        # convert_hf_to_gguf.py computes it
        original = int(config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"])
        scale = int(config["max_position_embeddings"]) / original
        md[f"{arch}.rope.scaling.original_context_length"] = original
        md[f"{arch}.rope.scaling.attn_factor"] = (math.sqrt(1 + math.log(scale) / math.log(original))
                                                  if scale > 1 else 1.0)
    elif kind != "default":
        raise UserError(f"config.json: unsupported rope scaling {kind!r} (supported: linear, llama3, yarn, longrope)")
    if model_type in DEEPSEEK:
        md.update(_deepseek(config, model_type, rope, kind))
        return md
    n_experts = _n_experts(config)
    if n_experts:
        if int(config.get("decoder_sparse_step") or 1) != 1 or config.get("mlp_only_layers"):
            raise UserError("config.json: dense layers between the expert layers (decoder_sparse_step, "
                            "mlp_only_layers) are not supported")
        md.update({f"{arch}.expert_count": n_experts,
                   f"{arch}.expert_used_count": int(config["num_experts_per_tok"]),
                   f"{arch}.expert_feed_forward_length": int(config.get("moe_intermediate_size")
                                                              or config["intermediate_size"]),
                   f"{arch}.expert_weights_norm": bool(config.get("norm_topk_prob", model_type == "mixtral"))})
        if config.get("shared_expert_intermediate_size"):
            md[f"{arch}.expert_shared_feed_forward_length"] = int(config["shared_expert_intermediate_size"])
    if arch == "granite":
        md.update({f"granite.{key}": float(config[name]) for name, key in GRANITE_SCALES.items()
                   if config.get(name) is not None})
    if arch in GEMMA_SWA_PATTERN:
        md[f"{arch}.attention.sliding_window"] = int(config["sliding_window"])
        if arch == "gemma2":
            md["gemma2.attn_logit_softcapping"] = config.get("attn_logit_softcapping") or 0.0
            md["gemma2.final_logit_softcapping"] = config.get("final_logit_softcapping") or 0.0
    return md


def _n_experts(config: Mapping[str, Any]) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0)


def _deepseek(config: Mapping[str, Any], model_type: str, rope: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """deepseek2's keys for a DeepseekV2 / V3 config.json (MLA, the routed and shared experts, YaRN)."""
    a = "deepseek2."
    if int(config.get("moe_layer_freq") or 1) != 1:
        raise UserError("config.json: moe_layer_freq other than 1 (dense layers between the expert layers) is not "
                        "supported")
    if model_type == "deepseek_v3" and config.get("rope_interleave") is False:
        raise UserError("config.json: rope_interleave false (rotate_half on the rope dims) is not supported: cobatch "
                        "runs DeepSeek's rope on adjacent pairs")
    nope, rope_dim = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    rank = int(config["kv_lora_rank"])
    method = config.get("topk_method") or ("noaux_tc" if model_type == "deepseek_v3" else "greedy")
    sigmoid = model_type == "deepseek_v3" or config.get("scoring_func") == "sigmoid"
    md = {a + "attention.head_count_kv": int(config["num_attention_heads"]),
          a + "attention.kv_lora_rank": rank, a + "attention.key_length": rank + rope_dim,
          a + "attention.value_length": rank, a + "attention.key_length_mla": nope + rope_dim,
          a + "attention.value_length_mla": int(config["v_head_dim"]), a + "rope.dimension_count": rope_dim,
          a + "leading_dense_block_count": int(config.get("first_k_dense_replace") or 0),
          a + "expert_count": int(config["n_routed_experts"]),
          a + "expert_used_count": int(config["num_experts_per_tok"]),
          a + "expert_feed_forward_length": int(config["moe_intermediate_size"]),
          a + "expert_shared_count": int(config.get("n_shared_experts") or 0),
          a + "expert_weights_scale": float(config.get("routed_scaling_factor") or 1.0),
          a + "expert_weights_norm": bool(config.get("norm_topk_prob", False)),
          a + "expert_gating_func": 2 if sigmoid else 1}
    if config.get("q_lora_rank"):
        md[a + "attention.q_lora_rank"] = int(config["q_lora_rank"])
    if method != "greedy":      # group_limited_greedy (V2), noaux_tc (V3): only the best groups' experts compete
        md.update({a + "expert_group_count": int(config.get("n_group") or 1),
                   a + "expert_group_used_count": int(config.get("topk_group") or 1)})
    if kind == "yarn":
        mscale, mscale_all = float(rope.get("mscale") or 1.0), float(rope.get("mscale_all_dim") or 0.0)
        if mscale_all and mscale != mscale_all:
            raise UserError(f"config.json: YaRN with mscale {mscale} and mscale_all_dim {mscale_all} (cos and sin "
                            "scaled by their ratio) is not supported; cobatch runs them equal, as DeepSeek's models")
        md[a + "rope.scaling.yarn_log_multiplier"] = 0.1 * mscale_all
    return md


def model_config(config: Mapping[str, Any], md: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    cfg = ModelConfig.from_metadata(md, tensor_names)
    # HF checkpoints keep q and k as trained (rotate_half): every family rotates halves, llama and mistral too;
    # DeepSeek's rope dims rotate adjacent pairs there as in GGUF
    changes: dict[str, Any] = {"rope_neox": cfg.arch != "deepseek2"}
    if cfg.arch in GEMMA_SWA_PATTERN:
        if config.get("query_pre_attn_scalar"):
            changes["attn_scale"] = float(config["query_pre_attn_scalar"]) ** -0.5
        if cfg.arch == "gemma3":
            local = _rope(config, "sliding_attention")
            changes["rope_theta_local"] = float(config.get("rope_local_base_freq") or local["rope_theta"])
        _check_layer_types(config, cfg)
    if not config.get("tie_word_embeddings", cfg.arch in GEMMA_SWA_PATTERN) and "output.weight" not in tensor_names:
        raise UserError("config.json says the output head is not tied to the embeddings, but the checkpoint has "
                        "no lm_head.weight")
    return dataclasses.replace(cfg, **changes)


def _check_layer_types(config: Mapping[str, Any], cfg: ModelConfig) -> None:
    """gemma: the local / global layers cobatch runs (every swa_pattern-th global) are the checkpoint's."""
    kinds = config.get("layer_types")
    if kinds is None:
        return
    ours = ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.n_layers)]
    if list(kinds) != ours:
        raise UserError(f"config.json: layer_types {kinds} is not the {cfg.arch} pattern (one global layer in "
                        f"{cfg.swa_pattern})")


def tensor_sources(model_type: str, config: Mapping[str, Any], n_layers: int) -> dict[str, TensorSource]:
    """GGUF tensor name -> the HF tensors it is made of, for every tensor this family may have (a checkpoint
    holds a subset: biases, fused projections and tied heads are optional)."""
    gemma = model_type in ("gemma2", "gemma3_text")
    out: dict[str, TensorSource] = {"token_embd.weight": TensorSource(("model.embed_tokens.weight",)),
                                    "output_norm.weight": TensorSource(("model.norm.weight",), gemma)}
    if not config.get("tie_word_embeddings", gemma):
        out["output.weight"] = TensorSource(("lm_head.weight",))
    n_experts = _n_experts(config)
    shared = "shared_experts" if model_type in DEEPSEEK else "shared_expert"
    for i in range(n_layers):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."

        def add(gguf_name: str, *hf_names: str, norm: bool = False) -> None:
            out[blk + gguf_name] = TensorSource(tuple(hf + n for n in hf_names), norm and gemma)

        add("attn_norm.weight", "input_layernorm.weight", norm=True)
        for x in "qkv":
            add(f"attn_{x}.weight", f"self_attn.{x}_proj.weight")
            add(f"attn_{x}.bias", f"self_attn.{x}_proj.bias")
        add("attn_qkv.weight", "self_attn.qkv_proj.weight")                       # phi3
        add("attn_output.weight", "self_attn.o_proj.weight")
        if model_type in DEEPSEEK:      # MLA: q straight or through its LoRA pair, the latent and its up-projection
            for gguf_name, hf_name in (("attn_q_a", "q_a_proj"), ("attn_q_a_norm", "q_a_layernorm"),
                                       ("attn_q_b", "q_b_proj"), ("attn_kv_a_mqa", "kv_a_proj_with_mqa"),
                                       ("attn_kv_a_norm", "kv_a_layernorm"), ("attn_kv_b", "kv_b_proj")):
                add(f"{gguf_name}.weight", f"self_attn.{hf_name}.weight")
            add("exp_probs_b.bias", "mlp.gate.e_score_correction_bias")
        add("attn_q_norm.weight", "self_attn.q_norm.weight", norm=True)
        add("attn_k_norm.weight", "self_attn.k_norm.weight", norm=True)
        if gemma:
            add("post_attention_norm.weight", "post_attention_layernorm.weight", norm=True)
            add("ffn_norm.weight", "pre_feedforward_layernorm.weight", norm=True)
            add("post_ffw_norm.weight", "post_feedforward_layernorm.weight", norm=True)
        else:
            add("ffn_norm.weight", "post_attention_layernorm.weight")
        if model_type == "phi3":
            add("ffn_up.weight", "mlp.gate_up_proj.weight")                       # gate rows first
        else:
            add("ffn_gate.weight", "mlp.gate_proj.weight")
            add("ffn_up.weight", "mlp.up_proj.weight")
        add("ffn_down.weight", "mlp.down_proj.weight")
        if model_type == "mixtral":
            add("ffn_gate_inp.weight", "block_sparse_moe.gate.weight")
            for x, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                add(f"ffn_{x}_exps.weight", *(f"block_sparse_moe.experts.{e}.{w}.weight" for e in range(n_experts)))
        elif n_experts:
            add("ffn_gate_inp.weight", "mlp.gate.weight")
            for x in ("gate", "up", "down"):
                add(f"ffn_{x}_exps.weight", *(f"mlp.experts.{e}.{x}_proj.weight" for e in range(n_experts)))
                add(f"ffn_{x}_shexp.weight", f"mlp.{shared}.{x}_proj.weight")
            add("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight")
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for each GGUF-named tensor, as HF stores it ([out, in]; experts one by one)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d),
                                          "output.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    expert_ffn = cfg.expert_ffn_dim
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (d,), b + "ffn_norm.weight": (d,), b + "attn_q.weight": (q, d),
                       b + "attn_k.weight": (kv, d), b + "attn_v.weight": (kv, d), b + "attn_q.bias": (q,),
                       b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,), b + "attn_qkv.weight": (q + 2 * kv, d),
                       b + "attn_output.weight": (d, q), b + "attn_q_norm.weight": (cfg.head_dim,),
                       b + "attn_k_norm.weight": (cfg.head_dim,), b + "post_attention_norm.weight": (d,),
                       b + "post_ffw_norm.weight": (d,)})
        if cfg.mla is not None:
            shapes.update(_mla_shapes(cfg, b))
        if cfg.moe_layer(i):
            shapes.update({b + "ffn_gate_inp.weight": (cfg.n_experts, d), b + "ffn_gate_exps.weight": (expert_ffn, d),
                           b + "ffn_up_exps.weight": (expert_ffn, d), b + "ffn_down_exps.weight": (d, expert_ffn),
                           b + "ffn_gate_shexp.weight": (cfg.shared_expert_ffn_dim, d),
                           b + "ffn_up_shexp.weight": (cfg.shared_expert_ffn_dim, d),
                           b + "ffn_down_shexp.weight": (d, cfg.shared_expert_ffn_dim),
                           b + "ffn_gate_inp_shexp.weight": (1, d), b + "exp_probs_b.bias": (cfg.n_experts,)})
        else:
            fused_up = 2 * cfg.ffn_dim if cfg.arch == "phi3" else cfg.ffn_dim
            shapes.update({b + "ffn_gate.weight": (cfg.ffn_dim, d), b + "ffn_up.weight": (fused_up, d),
                           b + "ffn_down.weight": (d, cfg.ffn_dim)})
    return shapes


def _mla_shapes(cfg: ModelConfig, b: str) -> dict[str, tuple[int, ...]]:
    """DeepSeek's attention tensors of layer prefix b: q (straight or its LoRA pair), the latent's projection and
    norm, its up-projection to each head's nope key and value, the output from each head's value."""
    mla, d, heads = cfg.mla, cfg.d_model, cfg.n_heads
    return {b + "attn_q.weight": (heads * mla.qk_head_dim, d), b + "attn_q_a.weight": (mla.q_lora_rank, d),
            b + "attn_q_a_norm.weight": (mla.q_lora_rank,), b + "attn_q_b.weight": (heads * mla.qk_head_dim,
                                                                                   mla.q_lora_rank),
            b + "attn_kv_a_mqa.weight": (mla.latent_dim, d), b + "attn_kv_a_norm.weight": (mla.kv_lora_rank,),
            b + "attn_kv_b.weight": (heads * (mla.qk_nope_dim + mla.v_head_dim), mla.kv_lora_rank),
            b + "attn_output.weight": (d, heads * mla.v_head_dim)}
