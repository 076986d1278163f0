"""ModelConfig: the numbers a model forward needs, read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from cobatch.errors import UserError

# Architectures and their rope layout: llama-arch GGUFs store Q/K permuted for NORM (adjacent pairs);
# qwen2/qwen3 keep the HF layout and rotate halves (NEOX). This comes from the arch, never from guessing.
# qwen2moe / qwen3moe are qwen2 / qwen3 with routed experts; llama with `llama.expert_count` is Mixtral.
# phi3 (Phi-3, Phi-3.5, Phi-4) stores q|k|v and gate|up each as one tensor, which is how cobatch fuses them anyway.
# gemma2 / gemma3 (text): tanh-GELU gating, embeddings scaled by sqrt(d_model), norms after each sublayer too,
# and sliding-window layers: every other one in gemma2 (with soft-capped attention and logits), five of six in
# gemma3 (with their own rope base).
SUPPORTED_ARCHS = {"llama": False, "qwen2": True, "qwen3": True, "qwen2moe": True, "qwen3moe": True, "phi3": True,
                   "gemma2": True, "gemma3": True}
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}   # every n-th layer is global (llama.cpp's and transformers')
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models scale q by d_model / n_heads, not head_dim
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # gemma3's sliding-window layers' rope base (not in the GGUF metadata)
# Whether the top-k routing weights are renormalized to sum to 1, as llama.cpp's build_moe_ffn is told per
# arch (Mixtral and Qwen3-MoE do; Qwen1.5/2-MoE do not). `{arch}.expert_weights_norm` overrides it.
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    rope_neox: bool
    rope_scaling: dict | None     # {"type": "llama3"|"linear", "factor": ..., ...} when present
    qkv_bias: bool                # qwen2
    qk_norm: bool                 # qwen3
    rope_original_context: int = 0  # phi3 LongRoPE: past this context the "long" frequency factors apply
    rope_attn_factor: float = 1.0   # phi3 LongRoPE: cos and sin are scaled by it (HF's attention_factor)
    activation: str = "silu"      # of the gated feed-forward: "silu" or "gelu_tanh" (gemma)
    embed_scale: float = 1.0      # input embeddings are multiplied by it (gemma: sqrt(d_model))
    attn_scale: float = 0.0       # q.k scale (0: head_dim ** -0.5)
    post_norms: bool = False      # gemma: RMSNorm on each sublayer's output before the residual add
    sliding_window: int = 0       # > 0: the local layers attend to their last sliding_window keys only
    swa_pattern: int = 0          # every swa_pattern-th layer is global (the others local)
    rope_theta_local: float = 0.0  # the local layers' rope base
    attn_softcap: float = 0.0     # gemma2: attention scores soft-capped at this (0: not)
    final_softcap: float = 0.0    # gemma2: output logits soft-capped at this (0: not)
    n_experts: int = 0            # routed experts per layer (0: a dense feed-forward)
    n_experts_used: int = 0       # experts each token is routed to (top-k)
    expert_ffn_dim: int = 0       # hidden width of one expert
    shared_expert_ffn_dim: int = 0  # qwen2moe: an always-on expert beside the routed ones (0: none)
    expert_weights_norm: bool = False  # renormalize the top-k routing weights to sum to 1

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise UserError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

        def get(key: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{key}", default)
            if value is None:
                raise UserError(f"GGUF metadata lacks {arch}.{key}")
            return value

        d_model = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        n_kv = get("attention.head_count_kv", n_heads)
        n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
        head_dim = int(md.get(f"{arch}.attention.key_length", d_model // n_heads))
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
        return cls(
            arch=arch,
            name=str(md.get("general.name", arch)),
            n_layers=int(get("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            context_length=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(md.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_neox=SUPPORTED_ARCHS[arch],
            rope_scaling=_rope_scaling(md, arch),
            rope_original_context=int(md.get(f"{arch}.rope.scaling.original_context_length")
                                      or get("context_length", 4096)),
            rope_attn_factor=float(md.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            **_experts(md, arch, tensor_names),
            **(_gemma(md, arch, n_layers=int(get("block_count")), d_model=d_model, n_heads=n_heads)
               if arch in GEMMA_SWA_PATTERN else {}),
        )

    def layer_window(self, layer: int) -> int:
        """The sliding window of a layer, 0 for a global one."""
        if not self.sliding_window or (layer + 1) % self.swa_pattern == 0:
            return 0
        return self.sliding_window


def _gemma(md: Mapping[str, Any], arch: str, n_layers: int, d_model: int, n_heads: int) -> dict[str, Any]:
    head_dim = int(md.get(f"{arch}.attention.key_length", d_model // n_heads))
    # The 27B models scale q by d_model / n_heads instead of head_dim (query_pre_attn_scalar); the GGUF does
    # not say, so it is told by the layer count, as llama.cpp does.
    attn_scalar = d_model / n_heads if n_layers == GEMMA_27B_LAYERS[arch] else head_dim
    window = md.get(f"{arch}.attention.sliding_window")
    if not window:
        raise UserError(f"GGUF metadata lacks {arch}.attention.sliding_window")
    traits = {"activation": "gelu_tanh", "embed_scale": math.sqrt(d_model), "attn_scale": attn_scalar ** -0.5,
              "post_norms": True, "sliding_window": int(window), "swa_pattern": GEMMA_SWA_PATTERN[arch]}
    if arch == "gemma2":
        traits.update(rope_theta_local=float(md.get("gemma2.rope.freq_base", 10000.0)),
                      attn_softcap=float(md.get("gemma2.attn_logit_softcapping") or 0.0),
                      final_softcap=float(md.get("gemma2.final_logit_softcapping") or 0.0))
    else:
        traits["rope_theta_local"] = GEMMA3_LOCAL_ROPE_THETA
    return traits


def _experts(md: Mapping[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    n_experts = int(md.get(f"{arch}.expert_count") or 0)
    if n_experts == 0:
        if arch.endswith("moe"):
            raise UserError(f"GGUF metadata lacks {arch}.expert_count")
        return {}
    if "blk.0.ffn_gate_exps.weight" not in tensor_names:
        raise UserError("this mixture-of-experts GGUF stores its experts as separate tensors per expert "
                        "(an old layout); convert it again with a current llama.cpp")
    used = int(md.get(f"{arch}.expert_used_count") or 0)
    if not 1 <= used <= n_experts:
        raise UserError(f"{arch}.expert_used_count is {used}, expected 1..{n_experts}")
    ffn = md.get(f"{arch}.expert_feed_forward_length") or md.get(f"{arch}.feed_forward_length")
    shared = md.get(f"{arch}.expert_shared_feed_forward_length") or 0
    if "blk.0.ffn_gate_shexp.weight" in tensor_names and not shared:
        raise UserError(f"GGUF metadata lacks {arch}.expert_shared_feed_forward_length")
    return {"n_experts": n_experts, "n_experts_used": used, "expert_ffn_dim": int(ffn),
            "shared_expert_ffn_dim": int(shared) if "blk.0.ffn_gate_shexp.weight" in tensor_names else 0,
            "expert_weights_norm": bool(md.get(f"{arch}.expert_weights_norm", _EXPERT_WEIGHTS_NORM[arch]))}


def _rope_scaling(md: Mapping[str, Any], arch: str) -> dict | None:
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none", "longrope", "su") or not factor or float(factor) == 1.0:
        return None     # LongRoPE ships as rope_factors_long / _short tensors (models/llama.py)
    if kind not in ("linear", "llama3", "yarn"):
        raise UserError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3, yarn)")
    return {
        "type": kind,
        "factor": float(factor),
        "original_context": int(md.get(f"{arch}.rope.scaling.original_context_length", 8192)),
        "low_freq_factor": float(md.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
        "high_freq_factor": float(md.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
        "beta_fast": float(md.get(f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": float(md.get(f"{arch}.rope.scaling.yarn_beta_slow") or 1.0),
    }
