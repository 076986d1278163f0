"""Serving benchmark: streaming clients against `cobatch serve`, measured on the client side.

    PYTHONPATH=src python bench/serve.py --model L3-8B-q8_0.gguf --device cuda
    PYTHONPATH=src python bench/serve.py --cpu-smoke                      # tiny settings, SmolLM2, CPU

1. Concurrency ladder (1, 2, 4, ..., 64 clients): each client streams `--rounds` completions of a fixed
   prompt length (random token ids, distinct per request, so the prefix cache does not help) and a fixed
   output length (ignore_eos). Per level: aggregate generated tok/s (tokens / wall time of the level),
   TTFT p50/p99, inter-token latency p50/p99 (every token is its own SSE frame: logprobs=0 is asked so
   that a token that completes no character still produces a frame).
2. Stall: `--stall-streams` streams decoding, then one newcomer with a `--stall-prompt-tokens` prompt.
   The worst inter-token gap of the running streams while the newcomer prefills, against their median gap
   before it arrived.

The server runs as a subprocess by default (its own GIL, like production); --in-process runs it in a
uvicorn thread of this process instead. --stub-step-ms replaces the engine by a stub whose step sleeps that
long (as a GPU step would, GIL released) and emits one token per running request: it measures what the
HTTP side alone can sustain. Prints a short table last; JSON (and a PNG if matplotlib is there) to $OUT
or bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

LEVELS = [1, 2, 4, 8, 16, 32, 64]


# --- one streamed request ----------------------------------------------------------------------------

@dataclass
class Trace:
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


async def stream_completion(client: httpx.AsyncClient, prompt_ids: list[int], max_tokens: int,
                            trace: Trace | None = None) -> Trace:
    """One streamed /v1/completions request; token arrival times go into `trace` as they come."""
    trace = trace or Trace()
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "logprobs": 0, "stream_options": {"include_usage": True}}
    trace.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                trace.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return trace
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    trace.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("logprobs"):
                        trace.token_times += [now] * len(choice["logprobs"]["token_logprobs"])
                if "error" in chunk:
                    trace.error = str(chunk["error"])
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    return trace


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


class Prompts:
    """Random prompts of ordinary tokens (no control tokens), a fresh one per request."""

    def __init__(self, normal_ids: list[int], seed: int = 0):
        self.ids, self.rng = normal_ids, random.Random(seed)

    def make(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(n)]


# --- the measurements --------------------------------------------------------------------------------

async def run_level(url: str, prompts: Prompts, clients: int, rounds: int, prompt_tokens: int,
                    output_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def one_client() -> list[Trace]:
            return [await stream_completion(client, prompts.make(prompt_tokens), output_tokens) for _ in range(rounds)]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client() for _ in range(clients)))
        wall = time.perf_counter() - start
    traces = [t for ts in per_client for t in ts]
    errors = [t.error for t in traces if t.error]
    tokens = sum(len(t.token_times) for t in traces)
    ttfts = [t.ttft for t in traces if t.ttft is not None]
    gaps = [g for t in traces for g in t.gaps]
    stream_rates = [(len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0])
                    for t in traces if len(t.token_times) > 1 and t.token_times[-1] > t.token_times[0]]
    return dict(clients=clients, requests=len(traces), errors=len(errors), first_error=errors[0] if errors else None,
                tokens=tokens, wall_s=wall, agg_tok_s=tokens / wall,
                ttft_p50_ms=_ms(percentile(ttfts, 50)), ttft_p99_ms=_ms(percentile(ttfts, 99)),
                itl_p50_ms=_ms(percentile(gaps, 50)), itl_p99_ms=_ms(percentile(gaps, 99)),
                itl_max_ms=_ms(max(gaps) if gaps else None),
                stream_tok_s_p50=percentile(stream_rates, 50))


async def run_stall(url: str, prompts: Prompts, streams: int, newcomer_tokens: int, prompt_tokens: int,
                    stream_tokens: int, warm_tokens: int = 24) -> dict:
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        traces = [Trace() for _ in range(streams)]
        running = [asyncio.create_task(stream_completion(client, prompts.make(prompt_tokens), stream_tokens, t))
                   for t in traces]
        # Wait until every stream is decoding steadily (polling the traces the tasks fill in).
        while min(len(t.token_times) for t in traces) < warm_tokens:
            if any(task.done() for task in running):
                break
            await asyncio.sleep(0.005)
        newcomer = await stream_completion(client, prompts.make(newcomer_tokens), 2)
        await asyncio.gather(*running)
    arrived, first = newcomer.sent, (newcomer.token_times[0] if newcomer.token_times else None)
    if first is None:
        return dict(error=newcomer.error or "newcomer produced no token")
    before, during = [], []
    for t in traces:
        for a, b in zip(t.token_times, t.token_times[1:]):
            if b <= arrived:
                before.append(b - a)
            elif a < first:              # the gap overlaps the newcomer's prefill
                during.append(b - a)
    baseline = statistics.median(before) if before else None
    worst = max(during) if during else None
    return dict(streams=streams, newcomer_prompt_tokens=newcomer_tokens, newcomer_ttft_ms=_ms(first - arrived),
                baseline_itl_p50_ms=_ms(baseline), worst_gap_during_prefill_ms=_ms(worst),
                stall_ms=_ms(worst - baseline) if worst is not None and baseline is not None else None,
                errors=[t.error for t in traces + [newcomer] if t.error])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# --- the server under test ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout}s")


class SubprocessServer:
    def __init__(self, args, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cobatch.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--parallel", str(args.parallel), "--max-queue", str(max(LEVELS) * args.rounds),
               "--device", args.device, "--prefill-chunk", str(args.prefill_chunk),
               "--max-step-tokens", str(args.max_step_tokens), "--log-level", "warning"]
        for flag, value in (("--model", args.model), ("--ctx", args.ctx), ("--dtype", args.dtype),
                            ("--kv-cache-gb", args.kv_cache_gb)):
            if value is not None:
                cmd += [flag, str(value)]
        if args.dense_large_batch:
            cmd.append("--dense-large-batch")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        self.log = open(log_path, "w")
        print("server:", " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.url, self.proc, args.load_timeout)
        except Exception:
            self.stop()
            print(log_path.read_text()[-4000:])
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class InProcessServer:
    def __init__(self, args):
        from cobatch.llm import LLM, EngineOptions
        from cobatch.server.app import create_app
        from cobatch.server.context import ServerOptions
        from cobatch.server.http_thread import ServerThread
        if args.stub_step_ms is not None:
            llm = StubLLM(args)
        else:
            llm = LLM.load(args.model, EngineOptions(
                device=args.device, dtype=args.dtype, ctx=args.ctx, max_num_seqs=args.parallel,
                kv_cache_gb=args.kv_cache_gb, prefill_chunk=args.prefill_chunk, max_step_tokens=args.max_step_tokens,
                dense_large_batch=args.dense_large_batch))
        app = create_app(llm, ServerOptions(max_queue=max(LEVELS) * args.rounds))
        self.thread = ServerThread(app).start()
        self.url = self.thread.url

    def stop(self) -> None:
        self.thread.stop()


class StubLLM:
    """The real tokenizer and an engine whose step only sleeps (GIL released, like a GPU sync) and then
    emits one token per running request: the HTTP side's own ceiling."""

    def __init__(self, args):
        from cobatch.loader.gguf import GGUFFile
        from cobatch.model_files import default_model_path
        from cobatch.tokenizer import Tokenizer
        self.path = Path(args.model) if args.model else default_model_path()
        self.tokenizer = Tokenizer.from_metadata(GGUFFile(self.path).metadata)
        self.template = None
        self.engine = StubEngine(args.parallel, args.ctx or 8192, args.stub_step_ms / 1e3,
                                 normal_token_ids(self.path)[:1000])

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


class StubEngine:
    def __init__(self, max_num_seqs: int, ctx: int, step_s: float, token_ids: list[int]):
        from cobatch.engine.kv_cache import BlockManager
        from cobatch.engine.scheduler import DecodeStats
        self.stats, self.max_context, self.step_s, self.token_ids = DecodeStats(), ctx, step_s, token_ids
        self.blocks = BlockManager(1024, 16)
        self.scheduler = type("S", (), {"max_num_seqs": max_num_seqs})()
        self.seqs: dict = {}
        self._left: dict[str, list] = {}
        self._aborted: list[str] = []

    def add_request(self, prompt_ids, params, request_id=None):
        self._left[request_id] = [params.max_tokens, len(prompt_ids)]
        return request_id

    def abort(self, request_id):
        if self._left.pop(request_id, None) is not None:
            self._aborted.append(request_id)

    def has_work(self) -> bool:
        return bool(self._left or self._aborted)

    def step(self):
        from cobatch.engine.engine import StepOutput
        outs = [StepOutput(r, None, True, "abort") for r in self._aborted]
        self._aborted.clear()
        if not self._left:
            return outs
        time.sleep(self.step_s)
        self.stats.decode_steps += 1
        self.stats.batched_steps += len(self._left) > 1
        for rid, state in list(self._left.items()):
            state[0] -= 1
            done = state[0] == 0
            if done:
                del self._left[rid]
            token = self.token_ids[state[0] % len(self.token_ids)]
            outs.append(StepOutput(rid, token, done, "length" if done else None, 0.0, [], state[1], 0))
        return outs


def normal_token_ids(path: Path) -> list[int]:
    from cobatch.loader.gguf import GGUFFile
    from cobatch.tokenizer import NORMAL
    md = GGUFFile(path).metadata
    types = list(md.get("tokenizer.ggml.token_type") or [])
    tokens = list(md["tokenizer.ggml.tokens"])
    ids = [i for i, k in enumerate(types) if int(k) == NORMAL] if types else list(range(len(tokens)))
    # Plain word pieces only: no whitespace runs or byte fragments that would merge into odd text.
    return [i for i in ids if str(tokens[i]).isalnum()] or ids


# --- main --------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: SmolLM2)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--parallel", type=int, default=64)
    ap.add_argument("--kv-cache-gb", type=float)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--max-step-tokens", type=int, default=2048)
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--stall-streams", type=int, default=8)
    ap.add_argument("--stall-prompt-tokens", type=int, default=4096)
    ap.add_argument("--stall-stream-tokens", type=int, default=512)
    ap.add_argument("--in-process", action="store_true", help="server in a thread of this process")
    ap.add_argument("--dense-large-batch", action="store_true", help="pass --dense-large-batch to the server")
    ap.add_argument("--stub-step-ms", type=float, help="stub engine: measure the HTTP side alone (in-process)")
    ap.add_argument("--url", help="benchmark an already running server instead")
    ap.add_argument("--load-timeout", type=float, default=1800)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny settings for a CPU run")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.device, args.ctx, args.parallel, args.levels, args.rounds = "cpu", 1024, 4, "1,2,4", 1
        args.prompt_tokens, args.output_tokens = 32, 16
        args.stall_streams, args.stall_prompt_tokens, args.stall_stream_tokens = 2, 600, 96
    levels = [int(x) for x in args.levels.split(",")]
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)

    from cobatch.model_files import default_model_path
    model_path = Path(args.model) if args.model else default_model_path()
    prompts = Prompts(normal_token_ids(model_path))
    if args.url:
        server, url = None, args.url.rstrip("/")
    elif args.in_process or args.stub_step_ms is not None:
        server = InProcessServer(args)
        url = server.url
    else:
        server = SubprocessServer(args, out / "serve_server.log")
        url = server.url
    results = dict(date=str(datetime.date.today()), command=" ".join(sys.argv), model=str(model_path),
                   mode="url" if args.url else ("stub" if args.stub_step_ms is not None else
                                               "in-process" if args.in_process else "subprocess"),
                   config={k: v for k, v in vars(args).items() if k not in ("url",)}, levels=[], stall=None)
    try:
        models = httpx.get(url + "/v1/models", timeout=30).json()
        results["server_model"] = models["data"][0]
        print("warm-up", flush=True)
        for c in levels:         # every batch size once, so graph captures and allocations are done
            asyncio.run(run_level(url, prompts, c, 1, args.prompt_tokens, 8))
        for c in levels:
            row = asyncio.run(run_level(url, prompts, c, args.rounds, args.prompt_tokens, args.output_tokens))
            results["levels"].append(row)
            print(_level_line(row), flush=True)
        if args.stall_streams:
            results["stall"] = asyncio.run(run_stall(url, prompts, args.stall_streams, args.stall_prompt_tokens,
                                                     args.prompt_tokens, args.stall_stream_tokens))
        results["server_metrics"] = _interesting_metrics(httpx.get(url + "/metrics", timeout=30).text)
    finally:
        if server is not None:
            server.stop()

    (out / "serve.json").write_text(json.dumps(results, indent=1))
    try:
        plot(results, out / "serve.png")
    except ImportError:
        pass
    print(f"\nserving benchmark, {results['server_model']['id']} ({results['mode']}), prompt {args.prompt_tokens} "
          f"tokens, output {args.output_tokens} tokens, {args.rounds} requests per client")
    print(" clients  reqs  err   agg tok/s   TTFT p50/p99 ms    ITL p50/p99 ms   ITL max ms  stream tok/s")
    for row in results["levels"]:
        print(_level_line(row))
    s = results["stall"]
    if s and "error" not in s:
        print(f"stall: {s['streams']} streams decoding, a {s['newcomer_prompt_tokens']}-token prompt arrives: "
              f"newcomer TTFT {s['newcomer_ttft_ms']:.0f} ms; running streams' worst gap "
              f"{_f(s['worst_gap_during_prefill_ms'])} ms vs median {_f(s['baseline_itl_p50_ms'])} ms "
              f"(stall {_f(s['stall_ms'])} ms)")
    elif s:
        print(f"stall: {s['error']}")
    print(f"JSON: {out / 'serve.json'}")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _level_line(r: dict) -> str:
    return (f" {r['clients']:7d} {r['requests']:5d} {r['errors']:4d} {r['agg_tok_s']:11.1f}  "
            f"{_f(r['ttft_p50_ms']):>7} / {_f(r['ttft_p99_ms']):<7}  {_f(r['itl_p50_ms']):>6} / {_f(r['itl_p99_ms']):<7} "
            f"{_f(r['itl_max_ms']):>9}  {_f(r['stream_tok_s_p50']):>8}")


def _interesting_metrics(text: str) -> dict:
    keep = ("cobatch_batched_decode_fraction", "cobatch_decode_steps_total", "cobatch_batched_decode_steps_total",
            "cobatch_lone_decode_steps_total", "cobatch_preemptions_total", "cobatch_engine_steps_total")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(keep)}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = results["levels"]
    xs = [r["clients"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(xs, [r["agg_tok_s"] for r in rows], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("streaming clients")
    a.set_ylabel("aggregate tok/s")
    a.grid(True, which="both", alpha=0.3)
    for key, style in (("itl_p50_ms", "o-"), ("itl_p99_ms", "s--"), ("ttft_p50_ms", "^-"), ("ttft_p99_ms", "v--")):
        b.plot(xs, [r[key] for r in rows], style, label=key.replace("_ms", "").replace("_", " "))
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("streaming clients")
    b.set_ylabel("ms")
    b.legend()
    b.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"cobatch serve: {results['server_model']['id']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
