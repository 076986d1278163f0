"""Write GGUF files for tests and benchmarks: random weights in the shapes of real models, and real
models cut down to their first layers.

A random model carries a real tokenizer copied from a real GGUF (SmolLM2 by default), so the whole
serving path (chat template, tokenization, stop tokens) works on it; only the weights are noise
(matrices std 0.02, norms ~1). A vocabulary smaller than the shape's is padded with CONTROL tokens
"<|pad_N|>"; only "tiny" takes its vocabulary size from the tokenizer. Tensors are produced chunk by
chunk while they are written, so an 8.5 GB llama3-8b file never exists in memory.

Source files are read with RawGGUF, a small reader of the metadata and tensor directory that keeps
every record's bytes (for exact copies) and is ~50x faster than gguf-py's on large vocabularies.

Which format each matrix gets follows llama.cpp's quantizer (llama_tensor_get_type), simplified:
  * every 2-D matrix, the token embedding included, is in the requested format;
  * the output head (output.weight, or token_embd when embeddings are tied) is Q6_K for every
    quantized format other than Q8_0, as llama.cpp writes it;
  * "q4_k_m" / "q5_k_m" also put attn_v and ffn_down of llama.cpp's "more bits" layers in Q6_K;
  * a row length that is not a whole number of blocks falls back as llama.cpp does (Q4_K->Q5_0,
    Q5_K->Q5_1, Q6_K->Q8_0; Q2_K/Q3_K->Q4_0 where llama.cpp picks IQ4_NL, which cobatch does not
    decode). qwen2.5-0.5b (d_model 896) hits this, like the real Qwen2.5-0.5B K-quant files.

    python -m cobatch.testing.gguf_writer random --shape llama3-8b --quant q8_0 -o PATH [--layers N] [--seed S]
    python -m cobatch.testing.gguf_writer cut SRC DST --layers N
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter, LlamaFileType

from cobatch.config import MlaShape
from cobatch.errors import UserError
from cobatch.loader.gguf_raw import SCALAR_FORMATS, MetadataValue, RawField, RawGGUF
from cobatch.loader.gguf_raw import aligned as _pad
from cobatch.output_files import check_output_path, partial_file
from cobatch.quant.formats import format_of, random_quantized

WEIGHT_STD = 0.02          # std of every random matrix (and of the biases)
NORM_JITTER = 0.02         # norm weights are 1 + this * N(0, 1)
_CHUNK_VALUES = 1 << 22    # values generated per write: keeps temporaries at tens of MB for any shape
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


# ---------------------------------------------------------------- model shapes and quant recipes

@dataclass(frozen=True, slots=True)
class ModelShape:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int | None       # None: the tokenizer's own size
    rope_theta: float
    rms_eps: float
    context_length: int
    qkv_bias: bool = False
    tied_embeddings: bool = False
    qk_norm: bool = False        # qwen3: RMSNorm over each q and k head
    head_size: int | None = None  # when heads are not d_model / n_heads wide (qwen3)
    n_experts: int = 0           # routed experts per layer instead of one feed-forward (MoE)
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    shared_expert_ffn_dim: int = 0  # qwen2moe's always-on expert (0: none)
    fused: bool = False          # phi3: q|k|v in one attn_qkv tensor, gate|up in one ffn_up tensor
    rope_dim: int | None = None  # rotated dims per head when not all (Phi-4-mini: 3/4)
    longrope: bool = False       # phi3 LongRoPE: rope_factors_long / _short tensors and their metadata
    sliding_window: int = 0      # gemma3: the local layers' window (and post-sublayer norms)
    rope_linear_factor: float = 0.0  # rope.scaling linear (gemma3 4b+: its global layers)
    attn_softcap: float = 0.0    # gemma2: soft caps on the attention scores and the output logits
    final_softcap: float = 0.0
    rope_yarn_factor: float = 0.0  # rope.scaling yarn over YARN_ORIGINAL_CONTEXT (Qwen3 / Qwen2.5 past 32k)
    yarn_original_context: int = 0  # ... or over this context (DeepSeek's 4096)
    yarn_log_multiplier: float = 0.0  # deepseek2: 0.1 * HF's mscale_all_dim
    # granite: the multipliers of the embeddings, q.k, each sublayer's output and (divided) the logits; 0: not written
    embedding_scale: float = 0.0
    attention_scale: float = 0.0
    residual_scale: float = 0.0
    logit_scale: float = 0.0
    # deepseek2: multi-head latent attention, the first layers dense, shared experts, and the routing
    mla: MlaShape | None = None
    split_kv_b: bool = True      # llama.cpp's current layout (attn_k_b, attn_v_b), else attn_kv_b (older files)
    leading_dense: int = 0
    n_shared_experts: int = 0    # deepseek2: always-on experts of expert_ffn_dim each
    expert_gating: str = "softmax"   # or "sigmoid" (V3: with a correction bias, exp_probs_b)
    expert_groups: int = 0
    expert_groups_used: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads


def _deepseek(n_layers: int, d_model: int, n_heads: int, ffn_dim: int, vocab_size: int | None, mla: MlaShape,
              n_experts: int, n_experts_used: int, expert_ffn_dim: int, **traits) -> ModelShape:
    """A deepseek2 shape: MLA (one KV head in GGUF's terms), rope base 10000, eps 1e-6, 160k context."""
    return ModelShape("deepseek2", n_layers, d_model, n_heads, 1, ffn_dim, vocab_size, 10000.0, 1e-6, 163840,
                      mla=mla, rope_dim=mla.qk_rope_dim, n_experts=n_experts, n_experts_used=n_experts_used,
                      expert_ffn_dim=expert_ffn_dim, **traits)


SHAPES: dict[str, ModelShape] = {
    "llama3-8b": ModelShape("llama", 32, 4096, 32, 8, 14336, 128256, 500000.0, 1e-5, 8192),
    "qwen2.5-7b": ModelShape("qwen2", 28, 3584, 28, 4, 18944, 152064, 1e6, 1e-6, 32768, qkv_bias=True),
    "qwen2.5-0.5b": ModelShape("qwen2", 24, 896, 14, 2, 4864, 151936, 1e6, 1e-6, 32768,
                               qkv_bias=True, tied_embeddings=True),
    "tiny": ModelShape("llama", 2, 256, 4, 2, 512, None, 10000.0, 1e-5, 4096),
    "qwen3-tiny": ModelShape("qwen3", 2, 256, 4, 2, 512, None, 1e6, 1e-6, 4096, qk_norm=True, head_size=128),
    "qwen3-yarn-tiny": ModelShape("qwen3", 2, 256, 4, 2, 512, None, 1e6, 1e-6, 4096, qk_norm=True, head_size=128,
                                  rope_yarn_factor=4.0),
    # Mixture-of-experts layouts, tiny: Qwen3-MoE (qwen3 + routed experts), Qwen2-MoE (+ a gated shared
    # expert, qkv biases) and Mixtral (llama with experts).
    "qwen3moe-tiny": ModelShape("qwen3moe", 2, 256, 4, 2, 512, None, 1e6, 1e-6, 4096, qk_norm=True, head_size=128,
                                n_experts=8, n_experts_used=2, expert_ffn_dim=128),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token (about 3B of its 30B weights read per token at B = 1).
    "qwen3-30b-a3b": ModelShape("qwen3moe", 48, 2048, 32, 4, 6144, 151936, 1e6, 1e-6, 40960, qk_norm=True,
                                head_size=128, n_experts=128, n_experts_used=8, expert_ffn_dim=768),
    "qwen2moe-tiny": ModelShape("qwen2moe", 2, 256, 4, 2, 512, None, 1e6, 1e-6, 4096, qkv_bias=True,
                                n_experts=8, n_experts_used=2, expert_ffn_dim=128, shared_expert_ffn_dim=256),
    "mixtral-tiny": ModelShape("llama", 2, 256, 4, 2, 512, None, 1e6, 1e-5, 4096,
                               n_experts=4, n_experts_used=2, expert_ffn_dim=256),
    # Phi-3 (fused tensors) and Phi-4-mini's layout (GQA, 3/4 of each head rotated, LongRoPE to 4x the context).
    "phi3-tiny": ModelShape("phi3", 2, 256, 4, 4, 512, None, 10000.0, 1e-5, 4096, fused=True),
    "phi4-mini-tiny": ModelShape("phi3", 2, 256, 4, 2, 512, None, 10000.0, 1e-5, 16384, fused=True, rope_dim=48,
                                 longrope=True),
    # Gemma 2: every other layer local. The caps are set low enough to bite on random weights (real: 50, 30).
    "gemma2-tiny": ModelShape("gemma2", 4, 128, 4, 2, 256, None, 10000.0, 1e-6, 4096, tied_embeddings=True,
                              head_size=64, sliding_window=12, attn_softcap=0.05, final_softcap=0.2),
    # Gemma 3 (text): 6 layers so that one (the last) is global; a window of 12 keys on the others.
    "gemma3-tiny": ModelShape("gemma3", 6, 128, 4, 2, 256, None, 1e6, 1e-6, 4096, tied_embeddings=True,
                              qk_norm=True, head_size=64, sliding_window=12, rope_linear_factor=8.0),
    # Granite 3.x: llama's layout and tied embeddings with its four multipliers (Granite-3.3-8B's values);
    # granitemoe: the same with routed experts.
    "granite-tiny": ModelShape("granite", 2, 256, 4, 2, 512, None, 10000.0, 1e-5, 4096, tied_embeddings=True,
                               embedding_scale=12.0, attention_scale=0.0078125, residual_scale=0.22,
                               logit_scale=16.0),
    "granitemoe-tiny": ModelShape("granitemoe", 2, 256, 4, 2, 512, None, 10000.0, 1e-5, 4096,
                                  tied_embeddings=True, n_experts=8, n_experts_used=2, expert_ffn_dim=128,
                                  embedding_scale=12.0, attention_scale=0.0078125, residual_scale=0.22,
                                  logit_scale=16.0),
    # DeepSeek (deepseek2): V2-Lite's layout (no q LoRA, softmax routing, weights not renormalized) in the older
    # attn_kv_b tensor layout, a scale on the routed weights so that it counts; and V3's (q LoRA, sigmoid routing
    # with the correction bias, 4 groups of which 2 are used, weights renormalized, YaRN) in the current split one.
    # The first layer is dense in both. Experts of 128 rows: whole row pads, so that CUDA stacks them for the routed
    # GEMV (packed_experts.stackable).
    "deepseek2-tiny": _deepseek(3, 128, 4, 256, None, MlaShape(0, 64, 32, 16, 32), 8, 2, 128, split_kv_b=False,
                                leading_dense=1, n_shared_experts=2, expert_weights_scale=1.5),
    "deepseek-v3-tiny": _deepseek(3, 128, 4, 256, None, MlaShape(64, 64, 32, 16, 32), 16, 4, 128, leading_dense=1,
                                  n_shared_experts=1, expert_gating="sigmoid", expert_groups=4, expert_groups_used=2,
                                  expert_weights_norm=True, expert_weights_scale=2.5, rope_yarn_factor=4.0,
                                  yarn_original_context=1024, yarn_log_multiplier=0.1),
    # The full shapes, for benchmarks (cut with --layers): DeepSeek-V2-Lite (16B, 2.4B active) and DeepSeek-V3 (671B)
    "deepseek-v2-lite": _deepseek(27, 2048, 16, 10944, 102400, MlaShape(0, 512, 128, 64, 128), 64, 6, 1408,
                                  leading_dense=1, n_shared_experts=2, rope_yarn_factor=40.0,
                                  yarn_original_context=4096, yarn_log_multiplier=0.0707),
    "deepseek-v3": _deepseek(61, 7168, 128, 18432, 129280, MlaShape(1536, 512, 128, 64, 128), 256, 8, 2048,
                             leading_dense=3, n_shared_experts=1, expert_gating="sigmoid", expert_groups=8,
                             expert_groups_used=4, expert_weights_norm=True, expert_weights_scale=2.5,
                             rope_yarn_factor=40.0, yarn_original_context=4096, yarn_log_multiplier=0.1),
}
LONGROPE_ORIGINAL_CONTEXT = 4096   # the context a LongRoPE random model was "trained" at (a quarter of its own)
YARN_ORIGINAL_CONTEXT = 1024       # likewise for the YaRN one: a quarter of its 4096


@dataclass(frozen=True, slots=True)
class QuantRecipe:
    base: T                      # the format of (almost) every matrix
    file_type: LlamaFileType     # what general.file_type says, as llama.cpp names the mix
    mixed: bool = False          # llama.cpp *_K_M: attn_v / ffn_down of the "more bits" layers in Q6_K


QUANTS: dict[str, QuantRecipe] = {
    "f32": QuantRecipe(T.F32, LlamaFileType.ALL_F32),
    "f16": QuantRecipe(T.F16, LlamaFileType.MOSTLY_F16),
    "bf16": QuantRecipe(T.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": QuantRecipe(T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": QuantRecipe(T.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": QuantRecipe(T.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": QuantRecipe(T.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q5_1": QuantRecipe(T.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "q2_k": QuantRecipe(T.Q2_K, LlamaFileType.MOSTLY_Q2_K),
    "q3_k": QuantRecipe(T.Q3_K, LlamaFileType.MOSTLY_Q3_K_S),
    "q4_k": QuantRecipe(T.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "q5_k": QuantRecipe(T.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "q6_k": QuantRecipe(T.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "q4_k_m": QuantRecipe(T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M, mixed=True),
    "q5_k_m": QuantRecipe(T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M, mixed=True),
}

_HEAD_KEEPS = {T.F32, T.F16, T.BF16, T.Q8_0}   # formats llama.cpp leaves the output head in
_BLOCK_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in *_M mixes: first and last eighth, every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _fit_block(ggml_type: T, cols: int) -> T:
    while cols % format_of(ggml_type).block_size:
        ggml_type = _BLOCK_FALLBACK[ggml_type]   # every chain ends at a 32-value format; all shapes fit those
    return ggml_type


def matrix_type(recipe: QuantRecipe, role: str, layer: int, n_layers: int, cols: int) -> T:
    """The format of one matrix. role: "head" (the output projection), "attn_v", "ffn_down" or "other"."""
    ggml_type = recipe.base
    if role == "head" and ggml_type not in _HEAD_KEEPS:
        ggml_type = T.Q6_K
    elif recipe.mixed and role in ("attn_v", "ffn_down") and _use_more_bits(layer, n_layers):
        ggml_type = T.Q6_K
    return _fit_block(ggml_type, cols)


def longrope_attn_factor(context_length: int) -> float:
    """LongRoPE's scaling of q and k for a context stretched past the original one (HF's default)."""
    scale = context_length / LONGROPE_ORIGINAL_CONTEXT
    return math.sqrt(1 + math.log(scale) / math.log(LONGROPE_ORIGINAL_CONTEXT)) if scale > 1 else 1.0


def lookup_shape(shape: str) -> ModelShape:
    if shape not in SHAPES:
        raise UserError(f"unknown model shape {shape!r} (valid: {', '.join(SHAPES)})")
    return SHAPES[shape]


def _lookup_quant(quant: str) -> QuantRecipe:
    recipe = QUANTS.get(quant.lower())
    if recipe is None:
        raise UserError(f"unknown quant {quant!r} (valid: {', '.join(QUANTS)})")
    return recipe


# ---------------------------------------------------------------- the tensors of a random model

@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    rows: int                    # output features (N); 1 for a vector
    cols: int                    # input features (K), the GGUF's fastest dimension
    ggml_type: T
    kind: str                    # "matrix", "router", "norm", "bias" or "rope_factors"
    experts: int = 1             # > 1: a stack of that many [rows / experts, cols] matrices (a 3-D tensor)

    @property
    def nbytes(self) -> int:
        return self.rows * format_of(self.ggml_type).row_bytes(self.cols)


def tensor_plan(shape: ModelShape, recipe: QuantRecipe, vocab_size: int, n_layers: int) -> list[TensorSpec]:
    """Every tensor of the model, in the order llama.cpp's converter writes them."""
    d, q_dim, kv_dim = shape.d_model, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim

    def matrix(name: str, rows: int, cols: int, role: str = "other", layer: int = 0) -> TensorSpec:
        return TensorSpec(name, rows, cols, matrix_type(recipe, role, layer, n_layers, cols), "matrix")

    def vector(name: str, n: int, kind: str) -> TensorSpec:
        return TensorSpec(name, 1, n, T.F32, kind)

    plan = [matrix("token_embd.weight", vocab_size, d, "head" if shape.tied_embeddings else "other")]
    if shape.longrope:
        half = (shape.rope_dim or shape.head_dim) // 2
        plan += [TensorSpec("rope_factors_long.weight", 1, half, T.F32, "rope_factors"),
                 TensorSpec("rope_factors_short.weight", 1, half, T.F32, "rope_factors")]
    for i in range(n_layers):
        blk = f"blk.{i}"
        plan.append(vector(f"{blk}.attn_norm.weight", d, "norm"))
        if shape.mla is not None:
            plan += _mla_tensors(shape, blk, i, matrix, vector)
        elif shape.fused:
            plan.append(matrix(f"{blk}.attn_qkv.weight", q_dim + 2 * kv_dim, d, layer=i))
        else:
            plan.append(matrix(f"{blk}.attn_q.weight", q_dim, d, layer=i))
            plan.append(matrix(f"{blk}.attn_k.weight", kv_dim, d, layer=i))
            plan.append(matrix(f"{blk}.attn_v.weight", kv_dim, d, "attn_v", i))
        if shape.qkv_bias and shape.mla is None:
            plan += [vector(f"{blk}.attn_q.bias", q_dim, "bias"), vector(f"{blk}.attn_k.bias", kv_dim, "bias"),
                     vector(f"{blk}.attn_v.bias", kv_dim, "bias")]
        if shape.qk_norm:
            plan += [vector(f"{blk}.attn_q_norm.weight", shape.head_dim, "norm"),
                     vector(f"{blk}.attn_k_norm.weight", shape.head_dim, "norm")]
        plan.append(matrix(f"{blk}.attn_output.weight", d, shape.n_heads * shape.mla.v_head_dim if shape.mla else q_dim,
                           layer=i))
        if shape.sliding_window:
            plan.append(vector(f"{blk}.post_attention_norm.weight", d, "norm"))
        plan.append(vector(f"{blk}.ffn_norm.weight", d, "norm"))
        if shape.n_experts and i >= shape.leading_dense:
            plan += _expert_tensors(shape, blk, i, matrix)
        elif shape.fused:
            plan.append(matrix(f"{blk}.ffn_up.weight", 2 * shape.ffn_dim, d, layer=i))     # gate | up
            plan.append(matrix(f"{blk}.ffn_down.weight", d, shape.ffn_dim, "ffn_down", i))
        else:
            plan.append(matrix(f"{blk}.ffn_gate.weight", shape.ffn_dim, d, layer=i))
            plan.append(matrix(f"{blk}.ffn_up.weight", shape.ffn_dim, d, layer=i))
            plan.append(matrix(f"{blk}.ffn_down.weight", d, shape.ffn_dim, "ffn_down", i))
        if shape.sliding_window:
            plan.append(vector(f"{blk}.post_ffw_norm.weight", d, "norm"))
    plan.append(vector("output_norm.weight", d, "norm"))
    if not shape.tied_embeddings:
        plan.append(matrix("output.weight", vocab_size, d, "head"))
    return plan


def _expert_tensors(shape: ModelShape, blk: str, layer: int, matrix) -> list[TensorSpec]:
    """A MoE layer's feed-forward tensors, as llama.cpp's converter writes them: the router (kept in F32,
    as llama.cpp's quantizer keeps it), the experts stacked in 3-D tensors, and qwen2moe's shared expert."""
    d, n, ffn = shape.d_model, shape.n_experts, shape.expert_ffn_dim
    plan = [TensorSpec(f"{blk}.ffn_gate_inp.weight", n, d, T.F32, "router")]
    if shape.expert_gating == "sigmoid":       # V3's correction bias on the scores that choose the experts
        plan.append(TensorSpec(f"{blk}.exp_probs_b.bias", 1, n, T.F32, "expert_bias"))
    for name, rows, cols, role in (("ffn_gate_exps", ffn, d, "other"), ("ffn_up_exps", ffn, d, "other"),
                                   ("ffn_down_exps", d, ffn, "ffn_down")):
        spec = matrix(f"{blk}.{name}.weight", n * rows, cols, role, layer)
        plan.append(TensorSpec(spec.name, spec.rows, spec.cols, spec.ggml_type, "matrix", experts=n))
    if shape.shared_expert_ffn_dim:
        shared = shape.shared_expert_ffn_dim
        plan += [TensorSpec(f"{blk}.ffn_gate_inp_shexp.weight", 1, d, T.F32, "bias"),
                 matrix(f"{blk}.ffn_gate_shexp.weight", shared, d, layer=layer),
                 matrix(f"{blk}.ffn_up_shexp.weight", shared, d, layer=layer),
                 matrix(f"{blk}.ffn_down_shexp.weight", d, shared, "ffn_down", layer)]
    if shape.n_shared_experts:                 # deepseek2's: ungated, n_shared_experts expert widths
        shared = shape.n_shared_experts * ffn
        plan += [matrix(f"{blk}.ffn_gate_shexp.weight", shared, d, layer=layer),
                 matrix(f"{blk}.ffn_up_shexp.weight", shared, d, layer=layer),
                 matrix(f"{blk}.ffn_down_shexp.weight", d, shared, "ffn_down", layer)]
    return plan


def _mla_tensors(shape: ModelShape, blk: str, layer: int, matrix, vector) -> list[TensorSpec]:
    """A deepseek2 layer's attention tensors, as llama.cpp's converter writes them: q straight or through its
    LoRA pair, the latent's down-projection (latent | rope key) and norm, and its up-projection to each head's
    k_nope and v, whole (attn_kv_b) or split (attn_k_b [heads, rank, nope], transposed; attn_v_b [heads, v, rank])."""
    mla, d, heads = shape.mla, shape.d_model, shape.n_heads
    plan = []
    if mla.q_lora_rank:
        plan += [matrix(f"{blk}.attn_q_a.weight", mla.q_lora_rank, d, layer=layer),
                 vector(f"{blk}.attn_q_a_norm.weight", mla.q_lora_rank, "norm"),
                 matrix(f"{blk}.attn_q_b.weight", heads * mla.qk_head_dim, mla.q_lora_rank, layer=layer)]
    else:
        plan.append(matrix(f"{blk}.attn_q.weight", heads * mla.qk_head_dim, d, layer=layer))
    plan += [matrix(f"{blk}.attn_kv_a_mqa.weight", mla.latent_dim, d, layer=layer),
             vector(f"{blk}.attn_kv_a_norm.weight", mla.kv_lora_rank, "norm")]
    if shape.split_kv_b:
        for name, rows, cols in (("attn_k_b", mla.kv_lora_rank, mla.qk_nope_dim),
                                 ("attn_v_b", mla.v_head_dim, mla.kv_lora_rank)):
            spec = matrix(f"{blk}.{name}.weight", heads * rows, cols, layer=layer)
            plan.append(TensorSpec(spec.name, spec.rows, spec.cols, spec.ggml_type, "matrix", experts=heads))
    else:
        plan.append(matrix(f"{blk}.attn_kv_b.weight", heads * (mla.qk_nope_dim + mla.v_head_dim), mla.kv_lora_rank,
                           layer=layer))
    return plan


ROUTER_STD = 0.2           # router weights: logits of std ~3, so the top-k choice is clear of float rounding
EXPERT_BIAS_STD = 0.1      # V3's correction bias: large enough beside sigmoid scores in (0, 1) to change choices


class _RandomTensor:
    """A tensor's bytes, made while being written: GGUFWriter.write_tensor_data only needs
    nbytes and tofile(). One generator per tensor, seeded by (seed, name), so a tensor's values do
    not depend on which other tensors the file holds (a 2-layer model is a prefix of a 32-layer one)."""

    dtype = np.dtype(np.uint8)

    def __init__(self, spec: TensorSpec, seed: int):
        self.spec = spec
        self.nbytes = spec.nbytes
        self.seed = zlib.crc32(f"{seed}/{spec.name}".encode())

    def chunks(self):
        spec, generator = self.spec, torch.Generator().manual_seed(self.seed)
        if spec.kind == "norm":
            yield (1.0 + NORM_JITTER * torch.randn(spec.cols, generator=generator)).view(torch.uint8)
        elif spec.kind == "rope_factors":    # frequency divisors >= 1, rising with the wavelength as LongRoPE's
            ramp = torch.linspace(1.0, 4.0, spec.cols)
            yield (ramp * (1.0 + 0.1 * torch.rand(spec.cols, generator=generator))).view(torch.uint8)
        elif spec.kind == "expert_bias":
            yield (EXPERT_BIAS_STD * torch.randn(spec.cols, generator=generator)).view(torch.uint8)
        elif spec.kind == "bias":
            yield (WEIGHT_STD * torch.randn(spec.cols, generator=generator)).view(torch.uint8)
        else:
            step = max(1, _CHUNK_VALUES // spec.cols)
            scale = ROUTER_STD if spec.kind == "router" else WEIGHT_STD
            for start in range(0, spec.rows, step):
                rows = min(step, spec.rows - start)
                yield random_quantized(spec.ggml_type, rows, spec.cols, generator, scale=scale)

    def tofile(self, fout: BinaryIO) -> None:
        written = 0
        for chunk in self.chunks():
            data = chunk.contiguous().numpy()
            fout.write(memoryview(data).cast("B"))
            written += data.nbytes
        assert written == self.nbytes, (self.spec.name, written, self.nbytes)


def resolve_tokenizer_source(tokenizer_from: str | os.PathLike | None) -> Path:
    """A GGUF path, or the name of a packaged model: "smollm2" (the default) or "qwen-coder"."""
    from cobatch import model_files

    named = {"smollm2": model_files.smollm2_path, "qwen-coder": model_files.qwen_coder_path}
    key = "smollm2" if tokenizer_from is None else str(tokenizer_from)
    if key in named:
        try:
            return named[key]()
        except model_files.ModelNotFound as e:
            raise UserError(str(e)) from None
    return Path(key)


def tokenizer_metadata(source: str | os.PathLike, vocab_size: int | None) -> dict[str, MetadataValue]:
    """The source GGUF's tokenizer.* fields, padded with CONTROL tokens "<|pad_N|>" up to vocab_size
    (a model's embedding often has more rows than its tokenizer has tokens)."""
    with RawGGUF(source) as gguf_file:
        fields = {name: gguf_file.value(f) for name, f in gguf_file.fields.items() if name.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in fields:
        raise UserError(f"tokenizer source {source} has no tokenizer.ggml.tokens")
    tokens: list[bytes] = fields["tokenizer.ggml.tokens"].value
    n_real = len(tokens)
    vocab_size = n_real if vocab_size is None else vocab_size
    if vocab_size < n_real:
        raise UserError(f"tokenizer has {n_real} tokens, more than the shape's vocab of {vocab_size}; "
                        "use a smaller tokenizer or the 'tiny' shape")
    if vocab_size == n_real:
        return fields
    existing = set(tokens)
    pads = []
    for token_id in range(n_real, vocab_size):
        name = f"<|pad_{token_id}|>".encode()
        pads.append(name if name not in existing else f"<|cobatch_pad_{token_id}|>".encode())
    n_pad = len(pads)
    fields["tokenizer.ggml.tokens"] = MetadataValue(tokens + pads, GGUFValueType.ARRAY, GGUFValueType.STRING)
    types = fields.get("tokenizer.ggml.token_type")
    real_types = types.value if types else [int(gguf.TokenType.NORMAL)] * n_real
    fields["tokenizer.ggml.token_type"] = MetadataValue(
        real_types + [int(gguf.TokenType.CONTROL)] * n_pad, GGUFValueType.ARRAY, GGUFValueType.INT32)
    if (scores := fields.get("tokenizer.ggml.scores")) is not None:
        fields["tokenizer.ggml.scores"] = MetadataValue(scores.value + [0.0] * n_pad, scores.vtype, scores.sub_type)
    return fields


# ---------------------------------------------------------------- random models

def _random_model_writer(shape_name: str, quant: str, tokenizer_from: str | os.PathLike | None, n_layers: int | None,
                         context_length: int | None, seed: int) -> tuple[GGUFWriter, list[TensorSpec]]:
    """A GGUFWriter holding all metadata and tensor infos (no data yet), and the tensor plan."""
    shape, recipe = lookup_shape(shape_name), _lookup_quant(quant)
    n_layers = shape.n_layers if n_layers is None else n_layers
    if n_layers < 1:
        raise UserError(f"--layers must be at least 1, got {n_layers}")
    context_length = shape.context_length if context_length is None else context_length
    if context_length < 1:
        raise UserError(f"context length must be at least 1, got {context_length}")
    tokenizer_path = resolve_tokenizer_source(tokenizer_from)
    tokenizer = tokenizer_metadata(tokenizer_path, shape.vocab_size)
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"].value)

    writer = GGUFWriter(None, shape.arch)
    writer.add_type("model")
    writer.add_name(f"random {shape_name} {quant.lower()}")
    writer.add_description(f"cobatch random weights (seed {seed}), not a trained model; "
                           f"tokenizer from {tokenizer_path.name}")
    writer.add_block_count(n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(shape.d_model)
    writer.add_feed_forward_length(shape.ffn_dim)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.rope_dim or shape.head_dim)
    if shape.longrope:
        writer.add_rope_scaling_orig_ctx_len(LONGROPE_ORIGINAL_CONTEXT)
        writer.add_rope_scaling_attn_factors(longrope_attn_factor(context_length))
    if shape.head_size:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.attn_softcap:
        writer.add_attn_logit_softcapping(shape.attn_softcap)
        writer.add_final_logit_softcapping(shape.final_softcap)
    if shape.rope_yarn_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.rope_yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(shape.yarn_original_context or YARN_ORIGINAL_CONTEXT)
        if shape.yarn_log_multiplier:
            writer.add_rope_scaling_yarn_log_mul(shape.yarn_log_multiplier)
    if shape.rope_linear_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(shape.rope_linear_factor)
    if shape.n_experts:
        writer.add_expert_count(shape.n_experts)
        writer.add_expert_used_count(shape.n_experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn_dim)
        if shape.shared_expert_ffn_dim:
            writer.add_expert_shared_feed_forward_length(shape.shared_expert_ffn_dim)
    if shape.mla is not None:
        _add_deepseek_metadata(writer, shape)
    for value, add in ((shape.embedding_scale, writer.add_embedding_scale),
                       (shape.attention_scale, writer.add_attention_scale),
                       (shape.residual_scale, writer.add_residual_scale), (shape.logit_scale, writer.add_logit_scale)):
        if value:
            add(value)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(int(recipe.file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, field in tokenizer.items():
        if field.vtype == GGUFValueType.ARRAY and not field.value:
            continue  # gguf-py cannot write an empty array
        writer.add_key_value(key, field.value, field.vtype, field.sub_type)

    plan = tensor_plan(shape, recipe, vocab_size, n_layers)
    for spec in plan:
        if spec.kind in ("matrix", "router"):  # byte shape + raw type: gguf-py turns (N, row_bytes) into ne = (K, N)
            byte_shape = (spec.rows, spec.nbytes // spec.rows)
            if spec.experts > 1:                 # ne = (K, N / experts, experts)
                byte_shape = (spec.experts, spec.rows // spec.experts, byte_shape[1])
            writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), spec.nbytes, raw_dtype=spec.ggml_type)
        else:
            writer.add_tensor_info(spec.name, (spec.cols,), np.dtype(np.float32), spec.nbytes)
    return writer, plan


def _add_deepseek_metadata(writer: GGUFWriter, shape: ModelShape) -> None:
    """deepseek2's keys as llama.cpp's converter writes them. The split layout's files say key_length /
    value_length of the cached latent and the per-head widths in key_length_mla / value_length_mla; the older
    attn_kv_b files have the per-head widths in key_length / value_length and no _mla keys."""
    mla = shape.mla
    writer.add_leading_dense_block_count(shape.leading_dense)
    if mla.q_lora_rank:
        writer.add_q_lora_rank(mla.q_lora_rank)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    if shape.split_kv_b:
        writer.add_key_length(mla.latent_dim)
        writer.add_value_length(mla.kv_lora_rank)
        writer.add_key_length_mla(mla.qk_head_dim)
        writer.add_value_length_mla(mla.v_head_dim)
    else:
        writer.add_key_length(mla.qk_head_dim)
        writer.add_value_length(mla.v_head_dim)
    writer.add_expert_shared_count(shape.n_shared_experts)
    writer.add_expert_weights_scale(shape.expert_weights_scale)
    writer.add_expert_weights_norm(shape.expert_weights_norm)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if shape.expert_gating == "sigmoid"
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    if shape.expert_groups:
        writer.add_expert_group_count(shape.expert_groups)
        writer.add_expert_group_used_count(shape.expert_groups_used)


def _write_header(writer: GGUFWriter, path: Path) -> int:
    """Write header, metadata and tensor infos; returns where the (aligned) tensor data starts."""
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()   # flushes
    return _pad(path.stat().st_size, writer.data_alignment)


def _data_size(plan: list[TensorSpec], alignment: int) -> int:
    return sum(_pad(spec.nbytes, alignment) for spec in plan)


def planned_size(shape: str, quant: str = "q8_0", *, tokenizer_from: str | Path | None = None,
                 n_layers: int | None = None, context_length: int | None = None) -> int:
    """The exact size in bytes of the file write_random_model would write (only the header is built)."""
    writer, plan = _random_model_writer(shape, quant, tokenizer_from, n_layers, context_length, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            data_start = _write_header(writer, Path(tmp) / "header.gguf")
        finally:
            writer.close()
    return data_start + _data_size(plan, writer.data_alignment)


def write_random_model(path: str | os.PathLike, shape: str, quant: str = "q8_0", *,
                       tokenizer_from: str | Path | None = None, n_layers: int | None = None, seed: int = 0,
                       context_length: int | None = None, progress: bool = False) -> Path:
    """Write a GGUF of random weights in the named shape (see SHAPES, QUANTS and the module doc)."""
    path = check_output_path(path, "--output")
    writer, plan = _random_model_writer(shape, quant, tokenizer_from, n_layers, context_length, seed)
    with partial_file(path) as partial:
        try:
            data_start = _write_header(writer, partial)
            needed = data_start + _data_size(plan, writer.data_alignment) - partial.stat().st_size
            free = shutil.disk_usage(path.parent).free
            if needed > free:
                raise UserError(f"{path}: needs {needed / 1e9:.2f} GB more disk, {free / 1e9:.2f} GB free")
            bar = None
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=sum(s.nbytes for s in plan), unit="B", unit_scale=True, desc=path.name)
            for spec in plan:
                writer.write_tensor_data(_RandomTensor(spec, seed))  # type: ignore[arg-type]  # duck-typed array
                if bar is not None:
                    bar.update(spec.nbytes)
            if bar is not None:
                bar.close()
        finally:
            writer.close()
    return path


# ---------------------------------------------------------------- cutting real models

def _cut_field(source: RawGGUF, field: RawField, arch: str, old_layers: int, n_layers: int) -> bytes:
    """The field's bytes as stored, except block_count and per-layer arrays (length == block_count)."""
    raw = source.raw(field)
    value_at = field.value_start - field.start
    if field.name == f"{arch}.block_count":
        return raw[:value_at] + struct.pack("<" + SCALAR_FORMATS[field.vtype], n_layers)
    is_per_layer = (field.name.startswith(f"{arch}.") and field.vtype == GGUFValueType.ARRAY
                    and field.sub_type in SCALAR_FORMATS and field.count == old_layers)
    if is_per_layer:  # value: item type (4 bytes), count (8), items
        item_size = struct.calcsize("<" + SCALAR_FORMATS[field.sub_type])
        items = raw[value_at + 12:value_at + 12 + n_layers * item_size]
        return raw[:value_at + 4] + struct.pack("<Q", n_layers) + items
    return raw


def cut_layers(src: str | os.PathLike, dst: str | os.PathLike, n_layers: int) -> Path:
    """Copy a GGUF keeping only blocks 0..n_layers-1: block_count (and per-layer metadata arrays)
    changed, later blocks' tensors dropped, every other metadata field and tensor copied byte-exact."""
    src, dst = Path(src), Path(dst)
    with RawGGUF(src) as source:
        check_output_path(dst, "cut: the destination", src)
        arch_field = source.fields.get("general.architecture")
        arch = source.value(arch_field).value.decode() if arch_field else None
        block_field = source.fields.get(f"{arch}.block_count")
        if block_field is None:
            raise UserError(f"{src}: no {arch}.block_count in the metadata, cannot cut layers")
        old_layers = int(source.value(block_field).value)
        if not 1 <= n_layers <= old_layers:
            raise UserError(f"--layers must be between 1 and {old_layers} for {src.name}, got {n_layers}")

        kept = [t for t in source.tensors if not ((m := _BLOCK_RE.match(t.name)) and int(m.group(1)) >= n_layers)]
        header = bytearray(b"GGUF" + struct.pack("<IQQ", source.version, len(kept), len(source.fields)))
        for field in source.fields.values():
            header += _cut_field(source, field, arch, old_layers, n_layers)
        offset = 0
        for t in kept:
            header += t.record + struct.pack("<Q", offset)
            offset += _pad(t.nbytes, source.alignment)
        header += bytes(_pad(len(header), source.alignment) - len(header))

        with partial_file(dst) as partial, open(partial, "wb") as out:
            out.write(header)
            for t in kept:
                source.copy_tensor_data(t, out)
                out.write(bytes(_pad(t.nbytes, source.alignment) - t.nbytes))
    return dst


# ---------------------------------------------------------------- command line

class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (main prints it and returns 2), not usage + exit."""

    def error(self, message: str):  # type: ignore[override]
        raise _ArgumentError(message)


def build_parser(prog: str = "python -m cobatch.testing.gguf_writer") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Write GGUF models for tests and benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    rnd = sub.add_parser("random", help="random weights in the shape of a real model, with a real tokenizer")
    rnd.add_argument("--shape", required=True, help=f"one of: {', '.join(SHAPES)}")
    rnd.add_argument("--quant", default="q8_0", help=f"one of: {', '.join(QUANTS)} (default q8_0)")
    rnd.add_argument("-o", "--output", required=True, type=Path, help="GGUF file to write")
    rnd.add_argument("--layers", type=int, default=None, help="number of layers (default: the shape's)")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--context-length", type=int, default=None)
    rnd.add_argument("--tokenizer-from", default=None,
                     help="GGUF to copy the tokenizer from, or smollm2 / qwen-coder (default smollm2)")
    rnd.add_argument("--dry-run", action="store_true", help="print the file size it would write, write nothing")
    cut = sub.add_parser("cut", help="a real model cut down to its first N layers")
    cut.add_argument("src", type=Path)
    cut.add_argument("dst", type=Path)
    cut.add_argument("--layers", type=int, required=True)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m cobatch.testing.gguf_writer") -> int:
    try:
        args = build_parser(prog).parse_args(argv)
        if args.command == "random":
            if args.dry_run:
                size = planned_size(args.shape, args.quant, tokenizer_from=args.tokenizer_from,
                                    n_layers=args.layers, context_length=args.context_length)
                print(f"{args.output}: {size} bytes ({size / 1e9:.2f} GB)")
                return 0
            path = write_random_model(args.output, args.shape, args.quant, tokenizer_from=args.tokenizer_from,
                                      n_layers=args.layers, seed=args.seed, context_length=args.context_length,
                                      progress=sys.stderr.isatty())
        else:
            path = cut_layers(args.src, args.dst, args.layers)
    except (_ArgumentError, UserError) as e:
        print(f"cobatch: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
