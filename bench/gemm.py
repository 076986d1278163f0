"""Mid-batch quantized GEMM benchmark on the GPU (quant_gemm.py): 16 to 256 tokens, and prefill sizes.

    PYTHONPATH=src python bench/gemm.py [--formats q8_0,q4_k,q4_1,q6_k] [--shapes qkv,o,...] [--toks 16,...]
        [--cases q8_0:o,q6_k:kv,...]          the format:shape pairs a model holds, instead of every pair
        [--reuse gemm.json [--time-toks 256]]  an earlier sweep's times of the same kernels: only the configs it
                                               lacks are timed (with --time-toks, only at those token counts)
        [--around-plans]                      only the committed plans' configs and their variants (around_plan)
        [--choose-from gemm.json]             choose the configs again from a sweep's times, no GPU

For each format and Llama-3-8B shape (bench/kernels.py's SHAPES) and token count n:
  - the quantized GEMM, each candidate config (NW, split_k, D) timed, the best reported;
  - the path it replaces: the GEMV up to the old crossover, else dequantize + cuBLAS (the plan without the GEMM);
  - cuBLAS bf16 (F.linear on a bf16 copy of the matrix): its TFLOP/s at this shape and n;
  - the two-sided roofline: the larger of weight bytes / copy bandwidth (measured in this run) and
    2 n rows cols / cuBLAS bf16's TFLOP/s at this shape and n. The GEMM's time over it is the figure of merit.
A correctness check against the float64 reference (512 rows) runs first for every weight. One config per weight
is then chosen for every batch (its split of K fixes a row's bits: batch invariance), the fastest over the
decode token counts, and written with the largest n where the GEMM still beats dequantize + cuBLAS as
quant_configs-gemm.json (merge into src/cobatch/kernels/quant_configs.json). Prints a short table last; JSON and
markdown to $OUT and bench/results/.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from cobatch.kernels import matmul_plans  # noqa: E402
from cobatch.kernels import quant_gemm, quant_pack  # noqa: E402
from cobatch.kernels.packed_weight import PackedWeight  # noqa: E402
from cobatch.kernels.quant_gemm import GemmConfig  # noqa: E402
from cobatch.quant.weight import QuantWeight  # noqa: E402
import provenance  # noqa: E402
from kernels import SHAPES, random_weight, rotating, time_torch_linear, use_model_shapes  # noqa: E402
from timing import COPY_DETAIL, copy_bandwidth, graph_time  # noqa: E402

FORMATS = ["q8_0", "q4_k", "q4_1", "q6_k"]
# Q4_K_M files hold k and v as matrices of their own (v in q6_K): a separate 1024-row launch each
SHAPES = {**SHAPES, "kv": (1024, 4096)}
TOKS = [16, 32, 64, 128, 256, 512, 2048]
DECODE = [32, 64, 128, 256]          # the token counts a weight's one config is chosen by
# the fragment planes' layout of each format (q4_K's are q4_1's)
PLANES_FMT = {"q8_0": quant_pack.Q8_0, "q4_0": quant_pack.Q4_0, "q4_1": quant_pack.Q4_1, "q4_k": quant_pack.Q4_1,
              "q6_k": quant_pack.Q6_K, "fp8_e4m3": quant_pack.FP8_E4M3, "nvfp4": quant_pack.NVFP4}


def candidates(rows: int, n_chunks: int) -> list[GemmConfig]:
    rows_pad = -(-rows // 128) * 128
    base = quant_gemm.default_config(rows_pad, n_chunks)
    s = base.split_k
    # The register path's configs without P won 2 of 90 weights and token counts in the sweep of 5d74045 (by
    # under 3 %), and the TMA variant of 8 warps with 3 buffers 1: not swept again.
    out = [GemmConfig(nw, split, P=True) for split in (s, 2 * s) for nw in (8, 4)]
    out.append(GemmConfig(8, s, D=4, P=True))
    out += [GemmConfig(8, s, P=True, TMA=4), GemmConfig(4, s, P=True, TMA=3)]
    out += [GemmConfig(8, s, RING=4, CHUNKS=2), GemmConfig(8, s, RING=6), GemmConfig(4, s, RING=6),
            GemmConfig(4, s, RING=4, CHUNKS=2), GemmConfig(4, 2 * s, RING=4, CHUNKS=2)]
    # deeper rings, and fewer K splits where a ring's CTA streams a longer slice (its partial sums cost less)
    out += [GemmConfig(nw, split, RING=ring, CHUNKS=chunks) for nw in (8, 4) for split in (s // 4, s // 2, s)
            if split >= 1 for ring, chunks in ((4, 2), (8, 2), (6, 1))]
    # every ring of two warpgroups again with them apart (each its own partition)
    out += [dataclasses.replace(c, APART=True) for c in out if c.RING and c.NW == 8 and c.split_k >= 1]
    # every ring again on the persistent grid (one CTA an SM walking work items), and the finest K splits of one
    # warpgroup's rings at two CTAs an SM
    out += [dataclasses.replace(c, PERSIST=1) for c in out if c.RING and c.split_k >= 1]
    out += [dataclasses.replace(c, split_k=2 * c.split_k, PERSIST=2) for c in out
            if c.RING and c.NW == 4 and c.PERSIST == 1]
    # every ring again with each stage's MMAs in flight while the next is dequantized (LAG)
    out += [dataclasses.replace(c, LAG=True) for c in out if c.RING]
    ok = []
    for c in out:
        if c.split_k < 1:
            continue
        if c.split_k <= 16 and n_chunks % (c.split_k * c.steps_per_iteration()) == 0 and c not in ok:
            ok.append(c)
    return ok


def around_plan(fmt_name: str, rows: int, cols: int) -> list[GemmConfig]:
    """--around-plans' candidates: the committed plan's GEMM configs of one weight and, for each ring among
    them, the same split of K with LAG, as rings of 4-chunk stages (as many, half as many, and 6 or 8 stages
    where the shared memory holds them), with its warpgroups in lock step (APART off), and each of these with
    a stage's bytes loaded at once (AHEAD)."""
    cols_pad = -(-cols // 256) * 256
    plan = matmul_plans.plan_for(fmt_name, rows, cols, cols_pad, gemv=True, quant_gemm_too=True)
    out = []
    for c in plan.gemm_configs():
        out.append(c)
        if not c.RING:
            continue
        lagged = dataclasses.replace(c, LAG=True)
        variants = [lagged, dataclasses.replace(lagged, RING=max(2, c.RING // 2) if c.CHUNKS == 2 else c.RING,
                                                CHUNKS=4),
                    dataclasses.replace(lagged, CHUNKS=4), dataclasses.replace(lagged, RING=6, CHUNKS=4),
                    dataclasses.replace(lagged, RING=8, CHUNKS=4)]
        if c.APART:
            variants += [dataclasses.replace(v, APART=False) for v in variants]
        out += variants + [dataclasses.replace(v, AHEAD=True) for v in [c] + variants]
    n_chunks = matmul_plans.gemv_chunks(fmt_name, cols_pad)
    return [c for i, c in enumerate(out) if c not in out[:i] and n_chunks % (c.split_k * c.steps_per_iteration()) == 0]


def runs_as(c: GemmConfig, fmt_id: int, n: int) -> GemmConfig | None:
    """The config a launch of c at n tokens runs: a ring with as many stages as fit at its token tile
    (quant_gemm.ring_stages), None if not even two fit; others as they are."""
    if not c.RING:
        return c
    stages = quant_gemm.ring_stages(c, fmt_id, quant_gemm.token_tile(n))
    return dataclasses.replace(c, RING=stages) if stages >= 2 else None


def config_key(c: GemmConfig) -> str:
    """A config as the sweep's JSON names it: NW,split_k,D,P,TMA,RING,CHUNKS, then ",apart" with APART,
    ",persistN" with PERSIST N, ",lag" with LAG and ",ahead" with AHEAD."""
    return (f"{c.NW},{c.split_k},{c.D},{int(c.P)},{c.TMA},{c.RING},{c.CHUNKS}" + (",apart" if c.APART else "")
            + (f",persist{c.PERSIST}" if c.PERSIST else "") + (",lag" if c.LAG else "")
            + (",ahead" if c.AHEAD else ""))


def config_of(key: str) -> GemmConfig:
    """config_key's inverse (older sweeps name the first five or seven fields only)."""
    fields = key.split(",")
    ahead = fields[-1] == "ahead"
    if ahead:
        fields.pop()
    lag = fields[-1] == "lag"
    if lag:
        fields.pop()
    persist = int(fields.pop()[len("persist"):]) if fields[-1].startswith("persist") else 0
    apart = fields[-1] == "apart"
    if apart:
        fields.pop()
    nw, split, d, pf, tm, ring, chunks = (list(map(int, fields[:7])) + [0, 1])[:7]
    return GemmConfig(nw, split, D=d, P=bool(pf), TMA=tm, RING=ring, CHUNKS=chunks, APART=apart, PERSIST=persist,
                      LAG=lag, AHEAD=ahead)


def _compile_one(task) -> str:
    """Run one (format, config, token tile) once on a small weight: fills Triton's disk cache."""
    fmt_name, key, n_tok = task
    try:
        cfg = config_of(key)
        split = cfg.split_k
        cols = 4096 if fmt_name != "q8_0" else 4096
        pw = PackedWeight.from_quant(random_weight(fmt_name, 256, cols), "cuda")
        n_chunks = pw.planes.qs.shape[1] // 512
        if n_chunks % (split * cfg.steps_per_iteration()):
            return ""
        pw.matmul(torch.randn(n_tok, cols, device="cuda").to(torch.bfloat16), config=cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported; the config is then skipped in the timing
        return f"{task}: {type(e).__name__}: {str(e)[:300]}"


def _as_dict(c: GemmConfig) -> dict:
    return {"NW": c.NW, "split_k": c.split_k, "D": c.D, "P": c.P, "TMA": c.TMA, "RING": c.RING, "CHUNKS": c.CHUNKS,
            **({"APART": True} if c.APART else {}), **({"PERSIST": c.PERSIST} if c.PERSIST else {}),
            **({"LAG": True} if c.LAG else {}), **({"AHEAD": True} if c.AHEAD else {})}


def choose(cands: list[GemmConfig], times: dict, mine: dict, toks: list[int]) -> dict:
    """The plan entry of one weight from its timings: times[(config, n)] in us, mine[n] the row of n (its old
    path's and dequantize + cuBLAS's times).

    One split of K per weight (it fixes a row's bits: batch invariance), in at most two configs of it: `mid`,
    and past `wide_from` tokens a `wide` one that streams x (TMA or RING: the TMA variant wins at 128-256 tokens
    and loses below). The GEMV
    runs up to the largest token count where it still beat that pair (among the GEMV's own; 8 where the GEMM
    beat it at 16), the GEMM up to the largest one where it beat dequantize + cuBLAS; the pair with the least
    total time over DECODE wins."""
    def t(c, n):
        return times.get((c, n), 1e9)

    def plan_of(c, w):
        wide_from = max([0] + [n for n in toks if t(c, n) <= t(w, n)]) if w else max(toks)
        gemm_us = {n: t(c, n) if n <= wide_from else t(w, n) for n in toks}
        gemv_ns = [n for n in toks if mine[n]["old_path"] == "gemv"]
        # The GEMM's 16-token tile beating the GEMV's 16-token tier takes 9-16 tokens too: the GEMV keeps up to
        # its 8-token tier, where it reads its weight about as fast as for one token.
        low = 8 if 16 in gemv_ns and gemm_us[16] < mine[16]["old_us"] else 16
        for n in sorted(gemv_ns):
            if n > 16 and mine[n]["old_us"] <= gemm_us[n] and low == max([16] + [m for m in gemv_ns if m < n]):
                low = n
        wins = [n for n in toks if n > low and gemm_us[n] < mine[n]["dequant_cublas_us"]]
        high = max(wins) if wins else low
        total = sum(mine[n]["old_us"] if n <= low else gemm_us[n] if n <= high else mine[n]["dequant_cublas_us"]
                    for n in DECODE if n in toks)
        return total, low, high, wide_from

    pairs = [(c, None) for c in cands] + [(c, w) for c in cands for w in cands
                                           if w.streams_x() and w != c and w.split_k == c.split_k]
    mid, wide = min(pairs, key=lambda cw: plan_of(*cw)[0])
    _, low, upto, wide_from = plan_of(mid, wide)
    entry = {"quant_gemm": _as_dict(mid), "quant_gemm_crossover": low, "quant_gemm_upto": upto}
    if wide is not None and wide_from < upto:
        entry.update(quant_gemm_wide=_as_dict(wide), quant_gemm_wide_from=wide_from)
    return entry


def precompile(tasks, workers: int) -> None:
    t0 = time.time()
    uniq = sorted(set(tasks))
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for err in pool.map(_compile_one, uniq):
            if err:
                print("compile failed:", err, flush=True)
    print(f"precompiled {len(uniq)} GEMM variants in {time.time() - t0:.0f} s", flush=True)


def check(pw: PackedWeight, w: QuantWeight) -> float:
    """Worst relative error against the float64 reference (first 512 rows) at 17, 100 and 256 tokens, each run as
    the weight's plan runs it (a ring config may be planned for small token tiles only: its buffers grow with it)."""
    ref_w = w.row_slice(0, 512).dequantize().double()     # with FP8 / NVFP4's row scale
    worst = 0.0
    for n in (17, 100, 256):
        x = torch.randn(n, w.cols, device="cuda").to(torch.bfloat16)
        y = pw.matmul(x, config=pw.plan.config_for(n))[:, :512].double()
        ref = x.double() @ ref_w.T
        worst = max(worst, ((y - ref).norm() / ref.norm()).item())
    return worst


def time_config(copies: list[PackedWeight], n: int, cfg) -> float:
    x = torch.randn(n, copies[0].cols, device="cuda").to(torch.bfloat16)
    out = torch.empty(n, copies[0].rows, device="cuda", dtype=torch.bfloat16)
    return graph_time([lambda w=w: w.matmul(x, config=cfg, out=out) for w in copies])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=None,
                    help="default: every shape of the model (Llama-3-8B's, or --model-shape's)")
    ap.add_argument("--model-shape", default=None,
                    help="the matrices of this `cobatch make-model --shape` instead of Llama-3-8B's")
    ap.add_argument("--toks", default=",".join(map(str, TOKS)))
    ap.add_argument("--reuse", type=Path, help="an earlier sweep's gemm.json of the same kernels: its configs' "
                    "times are taken from it, only the others are timed")
    ap.add_argument("--time-toks", help="with --reuse: the token counts at which the configs it lacks are timed "
                    "(default: all); at the others its times of the old path and of dequantize + cuBLAS are taken too")
    ap.add_argument("--cases", help="format:shape pairs instead of every format at every shape, e.g. "
                                    "q8_0:o,q6_k:kv (the shapes a model's files hold in that format)")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--around-plans", action="store_true",
                    help="time only the committed plans' configs and their variants (around_plan), not every one")
    ap.add_argument("--choose-from", type=Path, help="a sweep's gemm.json: choose the configs again, no GPU")
    args = ap.parse_args()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    res_dir = ROOT / "bench" / "results"
    dirs = [res_dir] + ([out_dir] if out_dir else [])
    if args.choose_from:
        return choose_again(args.choose_from, dirs)
    use_model_shapes(SHAPES, args.model_shape, with_kv=True)
    toks = [int(t) for t in args.toks.split(",")]
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    else:
        cases = [(f, s) for f in args.formats.split(",") for s in (args.shapes or ",".join(SHAPES)).split(",")]
    shapes = list(dict.fromkeys(s for _, s in cases))
    reused, reused_rows = {}, {}      # (fmt, shape, n) -> {config key: us}, and the row, of the earlier sweep
    reused_from = reuse_note(args)
    if args.reuse:
        for r in json.loads(args.reuse.read_text())["rows"]:
            reused[(r["fmt"], r["shape"], r["n_tok"])] = {config_key(config_of(k)): us
                                                         for k, us in r["all_configs_us"].items() if us is not None}
            reused_rows[(r["fmt"], r["shape"], r["n_tok"])] = r
    time_toks = [int(t) for t in args.time_toks.split(",")] if args.time_toks else toks
    torch.manual_seed(0)
    tasks = []
    for fmt_name, name in cases:
        rows, cols = SHAPES[name]
        n_chunks = matmul_plans.gemv_chunks(fmt_name, -(-cols // 256) * 256)
        for c in (around_plan(fmt_name, rows, cols) if args.around_plans else candidates(rows, n_chunks)):
            tasks += [(fmt_name, config_key(runs_as(c, PLANES_FMT[fmt_name], n)), n) for n in time_toks
                      if config_key(c) not in reused.get((fmt_name, name, n), {})
                      and runs_as(c, PLANES_FMT[fmt_name], n) is not None]
    precompile(tasks, workers=min(14, os.cpu_count() or 4))
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    cublas_us, cache = {}, {}
    for name in shapes:
        for n in toks:
            cublas_us[(name, n)] = time_torch_linear(*SHAPES[name], n, cache) * 1e6
    cache.clear()
    peak_tflops = {name: max(2 * n * SHAPES[name][0] * SHAPES[name][1] / cublas_us[(name, n)] / 1e6 for n in toks)
                   for name in shapes}
    rows_out, chosen = [], {}
    for fmt_name, name in cases:
        rows, cols = SHAPES[name]
        w = random_weight(fmt_name, rows, cols)
        pw = PackedWeight.from_quant(w, "cuda")
        assert pw.plan.mid is not None, "no quantized GEMM on this device"
        old = matmul_plans.plan_for(fmt_name, rows, cols, pw.planes.cols_pad, gemv=True)   # the plan before it
        err = check(pw, w)
        copies = rotating(pw)
        n_chunks = pw.planes.qs.shape[1] // 512
        cands = around_plan(fmt_name, rows, cols) if args.around_plans else candidates(rows, n_chunks)
        times = {}
        # the token counts timed here, and with --reuse those the earlier sweep has a row of for this weight
        case_toks = [n for n in toks if n in time_toks or (fmt_name, name, n) in reused_rows]
        for n in list(case_toks):
            trimmed = []
            for c in cands:
                ran = runs_as(c, pw.planes.fmt_id, n)
                if ran is None:
                    continue
                if ran != c and ran in cands:   # a ring trimmed at this tile to another candidate: its time
                    trimmed.append((c, ran))
                    continue
                if config_key(c) in reused.get((fmt_name, name, n), {}):
                    times[(c, n)] = reused[(fmt_name, name, n)][config_key(c)]
                    continue
                if n not in time_toks:
                    continue
                try:
                    times[(c, n)] = time_config(copies, n, ran) * 1e6
                except Exception as e:   # a config that fails to compile or run is reported and skipped
                    print(f"  {fmt_name} {name} {c} n={n}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            for c, ran in trimmed:
                if (ran, n) in times:
                    times[(c, n)] = times[(ran, n)]
            old_cfg = old.config_for(n)
            earlier = reused_rows.get((fmt_name, name, n))
            if earlier is not None and n not in time_toks:
                t_old, t_dq = earlier["old_us"], earlier["dequant_cublas_us"]
            else:
                t_old = time_config(copies, n, old_cfg) * 1e6
                t_dq = time_config(copies, n, matmul_plans.DEQUANT_CUBLAS) * 1e6
            if not any((c, n) in times for c in cands):     # --reuse: the earlier sweep timed none of these here
                case_toks.remove(n)
                continue
            best = min((c for c in cands if (c, n) in times), key=lambda c: times[(c, n)])
            t = times[(best, n)]
            flops = 2 * n * rows * cols
            cublas_tflops = flops / cublas_us[(name, n)] / 1e6
            bytes_us = pw.nbytes / copy_gbps / 1e3
            roof_us = max(bytes_us, cublas_us[(name, n)])              # the issue's: cuBLAS at this n
            strict_us = max(bytes_us, flops / peak_tflops[name] / 1e6)  # cuBLAS's best rate on this shape
            rows_out.append({
                "fmt": fmt_name, "shape": name, "rows": rows, "cols": cols, "n_tok": n, "gemm_us": t,
                "gemm_config": config_key(best), "old_us": t_old,
                "old_path": "gemv" if old_cfg is old.narrow else str(old_cfg), "dequant_cublas_us": t_dq,
                "cublas_bf16_us": cublas_us[(name, n)], "cublas_bf16_tflops": cublas_tflops,
                "gemm_tflops": flops / t / 1e6, "weight_bytes": pw.nbytes,
                "gemm_gbps": pw.nbytes / t / 1e3, "pct_copy": 100 * pw.nbytes / t / 1e3 / copy_gbps,
                "roofline_us": roof_us, "x_roofline": t / roof_us, "strict_roofline_us": strict_us,
                "x_strict": t / strict_us, "x_bytes": t / bytes_us, "rel_err": err,
                "all_configs_us": {config_key(c): times.get((c, n)) for c in cands}})
            print(f"  {fmt_name:5s} {name:8s} n={n:5d}: gemm {t:8.1f} us ({config_key(best)}) "
                  f"{t / roof_us:4.2f}x roof {t / strict_us:4.2f}x strict | old {t_old:8.1f} | dq+cublas {t_dq:8.1f} | "
                  f"bf16 {cublas_us[(name, n)]:8.1f} us", flush=True)
        mine = {r["n_tok"]: r for r in rows_out if r["fmt"] == fmt_name and r["shape"] == name}
        entry = choose(cands, times, mine, case_toks)
        chosen.setdefault(fmt_name, {})[f"{rows}x{cols}"] = entry
        print(f"  {fmt_name} {name}: rel_err {err:.1e}; {entry}", flush=True)
        del copies, pw, w
        torch.cuda.empty_cache()
        if (fmt_name, name) != cases[-1]:   # what is measured so far, in case the run is cut short
            write(result_of(args, reused_from, copy_gbps, None, rows_out, chosen), dirs, quiet=True)
    write(result_of(args, reused_from, copy_gbps, copy_bandwidth(), rows_out, chosen), dirs)


def reuse_note(args) -> dict:
    """Where the reused times come from: read before the run, since the run writes its own gemm.json over
    bench/results/gemm.json, the usual --reuse file."""
    if not args.reuse:
        return {}
    earlier = json.loads(args.reuse.read_text())
    return {"reused": f"the times of the configs in {args.reuse} (tree {earlier['tree']}, {earlier['date']}) "
                      "are that sweep's; the others were timed in this run"}


def result_of(args, reused_from: dict, copy_gbps: float, copy_end: float | None, rows_out: list,
              chosen: dict) -> dict:
    tree = provenance.tree()
    return {**reused_from, "date": args.date, "tree": tree,
            "command": "PYTHONPATH=src python bench/gemm.py " + " ".join(sys.argv[1:]),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "copy_gbps": copy_gbps,
            "copy_gbps_end": copy_end if copy_end is not None else float("nan"),
            "copy_detail": COPY_DETAIL, "rows": rows_out, "chosen": chosen}


def write(result: dict, dirs: list[Path], quiet: bool = False) -> None:
    """gemm.json and gemm.md, the chosen entries alone, and the package's table with them merged in."""
    chosen = result["chosen"]
    table = {"formats": {f: {"shapes": s} for f, s in chosen.items()}}
    merged = json.loads(matmul_plans.CONFIG_PATH.read_text())
    for f, shapes_of in chosen.items():
        for shape, entry in shapes_of.items():
            row = merged.setdefault("formats", {}).setdefault(f, {}).setdefault("shapes", {}).setdefault(shape, {})
            for key in ("quant_gemm_wide", "quant_gemm_wide_from"):   # an older choice's wide config goes
                row.pop(key, None)
            row.update(entry)
    md = markdown(result)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "gemm.json").write_text(json.dumps(result, indent=1))
        (d / "gemm.md").write_text(md)
        (d / "quant_configs-gemm.json").write_text(json.dumps(table, indent=1))
        (d / "quant_configs.json").write_text(json.dumps(merged, indent=1) + "\n")
    if not quiet:
        print(md.split("\n## ")[1] if "\n## " in md else md, flush=True)


def choose_again(path: Path, dirs: list[Path]) -> None:
    """Choose each weight's configs again from a sweep's timings (its gemm.json), without a GPU: for a change
    of the choice, not of the kernels."""
    result = json.loads(path.read_text())
    toks = sorted({r["n_tok"] for r in result["rows"]})
    chosen = {}
    for fmt, shape in dict.fromkeys((r["fmt"], r["shape"]) for r in result["rows"]):
        mine = {r["n_tok"]: r for r in result["rows"] if (r["fmt"], r["shape"]) == (fmt, shape)}
        times = {}
        for n, r in mine.items():
            for key, us in r["all_configs_us"].items():
                if us is not None:
                    times[(config_of(key), n)] = us
        cands = list(dict.fromkeys(c for c, _ in times))
        for n in mine:      # a ring trimmed at this tile runs the kernel of fewer stages: that one's time
            for c in cands:
                ran = runs_as(c, PLANES_FMT[fmt], n)
                if (c, n) not in times and ran is not None and (ran, n) in times:
                    times[(c, n)] = times[(ran, n)]
        rows, cols = SHAPES[shape]
        chosen.setdefault(fmt, {})[f"{rows}x{cols}"] = choose(cands, times, mine, toks)
    result["chosen"] = chosen
    result["command"] += "; configs chosen again by bench/gemm.py --choose-from"
    write(result, dirs)

def markdown(result: dict) -> str:
    lines = [f"# Mid-batch quantized GEMM ({result['device']}, {result['date']}, tree {result['tree']})", ""]
    if result.get("tree_note"):
        lines += [f"> {result['tree_note']}", ""]
    lines += [
             f"`{result['command']}`; copy bandwidth {result['copy_gbps']:.0f} GB/s (read + write; "
             + (f"{result['copy_gbps_end']:.0f} at the end" if result['copy_gbps_end'] == result['copy_gbps_end']
                else "the run was cut short before its last case: no copy measured at the end")
             + "). Roofline: max(weight bytes / copy, cuBLAS bf16 time at the same shape and n: the issue's), "
             "and the strict one: max(weight bytes / copy, FLOPs / cuBLAS bf16's best "
             "TFLOP/s on the shape over all n). `old`: the path the GEMM replaces (GEMV up to the old crossover, else "
             "dequantize + cuBLAS).", "",
             "## GEMM time over the roofline: the issue's / the strict one (speed-up over the old path)", ""]
    toks = sorted({r["n_tok"] for r in result["rows"]})
    lines.append("| format | shape | " + " | ".join(f"n={n}" for n in toks) + " |")
    lines.append("|---|---|" + "---|" * len(toks))
    keys = sorted({(r["fmt"], r["shape"]) for r in result["rows"]}, key=lambda k: (k[0], list(SHAPES).index(k[1])))
    for fmt, shape in keys:
        cells = []
        for n in toks:
            r = next((r for r in result["rows"] if r["fmt"] == fmt and r["shape"] == shape and r["n_tok"] == n), None)
            cells.append("" if r is None else
                         f"{r['x_roofline']:.2f} / {r['x_strict']:.2f} ({r['old_us'] / r['gemm_us']:.2f}x)")
        lines.append(f"| {fmt} | {shape} | " + " | ".join(cells) + " |")
    lines += ["", "## Detail", "",
              "| format | shape | n | GEMM us | config (NW, split, D, P, TMA, RING, CHUNKS[, apart]) | % copy | "
              "TFLOP/s | cuBLAS bf16 us / TFLOP/s | old us (path) | dequant+cuBLAS us | rel err |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['fmt']} | {r['shape']} | {r['n_tok']} | {r['gemm_us']:.1f} | {r['gemm_config']} | "
                     f"{r['pct_copy']:.0f} | {r['gemm_tflops']:.0f} | {r['cublas_bf16_us']:.1f} / "
                     f"{r['cublas_bf16_tflops']:.0f} | {r['old_us']:.1f} ({r['old_path']}) | "
                     f"{r['dequant_cublas_us']:.1f} | {r['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
