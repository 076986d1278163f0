"""Soak test: many streaming clients for a long time, then a check that the server is as clean as it started.

    PYTHONPATH=src python bench/soak.py --model L3-8B-random.gguf --device cuda        # 256 clients, 600 s
    PYTHONPATH=src python bench/soak.py --clients 4 --seconds 20 --device cpu          # SmolLM2, a quick check
    PYTHONPATH=src python bench/soak.py --url http://127.0.0.1:8000 --seconds 60       # a server already running

Each client loops until the deadline (and at most --max-requests-each times): a streaming chat completion with
a random prompt length and max_tokens (ignore_eos, so the lengths are what was asked), of which --disconnect
are dropped after a random number of chunks; and --malformed of its requests are bad bodies (broken JSON,
wrong types, unknown fields, oversized values) that must get a 4xx. A stream with no event for --stall-s is
counted as hung and dropped. Only 127.0.0.1 is ever contacted.

At the end, once the server is idle (polled with a deadline), /metrics tells whether anything leaked: requests
still holding a slot, KV blocks still held, queued requests. Memory: the server's RSS (when this script
started it) and the GPU's used memory (nvidia-smi), after a warm-up (--warmup-s) and at the end. Prints a
table; writes JSON to $OUT or bench/results/soak-<time>.json. Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

WORDS = ("river stone lamp winter harbour letter engine garden window signal market bridge candle "
         "mountain ledger orchard compass lantern").split()
MALFORMED = [
    b"{not json",
    b'{"messages": "not a list", "max_tokens": 4}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 100000}',
    b'{"messages": [{"role": "user", "content": "hi"}], "use_beam_search": true}',
    b"[]",
    b"",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gpu_used_mb() -> float | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series with labels: value} (summed over nothing: one key per line)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


class Tally:
    def __init__(self):
        self.counts: dict[str, int] = {}
        self.status: dict[int, int] = {}
        self.tokens = 0

    def add(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def saw(self, status: int) -> None:
        self.status[status] = self.status.get(status, 0) + 1


async def one_stream(http: httpx.AsyncClient, rng: random.Random, args, tally: Tally) -> None:
    words = rng.randint(args.min_prompt_words, args.max_prompt_words)
    content = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {"model": "soak", "messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": rng.randint(args.min_tokens, args.max_tokens), "temperature": 0.8,
            "seed": rng.randrange(1 << 30), "ignore_eos": True}
    drop_after = rng.randint(1, 8) if rng.random() < args.disconnect else None
    chunks = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        tally.saw(r.status_code)
        if r.status_code != 200:
            await r.aread()
            tally.add("rejected" if r.status_code in (429, 503) else "error")
            return
        lines = r.aiter_lines()
        while True:
            try:
                line = await asyncio.wait_for(anext(lines), args.stall_s)
            except StopAsyncIteration:
                tally.add("unterminated")        # the stream ended without [DONE]
                return
            except asyncio.TimeoutError:
                tally.add("hung")
                return
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                tally.add("completed")
                return
            chunks += 1
            tally.tokens += 1
            if drop_after is not None and chunks >= drop_after:
                tally.add("disconnected")
                return                           # leaving the block closes the connection mid-stream


async def one_malformed(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    r = await http.post("/v1/chat/completions", content=rng.choice(MALFORMED),
                        headers={"content-type": "application/json"})
    tally.saw(r.status_code)
    tally.add("malformed_4xx" if 400 <= r.status_code < 500 else "malformed_not_4xx")


async def client(i: int, url: str, deadline: float, args, tally: Tally) -> None:
    rng = random.Random(args.seed * 100003 + i)
    timeout = httpx.Timeout(args.stall_s, connect=30)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        for _ in range(args.max_requests_each):
            if time.monotonic() >= deadline:
                return
            try:
                if rng.random() < args.malformed:
                    await one_malformed(http, rng, tally)
                else:
                    await one_stream(http, rng, args, tally)
            except httpx.TimeoutException:
                tally.add("hung")
            except httpx.HTTPError as exc:
                tally.add(f"transport:{type(exc).__name__}")


async def poll(condition, timeout: float, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(step)


async def fetch_metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return parse_metrics((await http.get("/metrics")).text)


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from cobatch.cli import main; sys.exit(main())", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--parallel", str(args.parallel),
           "--max-queue", str(args.max_queue), "--device", args.device, "--accept-any-model", *args.serve_arg]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.server_log, "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.load_timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"soak: the server did not become ready (see {args.server_log})")


async def soak(args, url: str, pid: int | None) -> dict:
    started = time.monotonic()
    deadline = started + args.seconds
    tally = Tally()
    memory = {"start": {"rss_mb": rss_mb(pid), "gpu_mb": gpu_used_mb()}}
    tasks = [asyncio.create_task(client(i, url, deadline, args, tally)) for i in range(args.clients)]
    await asyncio.sleep(min(args.warmup_s, args.seconds))
    memory["warm"] = {"rss_mb": rss_mb(pid), "gpu_mb": gpu_used_mb()}
    # Every client stops at the deadline or after its stream's stall limit; wait a bounded time beyond that.
    done, pending = await asyncio.wait(tasks, timeout=args.seconds + 2 * args.stall_s + 30)
    for task in pending:
        task.cancel()
    tally.add("clients_cut_off", len(pending))

    async def idle():
        m = await fetch_metrics(url)
        return m if m.get("cobatch_running_requests") == 0 and m.get("cobatch_queue_depth") == 0 \
            and m.get("cobatch_kv_blocks_used") == 0 else None
    metrics = await poll(idle, args.idle_timeout_s) or await fetch_metrics(url)
    memory["end"] = {"rss_mb": rss_mb(pid), "gpu_mb": gpu_used_mb()}
    server_5xx = sum(v for k, v in metrics.items() if re.match(r'cobatch_http_errors_total\{status="5\d\d"\}', k))
    client_5xx = sum(n for status, n in tally.status.items() if status >= 500)
    growth = {key: (memory["end"][key] / memory["warm"][key] - 1) if memory["warm"][key] else None
              for key in ("rss_mb", "gpu_mb")}
    result = {
        "clients": args.clients, "seconds": args.seconds, "wall_s": round(time.monotonic() - started, 1),
        "counts": tally.counts, "http_status": {str(k): v for k, v in sorted(tally.status.items())},
        "stream_chunks": tally.tokens,
        "checks": {
            "5xx": int(max(server_5xx, client_5xx)),
            "hung_streams": tally.counts.get("hung", 0) + tally.counts.get("unterminated", 0),
            "leaked_slots": int(metrics.get("cobatch_running_requests", -1)),
            "leaked_kv_blocks": int(metrics.get("cobatch_kv_blocks_used", -1)),
            "queued_at_end": int(metrics.get("cobatch_queue_depth", -1)),
            "malformed_not_4xx": tally.counts.get("malformed_not_4xx", 0),
        },
        "memory": memory, "memory_growth_after_warmup": growth,
    }
    flat = all(g is None or abs(g) <= args.memory_tolerance for g in growth.values())
    result["ok"] = flat and not any(result["checks"].values()) and not pending
    return result


def report(result: dict) -> None:
    checks = result["checks"]
    print(f"\nsoak: {result['clients']} clients, {result['seconds']} s (wall {result['wall_s']} s), "
          f"{result['stream_chunks']} stream chunks")
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(result["counts"].items())))
    print(f"  {'check':<22}{'value':>10}")
    for name, value in checks.items():
        print(f"  {name:<22}{value:>10}")
    for key in ("rss_mb", "gpu_mb"):
        start, warm, end = (result["memory"][p][key] for p in ("start", "warm", "end"))
        growth = result["memory_growth_after_warmup"][key]
        shown = "n/a" if warm is None else f"{start:.0f} / {warm:.0f} / {end:.0f} MB ({growth:+.1%} after warm-up)"
        print(f"  {key:<22}{shown:>10}")
    print(f"  {'ok':<22}{str(result['ok']):>10}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server on 127.0.0.1 (default: start `cobatch serve`)")
    p.add_argument("--model", help="GGUF for the server started here (default: SmolLM2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--parallel", type=int, default=64, help="the started server's slots")
    p.add_argument("--max-queue", type=int, default=512)
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for `cobatch serve`")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--warmup-s", type=float, default=None, help="memory baseline time (default: 10 %% of --seconds)")
    p.add_argument("--min-prompt-words", type=int, default=4)
    p.add_argument("--max-prompt-words", type=int, default=600)
    p.add_argument("--min-tokens", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--disconnect", type=float, default=0.1, help="share of streams dropped mid-way")
    p.add_argument("--malformed", type=float, default=0.05, help="share of requests with a bad body")
    p.add_argument("--max-requests-each", type=int, default=100_000)
    p.add_argument("--stall-s", type=float, default=120, help="a stream silent this long is hung")
    p.add_argument("--idle-timeout-s", type=float, default=60, help="how long to wait for the server to go idle")
    p.add_argument("--load-timeout-s", type=float, default=900)
    p.add_argument("--memory-tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default="soak-server.log")
    args = p.parse_args()
    args.warmup_s = args.seconds * 0.1 if args.warmup_s is None else args.warmup_s
    proc = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost"):
            raise SystemExit("soak: only a server on 127.0.0.1 is soaked")
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args)
    try:
        result = asyncio.run(soak(args, url, proc.pid if proc else None))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                result_exit = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                result_exit = None
    if proc is not None:
        result["server_exit_status"] = result_exit
        result["ok"] = result["ok"] and result_exit == 0
    report(result)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"soak-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"  written: {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
