"""Whole decode steps under several plan tables or switches, in one process: the model loads once, then for each
round and each variant in turn every packed weight takes that variant's plan, the decode graphs are captured again,
and the steps at each batch are timed.

    python bench/plan_ab.py --model M.gguf --tables .,variant.json [--batches 32,64,128] [--rounds 2]
        [--context 512] [--out plan_ab.json]
    python bench/plan_ab.py --model M.gguf --ring-depths q4_k=4,6,8 ...
    python bench/plan_ab.py --model M.gguf --gemm-from q8_0=0 --tables . --batches 1,4,8,16
    python bench/plan_ab.py --model M.gguf --switch quant_gemm.PAD_X_TO_TILE=0,1 --batches 40,64,96,128
    python bench/plan_ab.py --model M.gguf --tables . --without-gemv q8_0 --switch-table no-gemv \
        --switch matmul_plans.DEEP_GEMV_DEFAULT=0,1 --batches 1,8,16
    python bench/plan_ab.py --model M.gguf --tables . --knockout norms,reduce,attention --batches 1,8,16,64

A table is a quant_configs.json (`.`: the package's). Generated variants of the package's table:
--ring-depths FMT=D,... every ring config of that format's plans (`quant_gemm`, `quant_gemm_wide`) D stages deep;
--gemm-from FMT=N,... every weight of that format with a GEMM plan handing the GEMM the calls of more than N tokens
(`quant_gemm_crossover`; 0: the GEMV's range too). FMT:ROWSxCOLS=... in either: only that table entry's weights
(q4_k:6144x4096=16: q4_K qkv's GEMV up to 16 tokens). --switch MODULE.ATTR=V,... runs the package's table once per
value of a module-level switch of cobatch.kernels (set before the graphs are captured again, put back after), or
--switch-table's (`no-gemv`: the one --without-gemv FMT,... writes, the package's table without those formats' GEMV
plans, itself a variant unless the switches run it).
--knockout NAME,... runs the package's table with a kind of kernel left out of the captured steps (KNOCKOUTS:
the RMSNorms, decode attention's reduce, or decode attention whole), the most that making it free could give. Those
steps compute nothing meaningful (greedy sampling takes any scores), so they are timings only, of dense models.
Why a benchmark of its own: a plan can pay in whole steps and not in its kernel alone (a deeper GEMM ring copies
more weights before its griddepcontrol.wait, under the kernel before: docs/kernels.md), and `bench/device.sh ab`
loads the model once a side and round (30-50 s each on Llama-3-8B), where a variant here costs a graph capture
(10-20 s). Prints each variant's step time per batch and round, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import clear, copy_bandwidth, kv_bytes_per_token, place_sessions, randomize_kv  # noqa: E402
from decode import time_steps, weight_bytes  # noqa: E402
from moe_decode import dense_bytes  # noqa: E402

from cobatch.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from cobatch.kernels import matmul_plans, packed_experts, packed_weight  # noqa: E402
from cobatch.kernels.operand_order import NATURAL, operand_buffer  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

PACKAGE_TABLE = str(matmul_plans.CONFIG_PATH)


def packed_weights(model) -> list[packed_weight.PackedWeight]:
    """The packed matrices of a decode step's dense projections (a stacked weight's parts one by one): attention's
    (MLA's fused q|kv_a and q_b too), a dense feed-forward's, a MoE block's shared experts', the head."""
    ws = [model.lm_head]
    for layer in model.layers:
        ws += [getattr(layer, name, None) for name in ("qkv", "q_kv_a", "q_b", "o", "gate_up", "down")]
        moe = getattr(layer, "moe", None)
        if moe is not None:
            ws += [moe.shared_gate_up, moe.shared_down]
    return [p for w in ws for p in getattr(w, "parts", [w])
            if isinstance(p, packed_weight.PackedWeight) and p.planes is not None]


def expert_stacks(model) -> list[packed_experts.PackedExperts]:
    """The routed experts' stacked weights (gate|up and down of each MoE block that routes on the device)."""
    moes = [m for m in (getattr(layer, "moe", None) for layer in model.layers) if m is not None]
    return [s for m in moes for s in (m.routed_gate_up, m.routed_down) if s is not None]


def shape_entries(table: dict, fmt_name: str, shape: str | None = None) -> list[dict]:
    """The entries of fmt_name's shapes in `table`, or only the one of `shape` ("ROWSxCOLS")."""
    shapes = table["formats"].get(fmt_name, {}).get("shapes", {})
    return [e for name, e in shapes.items() if shape in (None, name)]


def ring_depth_table(table: dict, fmt_name: str, depth: int, shape: str | None = None) -> dict:
    """`table` (quant_configs.json's contents) with every ring GEMM config of fmt_name's shapes (or of one `shape`)
    `depth` stages deep."""
    out = json.loads(json.dumps(table))
    for entry in shape_entries(out, fmt_name, shape):
        for key in ("quant_gemm", "quant_gemm_wide"):
            if entry.get(key, {}).get("RING"):
                entry[key]["RING"] = depth
    return out


def gemm_from_table(table: dict, fmt_name: str, crossover: int, shape: str | None = None) -> dict:
    """`table` with every fmt_name weight (or the one of `shape`) that has a GEMM plan handing it the calls of more
    than `crossover` tokens."""
    out = json.loads(json.dumps(table))
    for entry in shape_entries(out, fmt_name, shape):
        if "quant_gemm" in entry:
            entry["quant_gemm_crossover"] = crossover
    return out


def without_gemv_table(table: dict, fmt_names: list[str]) -> dict:
    """`table` with no GEMV plan for the formats `fmt_names`: their weights run matmul_plans.default_gemv_plan."""
    out = json.loads(json.dumps(table))
    for fmt_name in fmt_names:
        for entry in out["formats"].get(fmt_name, {}).get("shapes", {}).values():
            for key in ("gemv", "gemv_upto"):
                entry.pop(key, None)
    return out


VARIANTS = {"ring": ring_depth_table, "gemm-from": gemm_from_table}


def variant_tables(spec: str, into: Path, kind: str = "ring") -> list[str]:
    """FMT[:ROWSxCOLS]=V,V,...: one table file per value V of variant `kind` (VARIANTS), for every weight of the
    format or only that shape's, written into `into`, from the package's table."""
    weights, values = spec.split("=")
    fmt_name, _, shape = weights.partition(":")
    package = json.loads(Path(PACKAGE_TABLE).read_text())
    if shape and not shape_entries(package, fmt_name, shape):
        raise SystemExit(f"plan_ab.py: {fmt_name} has no table entry {shape}")
    paths = []
    for value in (int(v) for v in values.split(",")):
        path = into / f"{fmt_name}{'-' + shape if shape else ''}-{kind}{value}.json"
        path.write_text(json.dumps(VARIANTS[kind](package, fmt_name, value, shape or None), indent=1))
        paths.append(str(path))
    return paths


def parse_switch(spec: str) -> list[list[tuple[str, str, object]]]:
    """--switch MODULE.ATTR=V,V,...: one variant per value, [(module, attr, value)], MODULE a module of
    cobatch.kernels and each value a JSON literal (0, 1, true, "x") or else the text itself. Switches joined by
    '&' (MODULE.ATTR=V&MODULE.ATTR=V) are one variant with all of them set."""
    def literal(text: str):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def target(part: str) -> tuple[str, str, str]:
        name, values = part.split("=", 1)
        module, attr = name.rsplit(".", 1)
        return module, attr, values
    if "&" in spec:
        return [[(module, attr, literal(value)) for module, attr, value in map(target, spec.split("&"))]]
    module, attr, values = target(spec)
    return [[(module, attr, literal(v))] for v in values.split(",")]


@contextlib.contextmanager
def patched(patches: list[tuple[str, str, object]]):
    """Each (module, attribute, value) set while the block runs, then the attributes as they were put back."""
    targets = [(importlib.import_module(m), a, value) for m, a, value in patches]
    before = [getattr(mod, a) for mod, a, _ in targets]
    for mod, a, value in targets:
        setattr(mod, a, value)
    try:
        yield
    finally:
        for (mod, a, _), real in zip(targets, before):
            setattr(mod, a, real)


def switched(switches: list[tuple[str, str, object]] | None):
    """Each cobatch.kernels.MODULE.ATTR set to its value while the block runs (module-level switches such as
    quant_gemm.PAD_X_TO_TILE, read at launch), then put back."""
    patches = []
    for module, attr, value in switches or []:
        mod = importlib.import_module(f"cobatch.kernels.{module}")
        if not hasattr(mod, attr):
            raise SystemExit(f"plan_ab.py: cobatch.kernels.{module} has no {attr}")
        before = getattr(mod, attr)
        patches.append((mod.__name__, attr, type(before)(value) if isinstance(before, (bool, int, float)) else value))
    return patched(patches)


class _NoLaunch:
    """Stands in for a Triton kernel: kernel[grid](...) launches nothing."""
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _no_norm(x, weight, eps, residual=None, inplace_residual=False, out_dtype=None, out_order=NATURAL):
    """ops.rms_norm with no kernel: the normed rows' buffer as the op would hand it on, unwritten, and the residual
    stream as it was."""
    if out_order != NATURAL or out_dtype not in (None, x.dtype):
        out = operand_buffer(x.numel() // x.shape[-1], x.shape[-1], out_dtype or x.dtype, x.device, out_order)
        x_normed = out.view(x.shape)
    else:
        x_normed = x
    return x_normed, x if residual is None else residual


def _no_attention(q, k, v, positions, cos_sin, neox, k_cache, v_cache, meta, scale, window=0, softcap=0.0,
                  out_dtype=None, qk_norm=None, out_order=NATURAL):
    """ops.rope_attention with no kernel (no rope, no cache write, no attention): its output buffer, unwritten."""
    n, heads, dim = q.shape
    return operand_buffer(n, heads * dim, out_dtype or q.dtype, q.device, out_order).view(q.shape)


# --knockout's kinds of kernel: (module, attribute, stand-in) each
KNOCKOUTS = {
    "norms": [("cobatch.ops", "rms_norm", _no_norm)],
    "reduce": [("cobatch.kernels.attention", "_decode_reduce_kernel", _NoLaunch()),
               ("cobatch.kernels.mla_attention", "_decode_reduce_kernel", _NoLaunch())],
    "attention": [("cobatch.ops", "rope_attention", _no_attention)],
}


def knocked_out(name: str | None):
    """KNOCKOUTS[name]'s stand-ins in place while the block runs (the graphs captured in it launch none of those
    kernels), then the real ones back."""
    return patched(KNOCKOUTS[name] if name else [])


def use_table(llm: LLM, weights: list[packed_weight.PackedWeight], table: str) -> None:
    """Every weight's plan from `table` (as LLM.load would choose it with COBATCH_QUANT_CONFIGS=table), its
    scratch reserved, and the decode graphs captured again with them (same rows and context as before)."""
    os.environ["COBATCH_QUANT_CONFIGS"] = table
    device = torch.device("cuda")
    for pw in weights:
        pw.plan = matmul_plans.load_plan(pw.fmt_name, pw.rows, pw.cols, pw.planes, device)
        packed_weight.reserve_scratch(device, pw.plan, pw.planes.rows_pad, pw.rows, pw.cols)
    for stack in expert_stacks(llm.model):
        stack.replan()
    runner = llm.engine.runner
    rows, ctx = runner.graphs.max_batch, runner.graphs.max_context
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.graphs = DecodeGraphs(llm.model, llm.engine.pool, rows, ctx, quiet=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tables", default="", help="comma-separated quant_configs.json paths ('.': the package's)")
    ap.add_argument("--ring-depths", action="append", default=[],
                    help="FMT[:ROWSxCOLS]=D,D,...: the package's table with FMT's ring configs (or that shape's) D "
                         "stages deep, one table per D")
    ap.add_argument("--gemm-from", action="append", default=[],
                    help="FMT[:ROWSxCOLS]=N,N,...: the package's table with FMT's GEMM plans (or that shape's) "
                         "taking calls of more than N tokens")
    ap.add_argument("--switch", action="append", default=[],
                    help="MODULE.ATTR=V,V,...: the package's table with cobatch.kernels.MODULE.ATTR set to each V "
                         "(a module-level switch read at launch, e.g. quant_gemm.PAD_X_TO_TILE=0,1); "
                         "MODULE.ATTR=V&MODULE.ATTR=V: one variant with both set")
    ap.add_argument("--switch-table", default=".",
                    help="the table the --switch variants run ('.': the package's; 'no-gemv': the --without-gemv one)")
    ap.add_argument("--without-gemv", default="",
                    help="FMT,FMT,...: a variant, the package's table without those formats' GEMV plans (their weights "
                         "on the default GEMV plan)")
    ap.add_argument("--knockout", default="",
                    help=f"NAME,...: the package's table with one kind of kernel left out per NAME "
                         f"({', '.join(KNOCKOUTS)}): timings only")
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv-cache-gb", type=float, default=40.0)
    ap.add_argument("--out", default=None, help="where the JSON goes (default $OUT/plan_ab.json if OUT is set)")
    args = ap.parse_args()
    tables = [PACKAGE_TABLE if t == "." else str(Path(t).resolve()) for t in args.tables.split(",") if t]
    if args.ring_depths or args.gemm_from:
        variants_dir = Path(tempfile.mkdtemp(prefix="plan_ab-"))
        for kind, specs in (("ring", args.ring_depths), ("gemm-from", args.gemm_from)):
            for spec in specs:
                tables += variant_tables(spec, variants_dir, kind)
    no_gemv_table = None
    if args.without_gemv:
        fmts = args.without_gemv.split(",")
        no_gemv_table = Path(tempfile.mkdtemp(prefix="plan_ab-")) / f"no-gemv-{'-'.join(fmts)}.json"
        no_gemv_table.write_text(json.dumps(without_gemv_table(json.loads(Path(PACKAGE_TABLE).read_text()), fmts)))
        if args.switch_table != "no-gemv":       # else the switch variants run it
            tables.append(str(no_gemv_table))
    switch_table = {".": PACKAGE_TABLE, "no-gemv": str(no_gemv_table)}.get(args.switch_table, args.switch_table)
    if args.switch_table == "no-gemv" and no_gemv_table is None:
        raise SystemExit("plan_ab.py: --switch-table no-gemv needs --without-gemv")
    missing = [t for t in tables + ([switch_table] if args.switch else []) if not Path(t).is_file()]
    if missing:
        raise SystemExit(f"plan_ab.py: no such table: {', '.join(missing)}")
    names = [Path(t).name for t in tables]
    # (name, table, switch, knockout) each
    variants = [(name if names.count(name) == 1 else t, t, None, None) for name, t in zip(names, tables)]
    for spec in args.switch:
        variants += [(" & ".join(f"{module}.{attr}={value}" for module, attr, value in switches), switch_table,
                      switches, None) for switches in parse_switch(spec)]
    knockouts = [k for k in args.knockout.split(",") if k]
    unknown = [k for k in knockouts if k not in KNOCKOUTS]
    if unknown:
        raise SystemExit(f"plan_ab.py: no knockout {', '.join(unknown)} (one of {', '.join(KNOCKOUTS)})")
    variants += [(f"without {k}", PACKAGE_TABLE, None, k) for k in knockouts]
    if not variants:
        raise SystemExit("plan_ab.py: give --tables, --ring-depths, --gemm-from, --switch or --knockout")
    batches = [int(b) for b in args.batches.split(",")]
    max_batch, ctx = max(batches), args.context + 128
    copy_bps = copy_bandwidth()
    t0 = time.perf_counter()
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=ctx, max_num_seqs=max_batch,
                                             kv_cache_gb=args.kv_cache_gb, quiet=True))
    print(f"loaded {Path(args.model).name} in {time.perf_counter() - t0:.0f} s; copy {copy_bps / 1e9:.0f} GB/s",
          flush=True)
    if knockouts and llm.config.n_experts:
        # the router would read the left-out kernels' unwritten buffers (a DeepSeek-V2-Lite run aborted inside
        # torch; expert ids from garbage scores are the likely cause)
        raise SystemExit("plan_ab.py: --knockout takes dense models only (an MoE model routes on the values)")
    weights = packed_weights(llm.model)
    # an MoE model's roofline counts the weights every step reads, not its routed experts (they vary by step)
    wbytes, kvtok = dense_bytes(llm) if llm.config.n_experts else weight_bytes(llm), kv_bytes_per_token(llm)
    randomize_kv(llm)
    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name, *_ in variants}
    for rnd in range(args.rounds):
        for name, table, switch, knockout in variants:
            t1 = time.perf_counter()
            with switched(switch), knocked_out(knockout):
                use_table(llm, weights, table)
                for b in batches:
                    place_sessions(llm, b, args.context)
                    times[name][b].append(time_steps(llm) * 1e3)
                    clear(llm)
            print(f"round {rnd + 1} {name} (plans and graphs {time.perf_counter() - t1:.0f} s): "
                  + "  ".join(f"B={b} {times[name][b][-1]:.2f} ms" for b in batches), flush=True)
    rows = []
    for name, table, *_ in variants:
        for b in batches:
            ms = statistics.median(times[name][b])
            roofline_ms = (wbytes + b * (args.context + 8) * kvtok) / copy_bps * 1e3
            rows.append(dict(variant=name, table=table, batch=b, step_ms=ms, rounds_ms=times[name][b],
                             tok_s=b / ms * 1e3, step_over_roofline=ms / roofline_ms))
    print(f"\n{'variant':40} " + "".join(f"{'B=' + str(b):>22}" for b in batches))
    for name, *_ in variants:
        cells = [next(r for r in rows if r["variant"] == name and r["batch"] == b) for b in batches]
        print(f"{name[:40]:40} " + "".join(
            f"{' / '.join(f'{v:.2f}' for v in c['rounds_ms']):>14} {c['step_over_roofline']:5.2f}x " for c in cells))
    out = args.out or (str(Path(os.environ["OUT"]) / "plan_ab.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"model": args.model, "context": args.context, "copy_gbps": copy_bps / 1e9,
                                         "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
