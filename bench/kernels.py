"""Kernel benchmark on the GPU: quantized GEMV / GEMM against the copy bandwidth and cuBLAS bf16.

    PYTHONPATH=src python bench/kernels.py [--sweep] [--formats q8_0,q4_k,fp8_e4m3,nvfp4,...] [--quick]

1. Copy bandwidth (device-to-device, bytes read + written), measured in the same run: the ceiling.
2. With --sweep: for each format and Llama-3-8B shape, times candidate narrow tile configs (n_tok 1 and 16;
   for the Gluon GEMV, which gets one config per token tier (best_gemv_plan), the survivors of that screen at
   4 and 8 too: gemv_survivors)
   and GEMM configs (n_tok 2048), picks the best, and finds the crossover T (largest measured n_tok where
   the narrow kernel still beats the GEMM config). Writes the choice as quant_configs.json (to $OUT and
   bench/results/); copy it to src/cobatch/kernels/ to make it the default.
3. The table: n_tok 1..64 with the chosen plan: time, GB/s of weight bytes read, % of copy, speed-up over
   torch bf16 F.linear at the same n_tok; prefill GEMM TFLOP/s at n_tok 512 / 2048 vs torch bf16.
4. Decode-attention rows from bench/kernels_attention.py (run(copy_gbps) -> rows), when present.

Small kernels are timed inside one CUDA graph that runs the op over rotating copies of the weights
(together > 256 MB, several times the 60 MB L2), median over replays; never one launch with do_bench.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import importlib.util
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "src"))   # appended: a tree on PYTHONPATH comes first (bench/gemv_ab.py)

from cobatch.kernels import matmul_plans  # noqa: E402
from cobatch.kernels import quant_matmul as qm  # noqa: E402
from cobatch.kernels.packed_weight import PackedWeight  # noqa: E402
from cobatch.kernels.quant_gemv import GemvConfig, GemvPlan  # noqa: E402
from cobatch.kernels.quant_matmul import TileConfig  # noqa: E402
from cobatch.kernels.quant_pack import PackedPlanes  # noqa: E402
from cobatch.quant.formats import format_of, random_quantized  # noqa: E402
from cobatch.quant.weight import QuantWeight  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from timing import COPY_DETAIL, copy_bandwidth, graph_time, graph_times  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
FORMATS = ["q4_k", "q8_0", "q4_1", "q6_k"]


def model_shapes(name: str) -> dict[str, tuple[int, int]]:
    """SHAPES for another `cobatch make-model --shape` (gguf_writer.SHAPES): its q|k|v, o, gate|up, down and
    output matrices as (rows, cols), and k or v alone ("kv": Q4_K_M files hold v in another format than q and k),
    for plans of the widths Llama-3-8B's do not cover (Qwen2.5-0.5B's 896, say). Shapes of grouped-query
    attention only (not MLA's)."""
    from cobatch.testing.gguf_writer import SHAPES as MODEL_SHAPES
    if name not in MODEL_SHAPES or MODEL_SHAPES[name].mla is not None:
        raise SystemExit(f"--model-shape: one of {', '.join(k for k, v in MODEL_SHAPES.items() if v.mla is None)}")
    s = MODEL_SHAPES[name]
    head = s.head_size or s.d_model // s.n_heads
    shapes = {"qkv": ((s.n_heads + 2 * s.n_kv_heads) * head, s.d_model), "o": (s.d_model, s.n_heads * head),
              "gate_up": (2 * s.ffn_dim, s.d_model), "down": (s.d_model, s.ffn_dim),
              "kv": (s.n_kv_heads * head, s.d_model)}
    if s.vocab_size:
        shapes["lm_head"] = (s.vocab_size, s.d_model)
    return shapes


def use_model_shapes(shapes: dict, name: str | None, with_kv: bool) -> None:
    """A script's --model-shape: its shape table `shapes` becomes model_shapes(name) (with the lone k or v matrix
    where the script times it), in place, so modules holding the table see it. None: left as it is."""
    if name:
        new = model_shapes(name)
        shapes.clear()
        shapes.update({k: v for k, v in new.items() if with_kv or k != "kv"})
DECODE_TOKS = [1, 2, 3, 4, 8, 16, 32, 64]
PREFILL_TOKS = [512, 2048]
ROTATE_BYTES = 256 << 20
SMS = 132

NARROW_BASES = [  # (BN, BK, warps, stages); split-K is swept separately.
    # 4/8 warps: Triton picks wgmma (HGMMA, register A); it waits for each one before the next dequant.
    (128, 256, 4, 2), (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3),
    # 1/2 warps: mma.sync (HMMA.16816), no warpgroup waits; many small CTAs per SM.
    (64, 256, 2, 3), (64, 128, 2, 4), (64, 256, 2, 2), (128, 256, 2, 3), (32, 256, 1, 3), (32, 128, 1, 4),
    (64, 128, 2, 3)]
GEMM_CANDIDATES = [TileConfig(128, 128, 64, 1, 8, 3), TileConfig(128, 128, 128, 1, 8, 3),
                   TileConfig(128, 64, 64, 1, 4, 4), matmul_plans.DEQUANT_CUBLAS]
CROSSOVER_TOKS = [16, 32, 64, 128]


# --- timing: bench/timing.py (graph replays queued behind a GPU sleep; the 2 GiB copy) ---------------


# --- weights ----------------------------------------------------------------------------------------------

def random_weight(fmt_name: str, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    """Valid random blocks: a 256-row random_quantized slab, tiled over the rows on the GPU (fast). The checkpoint
    formats (fp8_e4m3, nvfp4) from a normal slab through their writers, with a row scale."""
    fmt = format_of(fmt_name)
    if fmt.ggml_type is None:
        from cobatch.testing.hf_checkpoints import checkpoint_weight
        slab = checkpoint_weight(torch.randn(256, cols, generator=torch.Generator().manual_seed(seed)) * 0.02, fmt_name)
        reps = -(-rows // 256)
        return QuantWeight(fmt, rows, cols, slab.raw.cuda().repeat(reps, 1)[:rows].contiguous(),
                           slab.row_scale.cuda().repeat(reps)[:rows].contiguous())
    slab = random_quantized(fmt.ggml_type, 256, cols, torch.Generator().manual_seed(seed)).cuda()
    raw = slab.repeat(-(-rows // 256), 1)[:rows].contiguous()
    return QuantWeight(fmt, rows, cols, raw)


def clone_packed(pw: PackedWeight) -> PackedWeight:
    p = pw.planes
    planes = PackedPlanes(p.fmt_id, p.rows, p.cols, p.rows_pad, p.cols_pad, p.qs.clone(), p.d.clone(),
                          None if p.m is None else p.m.clone(), None if p.sub is None else p.sub.clone(),
                          None if p.qh is None else p.qh.clone(), fragment=p.fragment)
    return PackedWeight(pw.fmt_name, pw.rows, pw.cols, planes=planes, plan=pw.plan)


def rotating(pw: PackedWeight) -> list[PackedWeight]:
    n = max(2, math.ceil(ROTATE_BYTES / pw.nbytes))
    return [pw] + [clone_packed(pw) for _ in range(n - 1)]


def time_packed(copies: list[PackedWeight], n_tok: int, cfg, x_dtype=None, both: bool = False):
    """Seconds per call (a GraphTime with both=True). x_dtype: the activations' dtype; by default what the
    kernel reads natively (f16 for the Gluon GEMV, which converts bf16 as it loads it; bf16 otherwise)."""
    plan = copies[0].plan
    config = cfg if cfg is not None else (plan.narrow if n_tok <= plan.crossover else plan.gemm)
    if x_dtype is None:
        x_dtype = torch.float16 if isinstance(config, (GemvConfig, GemvPlan)) else torch.bfloat16
    x = torch.randn(n_tok, copies[0].cols, device="cuda").to(x_dtype)
    out = torch.empty(n_tok, copies[0].rows, device="cuda", dtype=torch.bfloat16)
    launches = [lambda w=w: w.matmul(x, config=cfg, out=out) for w in copies]
    return graph_times(launches) if both else graph_time(launches)


def time_torch_linear(rows: int, cols: int, n_tok: int, cache: dict) -> float:
    key = (rows, cols)
    if key not in cache:
        one = rows * cols * 2
        cache.clear()
        cache[key] = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
                      for _ in range(max(1, math.ceil(ROTATE_BYTES / one)))]
    ws = cache[key]
    x = torch.randn(n_tok, cols, device="cuda", dtype=torch.bfloat16)
    return graph_time([lambda w=w: F.linear(x, w) for w in ws])


# --- parallel precompile ----------------------------------------------------------------------------------

def _config_key(c):
    """Picklable form of a config for the worker processes."""
    if isinstance(c, GemvConfig):
        return ("gemv", dataclasses.astuple(c))
    return dataclasses.astuple(c) if isinstance(c, TileConfig) else c


def _from_key(k):
    if isinstance(k, tuple) and k and k[0] == "gemv":
        return GemvConfig(*k[1])
    return TileConfig(*k) if isinstance(k, tuple) else k


def _compile_one(task) -> str:
    fmt_name, key, cols = task
    cfg = _from_key(key)
    try:
        w = random_weight(fmt_name, 256, cols)
        pw = PackedWeight.from_quant(w, "cuda")
        x = torch.randn(2, cols, device="cuda").to(torch.bfloat16)
        pw.matmul(x, config=cfg)
        if isinstance(cfg, GemvConfig):
            pw.matmul(torch.randn(12, cols, device="cuda").to(torch.bfloat16), config=cfg)   # BT = 16
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported, the config is dropped
        return f"{fmt_name} {cfg}: {type(e).__name__}: {str(e)[:300]}"


def precompile(tasks: list[tuple], workers: int) -> set[tuple[str, TileConfig]]:
    """Compile every (format, config[, cols]) in worker processes (Triton's disk cache is shared), on a weight of
    `cols` columns, 4096 if not given (the kernels specialize on K's divisibility, and a config's K split must
    divide its chunks); returns the (format, config) pairs that failed, so the sweep skips them."""
    uniq = sorted({(t[0], t[1], t[2] if len(t) > 2 else 4096) for t in tasks}, key=str)
    t0 = time.time()
    bad = set()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for (f, c, _), err in zip(uniq, pool.map(_compile_one, [(f, _config_key(c), k) for f, c, k in uniq])):
            if err:
                print("compile failed:", err, flush=True)
                bad.add((f, c))
    print(f"precompiled {len(uniq)} kernels in {time.time() - t0:.0f} s ({len(bad)} failed)", flush=True)
    return bad


# --- sweep -------------------------------------------------------------------------------------------------

def narrow_candidates(rows: int, cols: int) -> list[TileConfig]:
    out = []
    for bn, bk, warps, stages in NARROW_BASES:
        tiles = -(-rows // bn)
        k_tiles = -(-cols // 256) * 256 // bk
        for split in (1, 2, 4, 8):
            if k_tiles % split or (split > 1 and tiles * split > 6 * SMS):
                continue
            out.append(TileConfig(16, bn, bk, split, warps, stages))
    return out


# W, RT, U. RT = 1 with many K steps per iteration tends to win 8-token tiles, RT = 2-4 the 16-token ones.
# (2, 4, 1) was q8_0 lm_head's config at 91-92 % of copy for 1..8 tokens: keep it a candidate.
# (4, 4, 2) and (2, 4, 2) with R = 128 won q8_0 gate_up / lm_head by 7-16 points
# (results/gemv-configs-2026-11-29-u2.md at 5a66009^).
GEMV_BASES = [(4, 4, 1), (2, 4, 1), (4, 1, 8), (4, 1, 16), (8, 1, 4), (8, 1, 8), (4, 2, 4), (2, 1, 16), (8, 2, 2),
              (2, 2, 8), (4, 4, 2), (2, 4, 2)]
GEMV_PREFETCH = [0, 2]                                                                   # D
GEMV_REGISTERS = [0, 128]    # R: ptxas's own register choice, or a budget that lets it hoist the tile loads


def gemv_candidates(fmt_name: str, rows: int, cols: int) -> list[GemvConfig]:
    n_chunks = matmul_plans.gemv_chunks(fmt_name, -(-cols // 256) * 256)
    rows_pad = -(-rows // 128) * 128
    out = []
    for w, rt, u in GEMV_BASES:
        # the powers of two, and any divisor of a warp's K steps up to 16 (44 = 4 x 11 chunks: 2048 x 2816)
        steps = n_chunks // (w * u) if n_chunks % (w * u) == 0 else 0
        for split in sorted({1, 2, 4, 8} | {d for d in range(3, 17) if steps and steps % d == 0}):
            ctas = rows_pad // (16 * rt) * split
            if n_chunks % (w * u * split) == 0 and (split == 1 or ctas <= 16 * SMS) and ctas >= SMS // 2:
                out += [GemvConfig(W=w, RT=rt, split_k=split, U=u, D=d, R=r) for d in GEMV_PREFETCH
                        for r in GEMV_REGISTERS if d == 0 or n_chunks // (w * split) > d]
    return out


def sweep(formats, log, deadline: float, save, shapes=None) -> dict:
    """Stops early at `deadline` (time.time()). Starts from the package's quant_configs.json: the entries of
    the formats and shapes swept are replaced, the others kept (so a sweep of a few shapes is cheap)."""
    shapes = {n: SHAPES[n] for n in (shapes or SHAPES)}
    table = json.loads(matmul_plans.CONFIG_PATH.read_text())
    tasks = [(f, c, k) for f in formats for (r, k) in shapes.values() for c in narrow_candidates_for(f, r, k)]
    tasks += [(f, c, SHAPES["gate_up"][1]) for f in formats for c in gemm_candidates_for(f)]   # timed on gate_up
    try:
        bad = precompile(tasks, workers=min(14, os.cpu_count() or 4))
    except Exception as e:  # compile lazily instead
        print("parallel precompile failed:", repr(e), flush=True)
        bad = set()
    for fmt_name in formats:
        if time.time() > deadline:
            print("sweep deadline reached before", fmt_name, flush=True)
            break
        fmt_entry = table["formats"].setdefault(fmt_name, {"shapes": {}})
        # GEMM config: best TFLOP/s at n_tok 2048 on gate_up, used for every shape of the format
        rows, cols = SHAPES["gate_up"]
        pw = PackedWeight.from_quant(random_weight(fmt_name, rows, cols), "cuda")
        best_gemm = None
        for cfg in gemm_candidates_for(fmt_name):
            if (fmt_name, cfg) in bad:
                continue
            t = time_packed([pw] * 3, 2048, cfg)
            tflops = 2 * 2048 * rows * cols / t / 1e12
            log.append({"kind": "sweep_gemm", "fmt": fmt_name, "config": _cfg_dict(cfg), "tflops": tflops})
            t512 = time_packed([pw] * 3, 512, cfg)
            log[-1]["tflops_512"] = 2 * 512 * rows * cols / t512 / 1e12
            print(f"  {fmt_name} gemm {cfg}: {tflops:.0f} TFLOP/s at 2048, {log[-1]['tflops_512']:.0f} at 512",
                  flush=True)
            if best_gemm is None or tflops > best_gemm[0]:
                best_gemm = (tflops, cfg)
        gemm = best_gemm[1]
        fmt_entry["default"] = {"gemm": _cfg_dict(gemm)}
        del pw
        for name, (rows, cols) in shapes.items():
            if time.time() > deadline:
                print("sweep deadline reached at", fmt_name, name, flush=True)
                break
            pw = PackedWeight.from_quant(random_weight(fmt_name, rows, cols), "cuda")
            copies = rotating(pw)
            narrow = sweep_narrow(copies, fmt_name, name, bad, log)
            t1, t16 = time_packed(copies, 1, narrow), time_packed(copies, 16, narrow)
            print(f"  {fmt_name} {name}: narrow {narrow} {pw.nbytes / t1 / 1e9:.0f} GB/s @1, "
                  f"{pw.nbytes / t16 / 1e9:.0f} GB/s @16", flush=True)
            crossover = CROSSOVER_TOKS[0]
            for n in CROSSOVER_TOKS:
                tn, tg = time_packed(copies, n, narrow), time_packed(copies, n, gemm)
                log.append({"kind": "sweep_crossover", "fmt": fmt_name, "shape": name, "n_tok": n,
                            "narrow_us": tn * 1e6, "gemm_us": tg * 1e6})
                if tn <= tg:
                    crossover = n
                else:
                    break
            # the other kernel's entry stays
            entry = fmt_entry.setdefault("shapes", {}).setdefault(f"{rows}x{cols}", {})
            if isinstance(narrow, GemvPlan):
                entry.update({"gemv": _cfg_dict(narrow.default), "gemv_crossover": crossover})
                entry.pop("gemv_upto", None)
                if narrow.upto:
                    entry["gemv_upto"] = {str(n): _cfg_dict(c) for n, c in narrow.upto}
            else:
                entry.update({"narrow": _cfg_dict(narrow), "crossover": crossover})
            del copies, pw
            torch.cuda.empty_cache()
            save(table)
    return table


def sweep_narrow(copies: list[PackedWeight], fmt_name: str, name: str, bad: set, log: list):
    """The narrow path's plan for one shape (`copies`: rotating copies of one weight): every candidate timed at
    GEMV_SCREEN_TOKS, the survivors at every tier, then best_gemv_plan (the Triton kernel: one config, by the sum
    of its 1- and 16-token times). Each candidate's times go into `log`."""
    pw, timed = copies[0], []
    cands = [c for c in narrow_candidates_for(fmt_name, pw.rows, pw.cols) if (fmt_name, c) not in bad]
    screen = {c: {n: time_packed(copies, n, c) for n in GEMV_SCREEN_TOKS} for c in cands}
    survivors = set(gemv_survivors(screen) if cands and isinstance(cands[0], GemvConfig) else cands)
    for cfg in cands:
        toks = GEMV_TIERS + (GEMV_DEFAULT_TOK,) if cfg in survivors and isinstance(cfg, GemvConfig) else ()
        times = {**screen[cfg], **{n: time_packed(copies, n, cfg) for n in toks if n not in screen[cfg]}}
        if cfg in survivors:
            timed.append((times, cfg))
        log.append({"kind": "sweep_narrow", "fmt": fmt_name, "shape": name, "config": _cfg_dict(cfg),
                    **{f"us_{n}": t * 1e6 for n, t in times.items()}, "gbps_1": pw.nbytes / times[1] / 1e9})
    if timed and isinstance(timed[0][1], GemvConfig):
        return best_gemv_plan(timed)
    return min(timed, key=lambda r: r[0][1] + r[0][16])[1]


# The token tiers a GEMV plan may have: a config for n_tok <= 1, <= 4, <= 8, and the default for more,
# each chosen by its time at the tier's largest n_tok (16 for the default: the narrow path's usual top).
GEMV_TIERS = (1, 4, 8)
GEMV_DEFAULT_TOK = 16
# Every candidate is first timed at the smallest and the largest tier (the Triton kernel's two token counts too);
# the survivors (gemv_survivors) are then timed at the others.
GEMV_SCREEN_TOKS = (1, 16)
GEMV_SCREEN_KEEP = 0.3


def gemv_survivors(screen: dict) -> list:
    """The candidates worth timing at every tier, from their times at GEMV_SCREEN_TOKS: the fastest
    GEMV_SCREEN_KEEP of them by the sum of their times over the fastest at each screened n_tok, and the fastest of
    each (W, split_k) group, so best_gemv_plan still weighs every way of splitting K."""
    fastest = {n: min(t[n] for t in screen.values()) for n in GEMV_SCREEN_TOKS}
    score = {c: sum(t[n] / fastest[n] for n in GEMV_SCREEN_TOKS) for c, t in screen.items()}
    ranked = sorted(score, key=score.get)
    keep = set(ranked[:max(1, round(GEMV_SCREEN_KEEP * len(ranked)))])
    for group in {(c.W, c.split_k) for c in ranked}:
        keep.add(min((c for c in ranked if (c.W, c.split_k) == group), key=score.get))
    return [c for c in ranked if c in keep]


def best_gemv_plan(timed: list[tuple[dict, GemvConfig]]) -> GemvPlan:
    """From (times by n_tok, config) rows: per tier, the fastest config at the tier's n_tok, among configs
    that split K the same way (same W and split_k: batch invariance); the (W, split_k) group whose tiers
    lose least to the overall best, summed over the tiers (each tier weighs the same), wins. Adjacent tiers
    with the same config merge."""
    toks = GEMV_TIERS + (GEMV_DEFAULT_TOK,)
    fastest = {n: min(times[n] for times, _ in timed) for n in toks}
    groups: dict = {}
    for times, cfg in timed:
        groups.setdefault((cfg.W, cfg.split_k), []).append((times, cfg))
    best = None
    for rows in groups.values():
        picks = [min(rows, key=lambda r: r[0][n]) for n in toks]
        total = sum(p[0][n] / fastest[n] for p, n in zip(picks, toks))
        if best is None or total < best[0]:
            best = (total, [p[1] for p in picks])
    *tier_cfgs, default = best[1]
    upto = []
    for bound, cfg in zip(GEMV_TIERS, tier_cfgs):
        if upto and upto[-1][1] == cfg:
            upto[-1] = (bound, cfg)    # the same config serves both tiers: one tier, the larger bound
        else:
            upto.append((bound, cfg))
    while upto and upto[-1][1] == default:
        upto.pop()
    return GemvPlan(default, tuple(upto))


def gemm_candidates_for(fmt_name: str) -> list:
    """Fragment-order planes (the Gluon GEMV's) are read for prefill by the dequantize kernel only."""
    return [matmul_plans.DEQUANT_CUBLAS] if matmul_plans.uses_gemv(fmt_name, torch.device("cuda")) else GEMM_CANDIDATES


def narrow_candidates_for(fmt_name: str, rows: int, cols: int) -> list:
    if matmul_plans.uses_gemv(fmt_name, torch.device("cuda")):
        return gemv_candidates(fmt_name, rows, cols)
    return narrow_candidates(rows, cols)


def _cfg_dict(c):
    if isinstance(c, str):
        return c
    if isinstance(c, GemvConfig):
        return dataclasses.asdict(c)
    if isinstance(c, GemvPlan):
        return {"default": dataclasses.asdict(c.default),
                "upto": {str(n): dataclasses.asdict(t) for n, t in c.upto}}
    return {"BM": c.BM, "BN": c.BN, "BK": c.BK, "split_k": c.split_k, "num_warps": c.num_warps,
            "num_stages": c.num_stages}


# --- the table ---------------------------------------------------------------------------------------------

def measure(formats, copy_gbps: float, rows_out: list, config_path: str | None, save=lambda: None) -> None:
    if config_path:
        os.environ["COBATCH_QUANT_CONFIGS"] = config_path
        matmul_plans._config_table.cache_clear()
    tasks = []
    for fmt_name in formats:
        for rows, cols in SHAPES.values():
            plan = matmul_plans.plan_for(fmt_name, rows, cols, -(-cols // 256) * 256,
                                         gemv=matmul_plans.uses_gemv(fmt_name, torch.device("cuda")))
            narrow = plan.narrow.configs() if isinstance(plan.narrow, GemvPlan) else [plan.narrow]
            tasks += [(fmt_name, c, cols) for c in narrow] + [(fmt_name, plan.gemm, cols)]
    try:
        precompile(tasks, workers=min(14, os.cpu_count() or 4))
    except Exception as e:
        print("parallel precompile failed:", repr(e), flush=True)
    torch_cache: dict = {}
    torch_us = {}
    for name, (rows, cols) in SHAPES.items():
        for n in DECODE_TOKS + PREFILL_TOKS:
            torch_us[(name, n)] = time_torch_linear(rows, cols, n, torch_cache)
    torch_cache.clear()
    for fmt_name in formats:
        for name, (rows, cols) in SHAPES.items():
            w = random_weight(fmt_name, rows, cols)
            pw = PackedWeight.from_quant(w, "cuda")
            # sanity: the timed kernel computes the right thing on these weights
            x = torch.randn(16, cols, device="cuda").to(torch.bfloat16)
            sub = slice(0, 512)
            ref = x.double() @ w.row_slice(0, 512).dequantize().double().T   # with FP8 / NVFP4's row scale
            err = ((pw.matmul(x)[:, sub].double() - ref).norm() / ref.norm()).item()
            copies = rotating(pw)
            plan = pw.plan
            for n in DECODE_TOKS:
                timed = time_packed(copies, n, None, both=True)
                t = timed.queued
                path = "narrow" if n <= plan.crossover else "gemm"
                # what a bf16 caller pays: the f16 conversion of x is one more launch per call
                t_bf16 = time_packed(copies, n, None, torch.bfloat16) if isinstance(plan.narrow, GemvPlan) \
                    and n <= plan.crossover else t
                gbps = pw.nbytes / t / 1e9
                rows_out.append({"kind": "gemv", "fmt": fmt_name, "shape": name, "rows": rows, "cols": cols,
                                 "n_tok": n, "path": path, "us": t * 1e6, "gbps": gbps,
                                 "pct_copy": 100 * gbps / copy_gbps, "weight_bytes": pw.nbytes,
                                 "gguf_bytes": w.nbytes, "torch_bf16_us": torch_us[(name, n)] * 1e6,
                                 "speedup_vs_bf16": torch_us[(name, n)] / t, "crossover": plan.crossover,
                                 "narrow": _cfg_dict(plan.narrow), "rel_err": err, "us_bf16_input": t_bf16 * 1e6,
                                 "us_idle_stream": timed.idle * 1e6,
                                 "pct_copy_idle_stream": 100 * pw.nbytes / timed.idle / 1e9 / copy_gbps})
            # the prefill path's dense pass alone: quantized planes read, a bf16 matrix written
            dense = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
            t_dq = graph_time([lambda w=w: qm.dequantize_planes(w.planes, dense) for w in copies]) \
                if pw.planes is not None else None
            dq_bytes = pw.nbytes + dense.numel() * dense.element_size()
            del dense
            for n in PREFILL_TOKS:
                t = time_packed([pw] * 3, n, None)
                tflops = 2 * n * rows * cols / t / 1e12
                ttf = 2 * n * rows * cols / torch_us[(name, n)] / 1e12
                rows_out.append({"kind": "gemm", "fmt": fmt_name, "shape": name, "rows": rows, "cols": cols,
                                 "n_tok": n, "us": t * 1e6, "tflops": tflops, "torch_bf16_tflops": ttf,
                                 "ratio": tflops / ttf, "gemm": _cfg_dict(plan.gemm),
                                 **({"dequant_us": t_dq * 1e6, "dequant_gbps": dq_bytes / t_dq / 1e9,
                                     "dequant_pct_copy": 100 * dq_bytes / t_dq / 1e9 / copy_gbps} if t_dq else {})})
            print(f"  {fmt_name} {name}: rel_err {err:.1e}, crossover {plan.crossover}, narrow {plan.narrow}",
                  flush=True)
            del copies, pw, w
            torch.cuda.empty_cache()
        save()


def attention_rows(copy_gbps: float) -> list[dict]:
    path = ROOT / "bench" / "kernels_attention.py"
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location("kernels_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [{"kind": "attention", **r} for r in mod.run(copy_gbps)]


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"# Kernel benchmark {result['date']}", "", f"Command: `{result['command']}`", "",
             *([result["note"], ""] if result.get("note") else []),
             f"Device: {result['device']}; torch {result['torch']}, triton {result['triton']}. "
             f"Copy bandwidth (read + write): **{result['copy_gbps']:.0f} GB/s** "
             f"({', '.join(f'{k} {v:.0f}' for k, v in result.get('copy_detail', {}).items())}).", "",
             "## Quantized GEMV (decode): GB/s of weight bytes read (% of copy) / speed-up over torch bf16 "
             "F.linear", ""]
    for fmt_name in sorted({r["fmt"] for r in rows if r["kind"] == "gemv"}):
        lines += [f"### {fmt_name}", "", "| shape | T | " + " | ".join(f"n={n}" for n in DECODE_TOKS) + " |",
                  "|---|---|" + "---|" * len(DECODE_TOKS)]
        for name in SHAPES:
            cells = {r["n_tok"]: r for r in rows if r["kind"] == "gemv" and r["fmt"] == fmt_name and r["shape"] == name}
            if not cells:
                continue
            t = next(iter(cells.values()))["crossover"]
            lines.append(f"| {name} {SHAPES[name][0]}x{SHAPES[name][1]} | {t} | " + " | ".join(
                f"{cells[n]['gbps']:.0f} ({cells[n]['pct_copy']:.0f}%) / {cells[n]['speedup_vs_bf16']:.2f}x"
                for n in DECODE_TOKS if n in cells) + " |")
        lines.append("")
    idle = [r for r in rows if r["kind"] == "gemv" and r.get("us_idle_stream")]
    if idle:
        lines += ["### The same, timed as before 2026-11-30 (graph replayed onto an idle stream: its submission "
                  "charged to the calls), % of copy", "", "| format | shape | " + " | ".join(
                      f"n={n}" for n in DECODE_TOKS) + " |", "|---|---|" + "---|" * len(DECODE_TOKS)]
        for fmt_name in sorted({r["fmt"] for r in idle}):
            for name in SHAPES:
                cells = {r["n_tok"]: r for r in idle if r["fmt"] == fmt_name and r["shape"] == name}
                if cells:
                    lines.append(f"| {fmt_name} | {name} | " + " | ".join(
                        f"{cells[n]['pct_copy_idle_stream']:.0f}%" for n in DECODE_TOKS if n in cells) + " |")
        lines.append("")
    lines += ["## Dequant GEMM (prefill): TFLOP/s vs torch bf16 matmul", "",
              "The dense pass: the plan's dequantization of the whole weight to bf16 alone, GB/s of quantized bytes "
              "read plus bf16 bytes written (% of copy).", "",
              "| format | shape | n_tok | TFLOP/s | torch bf16 | ratio | dense pass us | GB/s (% of copy) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "gemm":
            dq = (f"{r['dequant_us']:.1f} | {r['dequant_gbps']:.0f} ({r['dequant_pct_copy']:.0f}%)"
                  if r.get("dequant_us") else " | ")
            lines.append(f"| {r['fmt']} | {r['shape']} | {r['n_tok']} | {r['tflops']:.0f} | "
                         f"{r['torch_bf16_tflops']:.0f} | {r['ratio']:.2f} | {dq} |")
    att = [r for r in rows if r["kind"] == "attention"]
    if att:
        keys = list(dict.fromkeys(k for r in att for k in r if k != "kind"))
        lines += ["", "## Decode attention", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in att:
            lines.append("| " + " | ".join(f"{r.get(k):.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                                           for k in keys) + " |")
    return "\n".join(lines) + "\n"


def table_from_result(result: dict, table: dict) -> dict:
    """Put the GEMV plans and crossovers a results JSON measured with into a quant_configs table: the
    results file alone reproduces the table of its run (e.g. when the run's quant_configs.json was lost)."""
    for r in result["rows"]:
        if r["kind"] != "gemv" or not isinstance(r.get("narrow"), dict) or "default" not in r["narrow"]:
            continue
        entry = table["formats"].setdefault(r["fmt"], {}).setdefault("shapes", {}).setdefault(
            f"{r['rows']}x{r['cols']}", {})
        entry.update({"gemv": r["narrow"]["default"], "gemv_crossover": r["crossover"]})
        entry.pop("gemv_upto", None)
        if r["narrow"]["upto"]:
            entry["gemv_upto"] = r["narrow"]["upto"]
    return table


def short_table(result: dict) -> str:
    out = [f"copy {result['copy_gbps']:.0f} GB/s", "fmt    shape     T   " + " ".join(f"{n:>9}" for n in DECODE_TOKS)]
    rows = [r for r in result["rows"] if r["kind"] == "gemv"]
    for fmt_name in sorted({r["fmt"] for r in rows}):
        for name in SHAPES:
            cells = {r["n_tok"]: r for r in rows if r["fmt"] == fmt_name and r["shape"] == name}
            if cells:
                out.append(f"{fmt_name:6} {name:8} {next(iter(cells.values()))['crossover']:3} " + " ".join(
                    f"{cells[n]['pct_copy']:4.0f}%{cells[n]['speedup_vs_bf16']:4.1f}" for n in DECODE_TOKS))
    out.append("gemm TFLOP/s (ratio to bf16): " + ", ".join(
        f"{r['fmt']}/{r['shape']}/{r['n_tok']}: {r['tflops']:.0f} ({r['ratio']:.2f})"
        for r in result["rows"] if r["kind"] == "gemm" and r["shape"] in ("gate_up", "o")))
    out.append("dense pass % of copy: " + ", ".join(
        f"{r['fmt']}/{r['shape']}: {r['dequant_pct_copy']:.0f}%"
        for r in result["rows"] if r["kind"] == "gemm" and r["n_tok"] == PREFILL_TOKS[0] and r.get("dequant_us")))
    for r in result["rows"]:
        if r["kind"] == "attention":
            out.append("attn " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in r.items() if k != "kind"))
    return "\n".join(out)


def render(path: Path, ceiling: float | None) -> None:
    """Re-render a results .json as .md (no GPU); optionally against another copy-bandwidth ceiling."""
    result = json.loads(path.read_text())
    if ceiling:
        result["copy_detail"] = {**result.get("copy_detail", {}), "measured_in_run": result["copy_gbps"],
                                 "ceiling_used": ceiling}
        result["copy_gbps"] = ceiling
        result["note"] = (f"Re-rendered on the CPU with `python bench/kernels.py --render {path.name} "
                          f"--ceiling-gbps {ceiling:.0f}`: percentages against that ceiling (ARCHITECTURE.md's "
                          f"copy figure). This run's own copy measurement, "
                          f"{result['copy_detail']['measured_in_run']:.0f}"
                          f" GB/s, timed copy_ inside a CUDA graph (a memcpy node), not an SM copy; cuBLAS bf16 "
                          f"GEMV read up to 4.35 TB/s in the same run. Attention rows keep their own ratio_to_copy.")
        for r in result["rows"]:
            if "gbps" in r and "pct_copy" in r:
                r["pct_copy"] = 100 * r["gbps"] / ceiling
        path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown(result))
    print(short_table(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="choose tile configs and crossovers first")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--model-shape", default=None,
                    help="the matrices of this `cobatch make-model --shape` instead of Llama-3-8B's")
    ap.add_argument("--configs", default=None, help="quant_configs.json to use (default: the package's)")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--sweep-seconds", type=float, default=150.0, help="time budget of the sweep")
    ap.add_argument("--sweep-shapes", default=None, help="sweep only these shapes (e.g. qkv,o,down)")
    ap.add_argument("--sweep-only", action="store_true", help="stop after the sweep (its quant_configs.json written)")
    ap.add_argument("--gemv-bases", default=None,
                    help="GEMV (W,RT,U) bases to sweep, e.g. '8,1,4;4,1,8' (default: GEMV_BASES)")
    ap.add_argument("--gemv-prefetch", default=None, help="GEMV prefetch distances D to sweep, e.g. '0,2'")
    ap.add_argument("--no-attention", action="store_true", help="skip the decode-attention rows")
    ap.add_argument("--render", default=None, help="only re-render the .md of this results .json")
    ap.add_argument("--table-from", default=None,
                    help="only write the GEMV plans of this results .json into the package's quant_configs.json")
    ap.add_argument("--ceiling-gbps", type=float, default=None,
                    help="with --render: percentages against this copy bandwidth instead of the run's")
    args = ap.parse_args()
    if args.render:
        render(Path(args.render), args.ceiling_gbps)
        return
    if args.table_from:
        table = table_from_result(json.loads(Path(args.table_from).read_text()),
                                  json.loads(matmul_plans.CONFIG_PATH.read_text()))
        matmul_plans.CONFIG_PATH.write_text(json.dumps(table, indent=1))
        return
    formats = args.formats.split(",")
    use_model_shapes(SHAPES, args.model_shape, with_kv=False)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    res_dir = ROOT / "bench" / "results"
    for d in [res_dir] + ([out_dir] if out_dir else []):
        d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    log: list = []
    config_path = args.configs
    if args.sweep:
        def save(table):
            text = json.dumps(table, indent=1)
            for d in [res_dir] + ([out_dir] if out_dir else []):
                (d / "quant_configs.json").write_text(text)
            if out_dir:
                (out_dir / "sweep.json").write_text(json.dumps(log))
        if args.gemv_bases:
            GEMV_BASES[:] = [tuple(int(v) for v in b.split(",")) for b in args.gemv_bases.split(";")]
        if args.gemv_prefetch:
            GEMV_PREFETCH[:] = [int(v) for v in args.gemv_prefetch.split(",")]
        table = sweep(formats, log, time.time() + args.sweep_seconds, save,
                      args.sweep_shapes.split(",") if args.sweep_shapes else None)
        save(table)
        if args.sweep_only:
            return
        config_path = str(res_dir / "quant_configs.json")
    rows: list = []

    def save_partial():
        if out_dir:
            (out_dir / "kernels-partial.json").write_text(json.dumps({"copy_gbps": copy_gbps, "rows": rows}))
    measure(formats, copy_gbps, rows, config_path, save_partial)
    copy_end = copy_bandwidth()
    print(f"copy bandwidth again at the end: {copy_end:.0f} GB/s", flush=True)
    if copy_end > copy_gbps * 1.02:   # percentages against the better (warm-clock) figure
        for r in rows:
            if "pct_copy" in r:
                r["pct_copy"] = 100 * r["gbps"] / copy_end
        copy_gbps = copy_end
    try:
        rows += [] if args.no_attention else attention_rows(copy_gbps)
    except Exception as e:  # the other module's failure must not lose our numbers
        print("attention bench failed:", repr(e), flush=True)
    result = {"date": args.date, "command": "PYTHONPATH=src python bench/kernels.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "copy_gbps": copy_gbps, "copy_detail": COPY_DETAIL,
              "rows": rows, "sweep": log}
    text = json.dumps(result, indent=1)
    md = markdown(result)
    for d in [res_dir] + ([out_dir] if out_dir else []):
        (d / f"kernels-{args.date}.json").write_text(text)
        (d / f"kernels-{args.date}.md").write_text(md)
    print(short_table(result), flush=True)


if __name__ == "__main__":
    main()
