"""A/B of the quantized GEMV between source trees, in one device call: each tree's kernels time the
Llama-3-8B shapes with that tree's committed plans, in alternating rounds, each in a fresh process.

    python bench/gemv_ab.py --tree old=.ab_old/src --tree new=src [--formats q8_0,q4_k,q4_1]
                            [--toks 1,8] [--rounds 2] [--out $OUT/gemv_ab.json]

Why a separate process per tree and round: both trees are the package `cobatch`; a fresh process imports
the one under test. Each worker measures the copy bandwidth itself (the ceiling), checks its GEMV against
a float64 reference on a row slice, and prints one JSON line. The table at the end gives, per format,
shape and n_tok, the best round of each tree as % of its copy bandwidth, and new / old time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(formats: list[str], toks: list[int], shapes: list[str]) -> dict:
    import torch

    sys.path.insert(0, str(HERE))      # `kernels` by name, so the precompile workers can unpickle its tasks
    import kernels
    from cobatch.kernels import matmul_plans, packed_weight
    from cobatch.kernels import quant_matmul as qm
    from cobatch.kernels.quant_gemv import GemvPlan
    from cobatch.quant.weight import QuantWeight
    src = Path(os.environ["GEMV_AB_SRC"]).resolve()
    assert Path(qm.__file__).resolve().is_relative_to(src), (qm.__file__, src)   # the tree under test

    copy_gbps = kernels.copy_bandwidth()
    tasks = []
    for fmt_name in formats:
        for name in shapes:
            rows, cols = kernels.SHAPES[name]
            plan = matmul_plans.plan_for(fmt_name, rows, cols, -(-cols // 256) * 256, gemv=True)
            narrow = plan.narrow.configs() if isinstance(plan.narrow, GemvPlan) else [plan.narrow]
            tasks += [(fmt_name, c) for c in narrow]
    kernels.precompile(tasks, workers=min(14, os.cpu_count() or 4))
    rows_out = []
    for fmt_name in formats:
        for name in shapes:
            rows, cols = kernels.SHAPES[name]
            w = kernels.random_weight(fmt_name, rows, cols)
            pw = packed_weight.PackedWeight.from_quant(w, "cuda")
            x = torch.randn(8, cols, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).half()
            sub = slice(0, 512)
            ref = x.double() @ QuantWeight(w.fmt, 512, cols, w.raw[sub]).dequantize().double().T
            err = ((pw.matmul(x)[:, sub].double() - ref).norm() / ref.norm()).item()
            copies = kernels.rotating(pw)
            for n in toks:
                t = kernels.time_packed(copies, n, None)
                gbps = pw.nbytes / t / 1e9
                rows_out.append({"fmt": fmt_name, "shape": name, "n_tok": n, "us": t * 1e6, "gbps": gbps,
                                 "pct_copy": 100 * gbps / copy_gbps, "rel_err": err,
                                 "plan": str(pw.plan.narrow.for_tokens(n)
                                             if isinstance(pw.plan.narrow, GemvPlan) else pw.plan.narrow)})
            del copies, pw, w
            torch.cuda.empty_cache()
    return {"copy_gbps": copy_gbps, "rows": rows_out}


def table(results: dict[str, list[dict]]) -> str:
    """Best round per tree (lowest time); columns: % of copy per tree, then time ratio to the first tree."""
    labels = list(results)
    best: dict[tuple, dict[str, dict]] = {}
    for label, runs in results.items():
        for run in runs:
            for r in run["rows"]:
                key = (r["fmt"], r["shape"], r["n_tok"])
                cur = best.setdefault(key, {}).get(label)
                if cur is None or r["us"] < cur["us"]:
                    best[key][label] = r
    head = "| format | shape | n_tok | " + " | ".join(f"{lb} % copy" for lb in labels) + " | " + \
        " | ".join(f"{lb} / {labels[0]} time" for lb in labels[1:]) + " | max rel_err |"
    lines = [head, "|" + "---|" * (3 + 2 * len(labels))]
    for (fmt, shape, n), per in sorted(best.items()):
        if len(per) != len(labels):
            continue
        base = per[labels[0]]["us"]
        lines.append(f"| {fmt} | {shape} | {n} | " + " | ".join(f"{per[lb]['pct_copy']:.1f}" for lb in labels)
                     + " | " + " | ".join(f"{per[lb]['us'] / base:.3f}" for lb in labels[1:])
                     + f" | {max(per[lb]['rel_err'] for lb in labels):.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", default=[], help="label=path/to/src (first: the baseline)")
    ap.add_argument("--formats", default="q8_0,q4_k,q4_1")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--toks", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    formats, shapes = args.formats.split(","), args.shapes.split(",")
    toks = [int(t) for t in args.toks.split(",")]
    if args.worker:
        print("RESULT " + json.dumps(worker(formats, toks, shapes)), flush=True)
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    if len(trees) < 2:
        ap.error("give at least two --tree label=src")
    results: dict[str, list[dict]] = {label: [] for label in trees}
    for rnd in range(args.rounds):
        for label, src in trees.items():
            src = str(Path(src).resolve())   # first on the path: kernels.py only appends the repo's src
            env = dict(os.environ, GEMV_AB_SRC=src,
                       PYTHONPATH=os.pathsep.join([src] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
            proc = subprocess.run([sys.executable, __file__, "--worker", "--formats", args.formats,
                                   "--shapes", args.shapes, "--toks", args.toks],
                                  env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(f"round {rnd} {label}: worker failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
                continue
            run = json.loads(line[len("RESULT "):])
            results[label].append(run)
            print(f"round {rnd} {label}: copy {run['copy_gbps']:.0f} GB/s, " + ", ".join(
                f"{r['fmt']}/{r['shape']}/{r['n_tok']} {r['pct_copy']:.0f}%" for r in run["rows"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "trees": trees,
                                              "results": results}, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
