"""The CUDA C++ quantized GEMM (quant_gemm_cuda.py) against the Gluon one's plans, kernel alone, on the H200.

    PYTHONPATH=src python bench/gemm_cuda.py [--shapes qkv,o,gate_up,down] [--toks 16,32,64,128]

q8_0 (--formats: q4_k, q4_1 too) on the Llama-3-8B shapes (bench/kernels.py's SHAPES). For each shape and token
count: the committed plan's
config (the Gluon GEMM, or the GEMV where the plan keeps it) and every CUDA candidate (candidates()), each timed
as CUDA-graph replays over copies of the weight rotating past L2 (bench/timing.py). Every candidate is first
checked against the float64 reference. Reports us, GB/s of weight bytes and their share of a device-to-device
copy measured in the same run. Prints a short table last; JSON and markdown to $OUT and bench/results/gemm_cuda.*.
With --probe, also where the best config's time goes (its MMAs, its dequantization, the ring alone). With $OUT set,
$OUT/quant_configs-cuda.json is the package's plan table with the fewest-token GEMM calls of each weight the CUDA
kernel won on planned through it (plan_table): bench/device.sh plan-ab weighs it in whole decode steps.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from cobatch.kernels import matmul_plans, scratch  # noqa: E402
from cobatch.kernels import quant_gemm_cuda, quant_pack  # noqa: E402
from cobatch.kernels.packed_weight import PackedWeight  # noqa: E402
from cobatch.kernels.quant_gemm_cuda import CudaGemmConfig  # noqa: E402
import provenance  # noqa: E402
from gemm import time_config  # noqa: E402
from kernels import SHAPES, random_weight, rotating  # noqa: E402
from timing import COPY_DETAIL, copy_bandwidth, graph_time  # noqa: E402

TOKS = [16, 32, 64, 128]
SMS = 132
PLANES = {f: quant_pack.fragment_layout(quant_pack.PACKED_FORMATS[f]) for f in ("q8_0", "q4_k", "q4_1")}


def chunks(fmt: str, shape: str) -> int:
    """The weight's chunks (32 columns in q8_0, 64 in the 4-bit formats)."""
    return SHAPES[shape][1] // (32 if fmt == "q8_0" else 64)


def candidates(rows: int, n_chunks: int, variants=("ring", "wreg"), producers=(1,)) -> list[CudaGemmConfig]:
    """The ring variant: every shape of CTA (1-2 warpgroups of 1-2 row blocks, 1-2 CTAs an SM) with stages of 4
    chunks, LAG or not (one row block: two need too many registers for it). The weights-in-registers variant
    (WREG, 1 or 2 stages ahead): one row block a warpgroup, one warpgroup and two CTAs an SM or two and one, stages
    of 4 or 8 chunks. The occupancy variant (occ): one warpgroup of one row block, 3 or 4 CTAs an SM, stages of 2
    or 4 chunks, LAG or not. Each with every count of producer warps in `producers`.
    K split until the CTAs fill the GPU one to two times over."""
    shapes = []
    if "ring" in variants:
        shapes += [dict(WG=wg, RB=rb, MINB=minb, LAG=lag, CH=4) for wg in (1, 2) for rb in (1, 2) for minb in (1, 2)
                   for lag in ((False, True) if rb == 1 else (False,))]
    if "occ" in variants:    # one warpgroup of one row block, 3-4 CTAs an SM: more independent chains a scheduler
        shapes += [dict(WG=1, RB=1, MINB=minb, LAG=lag, CH=ch) for minb in (3, 4) for ch in (2, 4)
                   for lag in (False, True)]
    if "wreg" in variants:
        shapes += [dict(WG=wg, RB=1, MINB=3 - wg, CH=ch, WREG=ahead, L2PF=l2) for wg in (1, 2) for ch in (4, 8)
                   for ahead in (1, 2) for l2 in (0, 2) if ch * (ahead + 1) <= 12]      # more chunks' registers spill
    out = []
    for shape in shapes:
        blocks = rows // (64 * shape["WG"] * shape.get("RB", 1))
        for split in (1, 2, 4, 8):
            if n_chunks % (split * shape["CH"]) or blocks * split > 2 * SMS * shape["MINB"]:
                continue
            if split > 1 and blocks * split // 2 >= SMS * shape["MINB"]:
                continue      # the GPU was full with half the splits
            out += [CudaGemmConfig(S=8, split_k=split, PRODUCERS=p, **shape) for p in producers]
    return out


def unfit(cfg: CudaGemmConfig, toks: list[int], fmt_id: int) -> bool:
    """Does ptxas spill registers, or serialize the wgmmas (its C7511 warning), in this config at any of the token
    tiles it would run? (not timed then)"""
    device = torch.device("cuda", torch.cuda.current_device())
    runs = [tile(n) for n in toks if cfg.runs_at(tile(n), fmt_id)]
    return any(quant_gemm_cuda.kernel(cfg, bn, 0, 2, quant_gemm_cuda.PDL, device, fmt_id).spill_bytes
               or "C7511" in quant_gemm_cuda.cubin(cfg, bn, 0, 2, quant_gemm_cuda.PDL, fmt_id)[1] for bn in runs)


def tile(n: int) -> int:
    return quant_gemm_cuda.token_tile(n)


def check(pw: PackedWeight, w, cfg, n: int) -> float:
    """The relative error of cfg's product at n tokens against float64, on the first 512 rows."""
    ref_w = w.row_slice(0, 512).dequantize().double()
    x = torch.randn(n, w.cols, device="cuda").to(torch.bfloat16)
    y = pw.matmul(x, config=cfg)[:, :512].double()
    ref = x.double() @ ref_w.T
    return ((y - ref).norm() / ref.norm()).item()


def time_staged(copies: list[PackedWeight], n: int, cfg) -> float:
    """The kernel alone: x staged once before, every launch reading the same image."""
    x = torch.randn(n, copies[0].cols, device="cuda").to(torch.bfloat16)
    out = torch.empty(n, copies[0].rows, device="cuda", dtype=torch.bfloat16)
    bn = quant_gemm_cuda.token_tile(n)
    img = torch.empty(-(-n // bn), copies[0].cols // 32, bn * 32, device="cuda", dtype=torch.float16)
    quant_gemm_cuda.x_image(x, bn, img, pdl=False)
    partial, count = scratch.SplitScratch.get(x.device)
    return graph_time([lambda w=w: quant_gemm_cuda.launch_staged(w.planes, img, n, out, cfg, partial, count)
                       for w in copies])


def key(cfg) -> str:
    if isinstance(cfg, CudaGemmConfig):
        return f"cuda WG{cfg.WG} RB{cfg.RB} CH{cfg.CH} S{cfg.S} split{cfg.split_k} minb{cfg.MINB}" + \
            (" lag" if cfg.LAG else "") + (f" wreg{cfg.WREG}" if cfg.WREG else "") + \
            (f" l2pf{cfg.L2PF}" if cfg.L2PF else "") + (f" prod{cfg.PRODUCERS}" if cfg.PRODUCERS > 1 else "")
    return f"plan {cfg}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q8_0", help="q8_0, q4_k, q4_1 (the latter two: q4_1's planes)")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--toks", default=",".join(map(str, TOKS)))
    ap.add_argument("--probe", action="store_true", help="also time the best config, kernel alone, without its MMAs "
                    "(PROBE 1), without its dequantization (2) and without both (3): where its time goes")
    ap.add_argument("--variants", default="ring,wreg", help="the CUDA kernel's variants to time: ring (weights "
                    "through the shared-memory ring), wreg (weights straight into registers), occ (one warpgroup, "
                    "3-4 CTAs an SM)")
    ap.add_argument("--producers", default="1", help="producer warps of the candidates (1, 2, 4; each count a "
                    "candidate of its own); with --probe, the ring alone of the best config with 1, 2 and 4 too")
    ap.add_argument("--markdown-from", type=Path, help="a gemm_cuda.json: write its markdown again, no GPU")
    args = ap.parse_args()
    if args.markdown_from:
        return write(json.loads(args.markdown_from.read_text()))
    toks = [int(t) for t in args.toks.split(",")]
    shapes = args.shapes.split(",")
    torch.manual_seed(0)
    # compile every candidate at every token tile first, in threads (NVRTC runs outside the GIL)
    variants = args.variants.split(",")
    producers = tuple(int(p) for p in args.producers.split(","))
    cases = [(f, s) for f in args.formats.split(",") for s in shapes]
    jobs = {(c, tile(n), PLANES[f]) for f, s in cases
            for c in candidates(SHAPES[s][0], chunks(f, s), variants, producers)
            for n in toks if c.runs_at(tile(n), PLANES[f])}
    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: quant_gemm_cuda.cubin(j[0], j[1], 0, 2, quant_gemm_cuda.PDL, j[2]), jobs))
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s ({len(jobs)} kernels compiled)", flush=True)
    rows_out = []
    for fmt, name in cases:
        rows, cols = SHAPES[name]
        w = random_weight(fmt, rows, cols)
        pw = PackedWeight.from_quant(w, "cuda")
        copies = rotating(pw)
        cands = [c for c in candidates(rows, chunks(fmt, name), variants, producers)
                 if not unfit(c, toks, PLANES[fmt])
                 and any(c.runs_at(tile(n), PLANES[fmt]) for n in toks)]
        # each at its widest measured tile, three tokens short of it (a partial tile)
        errors = {key(c): check(pw, w, c, max(n for n in toks if c.runs_at(tile(n), PLANES[fmt])) - 3)
                  for c in cands}
        bad = {k: e for k, e in errors.items() if not e < 5e-3}
        assert not bad, f"{name}: wrong results {bad}"
        for n in toks:
            bn = tile(n)
            plan_cfg = pw.plan.config_for(n)
            times = {key(plan_cfg): time_config(copies, n, plan_cfg) * 1e6}
            for c in cands:
                if c.runs_at(bn, PLANES[fmt]):
                    times[key(c)] = time_config(copies, n, c) * 1e6
            best = min((k for k in times if k.startswith("cuda")), key=times.get)
            best_cfg = next(c for c in cands if key(c) == best)
            quant_gemm_cuda.PDL = False
            no_pdl = time_config(copies, n, best_cfg) * 1e6
            quant_gemm_cuda.PDL = True
            # the best candidate with each count of producer warps
            by_producers = {p: min((times[key(c)] for c in cands if c.PRODUCERS == p and key(c) in times), default=None)
                            for p in producers}
            row = dict(fmt=fmt, shape=name, rows=rows, cols=cols, n_tok=n, weight_bytes=pw.nbytes,
                       best_us_by_producers=by_producers,
                       plan=key(plan_cfg), plan_us=times[key(plan_cfg)], best=best, best_us=times[best],
                       best_kernel_alone_us=time_staged(copies, n, best_cfg) * 1e6, best_without_pdl_us=no_pdl,
                       all_us=times, max_rel_err=max(errors.values()))
            if args.probe:
                row["probe_us"] = {p: time_staged(copies, n, dataclasses.replace(best_cfg, PROBE=p)) * 1e6
                                   for p in (1, 2, 3)}
                # the ring alone (its copies, shared loads and barriers) at each count of producer warps
                rings = {k: dataclasses.replace(best_cfg, PROBE=3, PRODUCERS=k)
                         for k in sorted(set(producers) | {1, 2, 4})}
                row["ring_alone_us"] = {k: time_staged(copies, n, c) * 1e6 if c.runs_at(bn, PLANES[fmt]) else None
                                        for k, c in rings.items()}
            for side in ("plan", "best"):
                row[f"{side}_gbps"] = pw.nbytes / row[f"{side}_us"] / 1e3
                row[f"{side}_copy"] = row[f"{side}_gbps"] / copy_gbps
            rows_out.append(row)
            print(f"{fmt} {name} n={n}: plan {row['plan_us']:.1f} us ({row['plan_copy']:.0%} of copy), "
                  f"cuda {row['best_us']:.1f} us ({row['best_copy']:.0%}) {best}", flush=True)
        del copies, pw
        torch.cuda.empty_cache()
    commit = provenance.tree()
    result = dict(benchmark="gemm_cuda", date=datetime.date.today().isoformat(), tree=commit or None,
                  device=torch.cuda.get_device_name(), command="PYTHONPATH=src python bench/gemm_cuda.py "
                  + " ".join(sys.argv[1:]), copy_gbps=copy_gbps, copy_detail=COPY_DETAIL, rows=rows_out)
    write(result)
    if os.environ.get("OUT"):
        table = plan_table(rows_out, json.loads(matmul_plans.CONFIG_PATH.read_text()))
        (Path(os.environ["OUT"]) / "quant_configs-cuda.json").write_text(json.dumps(table, indent=1))


def plan_table(rows_out: list[dict], table: dict, min_gain: float = 0.02) -> dict:
    """The package's plan table with each measured weight's fewest-token GEMM calls handed to the CUDA kernel where it
    wins: the CUDA config and the run of measured token counts from the GEMM's first (the GEMV's stay) with the most
    time saved over the plan, summed, become the entry's "quant_gemm_first" and "quant_gemm_first_upto", where they
    save at least min_gain of that run's time. For bench/device.sh plan-ab: whole decode steps."""
    out = json.loads(json.dumps(table))
    by_weight: dict[tuple, list[dict]] = {}
    for r in rows_out:
        if not r["plan"].startswith("plan GemvPlan"):
            by_weight.setdefault((r.get("fmt", "q8_0"), r["rows"], r["cols"]), []).append(r)
    for (fmt, rows, cols), rs in by_weight.items():
        rs = sorted(rs, key=lambda r: r["n_tok"])
        best = None      # (time saved, config key, last token count)
        for last in range(len(rs)):
            run = rs[:last + 1]
            plan_us = sum(r["plan_us"] for r in run)
            common = set.intersection(*(set(r["all_us"]) for r in run))
            for k in (k for k in common if k.startswith("cuda")):
                saved = plan_us - sum(r["all_us"][k] for r in run)
                if saved >= min_gain * plan_us and (best is None or saved > best[0]):
                    best = (saved, k, run[-1]["n_tok"])
        if best is None:
            continue
        entry = out.setdefault("formats", {}).setdefault(fmt, {}).setdefault("shapes", {}).setdefault(
            f"{rows}x{cols}", {})
        entry["quant_gemm_first"] = quant_gemm_cuda.plan_entry(config_of_key(best[1]))
        entry["quant_gemm_first_upto"] = best[2]
    return out


def config_of_key(k: str) -> CudaGemmConfig:
    """key()'s inverse for a CUDA config."""
    fields = k.split()[1:]
    values = {f.rstrip("0123456789"): f[len(f.rstrip("0123456789")):] for f in fields}
    return CudaGemmConfig(WG=int(values["WG"]), RB=int(values["RB"]), CH=int(values["CH"]), S=int(values["S"]),
                          split_k=int(values["split"]), MINB=int(values["minb"]), LAG="lag" in values,
                          WREG=int(values.get("wreg") or 0), L2PF=int(values.get("l2pf") or 0),
                          PRODUCERS=int(values.get("prod") or 1))


def markdown(result: dict) -> str:
    lines = [f"# The CUDA C++ quantized GEMM against the Gluon plans ({result['device']}, {result['date']}, "
             f"tree {result['tree']})", "",
             f"`{result['command']}`; Llama-3-8B shapes; copy bandwidth {result['copy_gbps']:.0f} GB/s "
             "(read + write). `plan`: the committed plan's config (the Gluon GEMM with its x_operands launch, or the "
             "GEMV), `CUDA`: the best CUDA config with its x_image launch, both as CUDA-graph replays over copies "
             "rotating past L2; `kernel alone`: that config with x staged once before; `without PDL`: launched "
             "plainly." + (f" Tree: {result['tree_note']}." if result.get("tree_note") else ""), "",
             "| format | shape | n | plan us | % copy | CUDA us | % copy | speed-up | kernel alone us | "
             "without PDL us | "
             "CUDA config |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r.get('fmt', 'q8_0')} | {r['shape']} | {r['n_tok']} | {r['plan_us']:.1f} | "
                     f"{r['plan_copy']:.0%} | {r['best_us']:.1f} | {r['best_copy']:.0%} | "
                     f"{r['plan_us'] / r['best_us']:.2f}x | {r['best_kernel_alone_us']:.1f} | "
                     f"{r['best_without_pdl_us']:.1f} | {r['best'][5:]} |")
    if all("probe_us" in r for r in result["rows"]):
        lines += ["", "Where the kernel's time goes: the best config alone, and the same kernel without its MMAs, "
                  "without its dequantization, and without both (the ring's copies, shared loads and barriers "
                  "only; wrong sums).", "",
                  "| format | shape | n | kernel alone us | without MMAs | without dequantization | without both | "
                  "% copy without both |", "|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            pr = {int(k): v for k, v in r["probe_us"].items()}
            floor = r["weight_bytes"] / pr[3] / 1e3 / result["copy_gbps"]
            lines.append(f"| {r.get('fmt', 'q8_0')} | {r['shape']} | {r['n_tok']} | {r['best_kernel_alone_us']:.1f} | "
                         f"{pr[1]:.1f} | {pr[2]:.1f} | {pr[3]:.1f} | {floor:.0%} |")
    if all("ring_alone_us" in r for r in result["rows"]) and result["rows"]:
        counts = list(result["rows"][0]["ring_alone_us"])
        lines += ["", "The ring alone (the best config without MMAs and dequantization) with 1, 2 or 4 producer warps "
                  "filling alternate stages: us (% of copy).", "",
                  "| format | shape | n | " + " | ".join(f"{k} producers" for k in counts) + " |",
                  "|---|---|---|" + "---|" * len(counts)]
        for r in result["rows"]:
            cells = [f"{v:.1f} ({r['weight_bytes'] / v / 1e3 / result['copy_gbps']:.0%})" if v else "-"
                     for v in r["ring_alone_us"].values()]
            lines.append(f"| {r.get('fmt', 'q8_0')} | {r['shape']} | {r['n_tok']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(result: dict) -> None:
    for d in [ROOT / "bench" / "results"] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        (d / "gemm_cuda.json").write_text(json.dumps(result, indent=1))
        (d / "gemm_cuda.md").write_text(markdown(result))
    print("\n" + markdown(result))

if __name__ == "__main__":
    main()
