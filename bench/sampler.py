"""The sampler on the GPU, a whole call as a decode step makes it: [B, V] float32 logits of Llama-3's vocabulary
in, tokens out, for greedy rows and for sampled ones with and without top-k / top-p / min-p, with the token picks of
kernels/greedy.py (the default) and with torch's ops alone (COBATCH_TORCH_OPS's way: nan_to_num + argmax, the noise
hashed over int64 copies of the logits).

    PYTHONPATH=src python bench/sampler.py [--batches 1,8,64,256] [--vocab 128256] [--calls 40]

Each row records whether both ways drew the same tokens (the GPU test asserts it). A call is timed from CUDA
events around `calls` calls queued back to back (its host work included, as a step pays it where it is not
overlapped), over logits rotating past L2. GB/s counts the logits read once; the ratio is to a device-to-device
copy in the same run. Prints a short table last; JSON to $OUT or bench/results/sampler.json.
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
from timing import copy_bandwidth  # noqa: E402

from cobatch import ops  # noqa: E402
from cobatch.engine.sampler import Sampler, SampleRow, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROTATE_BYTES = 256 << 20      # past the H200's 60 MB of L2
PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T=0.8 top_k=40": SamplingParams(temperature=0.8, top_k=40),
    "T=1 min_p=0.05": SamplingParams(temperature=1.0, min_p=0.05),
}


def per_call_seconds(sampler: Sampler, inputs: list[torch.Tensor], rows: list[SampleRow], calls: int) -> float:
    for x in inputs[:2]:
        sampler(x, rows)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        sampler(inputs[i % len(inputs)], rows)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        nbytes = batch * args.vocab * 4
        count = max(2, min(64, ROTATE_BYTES // nbytes))
        inputs = [torch.randn(batch, args.vocab, device="cuda", generator=gen) * 3 for _ in range(count)]
        for name, params in PARAMS.items():
            rows = [SampleRow(params, seed=i, step=5, prompt_ids=(), output_ids=()) for i in range(batch)]
            row = dict(batch=batch, vocab=args.vocab, params=name, logits_bytes=nbytes)
            tokens = {}
            for way, torch_only in (("torch", True), ("kernels", False)):
                ops._FORCE_TORCH = torch_only
                try:
                    sampler = Sampler()
                    tokens[way] = sampler(inputs[0], rows).token_ids.tolist()
                    seconds = per_call_seconds(sampler, inputs, rows, args.calls)
                finally:
                    ops._FORCE_TORCH = False
                row[f"{way}_us"] = seconds * 1e6
                row[f"{way}_gbps"] = nbytes / seconds / 1e9
                row[f"{way}_of_copy"] = row[f"{way}_gbps"] / copy_gbps
            row["same_tokens"] = tokens["torch"] == tokens["kernels"]
            results.append(row)
            print(f"  B {batch:3d} {name:16s} torch {row['torch_us']:8.1f} us  kernels {row['kernels_us']:8.1f} us"
                  f"{'' if row['same_tokens'] else '  (tokens differ)'}", flush=True)
        del inputs
    result = dict(measures="a sampler call on [B, V] float32 logits: the token picks of kernels/greedy.py against "
                           "torch's ops alone", date=str(datetime.date.today()),
                  command=" ".join(["bench/sampler.py", *sys.argv[1:]]), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, copy_gbps=copy_gbps, rows=results)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps(result, indent=1))
    print(f"{'B':>4} {'params':16s} {'torch us':>9} {'of copy':>8} {'kernels us':>11} {'of copy':>8} {'speed-up':>9}")
    for r in results:
        print(f"{r['batch']:4d} {r['params']:16s} {r['torch_us']:9.1f} {r['torch_of_copy']:8.1%} "
              f"{r['kernels_us']:11.1f} {r['kernels_of_copy']:8.1%} {r['torch_us'] / r['kernels_us']:8.2f}x")


if __name__ == "__main__":
    main()
