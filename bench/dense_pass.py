"""Prefill matmuls through the dense pass (dequantize into a bf16 matrix, then cuBLAS), the pass whole before the
matmul against the pass in row chunks on a side stream under the matmuls (quant_matmul.dense_matmul), on
Llama-3-8B's shapes at 512 and 2048 tokens (GPU only).

    python bench/dense_pass.py [--formats q8_0,q4_k] [--chunks 1,2,4,8] [--out dense_pass.json]

TFLOP/s of each call (a CUDA graph of 3 calls, bench/timing.py) and its ratio to torch bf16 F.linear on a bf16 copy of
the weight at the same shape (the prefill goal: at least 0.85); the plan's own choice at that token count beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import SHAPES, random_weight, time_torch_linear  # noqa: E402
from timing import copy_bandwidth, graph_time  # noqa: E402

from cobatch.kernels import quant_matmul as qm  # noqa: E402
from cobatch.kernels.quant_matmul import PackedWeight  # noqa: E402

TOKS = (512, 2048)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q8_0,q4_k")
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    copy_gbps = copy_bandwidth()
    torch_cache: dict = {}
    rows_out = []
    before = qm.DENSE_CHUNKS
    for fmt_name in args.formats.split(","):
        for name, (rows, cols) in SHAPES.items():
            w = random_weight(fmt_name, rows, cols)
            pw = PackedWeight.from_quant(w, "cuda")
            ref = None
            for n in TOKS:
                x = torch.randn(n, cols, device="cuda").to(torch.bfloat16)
                flops = 2 * n * rows * cols
                t_torch = time_torch_linear(rows, cols, n, torch_cache)
                row = dict(format=fmt_name, shape=name, n_tok=n, torch_bf16_tflops=flops / t_torch / 1e12,
                           plan=str(pw.plan.config_for(n)))
                t_plan = graph_time([lambda: pw.matmul(x)] * 3)
                row["plan_tflops"], row["plan_ratio"] = flops / t_plan / 1e12, t_torch / t_plan
                for c in chunk_counts:
                    qm.DENSE_CHUNKS = max(c, 1)
                    y = pw.matmul(x[:64], config=qm.DEQUANT_CUBLAS)
                    if ref is None:
                        ref = x[:64].double() @ w.dequantize(torch.float32).double().T
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    t = graph_time([lambda: pw.matmul(x, config=qm.DEQUANT_CUBLAS)] * 3)
                    row[f"chunks{c}"] = dict(us=t * 1e6, tflops=flops / t / 1e12, ratio=t_torch / t, rel_err=err,
                                             chunks=len(qm.dense_chunks(pw.planes)))
                qm.DENSE_CHUNKS = before
                rows_out.append(row)
                print(f"{fmt_name} {name:8s} n={n:5d} torch {row['torch_bf16_tflops']:4.0f} TFLOP/s | "
                      + " | ".join(f"{c} chunks {row[f'chunks{c}']['tflops']:4.0f} ({row[f'chunks{c}']['ratio']:.2f})"
                                   for c in chunk_counts)
                      + f" | plan {row['plan_tflops']:4.0f} ({row['plan_ratio']:.2f}) {row['plan'][:40]}", flush=True)
            del pw, w
            torch.cuda.empty_cache()
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(date=datetime.date.today().isoformat(), tree=tree, command="bench/dense_pass.py " + " ".join(
        sys.argv[1:]), device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=copy_gbps,
        chunk_rows=qm.DENSE_CHUNK_ROWS, rows=rows_out)
    out = args.out or (os.path.join(os.environ["OUT"], "dense_pass.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
