"""The sampler's greedy tokens on the GPU: kernels/greedy.py against torch's nan_to_num + argmax (what the sampler
ran before), on float32 logits of Llama-3's vocabulary (128256 columns) at B rows.

    PYTHONPATH=src python bench/greedy.py [--batches 1,8,64,256] [--vocab 128256]

Each way is checked against the other first, then timed as CUDA-graph replays over logits rotating past L2
(bench/timing.py). GB/s counts the logits read once; the ratio is to a device-to-device copy measured in the same
run. Prints a short table last; JSON to $OUT or bench/results/greedy.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copy_bandwidth, graph_time  # noqa: E402

from cobatch.kernels.greedy import greedy_tokens_ref, greedy_tokens_triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROTATE_BYTES = 256 << 20      # past the H200's 60 MB of L2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        nbytes = batch * args.vocab * 4
        count = max(2, min(256, ROTATE_BYTES // nbytes))
        inputs = [torch.randn(batch, args.vocab, device="cuda", generator=gen) for _ in range(count)]
        for x in inputs[:4]:
            assert torch.equal(greedy_tokens_triton(x), greedy_tokens_ref(x))
        row = dict(batch=batch, vocab=args.vocab, logits_bytes=nbytes)
        for name, way in (("torch", greedy_tokens_ref), ("kernel", greedy_tokens_triton)):
            seconds = graph_time([lambda x=x: way(x) for x in inputs])
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_gbps"] = nbytes / seconds / 1e9
            row[f"{name}_of_copy"] = row[f"{name}_gbps"] / copy_gbps
        rows.append(row)
        del inputs
    result = dict(measures="the sampler's greedy tokens: kernels/greedy.py against torch's nan_to_num + argmax",
                  date=str(datetime.date.today()), command=" ".join(["bench/greedy.py", *sys.argv[1:]]),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=copy_gbps, rows=rows)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "greedy.json").write_text(json.dumps(result, indent=1))
    print(f"{'B':>4} {'torch us':>9} {'GB/s':>7} {'of copy':>8} {'kernel us':>10} {'GB/s':>7} {'of copy':>8} "
          f"{'speed-up':>9}")
    for r in rows:
        print(f"{r['batch']:4d} {r['torch_us']:9.1f} {r['torch_gbps']:7.0f} {r['torch_of_copy']:8.1%} "
              f"{r['kernel_us']:10.1f} {r['kernel_gbps']:7.0f} {r['kernel_of_copy']:8.1%} "
              f"{r['torch_us'] / r['kernel_us']:8.2f}x")


if __name__ == "__main__":
    main()
