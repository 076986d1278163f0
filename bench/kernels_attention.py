"""Attention kernel benchmark: decode GB/s of KV bytes read, prefill TFLOP/s.

    PYTHONPATH=src python bench/kernels_attention.py [--sweep]

Decode: B = 1, 8, 64 sequences x context 512, 4k, 32k, Llama-3-8B heads (32 q, 8 KV, D 128), bf16 KV in
16-token pages scattered over the pool (ATTN_KV_DTYPES=bf16,fp8: also an fp8 cache, --kv-cache-dtype fp8).
Bytes counted: K + V of every sequence's context in the cache's dtype (q, the output and the block tables
are left out). Timed as the median replay of a CUDA graph holding R calls on R disjoint
copies of the inputs (R sized so that they overflow the 60 MB L2, and at least 4), divided by R.
Prefill: one 2048-token prompt, causal, against torch SDPA on the same (contiguous) K/V.
--fp8-words: an fp8 cache's decode and prefill with its tiles loaded as bytes against as 32-bit words
(DecodeConfig.fp8_words) and FP8_VARIANTS' deeper pipelines, with the bf16 cache beside them.
--fp8-tiles: an fp8 cache's decode kernel in FP8_TILE_VARIANTS' tiles, warps and stages (each checked against the
torch reference first), the default and the bf16 cache beside them (ATTN_CONTEXTS: the contexts, default 512,4096).
--mla: the MLA decode path instead, as the package runs it (kernels/mla_attention.py: the CUDA C++ split kernel
on Hopper, else the Triton one; --mla --sweep: each of MLA_SWEEP's configs;
--mla --cuda: the Triton split kernel against the CUDA C++ one, kernels/mla_decode_cuda.py, in MLA_CUDA_SWEEP's
configs (with ATTN_KV_DTYPES=bf16,fp8 also an fp8 cache's, MLA_CUDA_FP8_SWEEP: the CUDA kernel taking e4m3 rows, as
it does unless COBATCH_MLA_CUDA_FP8=0), each first checked against the torch reference), DeepSeek-V2-Lite's heads
(16 q heads, or MLA_HEADS=128 as V2 and V3 have them; one latent row of 512 + 64 values per token) at B = 1, 8, 64 x
context 512, 8192 (MLA_CONTEXTS): bytes counted, each
sequence's latent rows (576 values a token, in the cache's dtype; ATTN_KV_DTYPES=bf16,fp8: an fp8 cache too).
bench/kernels.py imports run(); run alone, this measures the copy bandwidth itself and writes JSON to $OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from cobatch.batch import AttentionMetadata
from cobatch.kernels import mla_decode_cuda
from cobatch.kernels.attention import (DECODE_CONFIG, PREFILL_CONFIG, DecodeConfig, PrefillConfig,
                                       paged_attention_ref, paged_decode_attention, paged_prefill_attention)
from cobatch.kernels import mla_attention
from cobatch.kernels.mla_attention import MLA_DECODE_CONFIG, mla_attention_ref, mla_decode_attention
from cobatch.kernels.mla_decode_cuda import MlaCudaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copy_bandwidth, graph_time, graph_times  # noqa: E402  (replays queued behind a GPU sleep)

N_Q, N_KV, HEAD_DIM, PAGE = 32, 8, 128, 16
BATCHES = tuple(int(b) for b in os.environ.get("ATTN_BATCHES", "1,8,64").split(","))
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
RUN_KV_DTYPES = tuple(os.environ.get("ATTN_KV_DTYPES", "bf16").split(","))
CONTEXTS = (512, 4096, 32768)
PREFILL_TOKENS = 2048
# DeepSeek-V2-Lite's 16 query heads (MLA_HEADS=128: V2's and V3's, the same latent row)
MLA_HEADS = int(os.environ.get("MLA_HEADS", "16"))
MLA_LORA, MLA_ROPE = 512, 64
MLA_CONTEXTS = tuple(int(c) for c in os.environ.get("MLA_CONTEXTS", "512,8192").split(","))
L2_FLUSH_BYTES = 256 << 20
MIN_CALLS = 4


def _random_cache(shape, gen: torch.Generator, kv_dtype: torch.dtype) -> torch.Tensor:
    """Random K or V in kv_dtype (drawn in bf16: torch draws no fp8)."""
    if kv_dtype == torch.bfloat16:
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(shape, device="cuda", dtype=kv_dtype)
    for page0 in range(0, shape[0], 4096):        # in slices: no bf16 copy of a 16 GiB pool
        piece = out[page0: page0 + 4096]
        piece.copy_(torch.randn(piece.shape, device="cuda", dtype=torch.bfloat16, generator=gen))
    return out


def _decode_inputs(batch: int, context: int, copies: int, gen: torch.Generator, filled: int | None = None,
                   kv_dtype: torch.dtype = torch.bfloat16):
    """`copies` independent (q, meta) sets over one shared pool, each with its own scattered pages.
    Sequences hold `filled` tokens (default: all `context`, the capacity the graph is planned for)."""
    pages_per_seq = -(-context // PAGE)
    num_pages = pages_per_seq * batch * copies
    shape = (num_pages, PAGE, N_KV, HEAD_DIM)
    k_cache = _random_cache(shape, gen, kv_dtype)
    v_cache = _random_cache(shape, gen, kv_dtype)
    sets = []
    for meta in _scattered_decode_metas(batch, context, copies, gen, filled):
        q = torch.randn(batch, N_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        sets.append((q, meta))
    return k_cache, v_cache, sets


def _scattered_decode_metas(batch: int, context: int, copies: int, gen: torch.Generator,
                            filled: int | None = None) -> list[AttentionMetadata]:
    """`copies` decode steps of `batch` sequences over one pool of pages_per_seq * batch * copies pages, each
    sequence's pages drawn at random (no two the same); sequences hold `filled` tokens (default `context`)."""
    pages_per_seq = -(-context // PAGE)
    perm = torch.randperm(pages_per_seq * batch * copies, device="cuda", generator=gen).to(torch.int32)
    metas = []
    for c in range(copies):
        tables = perm[c * batch * pages_per_seq: (c + 1) * batch * pages_per_seq].view(batch, pages_per_seq)
        metas.append(AttentionMetadata(
            slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device="cuda"),
            query_start=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            seq_lens=torch.full((batch,), context if filled is None else filled, dtype=torch.int32, device="cuda"),
            block_tables=tables.contiguous(), max_query_len=1, max_seq_len=context))
    return metas


def bench_decode(batch: int, context: int, cfg: DecodeConfig, gen: torch.Generator,
                 filled: int | None = None, kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    itemsize = torch.empty(0, dtype=kv_dtype).element_size()
    kv_bytes = batch * (context if filled is None else filled) * N_KV * HEAD_DIM * 2 * itemsize
    set_bytes = batch * context * N_KV * HEAD_DIM * 2 * itemsize
    # At least MIN_CALLS calls per graph, so that the graph's own launch (a few us, which a decode step pays
    # once for ~300 kernels) is not charged to one or two calls; at most 16 GiB of inputs.
    copies = max(MIN_CALLS, min(64, -(-L2_FLUSH_BYTES // set_bytes)))
    copies = max(1, min(copies, (16 << 30) // set_bytes))
    k_cache, v_cache, sets = _decode_inputs(batch, context, copies, gen, filled, kv_dtype)
    outs = [torch.empty_like(q) for q, _ in sets]
    scale = HEAD_DIM ** -0.5
    calls = [lambda q=q, m=m, o=o: paged_decode_attention(q, k_cache, v_cache, m, scale, out=o, cfg=cfg)
             for (q, m), o in zip(sets, outs)]
    timed = graph_times(calls, reps=20)
    ms = timed.queued * 1e3
    return {"kernel": "decode_attention", "batch": batch, "context": context, "filled": filled or context,
            "kv_dtype": str(kv_dtype).removeprefix("torch."), "us": ms * 1e3,
            "kv_bytes": kv_bytes, "gbps": kv_bytes / (ms * 1e-3) / 1e9, "config": asdict(cfg),
            "us_idle_stream": timed.idle * 1e6, "gbps_idle_stream": kv_bytes / timed.idle / 1e9}


def bench_mla_decode(batch: int, context: int, gen: torch.Generator, cfg: DecodeConfig | None = None,
                     block_h: int = 16, cuda: MlaCudaConfig | None = None,
                     kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The MLA decode kernel on `batch` sequences of `context` latent rows in 16-token pages scattered over the
    pool, R copies of the inputs as bench_decode. cfg None: the package's default path (the CUDA C++ kernel where
    mla_attention.MLA_CUDA and the GPU take it, each kernel on its own plan); else the Triton kernel on cfg, or
    the CUDA one (cuda) on cfg. kv_dtype: the latent cache's (fp8: the Triton kernel on its own plan, unless
    mla_decode_cuda.MLA_CUDA_FP8)."""
    default = cfg is None
    if default:
        cuda = MlaCudaConfig() if (mla_attention.MLA_CUDA and torch.cuda.get_device_capability()[0] == 9
                                   and (kv_dtype == torch.bfloat16 or mla_decode_cuda.MLA_CUDA_FP8)) else None
        cfg = ((mla_attention.MLA_CUDA_FP8_PLAN if kv_dtype != torch.bfloat16 else mla_attention.MLA_CUDA_PLAN)
               if cuda else MLA_DECODE_CONFIG)
    width = MLA_LORA + MLA_ROPE
    itemsize = torch.empty(0, dtype=kv_dtype).element_size()
    pages_per_seq = -(-context // PAGE)
    set_bytes = batch * pages_per_seq * PAGE * width * itemsize
    copies = max(1, min(max(MIN_CALLS, min(64, -(-L2_FLUSH_BYTES // set_bytes))), (16 << 30) // set_bytes))
    num_pages = pages_per_seq * batch * copies
    cache = _random_cache((num_pages, PAGE, 1, width), gen, kv_dtype)
    calls = []
    for meta in _scattered_decode_metas(batch, context, copies, gen):
        q = torch.randn(batch, MLA_HEADS, width, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(batch, MLA_HEADS, MLA_LORA, device="cuda", dtype=torch.bfloat16)
        calls.append(lambda q=q, m=meta, o=out: mla_decode_attention(
            q, cache, m, width ** -0.5, MLA_LORA, out=o, cfg=None if default else cfg, block_h=block_h,
            cuda=None if default else cuda is not None, cuda_cfg=cuda or MlaCudaConfig()))
    ms = graph_times(calls, reps=20).queued * 1e3
    kv_bytes = batch * context * width * itemsize
    return {"kernel": "mla_decode_attention", "batch": batch, "context": context, "filled": context,
            "kv_dtype": str(kv_dtype).removeprefix("torch."), "heads": MLA_HEADS, "latent_width": width, "us": ms * 1e3,
            "kv_bytes": kv_bytes, "gbps": kv_bytes / (ms * 1e-3) / 1e9, "config": asdict(cfg), "block_h": block_h,
            "cuda": asdict(cuda) if cuda else None}


# (config, block_h) candidates of --mla --sweep: tile length, warps, stages, programs aimed at per SM
MLA_SWEEP = [(MLA_DECODE_CONFIG, 16)] + [
    (replace(MLA_DECODE_CONFIG, block_n=bn, num_warps=w, num_stages=st, programs_per_sm=pps), 16)
    for bn, w, st, pps in [(64, 8, 3, 1), (64, 8, 2, 4), (32, 8, 2, 4), (32, 4, 2, 4), (32, 4, 3, 4), (16, 4, 3, 4),
                           (16, 4, 4, 8), (32, 8, 3, 8), (64, 4, 2, 4), (64, 8, 4, 1)]]


# (split plan config, CUDA config or None for the Triton kernel) of --mla --cuda
# (producers: the warps issuing the ring's row copies)
MLA_CUDA_SWEEP = [(MLA_DECODE_CONFIG, None)] + [
    (replace(MLA_DECODE_CONFIG, programs_per_sm=pps), MlaCudaConfig(segments=segs, producers=producers))
    for pps, segs, producers in [(1, 10, 1), (1, 10, 2), (1, 10, 4), (2, 5, 2)]]
# the same with an fp8 latent cache: the Triton kernel, then the CUDA one's rings of e4m3 rows (8 segments or fewer
# leave room for two CTAs an SM)
MLA_CUDA_FP8_SWEEP = [(MLA_DECODE_CONFIG, None)] + [
    (replace(MLA_DECODE_CONFIG, programs_per_sm=pps), MlaCudaConfig(fp8_segments=segs, fp8_producers=producers))
    for pps, segs, producers in [(2, 8, 1), (2, 8, 2), (1, 20, 2), (1, 20, 4)]]


class _cuda_fp8:
    """Within: the CUDA kernel takes an fp8 cache or leaves it to the Triton kernels (mla_decode_cuda.MLA_CUDA_FP8,
    COBATCH_MLA_CUDA_FP8)."""
    def __init__(self, enabled: bool):
        self.enabled, self.saved = enabled, mla_decode_cuda.MLA_CUDA_FP8

    def __enter__(self):
        mla_decode_cuda.MLA_CUDA_FP8 = self.enabled

    def __exit__(self, *exc):
        mla_decode_cuda.MLA_CUDA_FP8 = self.saved


def mla_error(cfg: DecodeConfig, cuda: MlaCudaConfig | None, heads: int, seq_lens: list[int], seed: int,
              kv_dtype: torch.dtype = torch.bfloat16) -> float:
    """Relative error (max |got - ref| / max |ref|) of one config against mla_attention_ref, on rows of the given
    lengths in 16-token pages scattered over a pool, rows past each length poisoned with NaN; kv_dtype the cache's
    (the reference reads the same rounded values)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = MLA_LORA + MLA_ROPE
    pages = [-(-n // PAGE) for n in seq_lens]
    cache = torch.full((sum(pages) + 1, PAGE, 1, width), float("nan"), device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(len(seq_lens), max(max(pages), 1), dtype=torch.int32)
    order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(seed)).tolist()
    for r, (n, np_) in enumerate(zip(seq_lens, pages)):
        for i in range(np_):
            page = order.pop()
            tables[r, i] = page
            rows = min(PAGE, n - i * PAGE)
            cache[page, :rows] = torch.randn(rows, 1, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(len(seq_lens), heads, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    n = len(seq_lens)
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.int64, device="cuda"),
                             torch.arange(n + 1, dtype=torch.int32, device="cuda"),
                             torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), tables.cuda(), 1,
                             max(max(seq_lens), 1))
    scale = 192 ** -0.5
    cache = cache.to(kv_dtype)
    ref = mla_attention_ref(q, torch.nan_to_num(cache.float()), meta, scale, MLA_LORA)
    got = mla_decode_attention(q, cache, meta, scale, MLA_LORA, cfg=cfg, cuda=cuda is not None,
                               cuda_cfg=cuda or MlaCudaConfig()).float()
    return float(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).nan_to_num(float("inf")))


def run_mla_cuda(copy_gbps: float) -> list[dict]:
    """Each MLA_CUDA_SWEEP candidate (and MLA_CUDA_FP8_SWEEP's where ATTN_KV_DTYPES has fp8): its error against the
    reference (16 and 128 heads; rows of 1, a page and a bit, several splits), then its time on every shape."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    sweeps = {"bf16": MLA_CUDA_SWEEP, "fp8": MLA_CUDA_FP8_SWEEP}
    candidates = [(kv, cfg, cuda) for kv in RUN_KV_DTYPES for cfg, cuda in sweeps[kv]]
    for variant, (kv, cfg, cuda) in enumerate(candidates):
        kv_dtype = KV_DTYPES[kv]
        with _cuda_fp8(cuda is not None):
            errors = {heads: mla_error(cfg, cuda, heads, [1, 17, 700, 8192, 0, 4000], seed=heads, kv_dtype=kv_dtype)
                      for heads in (16, 128)}
            for batch in BATCHES:
                for context in MLA_CONTEXTS:
                    try:
                        r = bench_mla_decode(batch, context, gen, cfg, 16, cuda, kv_dtype=kv_dtype)
                        r["ratio_to_copy"] = r["gbps"] / copy_gbps
                    except Exception as e:
                        r = {"kernel": "mla_decode_attention", "batch": batch, "context": context,
                             "error": repr(e)[:300]}
                    r["variant"], r["max_rel_error"] = variant, errors
                    rows.append(r)
        print(f"mla variant {variant} {kv} {'cuda ' + str(asdict(cuda)) if cuda else 'triton'} programs_per_sm "
              f"{cfg.programs_per_sm} error {errors}: " + " ".join(
                  f"{r.get('us', float('nan')):.1f}us/{r.get('ratio_to_copy', 0):.0%}" for r in rows
                  if r["variant"] == variant), flush=True)
    print("mla decode (B x context: us, of copy) as above, shapes in order: "
          + ", ".join(f"{b}x{c}" for b in BATCHES for c in MLA_CONTEXTS))
    return rows


def run_mla(copy_gbps: float, sweep: bool = False) -> list[dict]:
    """The package's default path on every shape, or (sweep) each MLA_SWEEP candidate of the Triton kernel; a
    failing candidate is reported in its rows' place."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    variants = MLA_SWEEP if sweep else [(None, 16)]
    for variant, (cfg, block_h, kv) in enumerate((c, b, kv) for kv in RUN_KV_DTYPES for c, b in variants):
        for batch in BATCHES:
            for context in MLA_CONTEXTS:
                try:
                    r = bench_mla_decode(batch, context, gen, cfg, block_h, kv_dtype=KV_DTYPES[kv])
                    r["ratio_to_copy"] = r["gbps"] / copy_gbps
                except Exception as e:
                    r = {"kernel": "mla_decode_attention", "batch": batch, "context": context, "error": repr(e)[:300]}
                r["variant"] = variant
                rows.append(r)
        print(f"mla variant {variant} {kv} {rows[-1].get('config')} cuda {rows[-1].get('cuda')}: " + " ".join(
            f"{r.get('us', float('nan')):.1f}us/{r.get('ratio_to_copy', 0):.0%}" for r in rows
            if r["variant"] == variant), flush=True)
    print("mla decode (B x context: us, of copy) as above, shapes in order: "
          + ", ".join(f"{b}x{c}" for b in BATCHES for c in MLA_CONTEXTS))
    return rows


def bench_prefill(cfg: PrefillConfig, gen: torch.Generator, tokens: int = PREFILL_TOKENS,
                  kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    pages = -(-tokens // PAGE)
    shape = (pages, PAGE, N_KV, HEAD_DIM)
    k_cache = _random_cache(shape, gen, kv_dtype)
    v_cache = _random_cache(shape, gen, kv_dtype)
    tables = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)[None]
    meta = AttentionMetadata(
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device="cuda"),
        query_start=torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device="cuda"),
        block_tables=tables, max_query_len=tokens, max_seq_len=tokens)
    q = torch.randn(tokens, N_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    flops = 4 * N_Q * HEAD_DIM * tokens * (tokens + 1) / 2      # causal: QK^T and PV over the visible keys
    ms = 1e3 * graph_time([lambda: paged_prefill_attention(q, k_cache, v_cache, meta, scale, out=out, cfg=cfg)])
    # The same attention through torch SDPA on contiguous bf16 K/V (a reference point, not a goal).
    k = k_cache[tables[0].long()].reshape(-1, N_KV, HEAD_DIM)[:tokens].transpose(0, 1)[None].to(torch.bfloat16)
    v = v_cache[tables[0].long()].reshape(-1, N_KV, HEAD_DIM)[:tokens].transpose(0, 1)[None].to(torch.bfloat16)
    qt = q.transpose(0, 1)[None]
    sdpa_ms = 1e3 * graph_time([lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, k, v, is_causal=True, scale=scale, enable_gqa=True)])
    return {"kernel": "prefill_attention", "tokens": tokens, "kv_dtype": str(kv_dtype).removeprefix("torch."),
            "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
            "torch_sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12, "config": asdict(cfg)}


def run(copy_gbps: float, decode_cfg: DecodeConfig = DECODE_CONFIG,
        prefill_cfg: PrefillConfig = PREFILL_CONFIG) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for kv in RUN_KV_DTYPES:
        for batch in BATCHES:
            for context in CONTEXTS:
                try:
                    r = bench_decode(batch, context, decode_cfg, gen, kv_dtype=KV_DTYPES[kv])
                    r["ratio_to_copy"] = r["gbps"] / copy_gbps
                except Exception as e:      # reported in the table's place rather than losing the other rows
                    r = {"kernel": "decode_attention", "batch": batch, "context": context, "kv_dtype": kv,
                         "error": repr(e)[:300]}
                rows.append(r)
        # Rows far shorter than the capacity a graph was captured for (a server started with a long --ctx)
        for batch, filled in ((1, 4096), (8, 4096)):
            r = bench_decode(batch, 32768, decode_cfg, gen, filled=filled, kv_dtype=KV_DTYPES[kv])
            r["ratio_to_copy"] = r["gbps"] / copy_gbps
            rows.append(r)
    for kv in RUN_KV_DTYPES:
        try:
            rows.append(bench_prefill(prefill_cfg, gen, kv_dtype=KV_DTYPES[kv]))
        except Exception as e:
            rows.append({"kernel": "prefill_attention", "kv_dtype": kv, "error": repr(e)[:300]})
    # One schema for every row (None where a field does not apply), so callers can tabulate them directly.
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows]


# The fp8 cache's variants against the bf16 cache: tiles as bytes, as words (the default: 3 stages), and as
# words in 2 stages and in 32-token tiles (each compiles within 128 registers without spills, sm_90).
FP8_VARIANTS = (("bf16", torch.bfloat16, DECODE_CONFIG),
                ("fp8 bytes", torch.float8_e4m3fn, replace(DECODE_CONFIG, fp8_words=False)),
                ("fp8 words", torch.float8_e4m3fn, replace(DECODE_CONFIG, fp8_words=True)),
                ("words 2 stages", torch.float8_e4m3fn, replace(DECODE_CONFIG, fp8_words=True, fp8_num_stages=2)),
                ("words 32x3", torch.float8_e4m3fn, replace(DECODE_CONFIG, fp8_words=True, block_n=32)))


# An fp8 cache's tile of 64 tokens is half a bf16 one's bytes for the same chain of waits, dots and softmax:
# tiles of 128 tokens carry a bf16 tile's bytes; 8 warps keep them within 128 registers (sm_90 compile: 126
# registers and no spills at 2-3 stages, where 4 warps spill 16 bytes), at 2 or 3 programs an SM (74 / 106 KB).
FP8_TILE_VARIANTS = (
    ("bf16", torch.bfloat16, DECODE_CONFIG),
    ("fp8 64x3 w4", torch.float8_e4m3fn, DECODE_CONFIG),
    ("bf16 64x3 w8", torch.bfloat16, replace(DECODE_CONFIG, num_warps=8, num_stages=3)),
    ("fp8 64x4 w8", torch.float8_e4m3fn, replace(DECODE_CONFIG, num_warps=8, fp8_num_stages=4)),
    ("fp8 128x2 w8", torch.float8_e4m3fn, replace(DECODE_CONFIG, block_n=128, num_warps=8, fp8_num_stages=2)),
    ("fp8 128x3 w8", torch.float8_e4m3fn, replace(DECODE_CONFIG, block_n=128, num_warps=8, fp8_num_stages=3)),
    ("fp8 128x3 w8 pps2", torch.float8_e4m3fn,
     replace(DECODE_CONFIG, block_n=128, num_warps=8, fp8_num_stages=3, programs_per_sm=2)),
    ("fp8 128x4 w8", torch.float8_e4m3fn, replace(DECODE_CONFIG, block_n=128, num_warps=8, fp8_num_stages=4)),
)


def check_decode(cfg: DecodeConfig, kv_dtype: torch.dtype, gen: torch.Generator, batch: int = 8,
                 context: int = 1000) -> float:
    """Largest error of the decode kernel on cfg against the torch reference, on one set of random inputs."""
    k_cache, v_cache, sets = _decode_inputs(batch, context, 1, gen, None, kv_dtype)
    q, meta = sets[0]
    out = paged_decode_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, cfg=cfg)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    return (out.float() - ref.float()).abs().max().item()


def run_fp8_words(copy_gbps: float, variants=None, contexts=CONTEXTS) -> list[dict]:
    """An fp8 cache's tiles loaded as bytes against as 32-bit words (DecodeConfig.fp8_words), each shape's rows
    one after the other, with the bf16 cache beside them; and prefill both ways. variants (name, KV dtype,
    config): others instead, each first checked against the reference (and no prefill)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    errors = {}
    for name, kv_dtype, cfg in variants or ():
        errors[name] = check_decode(cfg, kv_dtype, gen)
        print(f"{name}: max error {errors[name]:.2e} against the reference", flush=True)
    for batch in BATCHES:
        for context in contexts:
            for name, kv_dtype, cfg in variants or FP8_VARIANTS:
                r = bench_decode(batch, context, cfg, gen, kv_dtype=kv_dtype)
                r.update(variant=name, ratio_to_copy=r["gbps"] / copy_gbps, max_error=errors.get(name))
                rows.append(r)
                print(f"B={batch} x {context} {name}: {r['us']:.1f} us, {r['ratio_to_copy']:.0%} of copy", flush=True)
    prefills = () if variants else (("bf16", torch.bfloat16, False), ("fp8 bytes", torch.float8_e4m3fn, False),
                                     ("fp8 words", torch.float8_e4m3fn, True))
    for name, kv_dtype, words in prefills:
        r = bench_prefill(replace(PREFILL_CONFIG, fp8_words=words), gen, kv_dtype=kv_dtype)
        r["variant"] = name
        rows.append(r)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows]


def print_fp8_words(rows: list[dict], copy_gbps: float, variants=None, contexts=CONTEXTS) -> None:
    """Each shape's row of times; the last column: the second variant's time over the third's (FP8_VARIANTS:
    bytes over words), or (variants) the best fp8 variant's over the second's (the fp8 default's)."""
    names = [name for name, _, _ in variants or FP8_VARIANTS]
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s; decode us (of copy, in the cache's own bytes)")
    last = "best / default" if variants else "bytes / words"
    print(f"{'B':>4} {'context':>8} " + " ".join(f"{n:>18}" for n in names) + f" {last:>15}")
    by = {(r["batch"], r["context"], r["variant"]): r for r in rows if r["kernel"] == "decode_attention"}
    for batch in BATCHES:
        for context in contexts:
            cells = [by[(batch, context, n)] for n in names]
            fp8 = [c for c in cells[1:] if c["kv_dtype"] != "bfloat16"]
            ratio = min(c["us"] for c in fp8) / cells[1]["us"] if variants else cells[1]["us"] / cells[2]["us"]
            print(f"{batch:>4} {context:>8} " + " ".join(f"{c['us']:>10.1f} ({c['ratio_to_copy']:>4.0%})" for c in cells)
                  + f" {ratio:>14.2f}x")
    for r in rows:
        if r["kernel"] == "prefill_attention":
            print(f"prefill {r['tokens']} tokens, {r['variant']}: {r['us']:.0f} us, {r['tflops']:.0f} TFLOP/s")


DECODE_SWEEP = [
    DECODE_CONFIG,
    # More, shorter programs (2026-12-07): B = 16 x 512 reads its KV at 2.3x copy's time in whole steps (decode.json);
    # 8 and 16 programs an SM give its rows 8 one-tile splits.
    replace(DECODE_CONFIG, programs_per_sm=8),
    replace(DECODE_CONFIG, programs_per_sm=16),
    # Pages a tile ahead (2026-11-30): K/V get num_stages - 1 shared buffers. 64-token tiles x 2 stages: one
    # buffer in 45 KB (4 programs per SM); 32-token tiles x 3 stages: two buffers in 45 KB (level in whole steps:
    # bench/results/decode_wide_attention_tiles_ab.md).
    replace(DECODE_CONFIG, block_n=32, num_stages=3),
    replace(DECODE_CONFIG, block_n=32, num_stages=4),
    # The split plan's aim (2026-12-06): fewer, longer programs where 16-32 rows of a short context split into
    # 2-tile programs (B = 16 x 512: 4 splits, 512 programs, at 52 % of copy).
    replace(DECODE_CONFIG, programs_per_sm=2),
    replace(DECODE_CONFIG, programs_per_sm=1),
]
PREFILL_SWEEP = [
    PREFILL_CONFIG,
    replace(PREFILL_CONFIG, num_stages=3),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
    PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=3),
]


def sweep(copy_gbps: float, budget_s: float = 150.0, dump=None) -> list[dict]:
    """Prefill configs (unless SWEEP_PREFILL=0), then decode configs on every shape, until budget_s runs out:
    to choose the defaults.
    dump(rows) is called after each config so that a cut-short run still leaves its numbers."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    t0 = time.monotonic()
    rows = []
    for i, cfg in enumerate(PREFILL_SWEEP if os.environ.get("SWEEP_PREFILL", "1") == "1" else []):
        try:
            r = bench_prefill(cfg, gen)
        except Exception as e:      # a config that fails to compile or launch is reported, not fatal
            r = {"kernel": "prefill_attention", "error": repr(e)[:300]}
        r["variant"] = i
        rows.append(r)
        print(f"prefill variant {i} {asdict(cfg)}: {r.get('tflops', 0):.0f} TFLOP/s "
              f"(sdpa {r.get('torch_sdpa_tflops', 0):.0f})", flush=True)
    # Fixed cost: graphs planned for a capacity, sequences holding one token (and a short fill of a long one).
    for batch, context, filled in [(1, 32768, 1), (8, 4096, 1), (64, 512, 1), (8, 32768, 512)]:
        r = bench_decode(batch, context, DECODE_CONFIG, gen, filled=filled)
        r["variant"] = "floor"
        rows.append(r)
        print(f"decode B={batch} capacity {context} holding {filled}: {r['us']:.1f} us", flush=True)
    for i, cfg in enumerate(DECODE_SWEEP):
        if time.monotonic() - t0 > budget_s:
            print(f"sweep stopped at decode variant {i}: time budget spent", flush=True)
            break
        for batch in BATCHES:
            for context in CONTEXTS:
                try:
                    r = bench_decode(batch, context, cfg, gen)
                except Exception as e:
                    r = {"kernel": "decode_attention", "batch": batch, "context": context, "error": repr(e)[:300]}
                r["variant"] = i
                r["ratio_to_copy"] = r.get("gbps", 0.0) / copy_gbps
                rows.append(r)
        print(f"decode variant {i} {asdict(cfg)}: " + " ".join(
            f"{r['ratio_to_copy']:.2f}" for r in rows if r.get("variant") == i and r["kernel"] == "decode_attention"),
            flush=True)
        print("    us: " + " ".join(f"{r.get('us', 0):.1f}" for r in rows
                                   if r.get("variant") == i and r["kernel"] == "decode_attention"), flush=True)
        if dump:
            dump(rows)
    return rows


def print_table(rows: list[dict], copy_gbps: float) -> None:
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'decode':>8} {'KV':>14} {'B':>4} {'context':>8} {'holding':>8} {'us':>9} {'GB/s':>8} {'of copy':>8}"
          f"   (idle stream: {'us':>7} {'of copy':>8})")
    for r in rows:
        if r["kernel"] == "decode_attention" and r.get("gbps") is not None:
            print(f"{'':>8} {r['kv_dtype']:>14} {r['batch']:>4} {r['context']:>8} {r['filled']:>8} {r['us']:>9.1f} "
                  f"{r['gbps']:>8.0f} {r['ratio_to_copy']:>7.0%}   {'':>14}{r['us_idle_stream']:>7.1f} "
                  f"{r['gbps_idle_stream'] / copy_gbps:>7.0%}")
        elif r.get("error"):
            print(f"{r['kernel']} {r.get('batch', '')} {r.get('context', '')}: {r['error']}")
    for r in rows:
        if r["kernel"] == "prefill_attention" and r.get("tflops") is not None:
            print(f"prefill {r['tokens']} tokens, {r['kv_dtype']} KV: {r['us']:.0f} us, {r['tflops']:.0f} TFLOP/s "
                  f"(torch SDPA {r['torch_sdpa_tflops']:.0f})")


def main() -> None:
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy_gbps,
              "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d")}

    def dump(name: str, payload: dict) -> None:
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], name), "w") as f:
                json.dump(payload, f, indent=1)

    if "--fp8-tiles" in sys.argv:
        contexts = tuple(int(c) for c in os.environ.get("ATTN_CONTEXTS", "512,4096").split(","))
        result["rows"] = run_fp8_words(copy_gbps, FP8_TILE_VARIANTS, contexts)
        dump("kernels_attention_fp8_tiles.json", result)
        print_fp8_words(result["rows"], copy_gbps, FP8_TILE_VARIANTS, contexts)
        return
    if "--fp8-words" in sys.argv:
        result["rows"] = run_fp8_words(copy_gbps)
        dump("kernels_attention_fp8_words.json", result)
        print_fp8_words(result["rows"], copy_gbps)
        return
    if "--mla" in sys.argv and "--cuda" in sys.argv:
        result["rows"] = run_mla_cuda(copy_gbps)
        dump("kernels_mla_attention_cuda.json", result)
        return
    if "--mla" in sys.argv:
        sweeping = "--sweep" in sys.argv
        result["rows"] = run_mla(copy_gbps, sweep=sweeping)
        dump("kernels_mla_attention_sweep.json" if sweeping else "kernels_mla_attention.json", result)
        return
    if "--sweep" in sys.argv:
        result["sweep"] = sweep(copy_gbps, budget_s=float(os.environ.get("SWEEP_BUDGET_S", 150)),
                                dump=lambda rows: dump("kernels_attention_sweep.json", {**result, "sweep": rows}))
        dump("kernels_attention_sweep.json", result)
    rows = run(copy_gbps)
    result["rows"] = rows
    dump("kernels_attention.json", result)
    print_table(rows, copy_gbps)


if __name__ == "__main__":
    main()
