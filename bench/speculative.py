"""Prompt-lookup speculative decoding against plain decoding, on the CPU path or CUDA.

    python bench/speculative.py [--device cpu|cuda] [--model PATH] [--tokens 96] [--batches 1,8] [--k 4]
                                [--drafts lookup,oracle,wrong] [--model-draft SMALL.gguf]

One engine with --speculative-config {"method": "ngram", "num_speculative_tokens": k} (on CUDA its decode
graphs hold B x (1 + k) rows). For each prompt kind (text the model repeats; a free-form question) and
batch B, greedy decode of B sessions, timed over the decode steps, with each way of drafting:
- plain: no drafts;
- lookup: the engine's own prompt-lookup drafts;
- oracle: the plain run's next k tokens, so every draft is kept (the most speculation can give: what a step
  of B x (1 + k) rows costs against one of B rows);
- cold: plain decoding with an empty prefix cache (the first run of each prompt; the rows after it find their
  prompt blocks cached, and "as plain" compares each with the warm plain run);
- wrong: the same tokens shifted by one id, so none is kept (what failing drafts cost). Its steps have the
  rows the oracle's have, so its ms/step against plain's is the price of a step's drafts, kept or not;
- predicted: the plain run's whole output sent as the request's `prediction` (OpenAI's Predicted Outputs, the
  engine's own prediction drafts, as a server request gets them);
- edited: that prediction with every 16th token changed (an edit the output does not follow: the drafts
  recover by the n-gram search of the prediction);
- draft-model (with --model-draft): a second engine on the same model whose drafts come from that draft model
  (engine/draft_model.py), its passes included in the step time.
The oracle and wrong rows measure the machinery on any model, random weights included; lookup needs a model
whose text repeats. GB/s is the weight bytes every step reads (steps x weight bytes / time) and its ratio to a
copy measured in this run (device-to-device on CUDA, a 256 MiB tensor copy on the CPU). A short table last;
JSON to $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `decode` by name
from decode import copy_bandwidth, weight_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]   # the tree's src is on sys.path: decode (provenance.use_tree_source)

from cobatch.engine.sampler import SamplingParams  # noqa: E402
from cobatch.engine.drafts import DraftModelSpec, NgramSpec  # noqa: E402
from cobatch.llm import LLM, EngineOptions  # noqa: E402

PROMPTS = {
    "repeats": "apple banana cherry dates elderberry fig grape. " * 3 + "apple banana",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def cpu_copy_bandwidth() -> float:
    src = torch.randn(1 << 26)                               # 256 MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times)


def run(llm: LLM, prompt: list[int], batch: int, tokens: int, drafter=None, predictions=None) -> dict:
    """Greedy decode of `batch` sessions; drafter(session, seq, budget) -> drafts, or None for none;
    predictions: each session's `prediction` (token ids)."""
    eng = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                             prediction=tuple(predictions[i]) if predictions else ()) for i in range(batch)]
    drafted, kept = eng.stats.draft_tokens, eng.stats.accepted_tokens
    ids = [eng.add_request(prompt + [i + 10] * (i > 0), params[i]) for i in range(batch)]   # distinct sessions
    session = {rid: i for i, rid in enumerate(ids)}
    eng.scheduler.draft = None if drafter is None else lambda seq, budget: drafter(session[seq.request_id], seq,
                                                                                     budget)
    seqs = [eng.seqs[i] for i in ids]
    while any(seq.num_output == 0 for seq in seqs):         # prefill first; time the decode steps only
        eng.step()
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    t, steps = time.perf_counter(), 0
    while eng.has_work():
        eng.step()
        steps += 1
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    decoded = batch * (tokens - 1)
    return dict(batch=batch, steps=steps, seconds=seconds, tok_s=decoded / seconds,
                drafted=eng.stats.draft_tokens - drafted, kept=eng.stats.accepted_tokens - kept,
                outputs=[seq.output_ids for seq in seqs])


def drafters(llm: LLM, k: int, plain_outputs: list[list[int]]) -> dict:
    """The ways of drafting, as drafter(session, seq, budget) functions (see the module docstring)."""
    eng, vocab = llm.engine, llm.config.vocab_size

    def upcoming(i, seq, budget):
        room = min(k, budget, seq.params.max_tokens - seq.num_output - 1)
        return plain_outputs[i][seq.num_output:seq.num_output + max(room, 0)]

    def own(i, seq, budget):              # the engine's drafts: prompt lookup, or the request's prediction
        return eng._draft(seq, budget)

    return {"lookup": own, "predicted": own, "edited": own,
            "oracle": upcoming,
            "wrong": lambda i, seq, budget: [(t + 1) % vocab for t in upcoming(i, seq, budget)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--drafts", default="lookup", help="comma list of lookup, oracle, wrong, predicted, edited")
    ap.add_argument("--step-rows", default="", help="comma list of caps on a step's rows with drafts to try "
                    "(default: the engine's own)")
    ap.add_argument("--model-draft", default=None, help="also time drafts from this draft model (same vocabulary)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    copy_bps = copy_bandwidth() if cuda else cpu_copy_bandwidth()
    print(f"copy bandwidth: {copy_bps / 1e9:.1f} GB/s", flush=True)
    batches = [int(x) for x in args.batches.split(",")]
    caps = [int(c) for c in args.step_rows.split(",")] if args.step_rows else [None]
    # Slots for the largest batch, and decode graphs for the largest cap tried (they hold max_num_seqs rows or more)
    slots = max(batches + [c for c in caps if c])
    kv_gb = 4.0 if cuda else None       # room for a second engine beside it (--model-draft)
    llm = LLM.load(args.model, EngineOptions(device=args.device, ctx=1024, quiet=True, speculative=NgramSpec(args.k),
                                             max_num_seqs=slots, kv_cache_gb=kv_gb))
    drafted_llm = None
    if args.model_draft:
        drafted_llm = LLM.load(args.model, EngineOptions(device=args.device, ctx=1024, quiet=True, max_num_seqs=slots,
                                                         kv_cache_gb=kv_gb,
                                                         speculative=DraftModelSpec(args.model_draft, args.k)))
    wbytes = weight_bytes(llm)
    llm.engine.generate([llm.encode_prompt("Hello")], SamplingParams(temperature=0.0, max_tokens=8))   # warm-up
    rows = []
    own_cap = llm.engine.scheduler.draft_rows
    for kind, text in PROMPTS.items():
        for b in batches:
            # The first run fills the prefix cache; every later one reads its prompt blocks from there and
            # recomputes only the last partial block, which can round differently: compare warm with warm.
            cold = run(llm, llm.encode_prompt(text), b, args.tokens)
            plain = run(llm, llm.encode_prompt(text), b, args.tokens)
            want = plain["outputs"]
            ways = drafters(llm, args.k, want)
            vocab = llm.config.vocab_size
            predictions = {"predicted": want,
                           "edited": [[(t + 1) % vocab if j % 16 == 15 else t for j, t in enumerate(o)] for o in want]}
            results = [("cold", cold), ("plain", plain)]
            for cap in caps:
                llm.engine.scheduler.draft_rows = own_cap if cap is None else cap
                results += [(name if cap is None else f"{name}@{cap}",
                             run(llm, llm.encode_prompt(text), b, args.tokens, ways[name], predictions.get(name)))
                            for name in args.drafts.split(",")]
            if drafted_llm is not None:
                engine = drafted_llm.engine
                results.append(("draft-model", run(drafted_llm, llm.encode_prompt(text), b, args.tokens,
                                                   lambda i, seq, budget: engine._draft(seq, budget))))
            for label, r in results:
                r.update(mode=label, prompt=kind, gbps=r["steps"] * wbytes / r["seconds"] / 1e9,
                         same_as_plain=sum(o == p for o, p in zip(r.pop("outputs"), want)))
                rows.append(r)
                print(f"  {label:10s} {kind:8s} B={b}: {r['tok_s']:8.1f} tok/s, {r['steps']} steps, drafts "
                      f"{r['drafted']} kept {r['kept']}, {r['gbps']:.1f} GB/s of weights, outputs as plain "
                      f"{r['same_as_plain']}/{b}", flush=True)
    result = dict(date=str(datetime.date.today()), command=" ".join(["python"] + sys.argv), device=args.device,
                  model=str(llm.path), torch=torch.__version__, copy_gbps=copy_bps / 1e9, tokens=args.tokens,
                  k=args.k, rows=rows)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"speculative-{result['date']}-{args.device.split(':')[0]}.json").write_text(json.dumps(result, indent=1))
    print(f"\ncopy {copy_bps / 1e9:.1f} GB/s; greedy, {args.tokens} tokens per session, k = {args.k}")
    print("drafts      prompt    B     tok/s  steps  ms/step  drafts  kept  as plain   GB/s  of copy  speed-up")
    base = {(r["prompt"], r["batch"]): r["tok_s"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        print(f"{r['mode']:10s}  {r['prompt']:8s} {r['batch']:3d}  {r['tok_s']:8.1f}  {r['steps']:5d}  "
              f"{1e3 * r['seconds'] / r['steps']:7.3f}  "
              f"{r['drafted']:6d}  {r['kept']:4d}  {r['same_as_plain']:3d}/{r['batch']:<3d}  {r['gbps']:6.1f}  "
              f"{r['gbps'] * 1e9 / copy_bps:6.0%}  {r['tok_s'] / base[(r['prompt'], r['batch'])]:6.2f}x")


if __name__ == "__main__":
    main()
