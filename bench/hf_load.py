"""A Hugging Face checkpoint folder on the GPU: bf16 weights quantized on load, against the same shape from a GGUF.

    PYTHONPATH=src python bench/hf_load.py --folder /tmp/llama3-8b-hf --gguf /tmp/llama3-8b-q8_0.gguf
        [--shape llama3-8b] [--quantization q8_0] [--batches 1,16,64]

The folder is written first where it is absent (random bf16 weights drawn on the GPU,
testing/hf_checkpoints.write_random_checkpoint). Then, for the folder and for the GGUF (same shape; after the
quantization the same format, so the goal is a step within 5 % of the GGUF's): the load time (open, quantize
every matrix on the GPU and pack it, the KV pool, the decode graphs), the resident weight bytes, and the decode
step at each batch (ctx 512) with its GB/s and ratio to a device-to-device copy measured in this run. Prints a
short table last; JSON to $OUT or bench/results/hf_load.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `decode` by name
from decode import clear, copy_bandwidth, kv_bytes_per_token, place_sessions, randomize_kv, time_steps  # noqa: E402
from decode import weight_bytes  # noqa: E402
import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]   # the tree's src is on sys.path: decode (provenance.use_tree_source)

from cobatch.llm import LLM, EngineOptions  # noqa: E402
from cobatch.models.linear import resident_bytes  # noqa: E402
from cobatch.testing.hf_checkpoints import write_random_checkpoint  # noqa: E402

CONTEXT = 512


def measure(path: str, quantization: str, batches: list[int], copy_bps: float) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm = LLM.load(path, EngineOptions(device="cuda", ctx=CONTEXT + 256, max_num_seqs=max(batches), kv_cache_gb=8.0,
                                       quantization=quantization))
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    randomize_kv(llm)
    wbytes, kvtok = weight_bytes(llm), kv_bytes_per_token(llm)
    rows = []
    for b in batches:
        place_sessions(llm, b, CONTEXT)
        step_s = time_steps(llm)
        clear(llm)
        step_bytes = wbytes + b * (CONTEXT + 8) * kvtok
        rows.append(dict(batch=b, step_ms=step_s * 1e3, tok_s=b / step_s, gbps=step_bytes / step_s / 1e9,
                         of_copy=step_bytes / step_s / copy_bps))
        print(f"  {Path(path).name} B {b:3d}: {step_s * 1e3:6.2f} ms/step", flush=True)
    held = resident_bytes(llm.model)
    out = dict(path=path, load_s=load_s, resident_bytes=held, weight_bytes=wbytes, decode=rows)
    del llm
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True, help="a checkpoint folder (written with random weights if absent)")
    ap.add_argument("--gguf", help="a GGUF of the same shape to compare with")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--quantization", default="q8_0")
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    folder = Path(args.folder)
    if not (folder / "config.json").exists():
        t0 = time.perf_counter()
        write_random_checkpoint(folder, args.shape, device="cuda")
        print(f"wrote {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    copy_bps = copy_bandwidth()
    print(f"copy bandwidth: {copy_bps / 1e9:.0f} GB/s", flush=True)
    runs = {"folder": measure(str(folder), args.quantization, batches, copy_bps)}
    if args.gguf:
        runs["gguf"] = measure(args.gguf, "auto", batches, copy_bps)
    tree = provenance.tree()
    result = dict(date=str(datetime.date.today()), tree=tree, command=" ".join(sys.argv),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=copy_bps / 1e9,
                  shape=args.shape, quantization=args.quantization, context=CONTEXT, runs=runs)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_load.json").write_text(json.dumps(result, indent=1))
    print(f"\ncopy {copy_bps / 1e9:.0f} GB/s; {args.shape}, the folder's bf16 quantized to {args.quantization} on load")
    print("  source  load s  resident GB  " + "  ".join(f"B={b} ms (of copy)" for b in batches))
    for name, r in runs.items():
        steps = "  ".join(f"{d['step_ms']:7.2f} ({d['of_copy']:4.0%})" for d in r["decode"])
        print(f"  {name:6s}  {r['load_s']:6.1f}  {sum(r['resident_bytes'].values()) / 1e9:11.2f}  {steps}")
    if "gguf" in runs:
        ratio = [f["step_ms"] / g["step_ms"] for f, g in zip(runs["folder"]["decode"], runs["gguf"]["decode"])]
        print("  folder / gguf step: " + ", ".join(f"{x:.3f}" for x in ratio))


if __name__ == "__main__":
    main()
