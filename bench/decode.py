"""Decode benchmark on the GPU: one engine step advances B sessions; how close to the memory roofline?

    PYTHONPATH=src python bench/decode.py --model L3-8B-q8_0.gguf [--model L3-8B-q4_k.gguf] [--hf-peer]
        [--kv-cache-dtype auto,fp8] [--contexts 4096,32768] [--batches 1,4,8,16] [--lora 16x4]

For each model, KV cache dtype (each in its own load) and context (512, 4096) and batch B: the engine step
time (planning, graph replay, sampling, the one host sync), overlapped (the default: step n + 1 launched
while step n runs) and not, aggregate tok/s, its ratio to B=1, and the ratio of the step time to the roofline
(weight bytes the kernels read + KV bytes attention reads) / copy bandwidth measured in this run.
Sessions are placed at the given context with random KV (the values don't change the bytes read), so
no 128 x 4k prefill is needed. Then prefill tok/s at 512 and 2048 prompt tokens (the median of 3 runs), and, with
--hf-peer, the same shape in bf16 through Hugging Face transformers (random init): its ms/step at B = 1, 4, 16, 64.
With --lora RxC, each model is loaded again with C random LoRA adapters of rank R on every projection
(testing/lora_adapters.py) and every session runs through one of them, in turn: the same table, the adapters' bytes
in the roofline, to say what serving adapters costs a step.
Prints a short table last; JSON (+ PNG plot) to $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
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
from cobatch.engine.sequence import Sequence, SeqStatus  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

import timing  # noqa: E402
from timing import replay_seconds  # noqa: E402

BATCHES = [1, 2, 3, 4, 8, 16, 32, 64, 128]
CONTEXTS = [512, 4096]
PREFILL = (512, 2048)
PREFILL_SAMPLES = 3


def copy_bandwidth() -> float:
    """Bytes per second of the 2 GiB device-to-device copy (read + written; bench/timing.py): the ceiling every
    ratio is taken against."""
    return timing.copy_bandwidth() * 1e9


def weight_bytes(llm: LLM) -> int:
    """Bytes one decode step reads from the weights: every linear layer, norms, one embedding row each.
    (Dense models only: which experts an MoE step reads depends on its tokens.)"""
    if llm.config.n_experts:
        raise SystemExit("bench/decode.py measures dense models; this one has routed experts")
    total = 0
    for layer in llm.model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            parts = getattr(w, "parts", [w])
            total += sum(p.nbytes for p in parts)
    head = llm.model.lm_head
    total += sum(p.nbytes for p in getattr(head, "parts", [head]))
    lora = getattr(llm.model, "lora", None)    # LoRA adapters' slots: every step reads them all
    if lora is not None:
        total += sum(s.a.nbytes + s.b.nbytes for layer in lora.layers for s in layer.values() if s is not None)
    return total


def kv_bytes_per_token(llm: LLM) -> int:
    """KV bytes one token holds over all layers: each layer's K and V rows (one latent row under MLA)."""
    pool = llm.engine.pool
    return sum(t[0, 0].numel() * t.element_size() for t in list(pool.k) + list(pool.v))


def randomize_kv(llm: LLM) -> None:
    """Random KV: real bytes to read, never zeros (the values don't change the time). Drawn in bf16 and cast
    (torch draws no fp8), a slice at a time."""
    for t in llm.engine.pool.k + llm.engine.pool.v:
        for piece in t.split(4096):
            piece.copy_(torch.randn(piece.shape, device=piece.device, dtype=torch.bfloat16))


def place_sessions(llm: LLM, batch: int, context: int, params: SamplingParams | None = None) -> list[Sequence]:
    """B running sessions, each with `context` tokens already in (random) KV, ready to decode; with LoRA adapters
    loaded, each through one of them in turn."""
    eng = llm.engine
    params = params or SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    lora = getattr(llm.model, "lora", None)
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    seqs = []
    for i in range(batch):
        ids = torch.randint(0, llm.config.vocab_size, (context,), generator=gen).tolist()
        seq = Sequence(f"bench-{batch}-{i}", context - 1, params, 1234 + i, ids)
        blocks = eng.blocks.allocate(-(-(context + 64) // eng.pool.block_size))
        assert blocks is not None, "KV pool too small for this benchmark point"
        seq.block_table, seq.num_computed = blocks, context - 1
        seq.token_ids.append(ids[-1])           # one sampled token pending: the session is decoding
        seq.status = SeqStatus.RUNNING
        if lora is not None:
            seq.adapter = 1 + i % len(lora.slots)
        eng.scheduler.running.append(seq)
        eng.seqs[seq.request_id] = seq
        seqs.append(seq)
    return seqs


def step_times(llm: LLM, steps: int = 12, warmup: int = 3) -> list[float]:
    """Wall time of each of `steps` engine steps over the sessions in place (after `warmup` untimed ones)."""
    eng = llm.engine
    for _ in range(warmup):
        eng.step()
    if eng.runner.device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()              # ends with the step's one host sync (sampled ids)
        times.append(time.perf_counter() - t)
    return times


def time_steps(llm: LLM, steps: int = 12, warmup: int = 3) -> float:
    return statistics.median(step_times(llm, steps, warmup))


def graph_replay_ms(llm: LLM, batch: int) -> float:
    """GPU time of the captured decode graph alone (no planning, sampling or host sync; replays queued behind a
    GPU sleep, bench/timing.py)."""
    g = llm.engine.runner.graphs
    b = g.bucket_for(batch)
    for _ in range(3):
        g.graphs[b].replay()
    return replay_seconds(g.graphs[b], reps=10) * 1e3


def profiled_replays(llm: LLM, batch: int, replays: int):
    """The torch profiler (CUDA activity) over `replays` replays of the decode graph for `batch` rows, after one
    replay unprofiled."""
    from torch.profiler import ProfilerActivity, profile
    g = llm.engine.runner.graphs
    graph = g.graphs[g.bucket_for(batch)]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return prof


def graph_kernel_breakdown(llm: LLM, batch: int, replays: int = 5) -> list[dict]:
    """Per-kernel GPU time inside the captured decode graph, per replay (kernels in a graph run back to back,
    with programmatic dependent launch overlapping them: not the same as one eager step's)."""
    return _top_kernels(profiled_replays(llm, batch, replays), replays)


def _kernel_rows(prof, per: int = 1) -> list[dict]:
    """Every kernel (and copy) the profile saw on the GPU, by GPU time, per `per` repetitions."""
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append(dict(kernel=ev.key[:90], calls=ev.count // per, ms=t / 1e3 / per))
    rows.sort(key=lambda r: -r["ms"])
    return rows


def _top_kernels(prof, per: int = 1) -> list[dict]:
    return _kernel_rows(prof, per)[:14]


def prefill_profile(run) -> dict:
    """run() (an eager prefill) once under the torch profiler: the GPU's busy time (its kernels' times summed),
    its launches and its top kernels, against the wall time. Busy time well under the wall time: the host's
    launches, not the GPU, bound the prefill (the profiler's own overhead inflates the wall time somewhat)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    rows = _kernel_rows(prof)
    return dict(wall_ms=wall * 1e3, gpu_busy_ms=sum(r["ms"] for r in rows), launches=sum(r["calls"] for r in rows),
                top=rows[:10])


def kernel_breakdown(llm: LLM, batch: int) -> list[dict]:
    """Per-kernel GPU time of one eager decode step (same kernels the graph replays), top entries."""
    from torch.profiler import ProfilerActivity, profile
    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    llm.engine.overlap = False          # one step per call: the profile holds exactly one
    try:
        llm.engine.step()
        llm.engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.engine.step()
            torch.cuda.synchronize()
    finally:
        runner.graphs = graphs
        llm.engine.overlap = True
    return _top_kernels(prof)


def clear(llm: LLM) -> None:
    eng = llm.engine
    for seq in list(eng.scheduler.running):
        eng.abort(seq.request_id)
    eng.step()


def random_adapters(path: str, rank: int, count: int) -> tuple[tuple[str, str, float], ...]:
    """`count` random rank-`rank` adapters for the model at `path`, written once under $OUT (EngineOptions'
    lora_modules)."""
    from cobatch.config import ModelConfig
    from cobatch.loader.gguf import GGUFFile
    from cobatch.testing.lora_adapters import write_random_adapter
    gguf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gguf.metadata, set(gguf.tensors))
    root = Path(os.environ.get("OUT") or "/tmp") / "lora-adapters"
    return tuple((f"lora-{i}", str(write_random_adapter(root / f"{Path(path).stem}-r{rank}-{i}", cfg, rank, seed=i)),
                  1.0) for i in range(count))


def bench_model(path: str, copy_bps: float, max_batch: int, kv_gb: float, dense: bool,
                kv_cache_dtype: str = "auto", lora: tuple[int, int] | None = None) -> dict:
    t0 = time.perf_counter()
    adapters = random_adapters(path, *lora) if lora else ()
    llm = LLM.load(path, EngineOptions(device="cuda", ctx=max(*CONTEXTS, *PREFILL) + 128, max_num_seqs=max_batch,
                                       kv_cache_gb=kv_gb, prefill_chunk=2048, max_step_tokens=4096,
                                       dense_large_batch=dense, kv_cache_dtype=kv_cache_dtype,
                                       lora_modules=adapters))
    load_s = time.perf_counter() - t0
    wbytes = weight_bytes(llm)
    kvtok = kv_bytes_per_token(llm)
    randomize_kv(llm)
    rows, breakdowns = [], {}
    for context in CONTEXTS:
        base = None
        for b in [b for b in BATCHES if b <= max_batch]:
            place_sessions(llm, b, context)
            step_s = time_steps(llm)                 # overlapped steps (the engine's default)
            llm.engine.overlap = False
            plain_s = time_steps(llm)                # each step's tokens read before the next is planned
            llm.engine.overlap = True
            graph_ms = graph_replay_ms(llm, b)
            if context == CONTEXTS[0] and b in (1, 16, 64):
                breakdowns[b] = kernel_breakdown(llm, b)
                breakdowns[f"graph {b}"] = graph_kernel_breakdown(llm, b)
            clear(llm)
            kv_read = b * (context + 8) * kvtok          # contexts grow by ~8 tokens over the timed steps
            roofline_s = (wbytes + kv_read) / copy_bps
            base = base or b / step_s
            rows.append(dict(context=context, batch=b, step_ms=step_s * 1e3, step_ms_no_overlap=plain_s * 1e3,
                             graph_ms=graph_ms, tok_s=b / step_s,
                             vs_b1=(b / step_s) / base, roofline_ms=roofline_s * 1e3,
                             step_over_roofline=step_s / roofline_s,
                             gbps=(wbytes + kv_read) / step_s / 1e9))
            print(f"  ctx {context:5d} B {b:4d}: {step_s * 1e3:7.2f} ms/step ({plain_s * 1e3:6.2f} not overlapped)  "
                  f"{b / step_s:8.0f} tok/s  "
                  f"x{(b / step_s) / base:5.2f} vs B=1  {step_s / roofline_s:4.2f}x roofline", flush=True)
    prefill = []
    for n in PREFILL:
        ids = torch.randint(0, llm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        llm.engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))        # warm-up, compile
        samples = []
        for _ in range(PREFILL_SAMPLES):   # one wall-clock sample can catch a stall: the median of a few
            ids = [(i + 1) % llm.config.vocab_size for i in ids]                          # defeat the prefix cache
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))
            samples.append(time.perf_counter() - t)
        dt = statistics.median(samples)
        ids = [(i + 1) % llm.config.vocab_size for i in ids]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        profiled = prefill_profile(lambda engine=llm.engine, ids=ids: engine.generate([ids], params))
        prefill.append(dict(prompt_tokens=n, seconds=dt, tok_s=n / dt, samples_s=samples, profile=profiled))
        print(f"  prefill {n}: {n / dt:8.0f} tok/s; profiled: GPU busy {profiled['gpu_busy_ms']:.1f} ms of "
              f"{profiled['wall_ms']:.1f} ms wall, {profiled['launches']} launches", flush=True)
    label = os.path.basename(path) + (" +dense" if dense else "")
    label += f" kv={kv_cache_dtype}" if kv_cache_dtype != "auto" else ""
    label += f" +lora r{lora[0]} x{lora[1]}" if lora else ""
    out = dict(model=label, kv_cache_dtype=str(llm.engine.pool.dtype).removeprefix("torch."), load_s=load_s,
               weight_bytes=wbytes, kv_bytes_per_token=kvtok,
               decode=rows, prefill=prefill, kernel_breakdown=breakdowns, stats=dataclasses.asdict(llm.engine.stats))
    del llm
    torch.cuda.empty_cache()
    return out


def hf_peer(batches=(1, 4, 16, 64), context: int = 512) -> list[dict]:
    """Llama-3-8B shape in bf16 through transformers (random init; the weights don't change the time)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    rows = []
    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, context), device="cuda")
        with torch.inference_mode():
            out = model(ids, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            times = []
            for i in range(8):
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model(nxt, past_key_values=past, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t)
                past = out.past_key_values
        ms = statistics.median(times) * 1e3
        rows.append(dict(batch=b, context=context, step_ms=ms, tok_s=b / ms * 1e3))
        print(f"  transformers bf16 B {b:3d}: {ms:7.2f} ms/step", flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def plot(results: dict, copy_bps: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(CONTEXTS), figsize=(6 * len(CONTEXTS), 4.5), squeeze=False)
    for ax, context in zip(axes[0], CONTEXTS):
        for m in results["models"]:
            rows = [r for r in m["decode"] if r["context"] == context]
            bs = [r["batch"] for r in rows]
            ax.plot(bs, [r["tok_s"] for r in rows], "o-", label=f"{m['model']}")
            roof = [b / ((m["weight_bytes"] + b * (context + 8) * m["kv_bytes_per_token"]) / copy_bps) for b in bs]
            ax.plot(bs, roof, "--", label=f"roofline {m['model']}")
        if results.get("hf_peer") and context == 512:
            ax.plot([r["batch"] for r in results["hf_peer"]], [r["tok_s"] for r in results["hf_peer"]], "s:",
                    label="transformers bf16")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sessions B")
        ax.set_ylabel("aggregate decode tok/s")
        ax.set_title(f"Llama-3-8B shape, context {context}, H200")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--kv-cache-gb", type=float, default=72.0)
    ap.add_argument("--hf-peer", action="store_true")
    ap.add_argument("--dense-large-batch", action="store_true",
                    help="also keep bf16 weights for batches above the GEMV crossover")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="comma-separated KV cache dtypes, each measured in its own load (e.g. auto,fp8)")
    ap.add_argument("--contexts", default=None, help="comma-separated contexts (default 512,4096)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,2,3,4,8,...,128)")
    ap.add_argument("--lora", default=None, metavar="RxC",
                    help="each model also with C random LoRA adapters of rank R, every session through one (16x4)")
    args = ap.parse_args()
    lora = tuple(int(v) for v in args.lora.lower().split("x")) if args.lora else None
    global CONTEXTS, BATCHES
    if args.contexts:
        CONTEXTS = [int(c) for c in args.contexts.split(",")]
    if args.batches:
        BATCHES = [int(b) for b in args.batches.split(",")]
    copy_bps = copy_bandwidth()
    print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s", flush=True)
    tree = provenance.tree()
    results = dict(date=str(datetime.date.today()), tree=tree, command=" ".join(sys.argv),
                   quant_gemm=os.environ.get("COBATCH_QUANT_GEMM") != "0", device=torch.cuda.get_device_name(),
                   torch=torch.__version__, copy_gbps=copy_bps / 1e9, models=[])
    for path in args.model:
        for kv_dtype in args.kv_cache_dtype.split(","):
            print(f"== {path} (KV cache {kv_dtype})", flush=True)
            results["models"].append(bench_model(path, copy_bps, args.max_batch, args.kv_cache_gb,
                                                 args.dense_large_batch, kv_dtype))
            if lora:
                print(f"== {path} (KV cache {kv_dtype}) with {lora[1]} LoRA adapters of rank {lora[0]}", flush=True)
                results["models"].append(bench_model(path, copy_bps, args.max_batch, args.kv_cache_gb,
                                                     args.dense_large_batch, kv_dtype, lora))
    if args.hf_peer:
        results["hf_peer"] = hf_peer()
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(results, indent=1))
    try:
        plot(results, copy_bps, out / "decode.png")
    except Exception as e:      # the plot is a convenience; the JSON is the record
        print(f"plot failed: {e}")
    print(f"\ncopy {copy_bps / 1e9:.0f} GB/s; step time, aggregate tok/s, x vs B=1, step/roofline")
    for m in results["models"]:
        print(m["model"], f"weights {m['weight_bytes'] / 1e9:.2f} GB, load {m['load_s']:.0f}s")
        for r in m["decode"]:
            print(f"  ctx {r['context']:5d} B {r['batch']:4d} {r['step_ms']:7.2f} ms (not overlapped "
                  f"{r['step_ms_no_overlap']:6.2f}, graph {r['graph_ms']:6.2f}) "
                  f"{r['tok_s']:8.0f} tok/s "
                  f"x{r['vs_b1']:6.2f}  {r['step_over_roofline']:4.2f}x roof  {r['gbps']:6.0f} GB/s "
                  f"({r['gbps'] * 1e9 / copy_bps:4.0%} of copy)")
        for b, kernels in m["kernel_breakdown"].items():
            what = f"graph replay B={b.split()[1]}" if str(b).startswith("graph") else f"eager step B={b}"
            print(f"  {what}, ctx {CONTEXTS[0]}, GPU time by kernel:")
            for k in kernels[:8]:
                print(f"    {k['ms']:7.3f} ms  {k['calls']:4d}x  {k['kernel']}")
        for p in m["prefill"]:
            print(f"  prefill {p['prompt_tokens']}: {p['tok_s']:.0f} tok/s")
    for r in results.get("hf_peer", []):
        print(f"  transformers bf16 B {r['batch']}: {r['step_ms']:.2f} ms/step")


if __name__ == "__main__":
    main()
