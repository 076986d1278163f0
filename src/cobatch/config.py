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
# deepseek2 (DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2, Moonlight): multi-head latent attention (MLA) and shared plus
# routed experts after some dense layers; its rope dims rotate adjacent pairs (NORM), unpermuted.
# granite / granitemoe (IBM Granite 3.x): llama's layout (granitemoe: with routed experts) and four multipliers,
# on the embeddings, q.k, each sublayer's output before the residual add, and the logits (divided).
SUPPORTED_ARCHS = {"llama": False, "qwen2": True, "qwen3": True, "qwen2moe": True, "qwen3moe": True, "phi3": True,
                   "gemma2": True, "gemma3": True, "deepseek2": False, "granite": False, "granitemoe": False}
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}   # every n-th layer is global (llama.cpp's and transformers')
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models scale q by d_model / n_heads, not head_dim
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # gemma3's sliding-window layers' rope base (not in the GGUF metadata)
# Whether the top-k routing weights are renormalized to sum to 1, as llama.cpp's build_moe_ffn is told per
# arch (Mixtral and Qwen3-MoE do; Qwen1.5/2-MoE do not). `{arch}.expert_weights_norm` overrides it.
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True, "deepseek2": False, "granitemoe": True}
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}   # {arch}.expert_gating_func, as gguf-py's ExpertGatingFuncType


@dataclass(frozen=True, slots=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek): q through an optional low-rank pair, k and v through one shared
    latent of kv_lora_rank per token (plus a rope key of qk_rope_dim shared by all heads), which is what the KV
    cache holds."""
    q_lora_rank: int        # 0: q straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_dim: int        # per-head query/key dims without position
    qk_rope_dim: int        # per-head query dims that rotate; the key's are shared
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def latent_dim(self) -> int:
        """One cached token: the normalized latent c_kv, then the rotated k_rope."""
        return self.kv_lora_rank + self.qk_rope_dim


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
    embed_scale_in_dtype: bool = True  # gemma rounds that scale to the activations' dtype first; granite does not
    residual_scale: float = 1.0   # granite: each sublayer's output is multiplied by it before the residual add
    logit_scale: float = 1.0      # granite: the output logits are divided by it
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
    expert_weights_scale: float = 1.0  # deepseek2: the chosen weights times this (routed_scaling_factor)
    expert_gating: str = "softmax"     # deepseek2: "softmax" (V2) or "sigmoid" with a correction bias (V3)
    expert_groups: int = 0             # deepseek2: experts in this many groups, the top token's ...
    expert_groups_used: int = 0        # ... this many groups only (0: no group limit)
    leading_dense_layers: int = 0      # deepseek2: the first layers have a dense feed-forward
    mla: MlaShape | None = None        # deepseek2: multi-head latent attention
    yarn_log_multiplier: float = 0.0   # deepseek2: q.k scale times (1 + this * ln(yarn factor)) ** 2

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
        fields = dict(
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
        )
        fields.update(_experts(md, arch, tensor_names))
        if arch in GEMMA_SWA_PATTERN:
            fields.update(_gemma(md, arch, n_layers=int(get("block_count")), d_model=d_model, n_heads=n_heads))
        if arch == "deepseek2":
            fields.update(_deepseek(md, arch, tensor_names))
        if arch.startswith("granite"):
            fields.update(_granite(md, arch))
        return cls(**fields)

    @property
    def kv_cache_heads(self) -> tuple[int, int, int]:
        """(heads, k width, v width) of one token's KV cache entry per layer. MLA caches one "head" of
        latent | rope key and no V (the latent is both, read through the absorbed projections)."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, 0
        return self.n_kv_heads, self.head_dim, self.head_dim

    @property
    def gqa_equivalent_kv_heads(self) -> tuple[int, int, int]:
        """What the cache would hold per token and layer if the attention kept full K and V heads (MLA: one K
        head of qk_head_dim and one V head of v_head_dim per query head, as the decompressed form has)."""
        if self.mla is not None:
            return self.n_heads, self.mla.qk_head_dim, self.mla.v_head_dim
        return self.kv_cache_heads

    def moe_layer(self, layer: int) -> bool:
        """Does this layer route to experts (else a dense feed-forward)?"""
        return self.n_experts > 0 and layer >= self.leading_dense_layers

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


def _granite(md: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """Granite's multipliers (HF's embedding_multiplier, attention_multiplier, residual_multiplier and
    logits_scaling). One left out or 0 is the default (1; q.k's head_dim ** -0.5), as llama.cpp reads them; a
    negative one is refused."""
    def scale(key: str, default: float) -> float:
        value = float(md.get(f"{arch}.{key}") or 0.0)
        if value < 0 or value != value:
            raise UserError(f"{arch}.{key} is {value}, expected a positive number")
        return value or default
    return {"embed_scale": scale("embedding_scale", 1.0), "embed_scale_in_dtype": False,
            "attn_scale": scale("attention.scale", 0.0), "residual_scale": scale("residual_scale", 1.0),
            "logit_scale": scale("logit_scale", 1.0)}


def _experts(md: Mapping[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    n_experts = int(md.get(f"{arch}.expert_count") or 0)
    if n_experts == 0:
        if arch.endswith("moe"):
            raise UserError(f"GGUF metadata lacks {arch}.expert_count")
        return {}
    first = int(md.get(f"{arch}.leading_dense_block_count") or 0)     # the first layer with experts
    if f"blk.{first}.ffn_gate_exps.weight" not in tensor_names:
        raise UserError("this mixture-of-experts GGUF stores its experts as separate tensors per expert "
                        "(an old layout); convert it again with a current llama.cpp")
    used = int(md.get(f"{arch}.expert_used_count") or 0)
    if not 1 <= used <= n_experts:
        raise UserError(f"{arch}.expert_used_count is {used}, expected 1..{n_experts}")
    ffn = md.get(f"{arch}.expert_feed_forward_length") or md.get(f"{arch}.feed_forward_length")
    # qwen2moe gives the shared expert's width; deepseek2 its count of expert widths
    shared = (md.get(f"{arch}.expert_shared_feed_forward_length")
              or int(md.get(f"{arch}.expert_shared_count") or 0) * int(ffn))
    has_shared = f"blk.{first}.ffn_gate_shexp.weight" in tensor_names
    if has_shared and not shared:
        raise UserError(f"GGUF metadata lacks {arch}.expert_shared_feed_forward_length")
    return {"n_experts": n_experts, "n_experts_used": used, "expert_ffn_dim": int(ffn),
            "shared_expert_ffn_dim": int(shared) if has_shared else 0,
            "expert_weights_norm": bool(md.get(f"{arch}.expert_weights_norm", _EXPERT_WEIGHTS_NORM[arch]))}


def _deepseek(md: Mapping[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """MLA's shape and DeepSeek's routing. llama.cpp writes key_length / value_length as the latent's widths
    (kv_lora_rank + rope, kv_lora_rank) and the per-head ones as key_length_mla / value_length_mla; files
    converted before that hold the per-head ones in key_length / value_length."""
    def need(key: str) -> Any:
        value = md.get(f"{arch}.{key}")
        if value is None:
            raise UserError(f"GGUF metadata lacks {arch}.{key}")
        return value

    rope = int(need("rope.dimension_count"))
    if f"{arch}.attention.key_length_mla" in md:
        qk_head, v_head = int(need("attention.key_length_mla")), int(need("attention.value_length_mla"))
    else:
        qk_head, v_head = int(need("attention.key_length")), int(need("attention.value_length"))
    q_lora = int(md.get(f"{arch}.attention.q_lora_rank") or 0)
    if q_lora and "blk.0.attn_q_a.weight" not in tensor_names:
        raise UserError(f"{arch}.attention.q_lora_rank is {q_lora}, but the file has no attn_q_a tensors")
    if not 0 < rope < qk_head or rope % 2:
        raise UserError(f"{arch}.rope.dimension_count is {rope}: expected an even number below the key's {qk_head}")
    mla = MlaShape(q_lora_rank=q_lora, kv_lora_rank=int(need("attention.kv_lora_rank")),
                   qk_nope_dim=qk_head - rope, qk_rope_dim=rope, v_head_dim=v_head)
    traits: dict[str, Any] = {"mla": mla, "head_dim": qk_head, "rope_dim": rope,
                              "leading_dense_layers": int(md.get(f"{arch}.leading_dense_block_count") or 0),
                              "yarn_log_multiplier": float(md.get(f"{arch}.rope.scaling.yarn_log_multiplier") or 0)}
    gating = int(md.get(f"{arch}.expert_gating_func") or 1)   # files from before the key: V2's softmax
    if gating not in _GATING_FUNCS:
        raise UserError(f"{arch}.expert_gating_func is {gating}: cobatch knows 1 (softmax) and 2 (sigmoid)")
    groups = int(md.get(f"{arch}.expert_group_count") or 0)
    groups_used = int(md.get(f"{arch}.expert_group_used_count") or 0)
    n_experts = int(md.get(f"{arch}.expert_count") or 0)
    if groups > 1 and (n_experts % groups or not 1 <= groups_used <= groups):
        raise UserError(f"{arch}: {n_experts} experts in {groups} groups of which {groups_used} are used "
                        "is not a grouping")
    limited = groups > 1 and groups_used < groups     # all groups used: no limit
    n_used = int(md.get(f"{arch}.expert_used_count") or 0)
    if limited and n_used > groups_used * (n_experts // groups):
        raise UserError(f"{arch}: {n_used} experts a token from {groups_used} of {groups} groups of "
                        f"{n_experts // groups}: the groups hold fewer")
    traits.update(expert_gating=_GATING_FUNCS[gating],
                  expert_weights_scale=float(md.get(f"{arch}.expert_weights_scale") or 1.0),
                  expert_groups=groups if limited else 0, expert_groups_used=groups_used if limited else 0)
    return traits


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
