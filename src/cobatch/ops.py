"""One entry per model operation: the Triton kernel on CUDA, the torch reference on the CPU.

The model code calls only these, so it is the same on both devices. Set COBATCH_TORCH_OPS=1 to force
the torch references on CUDA too (a debugging aid: the GPU path must agree with them).

Always use the returned tensors: on the Triton path rope rotates q and k in place, while the references
return new tensors.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from cobatch.batch import AttentionMetadata
from cobatch.kernels.activation import gated_mul_ref, gated_mul_triton
from cobatch.kernels.attention import DecodeRope, fuses_rope, paged_attention_ref, paged_attention_triton, writes_order
from cobatch.kernels.greedy import greedy_tokens_ref, greedy_tokens_triton, gumbel_tokens_ref, gumbel_tokens_triton
from cobatch.kernels.kv_write import kv_write_ref, kv_write_triton
from cobatch.kernels.mla_attention import mla_attention_ref, mla_decode_attention, mla_prefill_attention
from cobatch.kernels.mla_latent import mla_latent_ref, mla_latent_triton
from cobatch.kernels import mla_value as mla_value_kernel
from cobatch.kernels.moe_routing import ExpertSlots, RouterRule, combine_ref, combine_triton, route_ref, route_triton
from cobatch.kernels.norm import rms_norm_ref, rms_norm_triton
from cobatch.kernels.operand_order import NATURAL, operand_buffer, ordered_ref
from cobatch.kernels.rope import fuses_qk_norm, rope_ref, rope_triton
from cobatch.kernels.top_k import top_k_keep_ref, top_k_keep_triton
from cobatch.kernels.top_p import top_p_keep_ref, top_p_keep_triton

_FORCE_TORCH = os.environ.get("COBATCH_TORCH_OPS") == "1"


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda and not _FORCE_TORCH


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether ops run their kernels on x (CUDA, and COBATCH_TORCH_OPS unset), where a caller picks between an op
    and a torch way of its own."""
    return _triton(x)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: each row's first index of its largest logit, a NaN counting as -inf."""
    if _triton(logits) and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        return greedy_tokens_triton(logits)
    return greedy_tokens_ref(logits)


def gumbel_tokens(scores: torch.Tensor, row_keys: torch.Tensor, token_keys: torch.Tensor,
                  fallback: torch.Tensor, inverse_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: Gumbel-max over float32 scores [R, V] (no NaN) with the sampler's counter noise of each row's key
    (int64 [R]) and the tokens' keys (int64 [V]); a row with nothing left (all -inf) takes fallback[row].
    inverse_temperature (float32 [R]) given: `scores` are logits, tempered first (kernels.greedy.temper_ref)."""
    if _triton(scores) and scores.stride(-1) == 1 and scores.shape[-1] > 0:
        return gumbel_tokens_triton(scores, row_keys, token_keys, fallback, inverse_temperature)
    return gumbel_tokens_ref(scores, row_keys, token_keys, fallback, inverse_temperature)


def top_p_keep(scores: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V] scores with the tokens outside each row's nucleus (the smallest prefix of its tokens by
    value, lowest ids first among equals, whose mass reaches p: float32 [R], each < 1) at -inf; then min-p's
    (float32 [R], 0: none: probability below min_p times the largest's)."""
    if _triton(scores) and scores.stride(-1) == 1:
        return top_p_keep_triton(scores, top_p, min_p)
    return top_p_keep_ref(scores, top_p, min_p)


def top_k_keep(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, V] scores with the tokens outside each row's top-k (int [R], 1 <= k <= kernels.top_k.CAP)
    then top-p (float32 [R], 1: none) set at -inf: the k largest, lowest ids first among equals, cut to the
    smallest prefix of them whose mass over the k reaches p; then min-p's as top_p_keep's."""
    if _triton(scores) and scores.stride(-1) == 1:
        return top_k_keep_triton(scores, top_k, top_p, min_p)
    return top_k_keep_ref(scores, top_k, top_p, min_p)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             inplace_residual: bool = False, out_dtype: torch.dtype | None = None,
             out_order: int = NATURAL) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_stream). inplace_residual=True writes x + residual into `residual` and returns it
    as the residual stream (saves an allocation; the caller must not need the old residual). out_dtype: the
    normed rows' dtype (default x's; operand_dtype of the weight they go to), the residual stream stays x's.
    out_order: the normed rows' column order (operand_order of the weight they go to, given to its linear)."""
    if _triton(x):
        out = None
        if out_order != NATURAL or out_dtype not in (None, x.dtype):
            out = operand_buffer(x.numel() // x.shape[-1], x.shape[-1], out_dtype or x.dtype, x.device,
                                 out_order).view(x.shape)
        return rms_norm_triton(x, weight, eps, residual, out=out, order=out_order,
                               residual_out=residual if inplace_residual and residual is not None else None)
    normed, h = rms_norm_ref(x, weight, eps, residual, out_dtype, out_order)
    if inplace_residual and residual is not None:
        h = residual.copy_(h)
    return normed, h


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
         neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(q):
        return rope_triton(q, k, positions, cos_sin, neox)
    return rope_ref(q, k, positions, cos_sin, neox)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    if _triton(k):
        kv_write_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        kv_write_ref(k, v, k_cache, v_cache, slot_mapping)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """rope then kv_write of the rotated k and v, in one launch on the Triton path. Returns (q, k) rotated.
    qk_norm = (q_weight, k_weight, eps): each head RMS-normed first (qwen3), in the same launch where every
    dim rotates."""
    if qk_norm is not None and not (_triton(q) and fuses_qk_norm(cos_sin.shape[1], q.shape[-1])):
        q_weight, k_weight, eps = qk_norm
        q, _ = rms_norm(q.contiguous(), q_weight, eps)
        k, _ = rms_norm(k.contiguous(), k_weight, eps)
        qk_norm = None
    if _triton(q):
        return rope_triton(q, k, positions, cos_sin, neox, kv_write=(v, k_cache, v_cache, slot_mapping),
                           qk_norm=qk_norm)
    q, k = rope_ref(q, k, positions, cos_sin, neox)
    kv_write_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def attention_orders(head_dim: int) -> bool:
    """Can attention store its rows in an operand_order (its out_order)? kernels/attention.py's writes_order."""
    return writes_order(head_dim)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
              scale: float, window: int = 0, softcap: float = 0.0, out_dtype: torch.dtype | None = None,
              out_order: int = NATURAL) -> torch.Tensor:
    """Decode kernel when meta.max_query_len == 1 (one row per sequence), the prefill kernel otherwise.
    window > 0: each row sees only its last `window` keys (sliding-window layers); softcap > 0: scores are
    soft-capped (Gemma 2). out_dtype: the output's dtype (default q's; operand_dtype of the weight it goes to).
    out_order: each row's columns in that order (operand_order of the weight it goes to; where attention_orders)."""
    if _triton(q):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap,
                                      out_dtype=out_dtype, out_order=out_order)
    out = paged_attention_ref(q, k_cache, v_cache, meta, scale, window, softcap)
    out = out if out_dtype is None else out.to(out_dtype)
    return ordered_ref(out.reshape(out.shape[0], -1), out_order).reshape(out.shape)


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor, neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                   out_dtype: torch.dtype | None = None,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                   out_order: int = NATURAL) -> torch.Tensor:
    """rope_kv_write, then attention over the caches it wrote. On the Triton path a decode step whose heads
    rotate whole (with qwen3's q/k norms or without) runs both in the decode attention kernel (one launch less a
    layer; COBATCH_FUSED_ROPE=0 keeps them apart). q, k are not rotated in place then: only the caches and the
    output are this op's results. out_order: as attention's."""
    if _triton(q) and fuses_rope(q, meta, cos_sin):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap,
                                      out_dtype=out_dtype, rope=DecodeRope(k, v, positions, cos_sin, neox, qk_norm),
                                      out_order=out_order)
    q, _ = rope_kv_write(q, k, v, positions, cos_sin, neox, k_cache, v_cache, meta.slot_mapping, qk_norm)
    return attention(q, k_cache, v_cache, meta, scale, window, softcap, out_dtype, out_order)


def mla_latent(q_rope: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool, cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> torch.Tensor:
    """MLA's step prologue: [rms_norm(c_kv) | rotated k_rope] of kv_a's rows into the latent cache, and the queries'
    rope dims q_rope rotated (returned, [N, H, R]). kernels/mla_latent.py."""
    if _triton(kv_a):
        return mla_latent_triton(q_rope, kv_a, norm_weight, eps, positions, cos_sin, neox, cache, slot_mapping)
    return mla_latent_ref(q_rope, kv_a, norm_weight, eps, positions, cos_sin, neox, cache, slot_mapping)


def mla_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
    """MLA in the absorbed form: queries q_latent [N, H, kv_lora_rank] and q_rope [N, H, R] against the cached
    latents -> [N, H, kv_lora_rank] (float32, or q's dtype from the kernels), W_UV still to apply
    (kernels/mla_attention.py). On CUDA a decode step runs the MLA decode kernel, any other step the MLA prefill
    kernel; both read the two query parts apart."""
    kv_lora_rank = q_latent.shape[-1]
    if _triton(q_latent) and kv_lora_rank & (kv_lora_rank - 1) == 0:
        # any row and head strides (W_UK's einsum hands q_latent over as a [H, N, R] product's transposed view)
        q_latent, q_rope = (q if q.stride(-1) == 1 else q.contiguous() for q in (q_latent, q_rope))
        if meta.is_decode and q_latent.shape[0] == meta.num_seqs:
            return mla_decode_attention(q_latent, cache, meta, scale, kv_lora_rank, q_rope=q_rope)
        return mla_prefill_attention(q_latent, cache, meta, scale, kv_lora_rank, q_rope=q_rope)
    return mla_attention_ref(torch.cat([q_latent, q_rope], dim=-1), cache, meta, scale, kv_lora_rank)


def mla_value(latent: torch.Tensor, w_uv: torch.Tensor, o_weight, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """W_UV applied to MLA's latent output [N, H, R] (W_UV [H, V, R]) -> (o's input [N, H V], its column order). The
    Triton kernel (kernels/mla_value.py, where it takes the step) writes it as o_weight's kernels read it (their
    dtype and operand_order); else torch's batched product, in `dtype` and the natural order, each head's product
    written where o's input row keeps it."""
    n, heads, _ = latent.shape
    if mla_value_kernel.takes(latent, w_uv):
        order = operand_order(o_weight, n, dtype)
        return mla_value_kernel.value_up(latent, w_uv, operand_dtype(o_weight, n, dtype), order), order
    out = torch.empty(n, heads, w_uv.shape[1], dtype=dtype, device=latent.device)
    torch.bmm(latent.to(dtype).transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out.view(n, -1), NATURAL


def gated_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up of the fused gate|up output; act "silu" or "gelu_tanh" (Gemma)."""
    if _triton(x):
        return gated_mul_triton(x, act)
    return gated_mul_ref(x, act)


def gated_linear(x: torch.Tensor, gate_up, act: str = "silu") -> torch.Tensor:
    """act(x @ gate.T) * (x @ up.T) for a fused gate|up weight. One GEMV launch where the weight is packed for
    it (rows interleaved, models/linear.py: load_gate_up), else the matmul then gated_mul."""
    if getattr(gate_up, "gate_up_interleaved", False):
        return gate_up.matmul(x, act=act)
    return gated_mul(linear(x, gate_up), act)


def feed_forward(h: torch.Tensor, gate_up, down, act: str = "silu", dtype: torch.dtype | None = None,
                 h_order: int = NATURAL) -> torch.Tensor:
    """(act(h @ gate.T) * (h @ up.T)) @ down.T in `dtype` (default h's). Where the gate|up GEMV or GEMM applies
    act itself, its output is written in the dtype down's kernels read (operand_dtype: f16 for the GEMV and the
    GEMM), so down does not convert it: rounded once, from float32, instead of to bf16 and then to f16.
    h_order: h's column order (operand_order of gate_up, which its writer followed)."""
    dtype = dtype or h.dtype
    rows = h.reshape(-1, h.shape[-1]).shape[0]
    mid_order = NATURAL
    if getattr(gate_up, "gate_up_interleaved", False):
        # act's output in the dtype, and where gate|up's epilogue can, the column order that down's kernels read
        mid_dtype = operand_dtype(down, rows, dtype)
        mid_order = operand_order(down, rows, dtype) if gate_up.act_orders(rows) else NATURAL
        mid = gate_up.matmul(h, act=act, x_order=h_order, out_order=mid_order,
                             out=operand_buffer(rows, gate_up.rows // 2, mid_dtype, h.device, mid_order))
    else:
        assert h_order == NATURAL, "an ordered h is for a gate|up weight the GEMM reads"
        mid = gated_linear(h, gate_up, act)
    return linear(mid.reshape(rows, -1), down, dtype=dtype, x_order=mid_order).reshape(*h.shape[:-1], -1)


def operand_dtype(weight, rows: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype in which weight's kernels read x of `rows` rows (PackedWeight.operand_dtype: f16 for the GEMV and
    the GEMM), else `dtype`: what the kernel producing that x should write. A stack of weights: their common one."""
    if hasattr(weight, "operand_dtype"):
        return weight.operand_dtype(rows, dtype)
    parts = getattr(weight, "parts", None)
    if parts:
        kinds = {operand_dtype(p, rows, dtype) for p in parts}
        return kinds.pop() if len(kinds) == 1 else dtype
    return dtype


def operand_order(weight, rows: int, dtype: torch.dtype) -> int:
    """The column order in which weight's kernels read an x of `rows` rows whose model dtype is `dtype`
    (PackedWeight.operand_order: the planes' order where the ring GEMM streams it), else NATURAL: what the kernel
    producing that x should write, and then tell `linear` through x_order."""
    return weight.operand_order(rows, dtype) if hasattr(weight, "operand_order") else NATURAL


def moe_route(h: torch.Tensor, router: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [N, k], expert ids [N, k]) of an MoE router by its rule (bias: DeepSeek-V3's correction
    of the choice); a row's do not depend on the other rows."""
    if _triton(h):
        return route_triton(h.contiguous(), router, rule, bias)
    return route_ref(h, router, rule, bias)


def moe_combine(y: torch.Tensor, slots: ExpertSlots, out_dtype: torch.dtype = torch.float32,
                shared: torch.Tensor | None = None) -> torch.Tensor:
    """[N, d]: each row's expert outputs (y, one row per pair) weighted and summed in expert-id order, in
    float32, plus the shared experts' output `shared` [N, d] where given, then stored as out_dtype."""
    if _triton(y):
        return combine_triton(y, slots, out_dtype, shared)
    return combine_ref(y, slots, out_dtype, shared)


# Decode on the CPU: a step of a few rows runs as weight @ x.T, the weights on the GEMM's long side, where x @ weight.T
# went to the BLAS's GEMV (one row) or its small-M GEMM, which read the weights a third to a half as fast on 2 cores
# (MKL; bench/results/cpu_decode.json). One row is padded to two: the GEMV is the slow kernel.
CPU_COLUMNS_UPTO = 16


def _as_columns(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= CPU_COLUMNS_UPTO and x.dtype == torch.float32


def _weight_times_columns(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T as (w @ x.T).T: a transposed view, for the caller to lay out once."""
    cols = torch.cat([x, x]) if x.shape[0] == 1 else x
    return torch.mm(w, cols.T).T[:x.shape[0]]


def linear(x: torch.Tensor, weight, out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
           x_order: int = NATURAL) -> torch.Tensor:
    """weight: a dense tensor [N, K] (CPU path, float weights) or a packed quantized weight (GPU). out: where to
    write the [n, N] result (x 2-D; it may be a column slice of a wider matrix), else a new tensor of `dtype`
    (default x's: x may come in its operand_dtype, the result in the model's). x_order: x's column order, the
    weight's operand_order where its writer followed it."""
    if x_order != NATURAL:
        if out is None:
            out = torch.empty(*x.shape[:-1], weight.rows, dtype=dtype or x.dtype, device=x.device)
        return weight.matmul(x, out=out, x_order=x_order)
    if isinstance(weight, torch.Tensor):
        w = weight.to(x.dtype) if weight.dtype != x.dtype else weight
        if _as_columns(x):
            y = _weight_times_columns(x, w)
            return y.contiguous() if out is None else out.copy_(y)
        y = F.linear(x, w)
        return (y if dtype in (None, y.dtype) else y.to(dtype)) if out is None else out.copy_(y)
    if out is None and dtype not in (None, x.dtype):
        out = torch.empty(*x.shape[:-1], weight.rows, dtype=dtype, device=x.device)
    return weight.matmul(x) if out is None else weight.matmul(x, out=out)
