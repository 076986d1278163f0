"""Where a prefill's wall time goes when the GPU is not busy: the host's work, function by function, and eager
steps against the prefill graphs' replays.

    PYTHONPATH=src python bench/prefill_host.py --model L3-8B-q8_0.gguf [--tokens 512,2048] [--top 40]
        [--graphs --beside 0,8,64 [--cut] [--seq-sizes 256]]

Run eagerly, a prefill chunk of a few hundred tokens takes less GPU time than the host needs to launch its kernels.
For each prompt length: the wall time of a one-token generate through the engine as loaded (its prefill graphs,
unless COBATCH_STEP_GRAPHS=0; the median of 3, prefix cache defeated), the GPU's busy time and launch count under
torch.profiler, and then the host's time by function under cProfile (the GPU work queued asynchronously, so a
function's time is its Python and launch cost), summed over 3 calls. With --graphs, the same steps are also timed
eagerly against replays of the prefill graphs (engine/cuda_graphs.StepGraphs, captured here whatever
COBATCH_STEP_GRAPHS says), in one process and alternating: a prompt of each length alone, and beside each --beside
count of sessions decoding at ctx 512 (a serving step with a chunk in it; with --cut, the chunk of a longer prompt
as the scheduler cuts it there, so that the step has the length's rows). --seq-sizes also captures graphs of other
sequence buckets, timing both captures and a third column of replays. Prints the tables; JSON to $OUT or
bench/results/.
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
from cobatch.engine.cuda_graphs import STEP_SEQS, StepGraphs  # noqa: E402
from cobatch.engine.runner import step_metadata  # noqa: E402
from cobatch.engine.sampler import SamplingParams, to_device  # noqa: E402
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


def step_lists(llm, n: int, beside: int, context: int):
    """One step's host lists: a prompt of n tokens from position 0, and `beside` sessions decoding their
    context-th token (blocks allocated here; release them with the returned tables)."""
    bs, vocab = llm.engine.pool.block_size, llm.config.vocab_size
    gen = torch.Generator().manual_seed(n + beside)
    ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
    for q_len, seq_len in [(n, n)] + [(1, context)] * beside:
        table = llm.engine.blocks.allocate(-(-seq_len // bs))
        first = seq_len - q_len
        ids += torch.randint(0, vocab, (q_len,), generator=gen).tolist()
        pos += range(first, seq_len)
        slots += [table[p // bs] * bs + p % bs for p in range(first, seq_len)]
        starts.append(starts[-1] + q_len)
        lens.append(seq_len)
        tables.append(table)
    return ids, pos, slots, starts, lens, tables


def eager_step(llm, lists) -> torch.Tensor:
    """The step's forward as the runner's eager path runs it: metadata sent from the host lists, then the layers."""
    ids, pos, slots, starts, lens, tables = lists
    dev = llm.engine.runner.device
    meta = step_metadata(slots, starts, lens, tables, dev)
    return llm.model.forward(to_device(ids, torch.int64, dev), to_device(pos, torch.int64, dev), meta,
                             llm.engine.pool.k, llm.engine.pool.v)


def step_ab(llm, graphs, n: int, beside: int, context: int, rounds: int, other=None) -> dict:
    """Wall ms of one step (its host work, launches and GPU work, then a sync) of an n-token prompt chunk beside
    `beside` decoders, eager and replayed from `graphs` (and from `other` graphs, if given), alternating, the median
    of `rounds` each; and the largest difference of their hidden states."""
    lists = step_lists(llm, n, beside, context)
    ids, pos, slots, starts, lens, tables = lists
    runs = {"eager": lambda: eager_step(llm, lists), "graph": lambda: graphs.run(ids, pos, slots, lens, starts, tables)}
    if other is not None:
        runs["other"] = lambda: other.run(ids, pos, slots, lens, starts, tables)
    times = {k: [] for k in runs}
    try:
        with torch.inference_mode():
            out = {k: run().clone() for k, run in runs.items()}        # warm-up (and the hidden states compared)
            for _ in range(rounds):
                for k, run in runs.items():
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    run()
                    torch.cuda.synchronize()
                    times[k].append((time.perf_counter() - t) * 1e3)
    finally:
        for table in tables:
            llm.engine.blocks.release(table)
    result = dict(prompt_tokens=n, beside=beside, rows=len(ids), bucket=list(graphs.bucket_for(len(ids), len(lens))),
                  eager_ms=statistics.median(times["eager"]), graph_ms=statistics.median(times["graph"]),
                  eager_samples=times["eager"], graph_samples=times["graph"],
                  max_abs_diff=(out["eager"].float() - out["graph"].float()).abs().max().item())
    if other is not None:
        result.update(other_bucket=list(other.bucket_for(len(ids), len(lens))),
                      other_ms=statistics.median(times["other"]), other_samples=times["other"],
                      other_max_abs_diff=(out["eager"].float() - out["other"].float()).abs().max().item())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--graphs", action="store_true", help="also time each step eagerly against a graph replay")
    ap.add_argument("--beside", default="0", help="with --graphs: sessions decoding beside the prompt")
    ap.add_argument("--cut", action="store_true",
                    help="with --beside: the prompt's chunk shrinks by the decode rows (engine/scheduler.py's cut)")
    ap.add_argument("--seq-sizes", default=None,
                    help="with --graphs: also time replays of prefill graphs of these sequence buckets (e.g. 256: "
                         "one graph a row count), captured beside the engine's")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    besides = [int(b) for b in args.beside.split(",")]
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=max(lengths) + 1024, max_num_seqs=max(4, *besides) + 1,
                                             kv_cache_gb=8, prefill_chunk=max(lengths),
                                             max_step_tokens=max(lengths) + max(besides)))
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
    steps, captures = [], {}
    if args.graphs:
        runner = llm.engine.runner

        def step_graphs(seq_sizes):
            t = time.perf_counter()
            graphs = StepGraphs(llm.model, llm.engine.pool, max(lengths) + max(besides), max(besides) + 1,
                                llm.engine.max_context, quiet=True, mempool=runner.graphs.mempool,
                                seq_sizes=seq_sizes)
            captures[",".join(map(str, seq_sizes))] = dict(graphs=len(graphs.graphs), seconds=time.perf_counter() - t)
            return graphs

        graphs = runner.step_graphs or step_graphs(STEP_SEQS)
        other = None
        if args.seq_sizes:       # both captured here, after the engine's own: kernels compiled, capture alone timed
            graphs = step_graphs(STEP_SEQS)
            other = step_graphs(tuple(int(s) for s in args.seq_sizes.split(",")))
            for sizes, c in captures.items():
                print(f"prefill graphs of sequence buckets {sizes}: {c['graphs']} captured in {c['seconds']:.1f} s")
        header = "\n prompt  beside  bucket        eager ms   graph ms   max |diff|"
        print(header + ("   other bucket  other ms" if other else ""))
        for n in lengths:
            for beside in besides:
                chunk = n - beside if args.cut else n
                if chunk < 1 or graphs.bucket_for(chunk + beside, 1 + beside) is None:
                    continue
                r = step_ab(llm, graphs, chunk, beside, 512, args.rounds, other)
                steps.append(r)
                extra = f"   {str(tuple(r['other_bucket'])):12s}  {r['other_ms']:8.2f}" if other else ""
                print(f" {n:6d}  {beside:6d}  {str(tuple(r['bucket'])):12s}  {r['eager_ms']:8.2f}  {r['graph_ms']:9.2f}"
                      f"   {r['max_abs_diff']:.2e}{extra}", flush=True)
    out_dir = Path(os.environ.get("OUT", ROOT / "bench" / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = dict(date=datetime.date.today().isoformat(), command="bench/prefill_host.py " + " ".join(sys.argv[1:]),
               device=torch.cuda.get_device_name(), torch=torch.__version__, tree=provenance.tree(),
               prefill=results, steps=steps, captures=captures)
    (out_dir / "prefill_host.json").write_text(json.dumps(doc, indent=1))
    print("\n prompt   wall ms   GPU busy ms   launches")
    for r in results:
        print(f" {r['prompt_tokens']:6d}  {r['wall_ms']:8.1f}  {r['gpu_busy_ms']:12.1f}  {r['launches']:9d}")
    if steps:
        print("\n prompt  beside   eager ms   graph ms")
        for r in steps:
            print(f" {r['prompt_tokens']:6d}  {r['beside']:6d}  {r['eager_ms']:8.2f}  {r['graph_ms']:9.2f}")


if __name__ == "__main__":
    main()
