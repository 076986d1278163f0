"""CPU-path decode speed on the default model (SmolLM2-135M Q4_1, dequantized to f32 at load).

    python bench/cpu_decode.py [--threads N] [--tokens 64]

Batch B sessions decode greedily together; prints aggregate tok/s per B and writes cpu_decode.json to $OUT or
bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

import provenance  # noqa: E402  (bench/, the script's own folder)

provenance.use_tree_source()
from cobatch.engine.sampler import SamplingParams  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM.load(None, EngineOptions(device="cpu", ctx=1024, max_num_seqs=8, quiet=True))
    prompt = llm.encode_prompt("Write a short story about a lighthouse keeper.")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))      # warm-up
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [prompt + [i + 10] for i in range(b)]        # distinct sessions, same length
        # Prefill first, then time only the decode steps.
        eng = llm.engine
        ids = [eng.add_request(p, params) for p in prompts]
        while any(eng.seqs[i].num_output == 0 for i in ids):
            eng.step()
        t, steps = time.perf_counter(), 0
        while eng.has_work():
            eng.step()
            steps += 1
        dt = time.perf_counter() - t
        rows.append(dict(batch=b, steps=steps, seconds=dt, step_ms=dt / steps * 1e3, tok_s=b * steps / dt))
        print(f"B={b}: {dt / steps * 1e3:.1f} ms/step, {b * steps / dt:.1f} tok/s aggregate", flush=True)
    tree = provenance.tree()
    result = dict(measures="decode steps on the CPU path (SmolLM2)",
                  reproduce=f"python3 bench/cpu_decode.py --threads {args.threads} --tokens {args.tokens}",
                  recorded=str(datetime.date.today()), tree=tree or None,
                  date=str(datetime.date.today()), command=" ".join([sys.executable.split('/')[-1]] + sys.argv),
                  machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                  threads=args.threads, torch=torch.__version__, model=llm.path.name, rows=rows)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
