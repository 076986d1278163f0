"""ModelConfig: the numbers a model forward needs, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from cobatch.errors import UserError

# Architectures and their rope layout: llama-arch GGUFs store Q/K permuted for NORM (adjacent pairs);
# qwen2/qwen3 keep the HF layout and rotate halves (NEOX). This comes from the arch, never from guessing.
# qwen2moe / qwen3moe are qwen2 / qwen3 with routed experts; llama with `llama.expert_count` is Mixtral.
# phi3 (Phi-3, Phi-3.5, Phi-4) stores q|k|v and gate|up each as one tensor, which is how cobatch fuses them anyway.
SUPPORTED_ARCHS = {"llama": False, "qwen2": True, "qwen3": True, "qwen2moe": True, "qwen3moe": True, "phi3": True}
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
        )


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
    if kind not in ("linear", "llama3"):
        raise UserError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")
    return {
        "type": kind,
        "factor": float(factor),
        "original_context": int(md.get(f"{arch}.rope.scaling.original_context_length", 8192)),
        "low_freq_factor": float(md.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
        "high_freq_factor": float(md.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
    }
