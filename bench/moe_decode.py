"""MoE decode on the GPU: device-routed experts in CUDA graphs against the expert-by-expert eager path.

    PYTHONPATH=src python bench/moe_decode.py --model qwen3-30b-a3b-12l.gguf

One load. For each batch B at context 512, three ways to run the same decode steps:
  - graph: the captured decode graph (experts routed on the device, kernels/moe_routing.py);
  - eager routed: the same kernels launched one by one;
  - eager per expert: the path before device routing (one GEMV pair per chosen expert, a host sync per layer).
Bytes per step: the dense weights, each layer's distinct chosen experts (counted from the routing of one
eager step at that batch) and the KV read; GB/s and the ratio to a device-to-device copy measured in this run.
Also the GPU time by kernel of one eager step at B = 1 and 8. Prints a short table last; JSON to $OUT or
bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `decode` by name
from decode import (clear, copy_bandwidth, graph_replay_ms, kernel_breakdown, kv_bytes_per_token,  # noqa: E402
                    place_sessions, randomize_kv, time_steps)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from cobatch.kernels import packed_experts  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402
from cobatch.models.moe import MoeFeedForward  # noqa: E402

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXT = 512


def _nbytes(w) -> int:
    return sum(p.nbytes for p in getattr(w, "parts", [w])) if w is not None else 0


def dense_bytes(llm: LLM) -> int:
    """Weights every step reads whatever the routing: attention, routers, shared experts, the head."""
    total = _nbytes(llm.model.lm_head)
    for layer in llm.model.layers:
        total += _nbytes(layer.qkv) + _nbytes(layer.o)
        m = layer.moe
        total += m.router.numel() * m.router.element_size() + _nbytes(m.shared_gate_up) + _nbytes(m.shared_down)
    return total


def routed_expert_bytes(llm: LLM) -> float:
    """Expert bytes of one eager step of the sessions in place: each layer's distinct chosen experts."""
    chosen: list[int] = []
    route = MoeFeedForward.route

    def counting(self, h):
        weights, ids = route(self, h)
        chosen.append(ids.unique().numel())
        return weights, ids

    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    MoeFeedForward.route = counting
    try:
        llm.engine.step()
    finally:
        MoeFeedForward.route = route
        runner.graphs = graphs
    per_expert = [m.moe.gate_up[0].nbytes + m.moe.down[0].nbytes for m in llm.model.layers]
    return sum(c * b for c, b in zip(chosen, per_expert))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-batch", type=int, default=64, help="up to 256 (the device-routed limit)")
    args = ap.parse_args()
    copy_bps = copy_bandwidth()
    print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s", flush=True)
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=CONTEXT + 256, max_num_seqs=args.max_batch,
                                             kv_cache_gb=8.0))
    assert llm.engine.runner.graphs is not None, "the experts of this file do not route on the device"
    randomize_kv(llm)
    dense, kvtok = dense_bytes(llm), kv_bytes_per_token(llm)
    runner = llm.engine.runner
    graphs = runner.graphs
    rows, breakdowns = [], {}
    for b in [b for b in BATCHES if b <= args.max_batch]:
        place_sessions(llm, b, CONTEXT)
        expert_b = routed_expert_bytes(llm)
        if b in (1, 8):
            breakdowns[b] = kernel_breakdown(llm, b)
        step_bytes = dense + expert_b + b * (CONTEXT + 8) * kvtok
        graph_s = time_steps(llm)
        graph_ms = graph_replay_ms(llm, b)
        runner.graphs = None
        eager_s = time_steps(llm, steps=6, warmup=2)
        limit = packed_experts.ROUTED_MAX_ROWS
        packed_experts.ROUTED_MAX_ROWS = 0          # every step expert by expert: the path before routing
        try:
            per_expert_s = time_steps(llm, steps=6, warmup=2)
        finally:
            packed_experts.ROUTED_MAX_ROWS = limit
            runner.graphs = graphs
        clear(llm)
        row = dict(batch=b, context=CONTEXT, step_ms=graph_s * 1e3, graph_ms=graph_ms, eager_routed_ms=eager_s * 1e3,
                   eager_per_expert_ms=per_expert_s * 1e3, tok_s=b / graph_s, step_bytes=step_bytes,
                   expert_bytes=expert_b, gbps=step_bytes / graph_s / 1e9,
                   graph_gbps=step_bytes / (graph_ms * 1e-3) / 1e9)
        rows.append(row)
        print(f"  B {b:3d}: graph step {row['step_ms']:6.2f} ms (replay {graph_ms:6.2f}), eager routed "
              f"{row['eager_routed_ms']:6.2f}, eager per expert {row['eager_per_expert_ms']:7.2f}", flush=True)
    cfg = llm.config
    result = dict(date=str(datetime.date.today()), command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, copy_gbps=copy_bps / 1e9, model=args.model, layers=cfg.n_layers,
                  experts=cfg.n_experts, experts_used=cfg.n_experts_used, dense_bytes=dense, rows=rows,
                  kernel_breakdown=breakdowns)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_decode.json").write_text(json.dumps(result, indent=1))
    for b, kernels in breakdowns.items():
        print(f"  eager step B={b}, GPU time by kernel:")
        for k in kernels[:10]:
            print(f"    {k['ms']:7.3f} ms  {k['calls']:4d}x  {k['kernel']}")
    print(f"\ncopy {copy_bps / 1e9:.0f} GB/s; {Path(args.model).name}: {cfg.n_layers} layers, {cfg.n_experts} experts, "
          f"{cfg.n_experts_used} per token; context {CONTEXT}")
    print("   B  step ms  replay ms   tok/s  GB read  GB/s (replay)  of copy  | eager routed  eager per expert  "
          "graph speed-up over per expert")
    for r in rows:
        print(f"  {r['batch']:2d}  {r['step_ms']:7.2f}  {r['graph_ms']:9.2f}  {r['tok_s']:6.0f}  "
              f"{r['step_bytes'] / 1e9:7.2f}  {r['graph_gbps']:13.0f}  {r['graph_gbps'] * 1e9 / copy_bps:7.0%}  | "
              f"{r['eager_routed_ms']:12.2f}  {r['eager_per_expert_ms']:16.2f}  "
              f"{r['eager_per_expert_ms'] / r['step_ms']:6.1f}x")


if __name__ == "__main__":
    main()
