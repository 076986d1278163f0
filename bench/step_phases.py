"""Where a decode step's time goes, phase by phase: every kernel of one CUDA-graph replay, named by what it does.

    PYTHONPATH=src python bench/step_phases.py --model M.gguf [--batches 1,8,12,16] [--context 512] [--replays 5]

For each batch B, sessions are placed at the context (random KV, as bench/decode.py), the decode graph is replayed
under the torch profiler, and each kernel is put in a phase:
- a matrix (qkv, o, gate_up, down, head, ...): the main kernel of each `PackedWeight.matmul` call, in the order an
  eager step makes those calls, with the small kernels that stage its x (`_x_operands_kernel`, `_x_image_kernel`);
  its GB/s and share of copy are its weight bytes over its kernels' charged time (below);
- attention (the split and reduce kernels), norm (RMSNorm), other (sampling, embedding, copies).
Kernels chained by programmatic dependent launch overlap: one launched early sits waiting for the kernel before.
So each kernel is charged only for how far it moves the replay's end past every kernel before it; the charges add
up to the replay's busy time, and each matrix's GB/s is over its charged time. `idle` is the replay's span with no
kernel running at all, the time between weight reads that nothing uses.
Also printed: one middle layer's kernels in order, each with its start after the one before (negative: launched
early under PDL). JSON to --out (default $OUT/step_phases.json when OUT is set).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

provenance.use_tree_source()
from decode import clear, copy_bandwidth, kv_bytes_per_token, place_sessions, randomize_kv  # noqa: E402
from decode import profiled_replays, time_steps  # noqa: E402

from cobatch.kernels import packed_weight  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

# A matmul call's main kernel, and the kernels that stage its x just before it
MATMUL_KERNEL = re.compile(r"_gemv_kernel|_gemm_\w*kernel|^quant_gemm|_matmul\w*kernel|_dequant_kernel")
X_STAGING = re.compile(r"_x_operands_kernel|_x_image_kernel")
PHASE_BY_KERNEL = ((re.compile(r"_decode_\w*kernel|_mla_\w*decode"), "attention"), (re.compile(r"rms_norm"), "norm"))
MATRIX_NAMES = ("qkv", "q_kv_a", "q_b", "o", "gate_up", "down")


def weight_labels(model) -> dict[int, str]:
    """id(PackedWeight) -> the matrix it is (a stacked weight's parts take their stack's name)."""
    labels = {id(model.lm_head): "head"}
    for part in getattr(model.lm_head, "parts", []):
        labels[id(part)] = "head"
    for layer in model.layers:
        for name in MATRIX_NAMES:
            w = getattr(layer, name, None)
            if w is not None:
                labels[id(w)] = name
                for part in getattr(w, "parts", []):
                    labels[id(part)] = name
    return labels


@contextmanager
def recorded_matmuls(labels: dict[int, str], calls: list[tuple[str, int]]):
    """Every PackedWeight.matmul call made inside, as (matrix, weight bytes), in call order."""
    matmul = packed_weight.PackedWeight.matmul

    def recording(self, x, *args, **kwargs):
        if x.reshape(-1, self.cols).shape[0] > 0:
            calls.append((labels.get(id(self), "matmul"), self.nbytes))
        return matmul(self, x, *args, **kwargs)
    packed_weight.PackedWeight.matmul = recording
    try:
        yield
    finally:
        packed_weight.PackedWeight.matmul = matmul


def eager_matmul_calls(llm: LLM) -> list[tuple[str, int]]:
    """The matmul calls of one eager decode step (the graph replays the same calls in the same order)."""
    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    llm.engine.overlap = False
    calls: list[tuple[str, int]] = []
    try:
        llm.engine.step()
        torch.cuda.synchronize()
        with recorded_matmuls(weight_labels(llm.model), calls):
            llm.engine.step()
        torch.cuda.synchronize()
    finally:
        runner.graphs = graphs
        llm.engine.overlap = True
    return calls


def replay_kernels(llm: LLM, batch: int, replays: int) -> list[list[dict]]:
    """Each replay's kernels as dicts (name, start and duration in us), in start order."""
    prof = profiled_replays(llm, batch, replays)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((dict(name=e["name"], ts=float(e["ts"]), dur=float(e["dur"]))
                      for e in events if e.get("cat") == "kernel"), key=lambda k: k["ts"])
    per = len(kernels) // replays
    if per * replays != len(kernels):
        raise SystemExit(f"step_phases.py: {len(kernels)} kernels in {replays} replays")
    return [kernels[i * per:(i + 1) * per] for i in range(replays)]


def label_kernels(kernels: list[dict], calls: list[tuple[str, int]]) -> bool:
    """Give each kernel its phase (and a matmul's main kernel its weight bytes): the i-th main matmul kernel is
    the i-th recorded call; x staging belongs to the call after it. False (phases by kernel only) where the
    counts differ."""
    mains = [k for k in kernels if MATMUL_KERNEL.search(k["name"]) and not X_STAGING.search(k["name"])]
    matched = len(mains) == len(calls)
    i = 0
    for k in kernels:
        name = k["name"]
        k["phase"], k["bytes"] = next((p for rx, p in PHASE_BY_KERNEL if rx.search(name)), "other"), 0
        if X_STAGING.search(name) or MATMUL_KERNEL.search(name):
            k["phase"] = calls[i][0] if matched and i < len(calls) else "matmul"
            if not X_STAGING.search(name):
                k["bytes"] = calls[i][1] if matched else 0
                i += 1
    return matched


def idle_us(kernels: list[dict]) -> tuple[float, float]:
    """(the replay's span, the part of it with no kernel running), us."""
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy, end = 0.0, kernels[0]["ts"]
    for k in kernels:
        a, b = max(k["ts"], end), k["ts"] + k["dur"]
        if b > a:
            busy += b - a
        end = max(end, b)
    return span, span - busy


def charge(kernels: list[dict]) -> None:
    """Each kernel's `charged` time: how far it moves the replay's end past every kernel before it. A programmatic
    dependent that launched early and waited is charged only for what it runs after the kernel before ends, so the
    charges add up to the replay's busy time (span - idle) and say where the step's time goes."""
    end = kernels[0]["ts"]
    for k in kernels:
        k["charged"] = max(0.0, k["ts"] + k["dur"] - max(k["ts"], end))
        end = max(end, k["ts"] + k["dur"])


def phases(replays: list[list[dict]], copy_bps: float) -> list[dict]:
    """Per phase, the median over replays of its kernels' charged time (charge) and summed time (overlaps
    counted in each kernel), its calls and bytes, and GB/s and share of copy over the charged time."""
    per: dict[str, list[float]] = defaultdict(list)
    summed: dict[str, list[float]] = defaultdict(list)
    calls, nbytes = {}, {}
    for kernels in replays:
        t: dict[str, float] = defaultdict(float)
        whole: dict[str, float] = defaultdict(float)
        for k in kernels:
            t[k["phase"]] += k["charged"]
            whole[k["phase"]] += k["dur"]
        for p, v in t.items():
            per[p].append(v)
            summed[p].append(whole[p])
        for p in t:
            calls[p] = sum(k["phase"] == p and not X_STAGING.search(k["name"]) for k in kernels)
            nbytes[p] = sum(k["bytes"] for k in kernels if k["phase"] == p)
    rows = []
    for p, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
        us = statistics.median(v)
        gbps = nbytes[p] / us / 1e3 if nbytes[p] and us > 0 else None
        rows.append(dict(phase=p, calls=calls[p], us=us, summed_us=statistics.median(summed[p]), bytes=nbytes[p],
                         gbps=gbps,
                         of_copy=gbps * 1e9 / copy_bps if gbps else None))
    return rows


def layer_calls(kernels: list[dict]) -> list[dict]:
    """A middle layer's kernels, from the attention split kernel of the middle layer to the next one's."""
    starts = [i for i, k in enumerate(kernels) if re.search(r"_decode_split_kernel|_mla_\w*decode", k["name"])]
    if len(starts) < 3:
        return []
    a, b = starts[len(starts) // 2 - 1], starts[len(starts) // 2]
    rows, prev_end = [], None
    for k in kernels[a:b]:
        rows.append(dict(kernel=k["name"][:48], phase=k["phase"], us=k["dur"], charged_us=k["charged"],
                         after_prev_us=None if prev_end is None else k["ts"] - prev_end))
        prev_end = k["ts"] + k["dur"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,12,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--kv-cache-gb", type=float, default=8.0)
    ap.add_argument("--out", default=None, help="where the JSON goes (default $OUT/step_phases.json if OUT is set)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    copy_bps = copy_bandwidth()
    t0 = time.perf_counter()
    llm = LLM.load(args.model, EngineOptions(device="cuda", ctx=args.context + 128, max_num_seqs=max(batches),
                                             kv_cache_gb=args.kv_cache_gb, quiet=True))
    print(f"loaded {Path(args.model).name} in {time.perf_counter() - t0:.0f} s; copy {copy_bps / 1e9:.0f} GB/s",
          flush=True)
    randomize_kv(llm)
    kvtok = kv_bytes_per_token(llm)
    results = []
    for b in batches:
        place_sessions(llm, b, args.context)
        step_ms = time_steps(llm) * 1e3
        calls = eager_matmul_calls(llm)
        replays = replay_kernels(llm, b, args.replays)
        matched = all([label_kernels(k, calls) for k in replays])
        for k in replays:
            charge(k)
        clear(llm)
        spans = [idle_us(k) for k in replays]
        span, idle = statistics.median(s for s, _ in spans), statistics.median(i for _, i in spans)
        kv_bytes = b * (args.context + 8) * kvtok
        rows = phases(replays, copy_bps)
        for r in rows:          # attention's bytes are the KV it reads
            if r["phase"] == "attention" and r["us"] > 0:
                r["bytes"], r["gbps"] = kv_bytes, kv_bytes / r["us"] / 1e3
                r["of_copy"] = r["gbps"] * 1e9 / copy_bps
        results.append(dict(batch=b, step_ms=step_ms, replay_span_us=span, idle_us=idle, labelled=matched,
                            phases=rows, layer=layer_calls(replays[len(replays) // 2])))
    out = args.out or (str(Path(os.environ["OUT"]) / "step_phases.json") if os.environ.get("OUT") else None)
    if out:
        record = dict(measures="one decode graph replay's kernels by phase: each matrix's, attention's, the norms' "
                               "time, GB/s and share of copy, and the time no kernel runs",
                      reproduce=" ".join(["bench/step_phases.py"] + sys.argv[1:]), recorded=str(datetime.date.today()),
                      tree=provenance.tree(), device=torch.cuda.get_device_name(), model=args.model,
                      context=args.context, copy_gbps=copy_bps / 1e9, results=results)
        Path(out).write_text(json.dumps(record, indent=1))
    for r in results:
        print(f"\nB={r['batch']}: a middle layer's kernels (us: run, charged, start after the one before ends)")
        for c in r["layer"]:
            gap = "" if c["after_prev_us"] is None else f"{c['after_prev_us']:+6.1f}"
            print(f"  {c['phase']:10} {c['kernel']:48} {c['us']:7.1f} {c['charged_us']:7.1f} {gap}")
    for r in results:
        print(f"\nB={r['batch']} ctx {args.context}: step {r['step_ms']:.3f} ms, replay span {r['replay_span_us']:.0f} us,"
              f" idle {r['idle_us']:.0f} us{'' if r['labelled'] else ' (matmuls not matched to weights)'}")
        for p in r["phases"]:
            rate = "" if not p["gbps"] else f"{p['gbps']:7.0f} GB/s {p['of_copy']:5.0%} of copy"
            print(f"  {p['phase']:10} {p['calls']:4d} calls {p['us']:8.1f} us charged ({p['summed_us']:7.1f} run)  {rate}")


if __name__ == "__main__":
    main()
