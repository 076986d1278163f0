"""Beyond one GPU: the decode step at each tensor-parallel size, and serving throughput at each data-parallel size.

    PYTHONPATH=src python bench/parallel.py step --model L3-8B-q4_k_m.gguf --tp 1,2 [--batches 1,8,64]
    PYTHONPATH=src python bench/parallel.py serve --model L3-8B-q4_k_m.gguf --dp 1,2 [--clients-per-replica 64]
    PYTHONPATH=src python bench/parallel.py step --cpu-smoke      # SmolLM2 (4 layers) on the CPU, TP 1 and 3

step: for each TP size, the model loaded over that many GPUs (cobatch.parallel.launch.load, the server's own
path: decode steps in CUDA graphs, the all-reduces captured inside them), B greedy sessions, then the engine's
step time over --steps decode steps (each a whole step: planning, replay, sampling, the one host sync). The goal
(docs/scale-out.md): TP = 2 at B = 1 at most 0.6x the TP = 1 step.
serve: for each DP size, `cobatch serve -dp N` (N replicas, one GPU each), then bench/serve.py --url against it
with N x --clients-per-replica streaming clients; its JSON's steady tok/s per level is kept. The goal: DP = 2
at least 1.9x DP = 1 at 64 clients per GPU.
JSON to $OUT/parallel-step.json / parallel-serve.json (or bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _out_dir() -> Path:
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    return out


def step_times(model: str, tp: int, batches: list[int], steps: int, device: str, ctx: int) -> list[dict]:
    import torch
    from cobatch.engine.sampler import SamplingParams
    from cobatch.llm import EngineOptions
    from cobatch.parallel import launch
    llm = launch.load(model, EngineOptions(device=device, ctx=ctx, max_num_seqs=max(batches), quiet=False,
                                           tensor_parallel_size=tp))
    engine, rows = llm.engine, []
    try:
        for b in batches:
            params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
            ids = [engine.add_request([1 + (i * 7 + j) % 1000 for j in range(32)], params) for i in range(b)]
            while any(engine.seqs[i].num_output == 0 for i in ids):     # every session past its prefill
                engine.step()
            for _ in range(4):
                engine.step()
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            ms = (time.perf_counter() - start) / steps * 1e3
            for i in ids:
                engine.abort(i)
            while engine.has_work():
                engine.step()
            rows.append({"tp": tp, "batch": b, "step_ms": round(ms, 3), "tok_s": round(b / ms * 1e3, 1)})
            print(f"TP={tp} B={b}: {ms:.2f} ms/step, {b / ms * 1e3:.0f} tok/s", flush=True)
    finally:
        if llm.ranks is not None:
            llm.ranks.stop()
    return rows


def serve_throughput(model: str, dp: int, clients_per_replica: int, output_tokens: int, device: str) -> dict:
    import httpx
    port = 18000 + dp
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen([sys.executable, "-m", "cobatch.cli", "serve", model, "-dp", str(dp), "--device", device,
                               "--port", str(port), "--parallel", str(clients_per_replica)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"cobatch serve -dp {dp} exited ({server.returncode})")
            time.sleep(1)
        out = _out_dir() / f"parallel-serve-dp{dp}"
        out.mkdir(exist_ok=True)
        clients = dp * clients_per_replica
        subprocess.run([sys.executable, str(ROOT / "bench" / "serve.py"), "--url", url, "--levels", str(clients),
                        "--rounds", "1", "--output-tokens", str(output_tokens), "--stall-streams", "0"],
                       env=dict(env, OUT=str(out)), check=True)
        result = json.loads((out / "serve.json").read_text())
        level = result["levels"][-1]
        return {"dp": dp, "clients": clients, "steady_tok_s": level.get("steady_tok_s"),
                "whole_run_tok_s": level.get("whole_run_tok_s")}
    finally:
        server.terminate()
        server.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["step", "serve"])
    ap.add_argument("--model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--dp", default="1,2")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--clients-per-replica", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--cpu-smoke", action="store_true", help="SmolLM2 cut to 4 layers on the CPU, TP 1 and 3")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        from cobatch.model_files import smollm2_path
        from cobatch.testing.gguf_writer import cut_layers
        args.model = str(cut_layers(smollm2_path(), _out_dir() / "smollm2-4l.gguf", 4))
        args.device, args.tp, args.dp, args.batches, args.steps, args.ctx = "cpu", "1,3", "1,2", "1,4", 8, 256
        args.clients_per_replica, args.output_tokens = 2, 16
    if not args.model:
        ap.error("--model is required (or --cpu-smoke)")
    record = {"measures": f"bench/parallel.py {args.what}", "reproduce": " ".join(["bench/parallel.py"] + sys.argv[1:]),
              "recorded": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model}
    if args.what == "step":
        batches = [int(b) for b in args.batches.split(",")]
        record["steps"] = [row for tp in map(int, args.tp.split(","))
                           for row in step_times(args.model, tp, batches, args.steps, args.device, args.ctx)]
        base = {r["batch"]: r["step_ms"] for r in record["steps"] if r["tp"] == 1}
        for r in record["steps"]:
            if r["batch"] in base:
                r["vs_tp1"] = round(r["step_ms"] / base[r["batch"]], 3)
    else:
        record["serve"] = [serve_throughput(args.model, dp, args.clients_per_replica, args.output_tokens, args.device)
                           for dp in map(int, args.dp.split(","))]
        one = next((r["steady_tok_s"] for r in record["serve"] if r["dp"] == 1), None)
        for r in record["serve"]:
            if one and r["steady_tok_s"]:
                r["vs_dp1"] = round(r["steady_tok_s"] / one, 3)
    path = _out_dir() / f"parallel-{args.what}.json"
    path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
