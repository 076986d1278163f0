"""What one request with penalties costs the sessions it is batched with: decode steps of B sessions where none, one
or all sample with repetition / presence / frequency penalties, with their steps planned ahead on the device
(engine.PENALTIES_AHEAD, COBATCH_PENALTIES_AHEAD=1) and without (each penalized step waits for the host).

    PYTHONPATH=src python bench/penalties_ahead.py --model L3-8B-q8_0.gguf [--batches 1,8,64] [--context 512]

Why: the engine plans step n + 1 while step n runs only where no running sequence needs step n's token on the host
first. Penalties count each row's tokens, so without PENALTIES_AHEAD a single such request stops the overlap for
every session in its batch (docs/performance.md). With it, the sampler counts the last token on the device.

Each point: B requests of `context` random prompt tokens added through the engine (prefilled, so the penalties'
counts start from real prompts), run until all decode, then the median engine step (planning, graph replay,
sampling, the host sync) over the timed steps, and how many steps were planned ahead of the one before. The same
load and process for every variant. Prints each step's GB/s of weight and KV bytes and its ratio to the device-to-
device copy measured in the same run, a table last; JSON to $OUT/penalties_ahead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import provenance  # noqa: E402

provenance.use_tree_source()
from decode import clear, copy_bandwidth, kv_bytes_per_token, time_steps, weight_bytes  # noqa: E402

from cobatch.engine import engine as engine_module  # noqa: E402
from cobatch.engine.sampler import SamplingParams  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

PLAIN = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
PENALIZED = SamplingParams(temperature=0.7, seed=3, max_tokens=1 << 20, ignore_eos=True, repetition_penalty=1.1,
                           presence_penalty=0.3, frequency_penalty=0.2)
# variant -> (sessions with penalties: none, one, all; PENALTIES_AHEAD)
VARIANTS = {"no penalties": ("none", False), "one penalized, waits": ("one", False),
            "one penalized, ahead": ("one", True), "all penalized, waits": ("all", False),
            "all penalized, ahead": ("all", True)}
WARMUP = 4             # untimed steps before the timed ones (the overlap starts on the second step)


def start_sessions(llm: LLM, batch: int, context: int, penalized: str) -> None:
    """`batch` requests of `context` random tokens, every one (or the first, or none) with PENALIZED, stepped until
    all of them decode."""
    eng = llm.engine
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    for i in range(batch):
        ids = torch.randint(0, llm.config.vocab_size, (context,), generator=gen).tolist()
        with_penalties = penalized == "all" or (penalized == "one" and i == 0)
        eng.add_request(ids, PENALIZED if with_penalties else PLAIN)
    while any(seq.num_output == 0 for seq in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()


def timed_steps(llm: LLM, steps: int) -> tuple[float, int]:
    """(the median step's seconds, how many of the timed and warm-up steps were planned ahead of the step before)."""
    runner, ahead = llm.engine.runner, []
    launch = runner.launch

    def counting(plan):
        ahead.append(plan.follows is not None)
        return launch(plan)

    runner.launch = counting
    try:
        return time_steps(llm, steps=steps, warmup=WARMUP), sum(ahead)
    finally:
        runner.launch = launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    copy_bps = copy_bandwidth()
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=args.context + 256, max_num_seqs=max(batches),
                                             kv_cache_gb=args.kv_cache_gb, quiet=True))
    wbytes, kvtok = weight_bytes(llm), kv_bytes_per_token(llm)
    print(f"{torch.cuda.get_device_name()}: copy {copy_bps / 1e9:.0f} GB/s, weights {wbytes / 1e9:.2f} GB", flush=True)
    rows = []
    for batch in batches:
        for variant, (penalized, ahead) in VARIANTS.items():
            engine_module.PENALTIES_AHEAD = ahead
            start_sessions(llm, batch, args.context, penalized)
            step_s, ahead_steps = timed_steps(llm, args.steps)
            clear(llm)
            bytes_read = wbytes + batch * (args.context + args.steps) * kvtok
            row = dict(batch=batch, variant=variant, steps_planned_ahead=ahead_steps, steps=args.steps + WARMUP,
                       step_ms=step_s * 1e3, tok_s=batch / step_s,
                       gbps=bytes_read / step_s / 1e9, of_copy=bytes_read / step_s / copy_bps)
            rows.append(row)
            print(f"  B {batch:3d} {variant:22} {row['step_ms']:6.3f} ms  {row['tok_s']:8.0f} tok/s  "
                  f"{row['gbps']:5.0f} GB/s ({row['of_copy']:4.0%} of copy), "
                  f"{ahead_steps} of {args.steps + WARMUP} steps planned ahead", flush=True)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results") / "penalties_ahead.json"
    out.write_text(json.dumps(dict(tree=provenance.tree(), command=" ".join(sys.argv),
                                   device=torch.cuda.get_device_name(), copy_gbps=copy_bps / 1e9,
                                   context=args.context, rows=rows), indent=1))
    print(f"\ncopy {copy_bps / 1e9:.0f} GB/s; ctx {args.context}; ms a step (% of copy)")
    print(f"{'variant':22}" + "".join(f"{'B = ' + str(b):>18}" for b in batches))
    for variant in VARIANTS:
        cells = [r for r in rows if r["variant"] == variant]
        print(f"{variant:22}" + "".join(f"{r['step_ms']:11.3f} ({r['of_copy']:3.0%})" for r in cells))


if __name__ == "__main__":
    main()
