"""GEMV plans for the shapes of one model: its dense matrices and its routed expert stacks, swept at the token counts
of decode steps and written into a copy of quant_configs.json.

    PYTHONPATH=src python bench/model_gemv_plans.py --model M.gguf [--budget-s 300] [--out quant_configs.json]

Why: a shape without an entry of its own in quant_configs.json runs the plans of the entry of the same K whose row
count is nearest, else matmul_plans.default_gemv_plan (matmul_plans.plan_for). DeepSeek-V2-Lite's matrices (K = 2048,
1408, 2816, 10944) have none, and at one row its step is held by its GEMVs (docs/kernels.md, What is next).

- Each dense shape (format, rows x cols, as the loaded model packs it: a fused q|kv_a, a gate|up, a MoE block's
  shared experts, the head): bench/kernels.py's sweep of the narrow path (`sweep_narrow`: every candidate at 1 and
  16 tokens, the survivors at 1, 4, 8 and 16; the tiers share W and split_k, so a row's bits do not depend on the
  batch).
- Each routed stack (kernels/packed_experts.py): every GEMV base without split-K, as a routed launch runs it
  (`without_split_k`), timed as the routed launch of a step of 1, 8 and 16 rows (k experts a row, each launch of a
  graph choosing its own, so their bytes come from memory as in a step whose other layers run in between). A step
  of up to 8 rows runs the 8-token slot's tier, up to 16 the default: the W whose two tiers lose least to the
  fastest wins, its 8-row config as the entry's tier "8" (for the 1- and 8-row steps alike), its 16-row one as the
  default.
Shapes that have an entry of their own are left as they are; a shape gets one only where the plan chosen beats the
plan in force (summed over the step sizes timed). Prints each shape's plan in force and the one chosen, with their
times and GB/s against the copy bandwidth measured in the same run; every timing as JSON to
$OUT/model_gemv_plans.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # sibling scripts by name
import kernels  # noqa: E402
from plan_ab import expert_stacks, packed_weights  # noqa: E402
from timing import copy_bandwidth, graph_time  # noqa: E402

from cobatch.kernels import matmul_plans, packed_experts  # noqa: E402
from cobatch.kernels.moe_routing import expert_slots, slot_size  # noqa: E402
from cobatch.kernels.quant_gemv import GemvConfig, GemvPlan  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

ROUTED_ROWS = (1, 8, 16)      # steps timed on a routed stack; 1 and 8 share the 8-token slot's tier
ROUTED_SETS = 16              # launches a graph, each with experts of its own choosing


def routed_candidates(stack: packed_experts.PackedExperts) -> list[GemvConfig]:
    """Every GEMV base (bench/kernels.py's GEMV_BASES, both register budgets) as the routed launch would run it."""
    n_chunks = stack.planes.qs.shape[1] // 512
    out = []
    for w, rt, u in kernels.GEMV_BASES:
        if n_chunks % (w * u) or stack.rows % (16 * rt):
            continue
        for r in kernels.GEMV_REGISTERS:
            plan = GemvPlan(GemvConfig(W=w, RT=rt, split_k=1, U=u, D=0, R=r))
            out.append(packed_experts.without_split_k(plan, n_chunks).default)
    return list(dict.fromkeys(out))


def routed_launches(stack: packed_experts.PackedExperts, n_rows: int, k: int, act: str | None, seed: int):
    """ROUTED_SETS routed launches of a step of n_rows rows, each row to k random experts of its own."""
    gen = torch.Generator().manual_seed(seed)
    launches = []
    for _ in range(ROUTED_SETS):
        ids = torch.rand(n_rows, stack.n_experts, generator=gen).argsort(dim=1)[:, :k].cuda()
        weights = torch.rand(n_rows, k, generator=gen).cuda()
        slots = expert_slots(ids, weights, stack.n_experts, slot_size(n_rows))
        x = torch.randn(n_rows * k, stack.cols, generator=gen).half().cuda()
        launches.append(lambda x=x, slots=slots: stack.routed_matmul(x, slots, act=act))
    return launches


def time_routed(stack, plan: GemvPlan, launches) -> float:
    saved, stack.routed_plan = stack.routed_plan, plan
    try:
        return graph_time(launches)
    finally:
        stack.routed_plan = saved


def routed_bytes(stack, n_rows: int, k: int) -> float:
    """Weight bytes a routed launch of n_rows rows reads, on average: the distinct experts its pairs choose."""
    distinct = stack.n_experts * (1 - (1 - k / stack.n_experts) ** n_rows)
    return stack.nbytes / stack.n_experts * distinct


def sweep_routed(stack, k: int, act: str | None, log: list, name: str) -> GemvPlan:
    launches = {n: routed_launches(stack, n, k, act, seed=n) for n in ROUTED_ROWS}
    times = {}
    for cfg in routed_candidates(stack):
        try:
            times[cfg] = {n: time_routed(stack, GemvPlan(cfg), launches[n]) for n in ROUTED_ROWS}
        except Exception as e:    # a config the compiler refuses (registers), skipped
            print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        log.append({"kind": "routed", "shape": name, "config": dataclasses.asdict(cfg),
                    **{f"us_{n}": t * 1e6 for n, t in times[cfg].items()}})
    if not times:
        return stack.routed_plan       # nothing ran: the plan in force stays
    fastest = {n: min(t[n] for t in times.values()) for n in ROUTED_ROWS}
    best = None
    for w in sorted({c.W for c in times}):
        group = [c for c in times if c.W == w]
        narrow = min(group, key=lambda c: times[c][1] / fastest[1] + times[c][8] / fastest[8])
        wide = min(group, key=lambda c: times[c][16])
        score = times[narrow][1] / fastest[1] + times[narrow][8] / fastest[8] + times[wide][16] / fastest[16]
        if best is None or score < best[0]:
            best = (score, GemvPlan(wide, ((8, narrow),) if narrow != wide else ()))
    return best[1]


def entry_of(plan: GemvPlan) -> dict:
    entry = {"gemv": dataclasses.asdict(plan.default)}
    if plan.upto:
        entry["gemv_upto"] = {str(n): dataclasses.asdict(c) for n, c in plan.upto}
    return entry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget-s", type=float, default=300.0, help="no new shape is swept after this")
    ap.add_argument("--out", default=None, help="the table written (default $OUT/quant_configs.json)")
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    out_dir = Path(os.environ.get("OUT") or ".")
    copy_gbps = copy_bandwidth()
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=256, max_num_seqs=16, kv_cache_gb=1.0, eager=True,
                                             quiet=True))
    table = json.loads(matmul_plans.CONFIG_PATH.read_text())
    weights = packed_weights(llm.model)
    dense = {(p.fmt_name, p.rows, p.cols): p for p in weights if p.planes.fragment}    # the GEMV's weights
    stacks = {(s.fmt_name, s.rows, s.cols, s.n_experts, bool(s.experts[0].gate_up_interleaved)): s
              for s in expert_stacks(llm.model)}
    moe = next(m for m in (getattr(layer, "moe", None) for layer in llm.model.layers) if m is not None) \
        if stacks else None
    own = {(f, shape) for f, t in table["formats"].items() for shape in t.get("shapes", {})}
    # the routed stacks first, then the dense shapes a step runs most often (a budget cut drops the rarest)
    uses = {key: sum((p.fmt_name, p.rows, p.cols) == key for p in weights) for key in dense}
    todo = [key for key in [*stacks, *sorted(dense, key=lambda k: -uses[k])]
            if (key[0], f"{key[1]}x{key[2]}") not in own]
    bad = kernels.precompile([(key[0], cfg, key[2]) for key in todo if key in dense
                              for cfg in kernels.narrow_candidates_for(*key)], workers=min(14, os.cpu_count() or 4))
    log, rows = [], []
    out = Path(args.out) if args.out else out_dir / "quant_configs.json"

    def save(table, rows, log):
        out.write_text(json.dumps(table, indent=1) + "\n")
        (out_dir / "model_gemv_plans.json").write_text(json.dumps(
            {"model": args.model, "device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps,
             "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]), "rows": rows,
             "log": log}, indent=1))
    for key in todo:
        if time.time() > deadline:
            print("budget spent before", key, flush=True)
            break
        fmt_name, n_rows, n_cols = key[:3]
        name = f"{fmt_name} {n_rows}x{n_cols}" + (f" x{key[3]} experts" if key in stacks else "")
        t0 = time.time()
        if key in dense and not [c for c in kernels.narrow_candidates_for(*key) if (fmt_name, c) not in bad]:
            print(f"{name}: no candidate splits its K (left to the default plan)", flush=True)
            continue
        if key in dense:
            pw = dense[key]
            copies = kernels.rotating(pw)
            before = pw.plan.narrow
            plan = kernels.sweep_narrow(copies, fmt_name, name, bad, log)
            toks = kernels.GEMV_TIERS + (kernels.GEMV_DEFAULT_TOK,)
            timed = {n: (kernels.time_packed(copies, n, before), kernels.time_packed(copies, n, plan)) for n in toks}
            nbytes = {n: pw.nbytes for n in toks}
            del copies
        else:
            stack, act = stacks[key], "silu" if key[4] else None
            before = stack.routed_plan
            plan = sweep_routed(stack, moe.rule.k, act, log, name)
            launches = {n: routed_launches(stack, n, moe.rule.k, act, seed=100 + n) for n in ROUTED_ROWS}
            timed = {n: (time_routed(stack, before, launches[n]), time_routed(stack, plan, launches[n]))
                     for n in ROUTED_ROWS}
            nbytes = {n: routed_bytes(stack, n, moe.rule.k) for n in ROUTED_ROWS}
        # an entry only where the sweep's plan beats the one in force over the step sizes timed (the default
        # plan for a shape without an entry, deep_gemv_config, is no sweep candidate and may win)
        better = sum(after for _, after in timed.values()) < sum(before_t for before_t, _ in timed.values())
        if better:
            table["formats"].setdefault(fmt_name, {"shapes": {}}).setdefault("shapes", {})[f"{n_rows}x{n_cols}"] = \
                entry_of(plan)
        for n, (t_before, t_after) in timed.items():
            rows.append({"shape": name, "n_tok": n, "us_before": t_before * 1e6, "us_after": t_after * 1e6,
                         "of_copy_before": nbytes[n] / t_before / 1e9 / copy_gbps,
                         "of_copy_after": nbytes[n] / t_after / 1e9 / copy_gbps,
                         "before": str(before), "after": str(plan), "taken": better})
        print(f"{name} ({time.time() - t0:.0f} s): {plan}" + ("" if better else ", slower: the plan in force kept"),
              flush=True)
        torch.cuda.empty_cache()
        save(table, rows, log)     # after every shape: a run cut short keeps what it chose
    print(f"\ncopy {copy_gbps:.0f} GB/s; us (of copy), the plan in force -> the one chosen")
    for r in rows:
        print(f"{r['shape']:36} n={r['n_tok']:>2}  {r['us_before']:7.1f} ({r['of_copy_before']:4.0%}) -> "
              f"{r['us_after']:7.1f} ({r['of_copy_after']:4.0%})")


if __name__ == "__main__":
    main()
