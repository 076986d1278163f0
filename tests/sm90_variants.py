"""Every kernel variant the package can launch, compiled for the H200 (sm_90) on the CPU with Triton's own ptxas;
and the fp8 KV cache's variants as Ampere (sm_80) runs them, on the cache's bytes (kernels/fp8_cache.py).

tests/test_kernels_compile.py runs this file in a child process (the test suite's TRITON_INTERPRET=1 turns @jit
into interpreted functions) and checks that every variant compiles, within its register budget and without
spills; bench/sass_loop.py imports it to disassemble a variant's hot loop. Run alone (without TRITON_INTERPRET),
it prints {name: "ok" | error} as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cobatch.kernels import (activation, attention, fragment_dequant, greedy, kv_write, lora, mla_attention, mla_latent,
                             mla_value, moe_routing, norm, quant_gemm, quant_gemv, quant_matmul, quant_pack, rope,
                             top_k, top_p)

H200 = GPUTarget("cuda", 90, 32)
AMPERE = GPUTarget("cuda", 80, 32)     # an A100: Triton has no e4m3 there
INT_POINTERS = {"bt_ptr", "seq_lens_ptr", "query_start_ptr", "pos_ptr", "slot_expert_ptr", "slot_start_ptr",
                "slot_count_ptr", "work_ptr"}
LONG_POINTERS = {"slot_ptr", "pairs_ptr", "ids_ptr", "pair_rows_ptr", "row_pairs_ptr"}
FLOAT_POINTERS = {"part_acc_ptr", "part_ml_ptr", "cs_ptr", "w_ptr", "logits_ptr", "weights_ptr",
                  "row_weights_ptr", "bias_ptr"}
FLOAT_SCALARS = {"qk_scale", "softcap", "eps", "scale"}


def compile_for_h200(kernel, constants, num_warps=4, num_stages=2, pointers=None, maxnreg=None, target=H200):
    # bf16 tensors as the launchers pass them (or as `pointers` says); pointers and strides 16-divisible, as
    # Triton specializes them. Constexprs the launchers may leave at their defaults compile at those defaults.
    names = list(kernel.arg_names)
    constants = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constants}
    signature = {}
    for name in names:
        if pointers and name in pointers:
            signature[name] = pointers[name]
        elif name in constants:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in LONG_POINTERS:
            signature[name] = "*i64"
        elif name in FLOAT_POINTERS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    divisible = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith(("_ptr", "stride"))}
    compiled = triton.compile(ASTSource(kernel, signature, constants, divisible), target=target,
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})})
    assert compiled.asm["cubin"]
    return compiled


def registers(compiled) -> tuple[int, int] | None:
    # (registers per thread, stack bytes: spills) of a compiled kernel, from Triton's bundled cuobjdump (None if
    # it is missing).
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return (int(found.group(1)), int(stack.group(1)) if stack else 0) if found else None


dec, pre = attention.DECODE_CONFIG, attention.PREFILL_CONFIG
BF16 = triton.language.bfloat16
FP8_CACHE = {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}     # --kv-cache-dtype fp8
variants = {}
# GROUPS: the split programs of a batch of invariant rows merge whole groups of splits (two accumulators)
SPLITS = dict(MIN_SPLIT=dec.min_split, SPLIT_GROUP=dec.split_group)
for softcap in (False, True):
    for single, groups in ((False, False), (False, True), (True, False)):
        for windowed in (False, True):
            variants[f"decode softcap={softcap} single_split={single} groups={groups} windowed={windowed}"] = (
                attention._decode_split_kernel,
                dict(GROUP=4, HEAD_D=128, PAGE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=dec.block_n, **SPLITS,
                     GROUPS=groups, SINGLE_SPLIT=single, PDL=True, DOT_F32=False, SOFTCAP=softcap,
                     WINDOWED=windowed, OPERAND=BF16, ROPE=False, NEOX=False, QK_NORM=False),
                dec.num_warps, dec.num_stages, None,
                attention.decode_register_cap(1 if single else 2, torch.bfloat16, 128, dec))
    for windowed in (False, True):
        variants[f"prefill softcap={softcap} windowed={windowed}"] = (
            attention._prefill_kernel,
            dict(GROUP=4, HEAD_D=128, PAGE=16, BLOCK_M=pre.block_m, BLOCK_N=pre.block_n, BLOCK_D=128, DOT_F32=False,
                 WINDOWED=windowed, SOFTCAP=softcap, OPERAND=BF16, ORDER=2 if windowed else 0,
                 WORK_LIST=softcap), pre.num_warps,        # a step's (sequence, tile) list: the prefill graphs'
            pre.num_stages)
F16 = triton.language.float16        # what an fp8 cache's tiles are widened to (attention.operand_dtype)
# an fp8 cache's tiles as words with the conversion's PTX (FP8_WORDS=2, the default), and as bytes (the switch:
# no groups then, attention.plan_has_groups)
for single, groups, words in ((False, False, 2), (False, True, 2), (True, False, 2), (False, False, 0)):
    name = f"decode softcap=False single_split={single} groups={groups} windowed=False fp8 cache words={words}"
    variants[name] = (
        attention._decode_split_kernel,
        dict(GROUP=4, HEAD_D=128, PAGE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=dec.block_n, **SPLITS,
             GROUPS=groups, SINGLE_SPLIT=single, PDL=True, DOT_F32=False, SOFTCAP=False, WINDOWED=False, OPERAND=F16,
             ROPE=False, NEOX=False, QK_NORM=False, FP8_WORDS=words),
        dec.num_warps, dec.fp8_num_stages if words else dec.num_stages, FP8_CACHE,
        attention.decode_register_cap(2, torch.float8_e4m3fn, 128, dec))
# Rope and the cache write in the decode kernel (ops.rope_attention): within the same 128 registers
for single, groups, neox, fp8, qk_norm in ((False, False, False, False, False), (False, True, False, False, False),
                                           (True, False, False, False, False), (False, True, True, False, False),
                                           (False, False, False, True, False), (False, True, False, True, False),
                                           (False, True, True, False, True)):
    variants[f"decode rope single_split={single} groups={groups} neox={neox} fp8={fp8} qk_norm={qk_norm}"] = (
        attention._decode_split_kernel,
        dict(GROUP=4, HEAD_D=128, PAGE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=dec.block_n, **SPLITS,
             GROUPS=groups, SINGLE_SPLIT=single, PDL=True, DOT_F32=False, SOFTCAP=False, WINDOWED=False,
             OPERAND=F16 if fp8 else BF16, ROPE=True, NEOX=neox, QK_NORM=qk_norm, FP8_WORDS=2 if fp8 else 0,
             ORDER=1 if single else 0),       # a single split's rows stored in o's GEMM's order (operand_order)
        dec.num_warps, dec.fp8_num_stages if fp8 else dec.num_stages, FP8_CACHE if fp8 else None,
        attention.decode_register_cap(1 if single else 2, torch.float8_e4m3fn if fp8 else torch.bfloat16, 128, dec))
# Gemma's 256-wide heads (GQA group 2, as Gemma 2/3-4B), bf16 and fp8 caches: past 128 registers, but no spills
for fp8 in (False, True):
    variants[f"decode head_d=256 softcap=True single_split=False windowed=True fp8={fp8}"] = (
        attention._decode_split_kernel,
        dict(GROUP=2, HEAD_D=256, PAGE=16, BLOCK_G=16, BLOCK_D=256, BLOCK_N=dec.block_n, **SPLITS, GROUPS=True,
             SINGLE_SPLIT=False, PDL=True, DOT_F32=False, SOFTCAP=True, WINDOWED=True, OPERAND=F16 if fp8 else BF16,
             ROPE=False, NEOX=False, QK_NORM=False, FP8_WORDS=2 if fp8 else 0),
        dec.num_warps, dec.fp8_num_stages if fp8 else dec.num_stages, FP8_CACHE if fp8 else None,
        attention.decode_register_cap(2, torch.float8_e4m3fn if fp8 else torch.bfloat16, 256, dec))
variants["prefill fp8 cache"] = (
    attention._prefill_kernel, dict(GROUP=4, HEAD_D=128, PAGE=16, BLOCK_M=pre.block_m, BLOCK_N=pre.block_n,
                                    BLOCK_D=128, DOT_F32=False, WINDOWED=False, SOFTCAP=False, OPERAND=F16,
                                    FP8_WORDS=2),
    pre.num_warps, pre.num_stages, FP8_CACHE)
variants["rope+kv_write fp8 cache"] = (
    rope._rope_kernel, dict(HALF=64, NEOX=False, WRITE_KV=True, QK_NORM=False, BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64,
                            BLOCK_D=128, PDL=True), 4, 2, FP8_CACHE)
for fp8 in (False, True):    # MLA's step prologue (DeepSeek-V2's 512 + 64 latent, 16 heads a program)
    variants[f"mla latent fp8={fp8}"] = (
        mla_latent._mla_latent_kernel, dict(RANK=512, HALF=32, BLOCK_R=512, BLOCK_H=16, NEOX=False, PDL=True), 4, 2,
        {"w_ptr": "*bf16", **({"cache_ptr": "*fp8e4nv"} if fp8 else {})})
for order in (0, 1):     # W_UV on MLA's latent output (DeepSeek-V2-Lite's 16 x 128 from 512), o's operand in f16
    variants[f"mla value order={order}"] = (
        mla_value._value_up_kernel, dict(RANK=512, V=128, BLOCK_V=mla_value.BLOCK_V, BLOCK_N=mla_value.BLOCK_N,
                                         ORDER=order, DOT_F32=False, PDL=True), 4, 2,
        {"lat_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp16"})
variants["kv_write fp8 cache"] = (kv_write._kv_write_kernel, dict(BLOCK_H=8, BLOCK_D=128), 4, 2, FP8_CACHE)
for groups in (False, True):
    variants[f"decode reduce groups={groups}"] = (
        attention._decode_reduce_kernel, dict(HEAD_D=128, BLOCK_D=128, BLOCK_GROUPS=64 // dec.split_group, PDL=True,
                                              BLOCK_N=dec.block_n, **SPLITS, GROUPS=groups, ORDER=int(groups)), 4, 2)
# MLA decode over the latent cache: DeepSeek's 512 + 64 wide latent, 16 heads a program, 8 warps (the launcher's)
for single in (False, True):
    variants[f"mla decode single_split={single}"] = (
        mla_attention._mla_decode_split_kernel,
        dict(N_HEADS=128, BLOCK_H=16, LAT=512, ROPE=64, BLOCK_R=64, PAGE=64, BLOCK_N=dec.block_n,
             MIN_SPLIT=dec.min_split, SINGLE_SPLIT=single, PDL=True, DOT_F32=False, OPERAND=BF16),
        8, dec.num_stages, {"cache_ptr": "*bf16"})
mla_dec = mla_attention.MLA_DECODE_CONFIG
for words in (2,):     # an fp8 latent cache (--kv-cache-dtype fp8), as words (as bytes: 80 bytes of spills)
    variants[f"mla decode fp8 cache words={words}"] = (
        mla_attention._mla_decode_split_kernel,
        dict(N_HEADS=128, BLOCK_H=16, LAT=512, ROPE=64, BLOCK_R=64, PAGE=64, BLOCK_N=mla_dec.block_n,
             MIN_SPLIT=mla_dec.min_split, SINGLE_SPLIT=False, PDL=True, DOT_F32=False, OPERAND=F16, FP8_WORDS=words),
        mla_dec.num_warps, mla_dec.num_stages, {"cache_ptr": "*fp8e4nv"})
# The Triton quantized matmul and dequantize kernels over the checkpoint formats' planes (an f32 row scale)
FP8_PLANES = {"x_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "count_ptr": "*i32", "qs_ptr": "*u8",
              "d_ptr": "*fp16", "m_ptr": "*u8", "sub_ptr": "*u8", "qh_ptr": "*u8"}     # q8_0's planes
NVFP4_PLANES = {**FP8_PLANES, "d_ptr": "*fp32"}                                          # the f32 row scale
variants["quant_matmul fp8 narrow split_k=2"] = (
    quant_matmul._quant_matmul_kernel, dict(FMT=quant_matmul.FP8, BM=16, BN=64, BK=64, SPLIT_K=2, EVEN_K=True,
                                            F32_DOT=False), 4, 3, FP8_PLANES)
variants["quant_matmul nvfp4 narrow split_k=2"] = (   # NVFP4: e2m1 codes, e4m3 block scales (sub), the row scale
    quant_matmul._quant_matmul_kernel, dict(FMT=quant_matmul.NVFP4, BM=16, BN=64, BK=64, SPLIT_K=2, EVEN_K=True,
                                            F32_DOT=False), 4, 3, NVFP4_PLANES)
for name, fmt, planes in (("fp8", quant_matmul.FP8, FP8_PLANES), ("nvfp4", quant_matmul.NVFP4, NVFP4_PLANES)):
    for frag in (False, True):    # fragment order: words in decode order (quant_matmul._byte_of_decode_order)
        variants[f"dequantize {name} frag={frag}"] = (quant_matmul._dequant_kernel, dict(
            FMT=fmt, BN=64, CHUNKS=4, F32=False, FRAG=frag), 4, 2, planes)
# MLA prefill at DeepSeek's latent: the launcher's default config (32 query rows = 2 tokens x 16 heads, 8 warps)
pre = mla_attention.MLA_PREFILL_CONFIG
variants["mla prefill"] = (
    mla_attention._mla_prefill_kernel,
    dict(N_HEADS=128, BLOCK_H=pre.block_h, BLOCK_T=pre.rows // pre.block_h, LAT=512, ROPE=64, BLOCK_R=64, PAGE=64,
         BLOCK_N=pre.block_n, DOT_F32=False, OPERAND=BF16),
    pre.num_warps, pre.num_stages, {"cache_ptr": "*bf16"})
for words in (2, 0):
    variants[f"mla prefill fp8 cache words={words}"] = (
        mla_attention._mla_prefill_kernel,
        dict(N_HEADS=128, BLOCK_H=pre.block_h, BLOCK_T=pre.rows // pre.block_h, LAT=512, ROPE=64, BLOCK_R=64,
             PAGE=64, BLOCK_N=pre.block_n, DOT_F32=False, OPERAND=F16, FP8_WORDS=words),
        pre.num_warps, pre.num_stages, {"cache_ptr": "*fp8e4nv"})
for gelu, interleaved in ((False, False), (True, False), (False, True)):
    variants[f"gated_mul gelu={gelu} interleaved={interleaved}"] = (
        activation._gated_mul_kernel, dict(BLOCK=1024, GELU=gelu, INTERLEAVED=interleaved, PDL=True), 4, 2)
for residual, order in ((False, 0), (True, 0), (True, 1), (True, 2)):     # order: operand_order's, for the GEMM
    variants[f"rms_norm residual={residual} order={order}"] = (
        norm._rms_norm_kernel, dict(HAS_RESIDUAL=residual, BLOCK=4096, PDL=True, ORDER=order), 16, 2)
for neox, half, qk_norm in ((False, 64, False), (True, 64, False), (True, 24, False), (True, 64, True)):
    # 24: Phi-4-mini's partial rotary (48 of 64 dims); qk_norm: qwen3's per-head norms
    variants[f"rope+kv_write neox={neox} half={half} qk_norm={qk_norm}"] = (
        rope._rope_kernel, dict(HALF=half, NEOX=neox, WRITE_KV=True, QK_NORM=qk_norm, BLOCK_HQ=16, BLOCK_HK=8,
                                BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=128, PDL=True), 4, 2)
# the sampler's token picks from float32 scores (bf16 rows compile the same loop): greedy, and Gumbel-max's noise
# over scores or over logits it tempers itself
for noise, temper in ((False, False), (True, False), (True, True)):
    variants[f"greedy chunk max noise={noise} temper={temper}"] = (
        greedy._chunk_max_kernel, dict(CHUNK=greedy.CHUNK, BLOCK=greedy.BLOCK, NOISE=noise, TEMPER=temper,
                                       HUGE=greedy.FLOAT32_HUGE), 4, 2,
        {"logits_ptr": "*fp32", "row_keys_ptr": "*i64", "token_keys_ptr": "*i64", "inverse_temperature_ptr": "*fp32",
         "max_ptr": "*fp32", "index_ptr": "*i32"})
for fallback in (False, True):
    variants[f"greedy row pick fallback={fallback}"] = (
        greedy._row_pick_kernel, dict(CHUNKS=32, FALLBACK=fallback), 1, 2,
        {"max_ptr": "*fp32", "index_ptr": "*i32", "fallback_ptr": "*i64", "out_ptr": "*i64"})
# top-p without a sort: one program a row over float32 scores
variants["top_p keep"] = (
    top_p._top_p_kernel, dict(BLOCK=top_p.BLOCK, CAP=top_p.CAP, VALUE_STEPS=top_p.VALUE_STEPS), top_p.WARPS, 2,
    {"scores_ptr": "*fp32", "out_ptr": "*fp32", "p_ptr": "*fp32", "min_p_ptr": "*fp32", "aside_ptr": "*fp32"})
variants["top_k keep"] = (
    top_k._top_k_kernel, dict(BLOCK=top_p.BLOCK, CAP=top_p.CAP, VALUE_STEPS=top_p.VALUE_STEPS), top_k.WARPS, 2,
    {"scores_ptr": "*fp32", "out_ptr": "*fp32", "k_ptr": "*i32", "p_ptr": "*fp32", "min_p_ptr": "*fp32",
     "aside_ptr": "*fp32"})
variants["kv_write"] = (kv_write._kv_write_kernel, dict(BLOCK_H=8, BLOCK_D=128), 4, 2)
variants["gemm x_operands"] = (quant_gemm._x_operands_kernel, dict(ORDER=1, BLOCK=1024, PDL=True), 4, 2,
                               {"out_ptr": "*fp16"})
# LoRA's shrink (K split, the last split adding the partials) and expand; the slots int64, as the model keeps them
LORA_POINTERS = {"slots_ptr": "*i64", "scale_ptr": "*fp32", "partial_ptr": "*fp32", "count_ptr": "*i32"}
for splits in (1, 8):
    variants[f"lora shrink splits={splits}"] = (
        lora._shrink_kernel, dict(CAPACITY=4, RANK=16, BN=16, BC=64, BK=128, K_SPLIT=512, SPLITS=splits,
                                  DOT_F32=False, PDL=True), 4, 2, LORA_POINTERS)
variants["lora expand"] = (lora._expand_kernel, dict(BN=16, BO=64, BC=64, ROW_BLOCKS=4, DOT_F32=False, PDL=True),
                           4, 2, LORA_POINTERS)
variants["moe combine"] = (moe_routing._combine_kernel, dict(K=8, SHARED=False, BLOCK=1024, PDL=True), 4, 2)
variants["moe combine shared"] = (moe_routing._combine_kernel, dict(K=6, SHARED=True, BLOCK=1024, PDL=True), 4, 2,
                                  {"shared_ptr": "*bf16", "out_ptr": "*bf16"})
variants["moe router logits"] = (moe_routing._router_logits_kernel, dict(BLOCK_E=1, BLOCK_K=2048, PDL=True), 4, 2)
variants["moe slots"] = (moe_routing._slots_kernel, dict(K=8, CHUNK=32, Q=256, QE=64, BLOCK_E=128, BLOCK_S=256,
                                                           SIZE=16, MAX_PER_EXPERT=4, PDL=True), 4, 2)
# a prefill chunk's slots for the routed GEMM: 2048 rows of DeepSeek-V2-Lite's 6 of 64 experts, 64 pairs a slot
variants["moe slots gemm"] = (moe_routing._slots_kernel, dict(K=6, CHUNK=32, Q=256, QE=128, BLOCK_E=64, BLOCK_S=256,
                                                              SIZE=64, MAX_PER_EXPERT=32, PDL=True), 4, 2)
# Qwen's softmax top-k, with and without renormalizing; DeepSeek-V3's sigmoid, bias and group limit (256 experts
# in 8 groups: 4 warps)
for normalize in (False, True):
    variants[f"moe route softmax normalize={normalize}"] = (
        moe_routing._choose_kernel, dict(BLOCK_E=128, K=8, BLOCK_KK=8, NORMALIZE=normalize, SIGMOID=False, BIAS=False,
                                         GROUPS=0, GROUPS_USED=0, GROUP_SIZE=128, BLOCK_G=1, PDL=True), 1, 2)
variants["moe route sigmoid bias groups"] = (
    moe_routing._choose_kernel, dict(BLOCK_E=256, K=8, BLOCK_KK=8, NORMALIZE=True, SIGMOID=True, BIAS=True, GROUPS=8,
                                     GROUPS_USED=4, GROUP_SIZE=32, BLOCK_G=8, PDL=True), 4, 2)



def compile_gluon_for_h200(kernel, constants, num_warps, maxnreg=None, descriptors=None, activations="bf16",
                           target=H200):
    # A Gluon kernel over the packed planes (quant_gemv.py, quant_gemm.py): their own front end, q6_K's f32
    # super-block scales, bf16 activations (or `activations`); `descriptors` names the arguments that are TMA
    # tensor descriptors.
    from triton.experimental.gluon._runtime import GluonASTSource
    # constexpr parameters a variant leaves out take their defaults (as a launch that does not name them)
    constants = {**{q.name: q.default for q in kernel.params if q.is_constexpr and q.has_default}, **constants}
    names = list(kernel.arg_names)
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif descriptors and name in descriptors:
            signature[name] = descriptors[name]
        elif name == "partial_ptr" or (name == "d_ptr" and constants["FMT"] in quant_pack.SCALED_BY_16):
            signature[name] = "*fp32"
        elif name in ("d_ptr", "m_ptr"):
            signature[name] = "*fp16"
        elif name in ("qs_ptr", "sub_ptr", "qh_ptr"):
            signature[name] = "*u8"
        elif name in ("x_ptr", "out_ptr"):
            signature[name] = f"*{activations}"
        else:
            signature[name] = "*i32" if name.endswith("_ptr") else "i32"
    divisible = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if n.endswith(("_ptr", "stride")) or n == "n_chunks"}
    compiled = triton.compile(GluonASTSource(kernel, signature, constants, divisible), target=target,
                              options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    assert compiled.asm["cubin"]
    return compiled


def compile_gemv_for_h200(constants, R):
    return compile_gluon_for_h200(quant_gemv._gemv_kernel, constants, constants["W"], R)


gemv_variants = {}
MASKED_TOKENS, CLAMPED_TOKENS = (quant_gemv.X_LOAD_MODES[m] for m in ("masked_tokens", "clamped_tokens"))
if quant_gemv.gluon is not None:
    # every format; the act*mul epilogue with and without split-K, at both token tiles, its output in the next
    # GEMM's column order (quant_gemv.act_code: 5 silu by 32, 10 gelu by 16); routed experts
    for fmt in (quant_pack.Q8_0, quant_pack.Q4_0, quant_pack.Q4_1, quant_pack.Q5_0, quant_pack.Q5_1, quant_pack.Q6_K,
                quant_pack.FP8_E4M3, quant_pack.NVFP4):
        for act, split, bt, routed in ((0, 2, 8, False), (5, 1, 16, False), (10, 2, 16, False), (1, 1, 8, True)):
            if fmt == quant_pack.FP8_E4M3 and not routed:
                continue                  # FP8 is q8_0 but for its byte decode: one variant
            if fmt == quant_pack.NVFP4 and (act, routed) not in ((0, False), (1, True)):
                continue                  # NVFP4: its decode and its row-scale epilogue, plain and routed
            gemv_variants[f"gemv fmt={fmt} act={act} split_k={split} bt={bt} routed={routed}"] = dict(
                FMT=fmt, W=4, RT=4, BT=bt, SPLIT_K=split, X_LOADS=MASKED_TOKENS, U=2, D=0, ROUTED=routed, ACT=act,
                PDL=False)
    # the leaner loops (quant_gemv.GEMV_CLAMP_X, GEMV_FOLD_STEPS): each loader of x and of the side planes, q6_K's
    # d moved by steps of whole super-blocks (W = 4) and not (W = 2), a tail, the fifth bits
    for fmt, routed, w in ((quant_pack.Q8_0, False, 4), (quant_pack.Q4_1, True, 4), (quant_pack.Q6_K, False, 4),
                           (quant_pack.Q6_K, False, 2), (quant_pack.NVFP4, False, 4), (quant_pack.Q5_0, False, 4)):
        gemv_variants[f"gemv lean loop fmt={fmt} routed={routed} W={w}"] = dict(
            FMT=fmt, W=w, RT=2, BT=8, SPLIT_K=1, X_LOADS=CLAMPED_TOKENS, U=4, TAIL=1, FOLD=True, D=0, ROUTED=routed,
            ACT=0, PDL=False)
    # as a programmatic dependent (quant_gemv.GEMV_PDL): L1 prefetches and the wait before the loop, the trigger after
    for fmt, routed in ((quant_pack.Q8_0, False), (quant_pack.Q4_1, True)):
        gemv_variants[f"gemv pdl fmt={fmt} routed={routed}"] = dict(
            FMT=fmt, W=4, RT=4, BT=8, SPLIT_K=2, X_LOADS=MASKED_TOKENS, U=2, D=0, ROUTED=routed, ACT=0, PDL=True)

def compile_gemm_for_h200(constants):
    # The Gluon mid-batch GEMM (quant_gemm.py): its wgmmas must stay pipelined (ptxas serializes them, and says
    # so in an info line, when a register operand is redefined while a wgmma reading it is in flight).
    return _require_pipelined_wgmma(compile_gluon_for_h200(quant_gemm._gemm_kernel, constants, constants["NW"]))


def _require_pipelined_wgmma(compiled):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                text=True).stderr
    if "serialized" in report:
        raise RuntimeError(report.strip().splitlines()[0])
    return compiled


gemm_variants = {}
if quant_gemm.warpgroup_mma is not None:
    # every format; between them: the largest token tile, split-K with each epilogue, one warpgroup, odd K, prefetch
    for fmt, nw, bn, split, act, even_k, d, p in (
            (quant_pack.Q8_0, 8, 256, 1, 0, True, 0, 1), (quant_pack.Q8_0, 4, 32, 4, 2, False, 2, 0),
            (quant_pack.Q4_0, 8, 64, 2, 1, True, 0, 1), (quant_pack.Q4_1, 8, 256, 1, 0, True, 0, 0),
            (quant_pack.Q4_1, 4, 32, 4, 2, False, 2, 1), (quant_pack.Q6_K, 8, 256, 1, 0, True, 0, 1),
            (quant_pack.Q6_K, 8, 64, 2, 1, True, 0, 0), (quant_pack.FP8_E4M3, 8, 256, 2, 1, True, 0, 1),
            (quant_pack.NVFP4, 8, 64, 2, 1, True, 0, 1), (quant_pack.NVFP4, 4, 256, 1, 0, False, 2, 0),
            (quant_pack.Q5_0, 8, 64, 2, 1, True, 0, 1), (quant_pack.Q5_0, 4, 256, 1, 0, False, 2, 0),
            (quant_pack.Q5_1, 8, 256, 1, 0, True, 0, 1), (quant_pack.Q5_1, 4, 32, 4, 2, False, 2, 0)):
        gemm_variants[f"gemm fmt={fmt} nw={nw} bn={bn} split_k={split} act={act} even_k={even_k} d={d} p={p}"] = \
            dict(FMT=fmt, NW=nw, BN=bn, SPLIT_K=split, EVEN_K=even_k, D=d, P=bool(p), ACT=act)
    # routed over stacked experts (an MoE step's slots of 32 or 64 pairs): the byte, nibble, 16-weight-scaled and
    # fifth-bit loops, with the act*mul epilogue of gate|up experts and without
    for fmt, nw, bn, act, p in ((quant_pack.Q8_0, 8, 64, 1, 0), (quant_pack.Q4_1, 8, 32, 0, 1),
                                (quant_pack.Q6_K, 4, 64, 1, 0), (quant_pack.NVFP4, 8, 64, 0, 0),
                                (quant_pack.Q5_0, 4, 32, 0, 1)):
        gemm_variants[f"gemm routed fmt={fmt} nw={nw} bn={bn} act={act} p={p}"] = \
            dict(FMT=fmt, NW=nw, BN=bn, SPLIT_K=1, EVEN_K=True, D=0, P=bool(p), ACT=act, ROUTED=True)

def compile_gemm_tma_for_h200(constants):
    # The GEMM's TMA variant: x arrives as a tensor descriptor
    from triton.experimental.gluon import language as gl
    kc = 32 if constants["FMT"] in quant_pack.BYTE_FORMATS else 64
    layout = gl.NVMMASharedLayout.get_default_for([constants["BN"], kc], gl.float16)
    return compile_gluon_for_h200(quant_gemm._gemm_tma_kernel, constants, constants["NW"],
                                  descriptors={"x_desc": f"tensordesc<fp16[{constants['BN']}, {kc}],{layout!r}>"})


gemm_tma_variants = {}
if quant_gemm.warpgroup_mma is not None:
    for fmt, nw, bn, split, act, s in ((quant_pack.Q4_1, 8, 256, 1, 0, 3), (quant_pack.Q6_K, 4, 64, 2, 1, 4),
                                       (quant_pack.NVFP4, 8, 128, 1, 0, 3), (quant_pack.Q5_0, 8, 128, 1, 0, 3)):
        gemm_tma_variants[f"gemm tma fmt={fmt} nw={nw} bn={bn} split_k={split} act={act} ring={s}"] = dict(
            FMT=fmt, NW=nw, BN=bn, SPLIT_K=split, D=0, P=True, S=s, ACT=act)

def compile_gemm_ring_for_h200(constants):
    # The GEMM's ring variant: every plane and x arrive as TMA descriptors of one stage's blocks, unswizzled
    # (quant_gemm.ring_descriptors); its consumer's wgmmas must stay pipelined too
    from triton.experimental.gluon import language as gl
    fmt, c, bn = constants["FMT"], constants["C"], constants["BN"]
    nw = constants["NW"] // 2 if constants["APART"] else constants["NW"]     # warps (row tiles) of one consumer
    def desc(dtype, block, bits):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=len(block))
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"
    kc = 32 if fmt in quant_pack.BYTE_FORMATS else 64
    qs = desc("u8", [nw, 2 * c, 256], 8)
    if fmt == quant_pack.Q6_K:
        d, sub, qh = desc("fp32", [nw, 16], 32), desc("i32", [nw, 16 * c], 32), desc("u8", [nw, c, 256], 8)
    elif fmt == quant_pack.NVFP4:     # a stage carries its sub plane's words where the others carry d
        d, sub, qh = desc("i32", [nw, 16 * c], 32), qs, qs
    else:
        d, sub, qh = desc("fp16", [nw, c * quant_gemm._SIDE_PER_CHUNK[fmt]], 16), qs, qs
        if fmt in quant_pack.FIFTH_BIT_FORMATS:
            qh = desc("u8", [nw, c, 128], 8)
    xb = quant_gemm.token_tile(bn + constants.get("BN2", 0))       # x's block: two accumulators' tokens and more
    x = f"tensordesc<fp16[{xb}, {kc}],{gl.NVMMASharedLayout.get_default_for([xb, kc], gl.float16)!r}>"
    cfg = quant_gemm.GemmConfig(NW=constants["NW"], RING=constants["S"], CHUNKS=c, APART=constants["APART"])
    compiled = compile_gluon_for_h200(quant_gemm._gemm_ring_kernel, constants, nw, cfg.registers(xb),
                                      descriptors={"qs_desc": qs, "d_desc": d, "sub_desc": sub, "qh_desc": qh,
                                                   "x_desc": x})
    return _require_pipelined_wgmma(compiled)


def ring_flags(apart, persist, lag, ahead) -> str:
    """The ring variants' name suffix for their boolean switches."""
    return "".join(f" {name}" for name, on in (("apart", apart), ("persist", persist), ("lag", lag), ("ahead", ahead))
                   if on)


gemm_ring_variants = {}
if quant_gemm.warpgroup_mma is not None:
    # the persistent grid (PERSIST: work items walked by each CTA) with and without APART and split-K; LAG (MMAs in
    # flight across the consumer's loop) alone, with APART, PERSIST and split-K, and where q6_K and NVFP4 ignore it;
    # AHEAD (a stage's bytes loaded at once) on stages of 2 and 4 chunks (q4_1's 4 with LAG: serialized, C7513)
    for fmt, nw, bn, split, act, s, c, apart, persist, lag, ahead in (
            (quant_pack.Q8_0, 8, 64, 1, 0, 4, 2, False, False, False, False),
            (quant_pack.Q4_1, 8, 256, 1, 0, 3, 1, False, False, False, False),
            (quant_pack.Q6_K, 4, 64, 2, 9, 4, 2, False, False, True, True),      # act 9: silu, stored by 16
            (quant_pack.Q8_0, 8, 128, 2, 1, 4, 2, True, False, False, False),
            (quant_pack.Q6_K, 8, 64, 1, 0, 4, 2, True, False, False, False),
            (quant_pack.FP8_E4M3, 8, 64, 1, 1, 8, 2, True, False, True, False),
            (quant_pack.Q8_0, 8, 64, 1, 0, 8, 2, True, True, True, False),
            (quant_pack.Q4_1, 4, 64, 2, 0, 8, 2, False, True, True, False),
            (quant_pack.Q8_0, 8, 128, 4, 2, 4, 4, False, False, True, True),
            (quant_pack.Q4_1, 8, 64, 1, 1, 8, 2, True, True, True, True),
            (quant_pack.NVFP4, 8, 64, 1, 1, 8, 2, True, False, True, False),
            (quant_pack.NVFP4, 4, 128, 2, 0, 6, 1, False, True, False, False),
            (quant_pack.Q5_1, 8, 64, 1, 1, 8, 2, True, True, True, True),
            (quant_pack.Q5_0, 4, 64, 2, 0, 8, 2, False, False, True, True)):
        gemm_ring_variants[f"gemm ring fmt={fmt} nw={nw} bn={bn} split_k={split} act={act} ring={s}x{c}"
                           f"{ring_flags(apart, persist, lag, ahead)}"] = dict(
            FMT=fmt, NW=nw, BN=bn, SPLIT_K=split, C=c, S=s, ACT=act, APART=apart, PERSIST=persist, LAG=lag,
            AHEAD=ahead, PDL=True)
    # token tiles of 96, 160 and 192 as two accumulators (quant_gemm.SPLIT_TILES): the committed plans' kinds of ring
    # (q8_0's and q4_K's decode configs, a wide one of two warpgroups apart, split-K) and a format of four k16 MMAs
    for fmt, nw, bn, bn2, split, act, s, c, apart, persist, lag, ahead in (
            (quant_pack.Q8_0, 8, 64, 32, 1, 5, 6, 4, False, True, True, True),   # act 5: silu, stored by 32
            (quant_pack.Q8_0, 4, 64, 32, 2, 0, 6, 4, False, False, True, True),
            (quant_pack.Q4_1, 8, 128, 32, 1, 0, 4, 2, False, False, True, True),
            (quant_pack.Q8_0, 8, 128, 64, 4, 0, 4, 2, True, False, True, False),
            (quant_pack.Q6_K, 4, 64, 32, 2, 0, 8, 2, False, False, True, True)):
        gemm_ring_variants[f"gemm ring fmt={fmt} nw={nw} bn={bn}+{bn2} split_k={split} act={act} ring={s}x{c}"
                           f"{ring_flags(apart, persist, lag, ahead)}"] = dict(
            FMT=fmt, NW=nw, BN=bn, BN2=bn2, SPLIT_K=split, C=c, S=s, ACT=act, APART=apart, PERSIST=persist, LAG=lag,
            AHEAD=ahead, PDL=True)
    # routed over stacked experts (an MoE step's slots): a CTA of one item skipping an empty slot, with LAG's tail
    # release guarded, apart and not; the persistent grid, whose empty slots run as any item
    for fmt, nw, bn, act, s, c, apart, persist, lag, ahead in (
            (quant_pack.Q8_0, 8, 64, 1, 4, 2, True, False, True, False),
            (quant_pack.Q4_1, 4, 64, 0, 8, 2, False, False, True, False),
            (quant_pack.Q4_1, 4, 32, 1, 8, 2, False, False, True, True),     # a decode step's (ROUTED_CONFIGS)
            (quant_pack.Q6_K, 8, 128, 1, 4, 2, False, True, False, False),
            (quant_pack.NVFP4, 8, 64, 0, 8, 2, True, True, True, False),
            (quant_pack.Q8_0, 8, 128, 1, 2, 4, False, True, True, True),
            (quant_pack.Q4_1, 8, 64, 1, 8, 2, False, True, True, True)):
        gemm_ring_variants[f"gemm ring routed fmt={fmt} nw={nw} bn={bn} act={act} ring={s}x{c}"
                           f"{ring_flags(apart, persist, lag, ahead)}"] = dict(
            FMT=fmt, NW=nw, BN=bn, SPLIT_K=1, C=c, S=s, ACT=act, APART=apart, PERSIST=persist, LAG=lag,
            AHEAD=ahead, PDL=True, ROUTED=True)

jobs = [(name, compile_for_h200, spec) for name, spec in variants.items()]


def on_ampere(kernel, constants, num_warps=4, num_stages=2, pointers=None, maxnreg=None):
    """A variant as an A100 runs it: no programmatic launch (Hopper's); an fp8 cache as uint8
    (fp8_cache.kernel_view), its rows widened by bit moves (FP8_WORDS = BITS)."""
    from cobatch.kernels import fp8_cache
    fp8 = "*fp8e4nv" in (pointers or {}).values()
    pointers = {name: "*u8" if kind == "*fp8e4nv" else kind for name, kind in (pointers or {}).items()}
    constants = {**constants, **({"FP8_WORDS": fp8_cache.BITS} if fp8 and "FP8_WORDS" in constants else {}),
                 **({"PDL": False} if "PDL" in constants else {})}
    return compile_for_h200(kernel, constants, num_warps, num_stages, pointers, maxnreg, target=AMPERE)


def has_fp8_cache(spec) -> bool:
    return len(spec) > 4 and "*fp8e4nv" in (spec[4] or {}).values()


def gemv_on_ampere(constants):
    """A GEMV as an A100 runs it: no programmatic launch; NVFP4's e4m3 block scales widened by bit moves
    (E4M3_CVT off)."""
    constants = {**constants, "PDL": False, **({"E4M3_CVT": False} if constants["FMT"] == quant_pack.NVFP4 else {})}
    return compile_gluon_for_h200(quant_gemv._gemv_kernel, constants, constants["W"], 128, target=AMPERE)


# Ampere (sm_80) runs the Triton kernels and the GEMV (the GEMMs and the CUDA C++ kernels are Hopper's)
jobs += [(f"ampere {name}", on_ampere, spec) for name, spec in variants.items()]
jobs += [(f"ampere {name}", gemv_on_ampere, (constants,)) for name, constants in gemv_variants.items()]
jobs += [(name, compile_gemm_ring_for_h200, (constants,)) for name, constants in gemm_ring_variants.items()]
jobs += [(name, compile_gemm_tma_for_h200, (constants,)) for name, constants in gemm_tma_variants.items()]
jobs += [(name, compile_gemm_for_h200, (constants,)) for name, constants in gemm_variants.items()]
jobs += [(name, compile_gemv_for_h200, (constants, 128)) for name, constants in gemv_variants.items()]


def compile_fragment_dequant_for_h200(fmt):
    # the prefill path's dense matrix from fragment-order planes: its stores must be 16 bytes a lane (q6_K: 8, the
    # 4 columns of a k16 half)
    compiled = compile_gluon_for_h200(fragment_dequant._dequant_kernel, dict(
        FMT=fmt, W=fragment_dequant.WARPS, RT=fragment_dequant.ROW_TILES, U=fragment_dequant.CHUNKS_PER_WARP),
        fragment_dequant.WARPS)
    ptx = compiled.asm["ptx"]
    if ptx.count("st.global") != ptx.count("st.global.v2" if fmt == quant_pack.Q6_K else "st.global.v4"):
        raise RuntimeError("stores not vectorized")
    return compiled


jobs += [(f"fragment dequant fmt={fmt}", compile_fragment_dequant_for_h200, (fmt,))
         for fmt in (fragment_dequant.FORMATS if fragment_dequant.gluon is not None else ())]


def within_budget(name: str, compiled) -> str:
    """"ok", or why not. Decode attention runs 4 programs per SM only within 128 registers (measured: a mask
    carried through the pipeline took 168 and cost 20 % of bandwidth), and the cap must not make it spill (256-wide
    heads cannot fit 128: they must not spill either; nor may MLA decode, one program per SM by its shared memory)."""
    usage = registers(compiled) if name.startswith(("decode", "mla")) else None
    if usage is None or ((usage[0] <= 128 or "head_d=256" in name or name.startswith("mla")) and usage[1] == 0):
        return "ok"
    return f"{usage[0]} registers, {usage[1]} bytes of stack (at most 128, and no spills)"


def compile_all() -> dict[str, str]:
    """Compile every variant, each checked as its kind requires: {name: "ok" | why not}."""
    results = {}
    for name, fn, args in jobs:
        try:
            results[name] = within_budget(name, fn(*args))
        except Exception as e:  # reported per variant, so one failure names itself
            results[name] = f"{type(e).__name__}: {str(e)[-400:]}"
    return results


if __name__ == "__main__":
    print(json.dumps(compile_all()))
