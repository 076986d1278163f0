"""What an L2 prefetch of a weight costs and buys (GPU only; kernels/l2_prefetch.py).

    python bench/l2_prefetch.py [--out l2_prefetch.json]

On Llama-3-8B's o projection (4096 x 4096; q8_0 and q4_K) at n_tok 1 and 8, each time a CUDA graph of calls over
copies rotating past L2 (bench/timing.py):
- the GEMV read from HBM (`cold`) and from L2 (`warm`: the same copy every call);
- the prefetch kernel alone, at several grid shapes (GRIDS: chunks a program, bytes a chunk);
- a latency-bound window (a GPU spin of WINDOW_US) then the GEMV, without and with the prefetch issued before
  the window: what a decode step at few rows would see between its qkv and o matmuls.
GB/s and % of copy count the weight's bytes once per call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import random_weight, rotating  # noqa: E402
from timing import copy_bandwidth, graph_time  # noqa: E402

from cobatch.kernels import l2_prefetch  # noqa: E402
from cobatch.kernels.l2_prefetch import chunk_table  # noqa: E402
from cobatch.kernels.quant_matmul import PackedWeight  # noqa: E402

WINDOW_US = 10.0
GRIDS = ((128, 16384), (32, 16384), (32, 4096), (32, 1024))    # (chunks a program, bytes a chunk)


def spin_cycles(us: float) -> int:
    return int(us * 1e-6 * torch.cuda.get_device_properties(0).clock_rate * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy_gbps = copy_bandwidth()
    cycles = spin_cycles(WINDOW_US)
    rows = []
    for fmt_name in ("q8_0", "q4_k"):
        pw = PackedWeight.from_quant(random_weight(fmt_name, 4096, 4096), "cuda")
        copies = rotating(pw)
        for n_tok in (1, 8):
            x = torch.randn(n_tok, 4096, device="cuda").to(torch.float16)
            out = torch.empty(n_tok, 4096, device="cuda", dtype=torch.bfloat16)

            def timed(name: str, launches) -> None:
                s = graph_time(launches)
                gbps = pw.nbytes / s / 1e9
                rows.append(dict(format=fmt_name, n_tok=n_tok, variant=name, us=s * 1e6, gbps=gbps,
                                 pct_copy=100 * gbps / copy_gbps))
                print(f"{fmt_name} n={n_tok} {name:36s} {s * 1e6:7.2f} us  {gbps:6.0f} GB/s  "
                      f"{100 * gbps / copy_gbps:4.0f} % copy", flush=True)

            timed("cold", [lambda w=w: w.matmul(x, out=out) for w in copies])
            timed("warm", [lambda: pw.matmul(x, out=out) for _ in copies])
            timed(f"spin {WINDOW_US:.0f} us + cold",
                  [f for w in copies for f in (lambda: torch.cuda._sleep(cycles), lambda w=w: w.matmul(x, out=out))])
            before = l2_prefetch.BLOCK
            for block, chunk in GRIDS:
                l2_prefetch.BLOCK = block
                tables = [chunk_table(w.planes.tensors(), chunk).cuda() for w in copies]
                name = f"{block} x {chunk // 1024} KB"
                timed(f"prefetch alone {name}", [lambda t=t: l2_prefetch.prefetch(t) for t in tables])
                timed(f"prefetch {name} + spin + GEMV",
                      [f for w, t in zip(copies, tables) for f in (lambda t=t: l2_prefetch.prefetch(t),
                                                                   lambda: torch.cuda._sleep(cycles),
                                                                   lambda w=w: w.matmul(x, out=out))])
            l2_prefetch.BLOCK = before
    result = dict(command="bench/l2_prefetch.py", device=torch.cuda.get_device_name(), torch=torch.__version__,
                  copy_gbps=copy_gbps, window_us=WINDOW_US, chunk_bytes=l2_prefetch.CHUNK_BYTES, rows=rows)
    out = args.out or (os.path.join(os.environ["OUT"], "l2_prefetch.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
