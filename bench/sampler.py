"""The sampler on the GPU, over [B, V] float32 logits of Llama-3's vocabulary: first the token-pick kernels alone
(kernels/greedy.py: greedy, and Gumbel-max over the sampler's counter noise) against the torch ops they replace,
and the top-p and top-k cuts without a sort (kernels/top_p.py, kernels/top_k.py) against the stable sort and
torch.topk's prefix; then whole sampler calls as a decode step makes them (greedy rows, sampled ones with and
without top-k / top-p / min-p), with the kernels (the default) and with torch's ops alone (COBATCH_TORCH_OPS's way);
where top-k or top-p applies, also with their torch ways (`torch_filters`: COBATCH_TOP_P_KERNEL=0 and
COBATCH_TOP_K_KERNEL=0), those with whole-row cumulative sums in place of sampler._prefix_below's one-block scans
(`row_scans`), and, where top-k applies, with each row sorted whole instead of read from torch.topk's prefix
(`sorted`); where min-p comes with them, with min-p in the kernels' output pass (`min_p_inside`,
COBATCH_MIN_P_IN_KERNELS=1).

    PYTHONPATH=src python bench/sampler.py [--batches 1,8,64,256] [--vocab 128256] [--calls 40] [--params NAMES]

The kernels alone are checked against the torch ops, then timed as CUDA-graph replays (bench/timing.py); a whole
call is timed from CUDA events around `calls` calls queued back to back (its host work included, as a step pays it
where it is not overlapped) and by its GPU time alone (torch.profiler: what it adds to an overlapped step), and
records whether the ways drew the same tokens (the GPU tests assert it for torch and kernels). Inputs
rotate past L2. GB/s counts the logits read once; the ratio is to a device-to-device copy in the same run. Prints
short tables last; JSON to $OUT or bench/results/sampler.json.
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

from cobatch import ops  # noqa: E402
from cobatch.engine import sampler as sampler_module  # noqa: E402
from cobatch.engine.sampler import Sampler, SampleRow, SamplingParams  # noqa: E402
from cobatch.kernels.greedy import (greedy_tokens_ref, greedy_tokens_triton, gumbel_tokens_ref,  # noqa: E402
                                    gumbel_tokens_triton, token_noise_key)
from cobatch.kernels import top_k as top_k_module  # noqa: E402
from cobatch.kernels import top_p as top_p_module  # noqa: E402
from cobatch.kernels.top_k import top_k_keep_triton  # noqa: E402
from cobatch.kernels.top_p import top_p_keep_ref, top_p_keep_triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROTATE_BYTES = 256 << 20      # past the H200's 60 MB of L2
PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T=0.8 top_k=40": SamplingParams(temperature=0.8, top_k=40),
    "llama.cpp's": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "T=1 min_p=0.05": SamplingParams(temperature=1.0, min_p=0.05),
}


def timed_row(row: dict, way: str, seconds: float, copy_gbps: float) -> None:
    row[f"{way}_us"] = seconds * 1e6
    row[f"{way}_gbps"] = row["logits_bytes"] / seconds / 1e9
    row[f"{way}_of_copy"] = row[f"{way}_gbps"] / copy_gbps


def time_filter(row: dict, ways: dict, inputs: list[torch.Tensor], copy_gbps: float, warps: list[int],
                kernel_module) -> None:
    """Time each way (name -> a function of one input) on every input in one graph; the kernel's way (of
    kernel_module, top_p or top_k) also with each program's warps in `warps` other than the package's
    (`kernel_w<n>`)."""
    for way, keep in ways.items():
        timed_row(row, way, graph_time([lambda x=x, keep=keep: keep(x) for x in inputs]), copy_gbps)
    default = kernel_module.WARPS
    for n in (n for n in warps if n != default):
        kernel_module.WARPS = n
        try:
            timed_row(row, f"kernel_w{n}", graph_time([lambda x=x: ways["kernel"](x) for x in inputs]), copy_gbps)
        finally:
            kernel_module.WARPS = default
    others = "".join(f"  {key[:-3]} {value:8.1f} us" for key, value in row.items()
                     if key.startswith("kernel_w") and key.endswith("_us"))
    print(f"  B {row['batch']:3d} {row['pick']:18s} torch {row['torch_us']:8.1f} us  kernel {row['kernel_us']:8.1f} us"
          f"{others}  rows kept otherwise {row['rows_differ']} of {4 * row['batch']}", flush=True)


def kernels_alone(batch: int, inputs: list[torch.Tensor], copy_gbps: float, warps: list[int]) -> list[dict]:
    """The two picks as kernels and as torch ops, each on every input in one graph; then top-p 0.9 of scores
    tempered by 0.7 (kernels/top_p.py: the cut found without a sort, against the stable sort), with the rows
    whose kept tokens differ (a mass landing on p within rounding) counted."""
    row_keys = torch.arange(batch, device="cuda", dtype=torch.int64) * 2654435761 % (1 << 32)
    token_keys = token_noise_key(torch.arange(inputs[0].shape[1], device="cuda"))
    fallback = torch.zeros(batch, device="cuda", dtype=torch.int64)
    picks = {"greedy": (lambda x: greedy_tokens_ref(x), lambda x: greedy_tokens_triton(x)),
             "gumbel": (lambda x: gumbel_tokens_ref(x, row_keys, token_keys, fallback),
                        lambda x: gumbel_tokens_triton(x, row_keys, token_keys, fallback))}
    rows = []
    for name, (reference, kernel) in picks.items():
        for x in inputs[:4]:
            assert torch.equal(kernel(x), reference(x)), (name, batch)
        row = dict(batch=batch, pick=name, logits_bytes=inputs[0].numel() * 4)
        for way, pick in (("torch", reference), ("kernel", kernel)):
            timed_row(row, way, graph_time([lambda x=x, pick=pick: pick(x) for x in inputs]), copy_gbps)
        rows.append(row)
    top_p = torch.full((batch,), 0.9, device="cuda")
    tempered = [x / 0.7 for x in inputs]
    row = dict(batch=batch, pick="top_p 0.9", logits_bytes=inputs[0].numel() * 4)
    row["rows_differ"] = sum(int((torch.isfinite(top_p_keep_triton(x, top_p)) != torch.isfinite(top_p_keep_ref(
        x, top_p))).any(dim=-1).sum()) for x in tempered[:4])
    time_filter(row, dict(torch=lambda x: top_p_keep_ref(x, top_p), kernel=lambda x: top_p_keep_triton(x, top_p)),
                tempered, copy_gbps, warps, top_p_module)
    rows.append(row)
    rows.append(top_k_alone(batch, [x / 0.8 for x in inputs], copy_gbps, warps))
    return rows


def top_k_alone(batch: int, tempered: list[torch.Tensor], copy_gbps: float, warps: list[int]) -> dict:
    """Top-k 40 then top-p 0.95 (llama.cpp's settings without min-p) as the sampler takes them from torch.topk's
    prefix (sampler._keep_largest: `torch`) and through kernels/top_k.py (`kernel`), rows kept otherwise counted."""
    k, p = 40, 0.95
    top_k, top_p = torch.full((batch,), k, device="cuda"), torch.full((batch,), p, device="cuda")
    width = sampler_module.top_k_width(k, tempered[0].shape[1])

    def prefix(x):
        return sampler_module._keep_largest(x, width, [k] * batch, [p] * batch)

    def kernel(x):
        return top_k_keep_triton(x, top_k, top_p)

    row = dict(batch=batch, pick=f"top_k {k} p {p}", logits_bytes=tempered[0].numel() * 4)
    row["rows_differ"] = sum(int((torch.isfinite(kernel(x)) != torch.isfinite(prefix(x))).any(dim=-1).sum())
                             for x in tempered[:4])
    time_filter(row, dict(torch=prefix, kernel=kernel), tempered, copy_gbps, warps, top_k_module)
    return row


def call_seconds(sampler: Sampler, inputs: list[torch.Tensor], rows: list[SampleRow], calls: int) -> float:
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


def call_gpu_seconds(sampler: Sampler, inputs: list[torch.Tensor], rows: list[SampleRow], calls: int) -> float:
    """The GPU time of one call: its kernels' and copies' durations (torch.profiler), summed over `calls` calls.
    With overlapped steps this, not the host's work, is what a call adds to a decode step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            sampler(inputs[i % len(inputs)], rows)
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e6 / calls


def prefix_below_row_scan(weights: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """sampler._prefix_below by one cumulative sum over the whole row (the way before it): fewer launches, one
    scan program a row."""
    before = torch.nn.functional.pad(weights.cumsum(dim=-1)[:, :-1], (1, 0))
    return (before < limit[:, None]).sum(dim=-1)


def set_way(settings: dict) -> None:
    """A way of the sampler: ops' torch switch and the sampler module's settings, by name."""
    for name, value in settings.items():
        setattr(ops if name == "_FORCE_TORCH" else sampler_module, name, value)


def whole_calls(batch: int, inputs: list[torch.Tensor], calls: int, copy_gbps: float,
                names: list[str]) -> list[dict]:
    """A sampler call per parameter set in each of the ways the module docstring names, each way's GPU time too
    (`_gpu_us`)."""
    out = []
    widths, prefix_below = sampler_module.TOP_K_WIDTHS, sampler_module._prefix_below
    for name in names:
        params = PARAMS[name]
        rows = [SampleRow(params, seed=i, step=5, prompt_ids=(), output_ids=()) for i in range(batch)]
        row = dict(batch=batch, params=name, logits_bytes=inputs[0].numel() * 4)
        tokens = {}
        off = dict(TOP_P_KERNEL=False, TOP_K_KERNEL=False)     # the filters' torch ways
        ways = {"torch": dict(_FORCE_TORCH=True), "kernels": {}}
        if params.top_k or params.top_p < 1.0:
            ways["torch_filters"] = off
            ways["row_scans"] = dict(off, _prefix_below=prefix_below_row_scan)
        if params.top_k:
            ways["sorted"] = dict(off, TOP_K_WIDTHS=())
        if params.min_p > 0.0 and (params.top_k or params.top_p < 1.0):
            ways["min_p_inside"] = dict(MIN_P_IN_KERNELS=True)
        defaults = dict(_FORCE_TORCH=False, TOP_K_WIDTHS=widths, _prefix_below=prefix_below,
                        TOP_P_KERNEL=sampler_module.TOP_P_KERNEL, TOP_K_KERNEL=sampler_module.TOP_K_KERNEL,
                        MIN_P_IN_KERNELS=sampler_module.MIN_P_IN_KERNELS)
        for way, settings in ways.items():
            set_way({**defaults, **settings})
            try:
                sampler = Sampler()
                tokens[way] = sampler(inputs[0], rows).token_ids.tolist()
                timed_row(row, way, call_seconds(sampler, inputs, rows, calls), copy_gbps)
                row[f"{way}_gpu_us"] = call_gpu_seconds(sampler, inputs, rows, min(calls, 10)) * 1e6
            finally:
                set_way(defaults)
        row["same_tokens"] = all(t == tokens["kernels"] for t in tokens.values())
        out.append(row)
        sort = f"  whole-row sort {row['sorted_us']:8.1f} us" if "sorted_us" in row else ""
        print(f"  B {batch:3d} {name:16s} torch {row['torch_us']:8.1f} us  kernels {row['kernels_us']:8.1f} us{sort}"
              f"{'' if row['same_tokens'] else '  (tokens differ)'}", flush=True)
    return out


def profile_calls(batch: int, vocab: int, params: SamplingParams, calls: int) -> None:
    """Where a call's GPU time goes: `calls` calls (the kernels' way) under torch.profiler, by kernel."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(batch, vocab, device="cuda", generator=gen) * 3 for _ in range(4)]
    rows = [SampleRow(params, seed=i, step=5, prompt_ids=(), output_ids=()) for i in range(batch)]
    sampler = Sampler()
    for x in inputs:
        sampler(x, rows)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            sampler(inputs[i % len(inputs)], rows)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    print(f"B = {batch}, {params}: {total / calls:.1f} GPU us a call; by kernel (us a call, launches a call):")
    for e in events[:20]:
        print(f"  {e.self_device_time_total / calls:8.1f} {e.count / calls:5.1f}  {e.key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--warps", default="", help="the filter kernels alone also with these warps a program (e.g. 4,16)")
    ap.add_argument("--params", default=",".join(PARAMS), help="the parameter sets of the whole calls, by name")
    ap.add_argument("--profile", metavar="PARAMS", help="instead: one PARAMS set's calls at the first batch size, "
                                                         "their GPU time by kernel (torch.profiler), largest first")
    args = ap.parse_args()
    if args.profile:
        profile_calls(int(args.batches.split(",")[0]), args.vocab, PARAMS[args.profile], args.calls)
        return
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    picks, calls = [], []
    for batch in [int(b) for b in args.batches.split(",")]:
        count = max(2, min(64, ROTATE_BYTES // (batch * args.vocab * 4)))
        inputs = [torch.randn(batch, args.vocab, device="cuda", generator=gen) * 3 for _ in range(count)]
        picks += kernels_alone(batch, inputs, copy_gbps, [int(n) for n in args.warps.split(",") if n])
        calls += whole_calls(batch, inputs, args.calls, copy_gbps, args.params.split(","))
        del inputs
    result = dict(measures="the sampler's token picks alone (kernels/greedy.py against the torch ops they replace), "
                           "then whole sampler calls with them and with torch's ops alone, on float32 logits",
                  date=str(datetime.date.today()), command=" ".join(["bench/sampler.py", *sys.argv[1:]]),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=copy_gbps, vocab=args.vocab,
                  picks=picks, calls=calls)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps(result, indent=1))
    for rows, label, (a, b) in ((picks, "pick", ("torch", "kernel")), (calls, "params", ("torch", "kernels"))):
        print(f"\n{'B':>4} {label:16s} {a + ' us':>10} {'of copy':>8} {b + ' us':>11} {'of copy':>8} {'speed-up':>9}")
        for r in rows:
            print(f"{r['batch']:4d} {r[label]:16s} {r[a + '_us']:10.1f} {r[a + '_of_copy']:8.1%} "
                  f"{r[b + '_us']:11.1f} {r[b + '_of_copy']:8.1%} {r[a + '_us'] / r[b + '_us']:8.2f}x")
    print(f"\n{'B':>4} {'params':16s} {'sorted us':>10} {'kernels us':>10} {'speed-up':>9}")
    for r in (r for r in calls if "sorted_us" in r):
        print(f"{r['batch']:4d} {r['params']:16s} {r['sorted_us']:10.1f} {r['kernels_us']:10.1f} "
              f"{r['sorted_us'] / r['kernels_us']:8.2f}x")
    ways = ("torch", "kernels", "torch_filters", "sorted", "row_scans", "min_p_inside")
    print(f"\nGPU us a call (call us)\n{'B':>4} {'params':16s} " + " ".join(f"{w:>18s}" for w in ways))
    for r in calls:
        print(f"{r['batch']:4d} {r['params']:16s} " + " ".join(
            f"{r[w + '_gpu_us']:7.1f} ({r[w + '_us']:7.1f})" if w + "_us" in r else f"{'':18s}" for w in ways))


if __name__ == "__main__":
    main()
