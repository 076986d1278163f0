"""What programmatic dependent launch (PDL) buys the decode GEMV, on the GPU.

    PYTHONPATH=src python bench/pdl_study.py [--formats q8_0,q4_k,q4_1] [--date D]

For each format and Llama-3-8B shape, with the committed GEMV config, times n_tok 1 and 8 (CUDA graph over
rotating weight copies, as bench/kernels.py does) in these variants:
  - no PDL (COBATCH_PDL=0): each launch waits for the previous kernel to finish;
  - PDL with P = 0, 2, 8 K steps of weights prefetched into L2 before the wait.
A chain of GEMVs is what a decode step is made of (with small kernels between them, which also launch as
programmatic dependents), so the chained time is the per-projection cost inside a step.
Prints a table (GB/s of weight bytes, % of copy) and writes JSON to $OUT and bench/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  (bench/kernels.py: timing helpers, shapes, random weights)

P_VALUES = [0, 2, 8]


def variants(cfg: kb.GemvConfig, steps: int) -> list[tuple[str, kb.GemvConfig, bool]]:
    out = [("no PDL", cfg, False)]
    out += [(f"P={p}", dataclasses.replace(cfg, P=p), True) for p in P_VALUES if p <= steps]
    return out


def time_variant(copies, n_tok: int, cfg, pdl: bool) -> float:
    old = os.environ.get("COBATCH_PDL")
    os.environ["COBATCH_PDL"] = "1" if pdl else "0"
    try:
        return kb.time_packed(copies, n_tok, cfg)
    finally:
        if old is None:
            os.environ.pop("COBATCH_PDL")
        else:
            os.environ["COBATCH_PDL"] = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q8_0,q4_k,q4_1")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    copy = kb.copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s {kb.COPY_DETAIL}", flush=True)
    tasks, plans = [], {}
    for fmt_name in args.formats.split(","):
        for name, (rows, cols) in kb.SHAPES.items():
            pw = kb.PackedWeight.from_quant(kb.random_weight(fmt_name, rows, cols), "cuda")
            cfg = pw.plan.narrow
            assert isinstance(cfg, kb.GemvConfig), (fmt_name, name, cfg)
            steps = kb.qm.gemv_chunks(fmt_name, pw.planes.cols_pad) // (cfg.W * cfg.split_k)
            plans[(fmt_name, name)] = (cfg, steps)
            tasks += [(fmt_name, c) for _, c, _ in variants(cfg, steps)]
            del pw
    kb.precompile(tasks, workers=min(14, os.cpu_count() or 4))
    rows_out = []
    for fmt_name in args.formats.split(","):
        for name, (rows, cols) in kb.SHAPES.items():
            cfg, steps = plans[(fmt_name, name)]
            pw = kb.PackedWeight.from_quant(kb.random_weight(fmt_name, rows, cols), "cuda")
            copies = kb.rotating(pw)
            for label, c, pdl in variants(cfg, steps):
                for n_tok in (1, 8):
                    t = time_variant(copies, n_tok, c, pdl)
                    gbps = pw.nbytes / t / 1e9
                    rows_out.append({"fmt": fmt_name, "shape": name, "variant": label, "config": dataclasses.asdict(c),
                                     "pdl": pdl, "n_tok": n_tok, "us": t * 1e6, "gbps": gbps,
                                     "pct_copy": 100 * gbps / copy, "steps_per_warp": steps})
                    print(f"{fmt_name} {name} {label} n={n_tok}: {t * 1e6:.1f} us {gbps:.0f} GB/s "
                          f"({100 * gbps / copy:.0f}%)", flush=True)
            del copies, pw
            torch.cuda.empty_cache()
    result = {"date": args.date, "command": "PYTHONPATH=src python3 bench/pdl_study.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy,
              "copy_detail": kb.COPY_DETAIL, "rows": rows_out}
    for d in (Path(os.environ.get("OUT", "/tmp/out")), kb.ROOT / "bench" / "results"):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"pdl-{args.date}.json").write_text(json.dumps(result, indent=1))
    # the table: % of copy at n_tok 1 / 8 per variant
    labels = list(dict.fromkeys(r["variant"] for r in rows_out))
    print(f"\n% of copy ({copy:.0f} GB/s), n_tok 1 / 8")
    print("| format | shape | " + " | ".join(labels) + " |")
    for fmt_name in args.formats.split(","):
        for name in kb.SHAPES:
            cells = []
            for lab in labels:
                v = {r["n_tok"]: r["pct_copy"] for r in rows_out
                     if r["fmt"] == fmt_name and r["shape"] == name and r["variant"] == lab}
                cells.append(f"{v[1]:.0f} / {v[8]:.0f}" if v else "-")
            print(f"| {fmt_name} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
