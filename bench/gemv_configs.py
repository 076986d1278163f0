"""Time chosen GEMV configs against the committed plan, without a sweep: a quick device check of one idea.

    python bench/gemv_configs.py --formats q4_1,q8_0 --shapes gate_up,lm_head --toks 8,16 \
        --configs '4,8,1,1,0;2,8,1,1,0' [--out $OUT/gemv_configs.json]

A config is W,RT,split_k,U,D[,R] (quant_gemv.GemvConfig). Each row: microseconds, GB/s of weight bytes and % of
the copy bandwidth measured in the same run; "plan" is the committed plan (quant_configs.json). Every
config is checked against the plan's output first (rows are computed in the same K order only within a
plan, so the check is a tolerance, not bitwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `kernels` by name, for its precompile workers
import kernels  # noqa: E402
from cobatch.kernels.packed_weight import PackedWeight  # noqa: E402
from cobatch.kernels.quant_gemv import GemvConfig  # noqa: E402


def parse_configs(text: str) -> list[GemvConfig]:
    out = []
    for part in filter(None, text.split(";")):
        values = [int(v) for v in part.split(",")]
        if len(values) not in (5, 6):
            raise ValueError(f"a config is W,RT,split_k,U,D[,R]: {part!r}")
        out.append(GemvConfig(*values))
    return out


def check(pw: PackedWeight, cfg: GemvConfig, n_tok: int) -> float:
    """Max relative error of cfg's output against the plan's, on a random x."""
    x = torch.randn(n_tok, pw.cols, device="cuda", generator=torch.Generator("cuda").manual_seed(n_tok))
    want = pw.matmul(x.half()).float()
    got = pw.matmul(x.half(), config=cfg).float()
    return ((got - want).abs().max() / want.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_1,q8_0")
    ap.add_argument("--shapes", default="gate_up,lm_head")
    ap.add_argument("--model-shape", default=None,
                    help="the matrices of this `cobatch make-model --shape` instead of Llama-3-8B's (adds kv)")
    ap.add_argument("--toks", default="8,16")
    ap.add_argument("--configs", required=True, help="W,RT,split_k,U,D[,R];...")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels.use_model_shapes(kernels.SHAPES, args.model_shape, with_kv=True)
    formats, shapes = args.formats.split(","), args.shapes.split(",")
    toks, configs = [int(t) for t in args.toks.split(",")], parse_configs(args.configs)
    kernels.precompile([(f, c) for f in formats for c in configs], workers=min(14, os.cpu_count() or 4))
    copy_gbps = kernels.copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for fmt_name in formats:
        for shape in shapes:
            n_rows, n_cols = kernels.SHAPES[shape]
            pw = PackedWeight.from_quant(kernels.random_weight(fmt_name, n_rows, n_cols), "cuda")
            copies = kernels.rotating(pw)
            for label, cfg in [("plan", None)] + [(str(c), c) for c in configs]:
                rel_err = 0.0 if cfg is None else max(check(pw, cfg, n) for n in toks)
                if rel_err > 2e-2:
                    raise SystemExit(f"{fmt_name} {shape} {label}: rel_err {rel_err:.1e} against the plan")
                for n in toks:
                    t = kernels.time_packed(copies, n, cfg)
                    gbps = pw.nbytes / t / 1e9
                    rows.append({"fmt": fmt_name, "shape": shape, "config": label, "n_tok": n, "us": t * 1e6,
                                 "gbps": gbps, "of_copy": gbps / copy_gbps, "rel_err": rel_err})
                    print(f"  {fmt_name} {shape} {label} n={n}: {t * 1e6:.1f} us {gbps:.0f} GB/s "
                          f"({100 * gbps / copy_gbps:.0f} % of copy)", flush=True)
            del pw, copies
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_gbps": copy_gbps, "rows": rows}, indent=1))
    print(f"\ncopy {copy_gbps:.0f} GB/s; % of copy")
    print(f"{'fmt':6} {'shape':8} {'config':44}" + "".join(f"{'n=' + str(n):>7}" for n in toks))
    for key in dict.fromkeys((r["fmt"], r["shape"], r["config"]) for r in rows):
        vals = {r["n_tok"]: r["of_copy"] for r in rows if (r["fmt"], r["shape"], r["config"]) == key}
        print(f"{key[0]:6} {key[1]:8} {key[2]:44}" + "".join(f"{100 * vals[n]:6.0f}%" for n in toks))


if __name__ == "__main__":
    main()
