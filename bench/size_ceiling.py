"""How fast can one kernel that moves N bytes go, as a function of N? (GPU)

    PYTHONPATH=src python bench/size_ceiling.py [--date D]

The narrow-GEMV goal is a ratio to the copy bandwidth of a 2 GiB copy. A decode GEMV moves 9-560 MB, and a
kernel pays a ramp-up and a tail whatever it does. This measures, in the harness bench/kernels.py uses (a
CUDA graph over rotating buffers that together overflow L2, median replay), for the byte sizes of the
Llama-3-8B projections in q8_0 / q4_K:
  - a device-to-device copy of N/2 bytes read + N/2 written (torch copy_, an SM kernel), and
  - a pure streaming read of N bytes (a Triton kernel: 16-byte loads, a sum per program, best of a few tilings),
each as GB/s and as a fraction of the 2 GiB copy. No kernel reading N bytes can beat the read ceiling by much.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb  # noqa: E402  (timing harness and the 2 GiB copy)

SIZES_MB = {"q4_k o": 9.4, "q4_k qkv": 14.2, "q8_0 o": 17.8, "q8_0 qkv": 26.7, "q4_k down": 33.0,
            "q8_0 down": 62.4, "q4_k gate_up": 66.1, "q8_0 gate_up": 124.8, "q4_k lm_head": 295.5,
            "q8_0 lm_head": 558.2}


@triton.jit
def _read_kernel(src_ptr, out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums int32 words [p * ITERS * BLOCK, (p + 1) * ITERS * BLOCK): all loads issued, then summed."""
    base = tl.program_id(0).to(tl.int64) * ITERS * BLOCK
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(ITERS):
        acc += tl.load(src_ptr + base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def time_read(nbytes: int, iters: int, block: int, warps: int) -> float:
    words = math.ceil(nbytes / 4 / (iters * block)) * iters * block
    n = max(2, math.ceil(kb.ROTATE_BYTES / (words * 4)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    bufs = [torch.randint(-1000, 1000, (words,), device="cuda", dtype=torch.int32, generator=gen) for _ in range(n)]
    out = torch.empty(words // (iters * block), device="cuda", dtype=torch.int32)
    grid = (words // (iters * block),)
    t = kb.graph_time([lambda b=b: _read_kernel[grid](b, out, ITERS=iters, BLOCK=block, num_warps=warps)
                       for b in bufs])
    assert torch.equal(out, bufs[-1].view(-1, iters * block).sum(1).to(torch.int32)), "the read kernel is wrong"
    return words * 4 / t


def time_copy(nbytes: int) -> float:
    half = nbytes // 2 // 4
    n = max(2, math.ceil(kb.ROTATE_BYTES / (nbytes)))
    srcs = [torch.randn(half, device="cuda") for _ in range(n)]
    dsts = [torch.empty_like(s) for s in srcs]
    t = kb.graph_time([lambda s=s, d=d: torch.mul(s, 1.0, out=d) for s, d in zip(srcs, dsts)])
    return half * 4 * 2 / t


TILINGS = [(4, 1024, 4), (8, 1024, 4), (16, 512, 4), (8, 2048, 8)]   # ITERS, BLOCK (int32 words), warps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    copy = kb.copy_bandwidth()
    print(f"2 GiB copy: {copy:.0f} GB/s {kb.COPY_DETAIL}", flush=True)
    rows = []
    for name, mb in SIZES_MB.items():
        nbytes = int(mb * 1e6)
        reads = {f"{i}x{b}/{w}w": time_read(nbytes, i, b, w) / 1e9 for i, b, w in TILINGS}
        best = max(reads, key=reads.get)
        c = time_copy(nbytes) / 1e9
        rows.append({"name": name, "mb": mb, "copy_gbps": c, "read_gbps": reads[best], "read_tiling": best,
                     "reads": reads, "copy_pct": 100 * c / copy, "read_pct": 100 * reads[best] / copy})
        print(f"{name:14s} {mb:6.1f} MB: copy {c:5.0f} GB/s ({100 * c / copy:3.0f}%), read {reads[best]:5.0f} GB/s "
              f"({100 * reads[best] / copy:3.0f}%, {best})", flush=True)
    result = {"date": args.date, "command": "PYTHONPATH=src python3 bench/size_ceiling.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy,
              "copy_detail": kb.COPY_DETAIL, "rows": rows}
    for d in (Path(os.environ.get("OUT", "/tmp/out")), kb.ROOT / "bench" / "results"):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"size-ceiling-{args.date}.json").write_text(json.dumps(result, indent=1))
    print(f"\n| bytes moved | copy of that size | pure read of that size |   (% of the 2 GiB copy, {copy:.0f} GB/s)")
    for r in rows:
        print(f"| {r['name']} ({r['mb']:.0f} MB) | {r['copy_pct']:.0f} % | {r['read_pct']:.0f} % |")


if __name__ == "__main__":
    main()
