"""MoE decode on the GPU: device-routed experts in CUDA graphs against the expert-by-expert eager path.

    PYTHONPATH=src python bench/moe_decode.py --model qwen3-30b-a3b-12l.gguf [--contexts 512,8192]
    PYTHONPATH=src python bench/moe_decode.py --model deepseek-v2-lite.gguf --batches 1,8,64 --contexts 512,8192 \
        --kv-cache-gb 24

One load. For each context and batch B, up to three ways to run the same decode steps:
  - graph: the captured decode graph (experts routed on the device, kernels/moe_routing.py), where the model
    captures its steps;
  - eager routed: the same kernels launched one by one;
  - eager per expert: the path before device routing (one GEMV pair per chosen expert, a host sync per layer).
Bytes per step: the weights every step reads (attention, routers, shared experts, dense leading layers, the head),
each layer's distinct chosen experts (counted from the routing of one eager step at that batch) and the KV read
(a latent row per token and layer under MLA); GB/s, the ratio to a device-to-device copy measured in this run,
and the step time over that roofline. Also the GPU time by kernel of one eager step at B = 1 and 8. Prints a
short table last; JSON to $OUT or bench/results/.
--prefill N,T: also the time to prefill N prompts of T tokens and sample their first tokens, with the experts
expert by expert, routed slice by slice (COBATCH_MOE_PREFILL=routed) and, where the experts can run it, through the
routed GEMM whole (the default; COBATCH_MOE_GEMM=0 turns it off). The engine then holds at least N sequences, so a
step packs prompts up to the engine's 2048 rows (with fewer slots than prompts they would prefill one by one, in
steps of T rows, which the first two ways run on the routed kernels alike: up to packed_experts.ROUTED_MAX_ROWS
rows).
COBATCH_MOE_GEMM=0 in the environment gives decode steps whose experts average more than 16 pairs the routed GEMV
instead of the routed GEMM (the graph and eager routed columns); run once with and once without it to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `decode` by name
from decode import (clear, copy_bandwidth, graph_replay_ms, kernel_breakdown, kv_bytes_per_token,  # noqa: E402
                    place_sessions, prefill_profile, randomize_kv, time_steps)

ROOT = Path(__file__).resolve().parents[1]   # the tree's src is on sys.path: decode (provenance.use_tree_source)

from cobatch.engine.sampler import SamplingParams  # noqa: E402
from cobatch.kernels import packed_experts  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402
from cobatch.models import moe  # noqa: E402

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXTS = [512]


def weight_nbytes(w) -> int:
    """Bytes of a weight the kernels read: a packed matrix (its parts), a dense tensor, nothing."""
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(p.nbytes for p in getattr(w, "parts", [w]))


def dense_bytes(llm: LLM) -> int:
    """Weights every step reads whatever the routing: each layer's attention (and a dense leading layer's
    feed-forward), the routers and shared experts, the final norm and the head; not the embedding table (one
    row a token)."""
    total = weight_nbytes(llm.model.lm_head) + weight_nbytes(llm.model.final_norm)
    for layer in llm.model.layers:
        total += sum(weight_nbytes(getattr(layer, f.name)) for f in dataclasses.fields(layer)
                     if f.name != "moe" and not isinstance(getattr(layer, f.name), (int, float, bool)))
        m = layer.moe
        if m is not None:
            total += sum(weight_nbytes(w) for w in (m.router, m.shared_gate_up, m.shared_down, m.shared_gate))
    return total


def routed_expert_bytes(llm: LLM) -> float:
    """Expert bytes of one eager step of the sessions in place: each MoE layer's distinct chosen experts."""
    moes = [layer.moe for layer in llm.model.layers if layer.moe is not None]
    chosen: dict[int, int] = {}
    originals = {cls: cls.route for cls in {type(m) for m in moes}}   # DeepSeek's router is a subclass's

    def counting(route):
        def count(self, h):
            weights, ids = route(self, h)
            chosen[id(self)] = ids.unique().numel()
            return weights, ids
        return count

    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    for cls, route in originals.items():
        cls.route = counting(route)
    try:
        llm.engine.step()
    finally:
        for cls, route in originals.items():
            cls.route = route
        runner.graphs = graphs
    return sum(chosen.get(id(m), 0) * (weight_nbytes(m.gate_up[0]) + weight_nbytes(m.down[0])) for m in moes)


PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def fresh_prompts(vocab: int, n_prompts: int, prompt_tokens: int, batch: int) -> list[list[int]]:
    """The n_prompts prompts of prefill batch `batch`: no two batches share a prefix, so none is cached."""
    return [[(i * 7919 + (batch * n_prompts + p) * 104729 + 11) % vocab for i in range(prompt_tokens)]
            for p in range(n_prompts)]


def time_prefill(llm: LLM, n_prompts: int, prompt_tokens: int, first_batch: int, reps: int = 3) -> float:
    """Best seconds of `reps` runs prefilling n_prompts prompts of prompt_tokens tokens and sampling one token
    each (eager, as prefill runs); new prompts every run (batches first_batch, first_batch + 1, ...)."""
    best = float("inf")
    for rep in range(reps + 1):                        # the first run warms up
        prompts = fresh_prompts(llm.config.vocab_size, n_prompts, prompt_tokens, first_batch + rep)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.engine.generate(prompts, PREFILL_PARAMS)
        torch.cuda.synchronize()
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def experts_run(routed_prefill: bool, routed_gemm: bool, max_rows: int | None = None):
    """The MoE switches set while the block runs (put back after): moe.ROUTED_PREFILL, packed_experts.ROUTED_GEMM
    and, if given, packed_experts.ROUTED_MAX_ROWS."""
    saved = moe.ROUTED_PREFILL, packed_experts.ROUTED_GEMM, packed_experts.ROUTED_MAX_ROWS
    moe.ROUTED_PREFILL, packed_experts.ROUTED_GEMM = routed_prefill, routed_gemm
    packed_experts.ROUTED_MAX_ROWS = saved[2] if max_rows is None else max_rows
    try:
        yield
    finally:
        moe.ROUTED_PREFILL, packed_experts.ROUTED_GEMM, packed_experts.ROUTED_MAX_ROWS = saved


PREFILL_WAYS = {"expert by expert": (False, False), "routed slices": (True, False), "routed GEMM": (False, True)}


def prefill_rows(llm: LLM, spec: str) -> list[dict]:
    """--prefill N,T: expert by expert, the routed slices and the routed GEMM (where the model's experts can run
    it), each timed, then run once more under the profiler (decode.prefill_profile: the GPU's busy time against
    the wall time, and its top kernels)."""
    n_prompts, prompt_tokens = (int(v) for v in spec.split(","))
    gemm_ok = any(layer.moe is not None and layer.moe.routed_gemm for layer in llm.model.layers)
    rows = []
    for way, (name, switches) in enumerate(PREFILL_WAYS.items()):
        if name == "routed GEMM" and not gemm_ok:
            continue
        with experts_run(*switches):
            first = way * 8                              # batches of prompts no other run has prefilled
            s = time_prefill(llm, n_prompts, prompt_tokens, first)
            prompts = fresh_prompts(llm.config.vocab_size, n_prompts, prompt_tokens, first + 7)
            profiled = prefill_profile(lambda: llm.engine.generate(prompts, PREFILL_PARAMS))
        rows.append(dict(prompts=n_prompts, prompt_tokens=prompt_tokens, experts=name, seconds=s,
                         prefill_tok_s=n_prompts * prompt_tokens / s, profile=profiled))
        print(f"  prefill {n_prompts} x {prompt_tokens} tokens, experts {rows[-1]['experts']}: {s * 1e3:.0f} ms, "
              f"{rows[-1]['prefill_tok_s']:.0f} tok/s; profiled: GPU busy {profiled['gpu_busy_ms']:.0f} ms of "
              f"{profiled['wall_ms']:.0f} ms wall, {profiled['launches']} launches", flush=True)
        for k in profiled["top"][:6]:
            print(f"    {k['ms']:8.2f} ms  {k['calls']:5d}x  {k['kernel']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-batch", type=int, default=64, help="up to 256 (the device-routed limit)")
    ap.add_argument("--batches", help="comma-separated (default: 1, 2, 4, ... up to --max-batch)")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--kv-cache-gb", type=float, default=8.0, help="room for the largest batch x context placed")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (the engine's --kv-cache-dtype)")
    ap.add_argument("--prefill", help="N,T: also time prefilling N prompts of T tokens, both ways")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [b for b in BATCHES
                                                                              if b <= args.max_batch]
    contexts = [int(c) for c in args.contexts.split(",")]
    copy_bps = copy_bandwidth()
    print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s", flush=True)
    prefill_prompts = int(args.prefill.split(",")[0]) if args.prefill else 0
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=max(contexts) + 256,
                                             max_num_seqs=max(*batches, prefill_prompts), kv_cache_gb=args.kv_cache_gb,
                                             kv_cache_dtype=args.kv_cache_dtype))
    randomize_kv(llm)
    dense, kvtok = dense_bytes(llm), kv_bytes_per_token(llm)
    runner = llm.engine.runner
    graphs = runner.graphs                         # None where the model's steps run eagerly
    print(f"dense weights read a step: {dense / 1e9:.2f} GB; KV {kvtok} bytes a token; decode steps "
          f"{'captured' if graphs is not None else 'eager (no CUDA graphs for this model)'}", flush=True)
    rows, breakdowns = [], {}
    for context in contexts:
        for b in batches:
            place_sessions(llm, b, context)
            expert_b = routed_expert_bytes(llm)
            if b in (1, 8) and context == contexts[0]:
                breakdowns[b] = kernel_breakdown(llm, b)
            step_bytes = dense + expert_b + b * (context + 8) * kvtok
            graph_s = time_steps(llm) if graphs is not None else None
            graph_ms = graph_replay_ms(llm, b) if graphs is not None else None
            runner.graphs = None
            eager_s = time_steps(llm, steps=6, warmup=2)
            try:
                with experts_run(False, False, max_rows=0):     # every step expert by expert: the path before
                    per_expert_s = time_steps(llm, steps=6, warmup=2)   # routing
            finally:
                runner.graphs = graphs
            clear(llm)
            step_s = graph_s if graph_s is not None else eager_s     # what the engine runs
            roofline_s = step_bytes / copy_bps
            row = dict(batch=b, context=context, step_ms=step_s * 1e3, graph_ms=graph_ms,
                       eager_routed_ms=eager_s * 1e3, eager_per_expert_ms=per_expert_s * 1e3, tok_s=b / step_s,
                       step_bytes=step_bytes, expert_bytes=expert_b, kv_bytes=b * (context + 8) * kvtok,
                       gbps=step_bytes / step_s / 1e9, roofline_ms=roofline_s * 1e3,
                       step_over_roofline=step_s / roofline_s,
                       graph_gbps=step_bytes / (graph_ms * 1e-3) / 1e9 if graph_ms else None)
            rows.append(row)
            print(f"  ctx {context:5d} B {b:3d}: step {row['step_ms']:6.2f} ms "
                  f"({row['step_over_roofline']:.2f}x roofline), graph replay "
                  f"{graph_ms if graph_ms is not None else float('nan'):6.2f}, eager routed "
                  f"{row['eager_routed_ms']:6.2f}, eager per expert {row['eager_per_expert_ms']:7.2f}", flush=True)
    prefill = prefill_rows(llm, args.prefill) if args.prefill else []
    cfg = llm.config
    result = dict(date=str(datetime.date.today()), command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, copy_gbps=copy_bps / 1e9, model=args.model, arch=cfg.arch,
                  layers=cfg.n_layers, experts=cfg.n_experts, experts_used=cfg.n_experts_used, dense_bytes=dense,
                  kv_bytes_per_token=kvtok, kv_cache_dtype=str(llm.engine.pool.dtype).removeprefix("torch."),
                  captured=graphs is not None, rows=rows, kernel_breakdown=breakdowns,
                  prefill=prefill)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_decode.json").write_text(json.dumps(result, indent=1))
    for b, kernels in breakdowns.items():
        print(f"  eager step B={b}, GPU time by kernel:")
        for k in kernels[:10]:
            print(f"    {k['ms']:7.3f} ms  {k['calls']:4d}x  {k['kernel']}")
    print(f"\ncopy {copy_bps / 1e9:.0f} GB/s; {Path(args.model).name}: {cfg.n_layers} layers, {cfg.n_experts} experts, "
          f"{cfg.n_experts_used} per token; KV {kvtok} bytes a token")
    print("    ctx    B  step ms  x roof  replay ms   tok/s  GB read  GB/s  of copy  | eager routed  eager per expert  "
          "speed-up over per expert")
    for r in rows:
        replay = f"{r['graph_ms']:9.2f}" if r["graph_ms"] is not None else "        -"
        print(f"  {r['context']:5d}  {r['batch']:3d}  {r['step_ms']:7.2f}  {r['step_over_roofline']:6.2f}  {replay}  "
              f"{r['tok_s']:6.0f}  {r['step_bytes'] / 1e9:7.2f}  {r['gbps']:4.0f}  "
              f"{r['gbps'] * 1e9 / copy_bps:7.0%}  | "
              f"{r['eager_routed_ms']:12.2f}  {r['eager_per_expert_ms']:16.2f}  "
              f"{r['eager_per_expert_ms'] / r['step_ms']:6.1f}x")
    for r in prefill:
        print(f"  prefill {r['prompts']} x {r['prompt_tokens']} tokens, experts {r['experts']}: "
              f"{r['seconds'] * 1e3:.0f} ms ({r['prefill_tok_s']:.0f} tok/s)")


if __name__ == "__main__":
    main()
