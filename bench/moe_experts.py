"""One MoE layer's experts alone on the GPU, each way a step can run them: which way a prefill chunk should take.

    PYTHONPATH=src python bench/moe_experts.py --model deepseek-v2-lite-q4_k_m-2l.gguf [--rows 64,256,2048]

The model's first MoE layer (`layer.moe`, models/moe.py: the router, the routed experts, the shared ones) is called
on N random rows, eagerly as a prefill step calls it, under the switches of each way:
  - expert by expert (every step, as before device routing): the counts to the host, then each chosen expert on
    its rows through its own plan (the GEMV, the mid-batch GEMM or dequantize + cuBLAS);
  - routed slices (COBATCH_MOE_PREFILL=routed): the routed GEMV on slices of packed_experts.ROUTED_MAX_ROWS rows;
  - routed GEMM (the default way; COBATCH_MOE_GEMM=0 turns it off): as the stacks plan it, then for each config
    (GEMM_CONFIGS: the plain kernel's and the ring kernel's) and largest slot (packed_experts.ROUTED_GEMM_MAX_SLOT:
    32, 64, 128), at the rows where the experts average more than 16 pairs.
Each way: its output against expert by expert's (relative error), the wall time of a call (median; the host's
launches and syncs included, as a prefill step pays them) and, where the call has no host sync, the GPU time of
the call captured in a graph. GB/s counts the weights a call reads, each once (the router, the shared experts,
each chosen expert); TFLOP/s the routed experts' multiply-adds. Beside them: the copy bandwidth, and cuBLAS bf16's
TFLOP/s on the same multiply-adds as two plain matmuls of all the pairs, measured in this run. A short table last;
JSON to $OUT or bench/results/moe_experts.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # sibling scripts by name
from moe_decode import experts_run, weight_nbytes  # noqa: E402
from timing import copy_bandwidth, graph_time  # noqa: E402

from cobatch.kernels import packed_experts, quant_gemm  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the plain kernel, one or two warpgroups, loads one step ahead or not; the ring kernel in the shapes the dense
# plans chose (quant_configs.json: q4_K's 8 stages of 2 chunks and 6 of 1, q8_0's 6 of 4), the warpgroups apart, and
# the persistent grid
GEMM_CONFIGS = [quant_gemm.GemmConfig(NW=nw, P=p) for nw in (8, 4) for p in (False, True)] + [
    quant_gemm.GemmConfig(NW=nw, RING=8, CHUNKS=2, LAG=True, AHEAD=True) for nw in (8, 4)] + [
    quant_gemm.GemmConfig(NW=8, RING=6, CHUNKS=1, LAG=True),
    quant_gemm.GemmConfig(NW=8, RING=4, CHUNKS=2, LAG=True, APART=True),
    quant_gemm.GemmConfig(NW=8, RING=8, CHUNKS=2, LAG=True, AHEAD=True, PERSIST=1),
    quant_gemm.GemmConfig(NW=8, RING=6, CHUNKS=4, LAG=True, AHEAD=True)]
MAX_SLOTS = (32, 64, 128)


@contextlib.contextmanager
def routed_gemm_as(moe, cfg: quant_gemm.GemmConfig, max_slot: int):
    """The layer's two stacks run the routed GEMM with `cfg`, in slots of at most `max_slot` pairs."""
    stacks = (moe.routed_gate_up, moe.routed_down)
    saved = [(s.routed_gemm, s.routed_gemm_wide) for s in stacks], packed_experts.ROUTED_GEMM_MAX_SLOT
    for s in stacks:
        s.routed_gemm = s.routed_gemm_wide = cfg
    packed_experts.ROUTED_GEMM_MAX_SLOT = max_slot
    try:
        with experts_run(False, True):
            yield
    finally:
        for s, (narrow, wide) in zip(stacks, saved[0]):
            s.routed_gemm, s.routed_gemm_wide = narrow, wide
        packed_experts.ROUTED_GEMM_MAX_SLOT = saved[1]


def label(cfg: quant_gemm.GemmConfig) -> str:
    """A GEMM config in a few words: "plain NW=8 P=1", "ring NW=8 6x4 lag ahead persist"."""
    if not cfg.RING:
        return f"plain NW={cfg.NW} P={int(cfg.P)}"
    knobs = [k.lower() for k in ("LAG", "APART", "AHEAD", "PERSIST") if getattr(cfg, k)]
    return " ".join([f"ring NW={cfg.NW} {cfg.RING}x{cfg.CHUNKS}", *knobs])


def ways(moe, n_rows: int) -> list[tuple[str, contextlib.AbstractContextManager, bool]]:
    """(name, the switches, captured: has no host sync) of each way to run a call of n_rows rows."""
    out = [("expert by expert", experts_run(False, False, max_rows=0), False),
           ("routed slices", experts_run(True, False), True)]
    with experts_run(False, True):
        gemm = moe.routed_gemm and moe._gemm_slots(n_rows)
    if gemm:
        out.append(("routed GEMM as planned", experts_run(False, True), True))     # the stacks' own configs
        stacks = (moe.routed_gate_up, moe.routed_down)
        for cfg in GEMM_CONFIGS:   # a CTA's rows divide an expert's, an iteration's chunks its K (quant_gemm.steps)
            if any(s.rows % cfg.rows_per_cta() or (s.planes.qs.shape[1] // 512) % cfg.steps_per_iteration()
                   for s in stacks):
                continue
            for max_slot in MAX_SLOTS:      # a ring's stages must fit the SM at the slot's token tile
                if cfg.RING and any(quant_gemm.ring_stages(cfg, s.planes.fmt_id, max_slot) < 2 for s in stacks):
                    continue
                out.append((f"routed GEMM {label(cfg)} slots<={max_slot}", routed_gemm_as(moe, cfg, max_slot), True))
    return out


def wall_ms(f, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cublas_tflops(n_pairs: int, d: int, ffn: int) -> float:
    """cuBLAS bf16 on the experts' multiply-adds as two plain matmuls of all the pairs: [P, d] x [d, 2 ffn] and
    [P, ffn] x [ffn, d]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_pairs, d, device="cuda", dtype=torch.bfloat16, generator=g)
    y = torch.randn(n_pairs, ffn, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(2 * ffn, d, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(d, ffn, device="cuda", dtype=torch.bfloat16, generator=g)
    s = graph_time([lambda: (x @ w1.T, y @ w2.T)] * 3)
    return 2 * n_pairs * 3 * ffn * d / s / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a GGUF with MoE layers (the experts in a routed format)")
    ap.add_argument("--rows", default="64,256,512,2048")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    copy_bps = copy_bandwidth() * 1e9          # (timing gives GB/s)
    print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s", flush=True)
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=512, max_num_seqs=1, kv_cache_gb=1, eager=True,
                                             quiet=True))
    moe = next((layer.moe for layer in llm.model.layers if layer.moe is not None), None)
    if moe is None or not moe.routed:
        raise SystemExit(f"moe_experts.py: {args.model} has no MoE layer whose experts route on the device")
    gate_up, down = moe.routed_gate_up, moe.routed_down
    d, ffn, k, n_experts = gate_up.cols, down.cols, moe.rule.k, moe.n_experts
    shared = sum(weight_nbytes(w) for w in (moe.router, moe.shared_gate_up, moe.shared_down, moe.shared_gate))
    print(f"{Path(args.model).name}: d {d}, {n_experts} experts of {ffn}, {k} a row ({gate_up.fmt_name} / "
          f"{down.fmt_name}); router and shared experts {shared / 1e6:.1f} MB", flush=True)
    rows = []
    for n in (int(v) for v in args.rows.split(",")):
        h = torch.randn(n, d, generator=torch.Generator().manual_seed(n)).bfloat16().cuda()
        _, ids = moe.route(h)
        used = int(ids.unique().numel())
        read = shared + used * (gate_up.nbytes + down.nbytes) // n_experts
        flops = 2 * n * k * 3 * ffn * d
        dense_tflops = cublas_tflops(n * k, d, ffn)
        want = None
        for name, switches, capturable in ways(moe, n):
            with switches:
                got = moe(h).float()
                wall = wall_ms(lambda: moe(h), args.reps)
                gpu = graph_time([lambda: moe(h)]) * 1e3 if capturable else None
            want = got if want is None else want
            ms = gpu if gpu is not None else wall
            row = dict(rows=n, way=name, wall_ms=wall, gpu_ms=gpu, experts_used=used, bytes=read,
                       gbps=read / ms / 1e6, of_copy=read / ms / 1e6 / (copy_bps / 1e9), tflops=flops / ms / 1e9,
                       cublas_tflops=dense_tflops, of_cublas=flops / ms / 1e9 / dense_tflops,
                       rel_err=((got - want).norm() / want.norm()).item())
            rows.append(row)
            print(f"  {n:5d} rows  {name:34s} wall {wall:8.3f} ms  GPU "
                  f"{gpu if gpu is not None else float('nan'):8.3f} ms  {row['gbps']:6.0f} GB/s "
                  f"({row['of_copy']:4.0%})  {row['tflops']:6.1f} TFLOP/s ({row['of_cublas']:4.0%} of cuBLAS)  "
                  f"err {row['rel_err']:.1e}", flush=True)
    result = dict(date=str(datetime.date.today()), command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, copy_gbps=copy_bps / 1e9, model=args.model, d_model=d, expert_ffn=ffn,
                  experts=n_experts, experts_used=k, formats=[gate_up.fmt_name, down.fmt_name],
                  gemm_configs=[dataclasses.asdict(c) for c in GEMM_CONFIGS], rows=rows)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_experts.json").write_text(json.dumps(result, indent=1))
    print(f"\ncopy {copy_bps / 1e9:.0f} GB/s; the best way at each row count (by its GPU time, else its wall time):")
    for n in sorted({r["rows"] for r in rows}):
        mine = [r for r in rows if r["rows"] == n]
        best = min(mine, key=lambda r: r["gpu_ms"] if r["gpu_ms"] is not None else r["wall_ms"])
        base = next(r for r in mine if r["way"] == "expert by expert")
        print(f"  {n:5d} rows: {best['way']:34s} {best['wall_ms']:8.3f} ms wall, {best['of_copy']:4.0%} of copy, "
              f"{best['of_cublas']:4.0%} of cuBLAS; expert by expert {base['wall_ms']:8.3f} ms wall")


if __name__ == "__main__":
    main()
