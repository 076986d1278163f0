"""Where an eager prefill's wall time goes when the GPU is not busy: the host's work, function by function.

    PYTHONPATH=src python bench/prefill_host.py --model L3-8B-q8_0.gguf [--tokens 512,2048] [--top 40]

A prefill chunk runs eagerly (decode steps replay CUDA graphs), so at a few hundred tokens its kernels can take
less time than the host needs to launch them. For each prompt length: the wall time of a one-token generate (the
median of 3, prefix cache defeated), the GPU's busy time and launch count under torch.profiler, and then the
host's time by function under cProfile (the GPU work queued asynchronously, so a function's time is its Python
and launch cost), summed over 3 calls. Prints the tables; JSON to $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import provenance  # noqa: E402

provenance.use_tree_source()
from cobatch.engine.sampler import SamplingParams  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

from decode import prefill_profile  # noqa: E402

CALLS = 3


def prompts(vocab: int, n: int, count: int) -> list[list[int]]:
    """count prompts of n tokens, each shifted by one id from the one before, so none hits the prefix cache."""
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    return [[(i + k) % vocab for i in ids] for k in range(count)]


def host_functions(stats: pstats.Stats, calls: int, top: int) -> list[dict]:
    """The functions with the most time of their own, per call of the prefill, and their cumulative time."""
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append(dict(function=f"{Path(path).name}:{line}({name})", calls=ncalls / calls,
                         own_ms=tottime * 1e3 / calls, cum_ms=cumtime * 1e3 / calls))
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=max(lengths) + 128, max_num_seqs=4, kv_cache_gb=8,
                                             prefill_chunk=max(lengths), max_step_tokens=max(lengths)))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    engine, vocab = llm.engine, llm.config.vocab_size
    results = []
    for n in lengths:
        batch = prompts(vocab, n, 1 + 3 * CALLS)
        engine.generate([batch[0]], params)                      # warm-up: compiles and plans
        walls = []
        for ids in batch[1:1 + CALLS]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate([ids], params)
            walls.append(time.perf_counter() - t)
        profiled = prefill_profile(lambda ids=batch[1 + CALLS]: engine.generate([ids], params))
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for ids in batch[2 + CALLS:2 + 2 * CALLS]:
            engine.generate([ids], params)
        prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof, stream=io.StringIO())
        host = host_functions(stats, CALLS, args.top)
        wall_ms = statistics.median(walls) * 1e3
        results.append(dict(prompt_tokens=n, wall_ms=wall_ms, walls_ms=[w * 1e3 for w in walls],
                            gpu_busy_ms=profiled["gpu_busy_ms"], launches=profiled["launches"],
                            top_kernels=profiled["top"], host_functions=host))
        print(f"\nprefill {n}: {wall_ms:.1f} ms wall (median of {CALLS}), GPU busy {profiled['gpu_busy_ms']:.1f} ms, "
              f"{profiled['launches']} launches")
        print(f"  {'host function (cProfile, per prefill)':70s} {'calls':>7s} {'own ms':>8s} {'cum ms':>8s}")
        for r in host:
            print(f"  {r['function'][:70]:70s} {r['calls']:7.0f} {r['own_ms']:8.2f} {r['cum_ms']:8.2f}")
    out_dir = Path(os.environ.get("OUT", ROOT / "bench" / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = dict(date=datetime.date.today().isoformat(), command="bench/prefill_host.py " + " ".join(sys.argv[1:]),
               device=torch.cuda.get_device_name(), torch=torch.__version__, tree=provenance.tree(),
               prefill=results)
    (out_dir / "prefill_host.json").write_text(json.dumps(doc, indent=1))
    print("\n prompt   wall ms   GPU busy ms   launches")
    for r in results:
        print(f" {r['prompt_tokens']:6d}  {r['wall_ms']:8.1f}  {r['gpu_busy_ms']:12.1f}  {r['launches']:9d}")


if __name__ == "__main__":
    main()
