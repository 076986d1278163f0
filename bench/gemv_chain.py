"""GEMVs of a Llama-3-8B layer chained in one persistent launch (kernels/gemv_chain.py) against the package's
plans, one launch a matrix (GPU only): q8_0, or with --format q4_k the ring engine's configs on q4_K's planes.

    python bench/gemv_chain.py [--format q4_k] [--out gemv_chain.json]
    ncu -k regex:gemv --launch-skip 1 --launch-count 3 ... python bench/gemv_chain.py --once   # o, for a profiler

At n_tok 1 and 8, each as a CUDA graph of calls over copies of the weights rotating past L2 (bench/timing.py):
- each matrix alone (qkv, o, gate_up with its act, down);
- the MLP pair, gate_up (act) then down reading its output;
- the layer's four matrices in order (each stage waits for the one before, as in a decode step, though here o and
  gate_up read inputs of their own: there is no attention or norm between them).
GB/s and % of copy count the weights' bytes once per call; the table ends with the best chain config per case.
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
import provenance  # noqa: E402
from kernels import random_weight  # noqa: E402
from timing import copy_bandwidth, graph_time  # noqa: E402

from cobatch.kernels import gemv_chain  # noqa: E402
from cobatch.kernels.gemv_chain import ChainConfig, ChainStage  # noqa: E402
from cobatch.kernels import nvrtc, quant_pack  # noqa: E402
from cobatch.kernels.packed_weight import PackedWeight  # noqa: E402
from cobatch.kernels.quant_gemm_cuda import SMEM_LIMIT  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CASES = {"qkv": ["qkv"], "o": ["o"], "gate_up": ["gate_up"], "down": ["down"], "mlp": ["gate_up", "down"],
         "layer": ["qkv", "o", "gate_up", "down"]}
# the item engine's best in gemv_chain.md; the ring engine's best two with every slot's chunks split over the warps
# (docs/kernels.md); then warps taking whole slots (OWN), one or two CTAs an SM; two producer warps; two accumulators
CONFIGS = [ChainConfig(W=8, RT=1, CTAS=2, U=4, ITEMS=1, PIPE=True),
           ChainConfig(W=4, RT=1, CTAS=2, RING=12, CH=16), ChainConfig(W=4, RT=2, CTAS=1, RING=12, CH=16),
           ChainConfig(W=8, RT=1, CTAS=1, RING=24, CH=8, OWN=True),
           ChainConfig(W=8, RT=2, CTAS=1, RING=12, CH=8, OWN=True),
           ChainConfig(W=4, RT=2, CTAS=2, RING=12, CH=8, OWN=True),
           ChainConfig(W=8, RT=1, CTAS=1, RING=12, CH=16, OWN=True),
           ChainConfig(W=8, RT=4, CTAS=1, RING=6, CH=8, OWN=True),
           ChainConfig(W=8, RT=1, CTAS=2, RING=24, CH=4, OWN=True),
           ChainConfig(W=8, RT=1, CTAS=1, RING=24, CH=8, OWN=True, PRODUCERS=2),
           ChainConfig(W=4, RT=1, CTAS=2, RING=12, CH=16, PRODUCERS=2),
           ChainConfig(W=8, RT=1, CTAS=1, RING=24, CH=8, OWN=True, ACC=2)]
# on 4-bit planes a chunk is 64 columns (two x loads, 128 bytes of sides): fewer chunks a warp and a slot
CONFIGS_4BIT = [ChainConfig(W=4, RT=1, CTAS=2, RING=12, CH=8), ChainConfig(W=4, RT=2, CTAS=1, RING=12, CH=8),
                ChainConfig(W=8, RT=1, CTAS=1, RING=24, CH=4, OWN=True),
                ChainConfig(W=8, RT=1, CTAS=2, RING=24, CH=4, OWN=True),
                ChainConfig(W=8, RT=2, CTAS=1, RING=12, CH=4, OWN=True),
                ChainConfig(W=4, RT=1, CTAS=2, RING=12, CH=4, OWN=True),
                ChainConfig(W=8, RT=1, CTAS=1, RING=24, CH=4, OWN=True, PRODUCERS=2),
                ChainConfig(W=8, RT=1, CTAS=1, RING=24, CH=4, OWN=True, ACC=2)]
SETS = 4          # weight sets rotating: 4 x 232 MB, well past the 50 MB L2


def configs_for(fmt: str) -> list[ChainConfig]:
    """The item engine reads q8_0 only; on 4-bit planes, CONFIGS_4BIT's ring configs whose slots fit an SM's shared
    memory and whose registers do not spill."""
    if fmt == "q8_0":
        return CONFIGS
    fits = []
    for cfg in CONFIGS_4BIT:
        if cfg.CTAS * cfg.smem_bytes(quant_pack.Q4_1) > SMEM_LIMIT:
            continue
        _, log = nvrtc.compile_cubin(gemv_chain.source(cfg, torch.bfloat16, False, quant_pack.Q4_1), "gemv_chain",
                                     "90a", ("--ptxas-options=-v",))
        if not nvrtc.spills(log):
            fits.append(cfg)
    return fits


def once() -> None:
    pw = PackedWeight.from_quant(random_weight("q8_0", *SHAPES["o"]), "cuda")
    x = torch.randn(1, SHAPES["o"][1], device="cuda").to(torch.bfloat16)
    out = torch.empty(1, SHAPES["o"][0], device="cuda", dtype=torch.bfloat16)
    scratch = gemv_chain.ChainScratch(torch.device("cuda"))
    for _ in range(2):
        pw.matmul(x, out=out)
    for _ in range(2):
        gemv_chain.launch([ChainStage(pw.planes, x, out)], 1, ChainConfig(), scratch)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--format", default="q8_0", choices=["q8_0", "q4_k"])
    ap.add_argument("--once", action="store_true",
                    help="only o at one token: the plan's GEMV twice, then the chain twice (for Nsight Compute)")
    args = ap.parse_args()
    if args.once:
        once()
        return
    copy_gbps = copy_bandwidth()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    sets, first = [], {}
    for i in range(SETS):
        ws = {}
        for name, (rows, cols) in SHAPES.items():
            w = random_weight(args.format, rows, cols, seed=i)
            ws[name] = PackedWeight.from_quant(w, dev, gate_up_interleaved=name == "gate_up")
            if i == 0:
                first[name] = w
        sets.append(ws)
    scratch = gemv_chain.ChainScratch(dev)
    # correctness first: the MLP pair at 8 tokens against the torch reference
    x = torch.randn(8, 4096, device=dev).to(dtype)
    mid, y = torch.empty(8, 14336, device=dev, dtype=dtype), torch.empty(8, 4096, device=dev, dtype=dtype)
    pair = [ChainStage(sets[0]["gate_up"].planes, x, mid, "silu"), ChainStage(sets[0]["down"].planes, mid, y)]
    gemv_chain.launch(pair, 8, ChainConfig() if args.format == "q8_0" else configs_for(args.format)[0], scratch)
    ref = gemv_chain.chain_ref([(first["gate_up"], "silu"), (first["down"], None)], x)
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    print(f"MLP pair, 8 tokens: relative error {err:.2e} against the torch reference", flush=True)
    if not err < 1e-2:
        raise SystemExit("gemv_chain.py: the chain's product is wrong")
    rows_out = []
    for n_tok in (1, 8):
        xs = {name: torch.randn(8, cols, device=dev).to(dtype) for name, (rows, cols) in SHAPES.items()}
        outs = {name: torch.empty(8, rows // 2 if name == "gate_up" else rows, device=dev, dtype=dtype)
                for name, (rows, cols) in SHAPES.items()}

        def inputs(case: list[str]) -> dict[str, torch.Tensor]:
            # down reads gate_up's output where both run (the MLP pair and the layer)
            return {name: outs["gate_up"] if name == "down" and "gate_up" in case else xs[name] for name in case}

        for case_name, case in CASES.items():
            nbytes = sum(sets[0][m].nbytes for m in case)
            ins = inputs(case)

            def record(variant: str, seconds: float) -> None:
                gbps = nbytes / seconds / 1e9
                rows_out.append(dict(case=case_name, n_tok=n_tok, variant=variant, us=seconds * 1e6, gbps=gbps,
                                     pct_copy=100 * gbps / copy_gbps))
                print(f"n={n_tok} {case_name:8s} {variant:58s} {seconds * 1e6:8.2f} us {gbps:6.0f} GB/s "
                      f"{100 * gbps / copy_gbps:4.0f} %", flush=True)

            plan = [lambda ws=ws, m=m: ws[m].matmul(ins[m][:n_tok], out=outs[m][:n_tok],
                                                    act="silu" if m == "gate_up" else None)
                    for ws in sets for m in case]
            record("plan (one launch a matrix)", graph_time(plan) * len(case))
            for cfg in configs_for(args.format):
                stages_of = [[ChainStage(ws[m].planes, ins[m], outs[m], "silu" if m == "gate_up" else None)
                              for m in case] for ws in sets]
                try:
                    chain = [lambda st=st, cfg=cfg: gemv_chain.launch(st, n_tok, cfg, scratch) for st in stages_of]
                    record(f"chain {cfg}", graph_time(chain))
                except (ValueError, RuntimeError) as e:
                    print(f"n={n_tok} {case_name} chain {cfg}: {e}", flush=True)
    # the best chain config against the plan, per case and n_tok
    print(f"\ncopy {copy_gbps:.0f} GB/s\n{'case':8s} {'n':>2s} {'plan us':>8s} {'% copy':>6s} {'chain us':>8s} "
          f"{'% copy':>6s}  best chain config")
    summary = []
    for case_name in CASES:
        for n_tok in (1, 8):
            rs = [r for r in rows_out if r["case"] == case_name and r["n_tok"] == n_tok]
            plan = next(r for r in rs if r["variant"].startswith("plan"))
            chains = [r for r in rs if r["variant"].startswith("chain")]
            best = min(chains, key=lambda r: r["us"]) if chains else None
            summary.append(dict(case=case_name, n_tok=n_tok, plan_us=plan["us"], plan_pct_copy=plan["pct_copy"],
                                chain_us=best and best["us"], chain_pct_copy=best and best["pct_copy"],
                                chain_config=best and best["variant"]))
            print(f"{case_name:8s} {n_tok:2d} {plan['us']:8.2f} {plan['pct_copy']:5.0f}% "
                  + (f"{best['us']:8.2f} {best['pct_copy']:5.0f}%  {best['variant'][6:]}" if best else "-"))
    result = dict(date=datetime.date.today().isoformat(), tree=provenance.tree(),
                  command=f"bench/gemv_chain.py --format {args.format}", format=args.format,
                  device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=copy_gbps,
                  rows=rows_out, summary=summary, mlp_relative_error=err)
    name = "gemv_chain.json" if args.format == "q8_0" else f"gemv_chain_{args.format}.json"
    out = args.out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
