"""Prompt-lookup speculative decoding against plain decoding, on the CPU path or CUDA.

    python bench/speculative.py [--device cpu|cuda] [--model PATH] [--tokens 96] [--batches 1,8] [--k 4]

For each prompt kind (text the model repeats; a free-form question) and batch B, greedy decode with and
without --speculative-config {"method": "ngram", "num_speculative_tokens": k}: tokens/s, steps, drafts
proposed and kept. GB/s is the weight bytes every step reads (steps x weight bytes / time) and its ratio to a
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from cobatch.engine.sampler import SamplingParams  # noqa: E402
from cobatch.engine.speculative import NgramSpec  # noqa: E402
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


def run(llm: LLM, prompt: list[int], batch: int, tokens: int) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    drafted, kept = eng.stats.draft_tokens, eng.stats.accepted_tokens
    ids = [eng.add_request(prompt + [i + 10] * (i > 0), params) for i in range(batch)]   # distinct sessions
    while any(eng.seqs[i].num_output == 0 for i in ids):     # prefill first; time the decode steps only
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
                drafted=eng.stats.draft_tokens - drafted, kept=eng.stats.accepted_tokens - kept)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    copy_bps = copy_bandwidth() if cuda else cpu_copy_bandwidth()
    print(f"copy bandwidth: {copy_bps / 1e9:.1f} GB/s", flush=True)
    rows = []
    for label, spec in (("plain", None), (f"ngram k={args.k}", NgramSpec(args.k))):
        llm = LLM.load(args.model, EngineOptions(device=args.device, ctx=1024, max_num_seqs=8, quiet=True,
                                                 speculative=spec))
        wbytes = weight_bytes(llm)
        llm.engine.generate([llm.encode_prompt("Hello")], SamplingParams(temperature=0.0, max_tokens=8))   # warm-up
        for kind, text in PROMPTS.items():
            for b in [int(x) for x in args.batches.split(",")]:
                r = run(llm, llm.encode_prompt(text), b, args.tokens)
                r.update(mode=label, prompt=kind, gbps=r["steps"] * wbytes / r["seconds"] / 1e9)
                rows.append(r)
                print(f"  {label:10s} {kind:8s} B={b}: {r['tok_s']:7.1f} tok/s, {r['steps']} steps, drafts "
                      f"{r['drafted']} kept {r['kept']}, {r['gbps']:.1f} GB/s of weights", flush=True)
        del llm
    result = dict(date=str(datetime.date.today()), command=" ".join(["python"] + sys.argv), device=args.device,
                  torch=torch.__version__, copy_gbps=copy_bps / 1e9, tokens=args.tokens, rows=rows)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"speculative-{result['date']}-{args.device.split(':')[0]}.json").write_text(json.dumps(result, indent=1))
    print(f"\ncopy {copy_bps / 1e9:.1f} GB/s; greedy, {args.tokens} tokens per session")
    print("mode        prompt    B    tok/s  steps  drafts  kept  GB/s  of copy  speed-up")
    base = {(r["prompt"], r["batch"]): r["tok_s"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        print(f"{r['mode']:10s}  {r['prompt']:8s} {r['batch']:2d}  {r['tok_s']:7.1f}  {r['steps']:5d}  "
              f"{r['drafted']:6d}  {r['kept']:4d}  {r['gbps']:5.1f}  {r['gbps'] * 1e9 / copy_bps:6.0%}  "
              f"{r['tok_s'] / base[(r['prompt'], r['batch'])]:6.2f}x")


if __name__ == "__main__":
    main()
