"""Run one weight's committed plan at one batch a few times: a target for Nsight Compute (bench/device.sh profile
with a case "gemm FMT SHAPE N"), so its counters come from the kernel a decode step runs.

    python bench/gemm_once.py FMT SHAPE N_TOK [CALLS]

FMT q8_0, q4_k, q4_1, q6_k; SHAPE a Llama-3-8B weight (bench/kernels.py SHAPES, and kv). Prints the plan's config,
the time of one call (CUDA events around CALLS launches after a warm-up) and its GB/s of weight bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import SHAPES, random_weight  # noqa: E402
from cobatch.kernels.packed_weight import PackedWeight  # noqa: E402

SHAPES = {**SHAPES, "kv": (1024, 4096)}


def main() -> None:
    if len(sys.argv) not in (4, 5) or sys.argv[2] not in SHAPES:
        print("usage: python bench/gemm_once.py FMT SHAPE N_TOK [CALLS]", file=sys.stderr)
        sys.exit(2)
    fmt, shape, n_tok = sys.argv[1], sys.argv[2], int(sys.argv[3])
    calls = int(sys.argv[4]) if len(sys.argv) == 5 else 5
    rows, cols = SHAPES[shape]
    pw = PackedWeight.from_quant(random_weight(fmt, rows, cols), "cuda")
    x = torch.randn(n_tok, cols, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(torch.bfloat16)
    out = torch.empty(n_tok, rows, device="cuda", dtype=torch.bfloat16)
    pw.matmul(x, out=out)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        pw.matmul(x, out=out)
    end.record()
    torch.cuda.synchronize()
    s = start.elapsed_time(end) / 1e3 / calls
    print(f"{fmt} {shape} n_tok={n_tok}: config {pw.plan.config_for(n_tok)}, {s * 1e6:.1f} us a call "
          f"(eager, L2 warm), {pw.nbytes / s / 1e9:.0f} GB/s of weight bytes")


if __name__ == "__main__":
    main()
