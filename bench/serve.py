"""Serving benchmark: streaming clients against `cobatch serve`, measured on the client side.

    PYTHONPATH=src python bench/serve.py --model L3-8B-q8_0.gguf --device cuda --engine-baseline
    PYTHONPATH=src python bench/serve.py --cpu-smoke [--engine-baseline]   # tiny settings, SmolLM2, CPU

1. Concurrency ladder (1, 2, 4, ..., 64 clients): `--rounds` rounds per level; in each round every client
   streams one completion of a fixed prompt length (random token ids, distinct per request, so the prefix
   cache does not help) and a fixed output length (ignore_eos), all clients starting together. Per level:
   - whole-run tok/s: all tokens received / wall time of the level (prefills, ramp-up and tail included);
   - steady tok/s: tokens received inside each round's steady window (from the moment the last stream got
     its first token to the moment the first stream got its last one: all N streams decoding, no prefill)
     / the window's length, summed over rounds; and the step time it implies (N / steady tok/s);
   - TTFT p50/p99, inter-token latency p50/p99 (every token is its own SSE frame: logprobs=0 is asked so
     that a token that completes no character still produces a frame);
   - server CPU ms per engine step (subprocess servers: /proc CPU time over /metrics' step counter).
2. Stall: `--stall-streams` streams decoding, then one newcomer with a `--stall-prompt-tokens` prompt.
   The worst inter-token gap of the running streams while the newcomer prefills, against their median gap
   before it arrived.
3. --engine-baseline: before any server starts, a child process loads the engine with exactly the server's
   configuration and times decode steps alone (bench/decode.py's code) at B = each level, sessions placed
   at the prompt length and sampled as the requests ask; the last table puts the server's steady and
   whole-run tok/s beside it.

The server runs as a subprocess by default (its own GIL, like production); --in-process runs it in a
uvicorn thread of this process instead. --stub-step-ms replaces the engine by a stub whose step sleeps that
long (as a GPU step would, GIL released) and emits one token per running request: it measures what the
HTTP side alone can sustain (its "engine baseline" is then N tokens per stub step). Prints a short table
last; JSON (rewritten after every stage, so a run cut short keeps what it measured; a PNG if matplotlib is
there) to $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import datetime
import hashlib
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
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

LEVELS = [1, 2, 4, 8, 16, 32, 64]
# How every benchmark request samples; the engine baseline samples its sessions the same way.
REQUEST_SAMPLING = dict(temperature=0.0, logprobs=0, ignore_eos=True)


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
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            **REQUEST_SAMPLING}
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

def steady_window(traces: list[Trace]) -> tuple[float, float] | None:
    """The span in which all of a round's streams decode: from the last stream's first token to the first
    stream's last token. None when a stream got no token or the spans do not overlap."""
    if not traces or not all(t.token_times for t in traces):
        return None
    start, end = max(t.token_times[0] for t in traces), min(t.token_times[-1] for t in traces)
    return (start, end) if end > start else None


def tokens_between(traces: list[Trace], start: float, end: float) -> int:
    """Tokens that arrived in (start, end]."""
    return sum(bisect.bisect_right(t.token_times, end) - bisect.bisect_right(t.token_times, start) for t in traces)


class ServerProbe:
    """Engine steps (from /metrics) and the server process's CPU time (from /proc, when it is a child of
    ours on Linux), read around a level: host time per step, the engine thread and the HTTP side together."""

    def __init__(self, url: str, pid: int | None):
        self.url, self.pid = url, pid

    def read(self) -> tuple[float | None, float | None]:
        steps = cpu = None
        try:
            text = httpx.get(self.url + "/metrics", timeout=30).text
            steps = next(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith("cobatch_engine_steps_total"))
        except (httpx.HTTPError, StopIteration, ValueError):
            pass
        if self.pid is not None:
            try:
                fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime
            except (OSError, IndexError, ValueError):
                pass
        return steps, cpu


async def run_level(url: str, prompts: Prompts, clients: int, rounds: int, prompt_tokens: int,
                    output_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        start, cpu = time.perf_counter(), time.process_time()
        rounds_traces = []
        for _ in range(rounds):
            # Every client starts together, so each round has a span where all of them decode.
            rounds_traces.append(await asyncio.gather(
                *(stream_completion(client, prompts.make(prompt_tokens), output_tokens) for _ in range(clients))))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    traces = [t for ts in rounds_traces for t in ts]
    errors = [t.error for t in traces if t.error]
    tokens = sum(len(t.token_times) for t in traces)
    ttfts = [t.ttft for t in traces if t.ttft is not None]
    gaps = [g for t in traces for g in t.gaps]
    stream_rates = [(len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0])
                    for t in traces if len(t.token_times) > 1 and t.token_times[-1] > t.token_times[0]]
    windows = [(ts, w) for ts in rounds_traces if (w := steady_window(ts)) is not None]
    steady_tokens = sum(tokens_between(ts, *w) for ts, w in windows)
    steady_s = sum(w[1] - w[0] for _, w in windows)
    steady_tok_s = steady_tokens / steady_s if steady_s > 0 else None
    return dict(clients=clients, requests=len(traces), errors=len(errors), first_error=errors[0] if errors else None,
                tokens=tokens, wall_s=wall, whole_run_tok_s=tokens / wall,
                steady_rounds=len(windows), steady_tokens=steady_tokens, steady_window_s=steady_s,
                steady_tok_s=steady_tok_s,
                steady_step_ms=clients / steady_tok_s * 1e3 if steady_tok_s else None,   # one token per stream per step
                ttft_p50_ms=_ms(percentile(ttfts, 50)), ttft_p99_ms=_ms(percentile(ttfts, 99)),
                itl_p50_ms=_ms(percentile(gaps, 50)), itl_p99_ms=_ms(percentile(gaps, 99)),
                itl_max_ms=_ms(max(gaps) if gaps else None),
                stream_tok_s_p50=percentile(stream_rates, 50), client_cpu_frac=cpu / wall)


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


def engine_options(args):
    """The engine configuration the server gets from these flags (`cobatch serve` maps its flags the same way)."""
    from cobatch.llm import EngineOptions
    return EngineOptions(device=args.device, dtype=args.dtype, ctx=args.ctx, max_num_seqs=args.parallel,
                         kv_cache_gb=args.kv_cache_gb, prefill_chunk=args.prefill_chunk,
                         max_step_tokens=args.max_step_tokens, dense_large_batch=args.dense_large_batch,
                         overlap_steps=not args.no_async_scheduling)


def max_queue(args) -> int:
    return max(LEVELS) * args.rounds


class SubprocessServer:
    """`cobatch serve` as a child process, or, with --stub-step-ms, this script serving the stub engine."""

    def __init__(self, args, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if args.stub_step_ms is not None:
            # The same flags again, so the child builds the same stub (see serve_stub).
            cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--stub-serve-port", str(self.port)]
        else:
            cmd = [sys.executable, "-m", "cobatch.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--parallel", str(args.parallel), "--max-queue", str(max_queue(args)),
                   "--device", args.device, "--prefill-chunk", str(args.prefill_chunk),
                   "--max-step-tokens", str(args.max_step_tokens), "--log-level", "warning"]
            for flag, value in (("--model", args.model), ("--ctx", args.ctx), ("--dtype", args.dtype),
                                ("--kv-cache-gb", args.kv_cache_gb)):
                if value is not None:
                    cmd += [flag, str(value)]
            if args.dense_large_batch:
                cmd.append("--dense-large-batch")
            if args.no_async_scheduling:
                cmd.append("--no-async-scheduling")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        self.log = open(log_path, "w")
        print("server:", " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
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
                self.proc.wait()
        self.log.close()


class InProcessServer:
    pid = None       # its CPU time is mixed with the clients'

    def __init__(self, args):
        from cobatch.server.http_thread import ServerThread
        self.thread = ServerThread(make_app(args)).start()
        self.url = self.thread.url

    def stop(self) -> None:
        self.thread.stop()


def make_app(args):
    from cobatch.llm import LLM
    from cobatch.server.app import create_app
    from cobatch.server.context import ServerOptions
    llm = StubLLM(args) if args.stub_step_ms is not None else LLM.load(args.model, engine_options(args))
    return create_app(llm, ServerOptions(max_queue=max_queue(args)))


def serve_stub(args) -> None:
    """The child process of a stub run: the stub engine behind the real app, served as `cobatch serve` does."""
    import uvicorn
    uvicorn.run(make_app(args), host="127.0.0.1", port=args.stub_serve_port, log_level="warning", access_log=False)


# --- the engine alone --------------------------------------------------------------------------------

def engine_baseline(args, levels: list[int]) -> dict:
    """The engine's isolated decode rate at B = each level, configured exactly as the server is: B sessions
    placed at the prompt length (random KV, no prefill), sampled as the requests ask, and as many decode
    steps timed as a request decodes. Runs in a process of its own (run_engine_baseline)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from decode import clear, place_sessions, randomize_kv, step_times
    from cobatch.engine.sampler import SamplingParams
    from cobatch.llm import LLM
    t0 = time.perf_counter()
    llm = LLM.load(args.model, engine_options(args))
    load_s = time.perf_counter() - t0
    randomize_kv(llm)
    params = SamplingParams(max_tokens=1 << 20, **REQUEST_SAMPLING)
    rows = []
    for n in levels:
        if n > args.parallel:
            rows.append(dict(clients=n, error=f"more than --parallel {args.parallel} sessions"))
            continue
        # +1: the server's first decode step runs at position prompt_tokens (after the prefill's token).
        place_sessions(llm, n, args.prompt_tokens + 1, params)
        times = step_times(llm, steps=max(args.output_tokens - 1, 8), warmup=3)
        clear(llm)
        mean = statistics.fmean(times)
        # tok/s from the mean step: the server's steady rate is a mean over its window too, hiccups included.
        rows.append(dict(clients=n, context=args.prompt_tokens + 1, steps=len(times), step_ms_mean=mean * 1e3,
                         step_ms_median=statistics.median(times) * 1e3, tok_s=n / mean))
        print(f"  engine B {n:3d}: {mean * 1e3:7.2f} ms/step  {n / mean:8.1f} tok/s", flush=True)
    return dict(mode="engine", load_s=load_s, device=str(llm.engine.runner.device),
                sampling=dict(REQUEST_SAMPLING), options=dataclasses.asdict(engine_options(args)), levels=rows)


def stub_baseline(args, levels: list[int]) -> dict:
    """The stub engine's own step rate (its sleeps overshoot a little), timed here without any server."""
    from cobatch.engine.sampler import SamplingParams
    engine = stub_engine(args, [1, 2, 3])
    rows = []
    for n in [n for n in levels if n <= args.parallel]:
        for i in range(n):
            engine.add_request([1] * args.prompt_tokens, SamplingParams(max_tokens=1 << 20), f"b{n}-{i}")
        engine.step()
        times = []
        for _ in range(max(args.output_tokens - 1, 8)):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        for i in range(n):
            engine.abort(f"b{n}-{i}")
        engine.step()
        mean = statistics.fmean(times)
        rows.append(dict(clients=n, steps=len(times), step_ms_mean=mean * 1e3, tok_s=n / mean))
    return dict(mode="stub", levels=rows)


def run_engine_baseline(args, levels: list[int], out: Path) -> dict:
    """engine_baseline() in a child process, started and ended before any server runs: the two never
    share the device, and the child's memory is gone when the server starts."""
    if args.stub_step_ms is not None:
        return stub_baseline(args, levels)
    path = out / "serve_engine_baseline.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--baseline-worker", str(path)]
    print("engine baseline:", " ".join(cmd), flush=True)
    try:
        code = subprocess.run(cmd, timeout=args.load_timeout + 600).returncode
    except subprocess.TimeoutExpired:
        return dict(error="engine baseline timed out")
    if code != 0 or not path.exists():
        return dict(error=f"engine baseline exited with code {code}")
    return json.loads(path.read_text())


class StubLLM:
    """The real tokenizer and a stub engine (StubEngine): what the HTTP side costs, with no model."""

    def __init__(self, args):
        from cobatch.loader.gguf import GGUFFile
        from cobatch.model_files import default_model_path
        from cobatch.tokenizer import Tokenizer
        self.path = Path(args.model) if args.model else default_model_path()
        self.tokenizer = Tokenizer.from_metadata(GGUFFile(self.path).metadata)
        self.template = None
        self.engine = stub_engine(args, normal_token_ids(self.path)[:1000])

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


def stub_engine(args, token_ids: list[int]) -> "StubEngine":
    return StubEngine(args.parallel, args.ctx or 8192, args.stub_step_ms / 1e3, args.stub_host_ms / 1e3, token_ids)


class StubEngine:
    """A step is `host_s` worth of Python work holding the GIL (planning, inputs: a real step's host part,
    which lets the GIL go briefly at every torch call), then a `step_s` sleep (the GPU, GIL released), then
    one token for every running request. The host work is a fixed amount of work, not a deadline, so time
    the HTTP side takes from it shows as a longer step, as it does in the real engine."""

    SLICE_S = 50e-6       # host work between two GIL releases

    def __init__(self, max_num_seqs: int, ctx: int, step_s: float, host_s: float, token_ids: list[int]):
        from cobatch.engine.kv_cache import BlockManager
        from cobatch.engine.scheduler import DecodeStats
        self.stats, self.max_context, self.token_ids = DecodeStats(), ctx, token_ids
        self.step_s = step_s
        self.slices, self.slice_iters = round(host_s / self.SLICE_S), self._spin_iterations(self.SLICE_S)
        self.blocks = BlockManager(1024, 16)
        # what the server and its /metrics read of an engine besides the methods below
        self.scheduler = SimpleNamespace(max_num_seqs=max_num_seqs, by_priority=False)       # fcfs
        self.pool = SimpleNamespace(dtype="stub", block_size=16, num_blocks=1024)
        self.runner = SimpleNamespace(model=SimpleNamespace())
        self.seqs: dict = {}
        self._left: dict[str, list] = {}
        self._aborted: list[str] = []

    @staticmethod
    def _spin_iterations(slice_s: float) -> int:
        """Empty-loop iterations that, with one GIL-free hash, take `slice_s` here (best of a few tries)."""
        n = 200_000
        per_iteration = min(_timed(_spin, n) for _ in range(5)) / n
        hash_s = min(_timed(hashlib.sha256, _GIL_FREE_BYTES) for _ in range(20))
        return max(0, round((slice_s - hash_s) / per_iteration))

    def add_request(self, prompt_ids, params, request_id=None):
        self._left[request_id] = [params.max_tokens, len(prompt_ids)]
        return request_id

    def abort(self, request_id):
        if self._left.pop(request_id, None) is not None:
            self._aborted.append(request_id)

    def has_work(self) -> bool:
        return bool(self._left or self._aborted)

    def step(self, on_launched=None):
        from cobatch.engine.engine import StepOutput
        outs = [StepOutput(r, None, True, "abort") for r in self._aborted]
        self._aborted.clear()
        if not self._left:
            return outs
        for _ in range(self.slices):
            _spin(self.slice_iters)
            hashlib.sha256(_GIL_FREE_BYTES)      # lets the GIL go for a moment, as a torch call does
        done_at = time.perf_counter() + self.step_s        # the "GPU" runs from the launch on
        if on_launched is not None:
            on_launched()
        time.sleep(max(0.0, done_at - time.perf_counter()))   # the host sync
        self.stats.decode_steps += 1
        self.stats.batched_steps += len(self._left) > 1
        for rid, state in list(self._left.items()):
            state[0] -= 1
            done = state[0] == 0
            if done:
                del self._left[rid]
            token = self.token_ids[state[0] % len(self.token_ids)]
            outs.append(StepOutput(rid, token, done, "length" if done else None, logprob=0.0, top_logprobs=[],
                                   num_prompt_tokens=state[1]))
        return outs


# hashlib hashes inputs of 2 KiB and more without the GIL: 16 KiB take ~10 us, about what a torch call
# spends in dispatch and launch with the GIL let go.
_GIL_FREE_BYTES = bytes(16 << 10)


def _spin(n: int) -> None:
    for _ in range(n):
        pass


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


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
    ap.add_argument("--rounds", type=int, default=2, help="rounds per level: every client streams one request each")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--stall-streams", type=int, default=8, help="0: no stall measurement")
    ap.add_argument("--stall-prompt-tokens", type=int, default=4096)
    ap.add_argument("--stall-stream-tokens", type=int, default=512)
    ap.add_argument("--in-process", action="store_true", help="server in a thread of this process")
    ap.add_argument("--dense-large-batch", action="store_true", help="pass --dense-large-batch to the server")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="pass --no-async-scheduling to the server "
                         "(each step's tokens read before the next is planned)")
    ap.add_argument("--engine-baseline", action="store_true",
                    help="also time the engine alone (same configuration, decode steps only) at B = each level")
    ap.add_argument("--stub-step-ms", type=float, help="stub engine: measure the HTTP side alone")
    ap.add_argument("--stub-host-ms", type=float, default=1.0,
                    help="stub engine: host work per step holding the GIL (H200, 8B q8_0, B=32: ~1.2 ms)")
    ap.add_argument("--url", help="benchmark an already running server instead")
    ap.add_argument("--load-timeout", type=float, default=1800)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny settings for a CPU run")
    ap.add_argument("--stub-serve-port", type=int, help=argparse.SUPPRESS)      # child: serve the stub
    ap.add_argument("--baseline-worker", help=argparse.SUPPRESS)                # child: engine baseline -> JSON
    args = ap.parse_args()
    if args.cpu_smoke:
        args.device, args.ctx, args.parallel, args.levels, args.rounds = "cpu", 1024, 4, "1,2,4", 1
        args.prompt_tokens, args.output_tokens = 32, 16
        args.stall_streams, args.stall_prompt_tokens, args.stall_stream_tokens = 2, 600, 96
    levels = [int(x) for x in args.levels.split(",")]
    if args.stub_serve_port is not None:
        return serve_stub(args)
    if args.baseline_worker:
        Path(args.baseline_worker).write_text(json.dumps(engine_baseline(args, levels), indent=1))
        return
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)

    from cobatch.model_files import default_model_path
    model_path = Path(args.model) if args.model else default_model_path()
    prompts = Prompts(normal_token_ids(model_path))
    results = dict(date=str(datetime.date.today()), command=" ".join(sys.argv), model=str(model_path),
                   mode="url" if args.url else ("in-process" if args.in_process else "subprocess") +
                   (" stub" if args.stub_step_ms is not None else ""),
                   config={k: v for k, v in vars(args).items()
                           if k not in ("url", "stub_serve_port", "baseline_worker")},
                   levels=[], stall=None)

    def save() -> None:
        (out / "serve.json").write_text(json.dumps(results, indent=1))

    if args.engine_baseline:
        if args.url:
            print("note: --url: the engine baseline uses this script's flags, which may not be that server's")
        results["engine_baseline"] = run_engine_baseline(args, levels, out)
        save()
    if args.url:
        server, url = None, args.url.rstrip("/")
    elif args.in_process:
        server = InProcessServer(args)
        url = server.url
    else:
        server = SubprocessServer(args, out / "serve_server.log")
        url = server.url
    probe = ServerProbe(url, getattr(server, "pid", None))
    try:
        models = httpx.get(url + "/v1/models", timeout=30).json()
        results["server_model"] = models["data"][0]
        print("warm-up", flush=True)
        for c in levels:         # every batch size once, so graph captures and allocations are done
            asyncio.run(run_level(url, prompts, c, 1, args.prompt_tokens, 8))
        print(LEVEL_HEADER)
        for c in levels:
            before = probe.read()
            row = asyncio.run(run_level(url, prompts, c, args.rounds, args.prompt_tokens, args.output_tokens))
            row.update(_server_per_step(before, probe.read()))
            results["levels"].append(row)
            print(_level_line(row), flush=True)
            save()
        if args.stall_streams:
            results["stall"] = asyncio.run(run_stall(url, prompts, args.stall_streams, args.stall_prompt_tokens,
                                                     args.prompt_tokens, args.stall_stream_tokens))
        results["server_metrics"] = _interesting_metrics(httpx.get(url + "/metrics", timeout=30).text)
    finally:
        if server is not None:
            server.stop()
        results["comparison"] = compare(results)
        save()

    try:
        plot(results, out / "serve.png")
    except ImportError:
        pass
    print(f"\nserving benchmark, {results['server_model']['id']} ({results['mode']}), prompt {args.prompt_tokens} "
          f"tokens, output {args.output_tokens} tokens, {args.rounds} rounds (every client one request each)")
    print(LEVEL_HEADER)
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
    base = results.get("engine_baseline")
    if base is not None:
        print("\nserver vs engine alone (same engine configuration; engine: decode steps only, B = clients)")
        if "error" in base:
            print(f"engine baseline: {base['error']}")
        print(" clients  steady tok/s  whole-run tok/s  engine tok/s   ms/step server engine   steady/engine  "
              "whole/engine")
        for c in results["comparison"]:
            print(f" {c['clients']:7d} {_f(c['server_steady_tok_s']):>13} {_f(c['server_whole_run_tok_s']):>16} "
                  f"{_f(c['engine_tok_s']):>13}   {_f(c['server_steady_step_ms']):>14} {_f(c['engine_step_ms']):>6}"
                  f"   {_pct(c['steady_over_engine']):>13} {_pct(c['whole_run_over_engine']):>13}")
    print(f"JSON: {out / 'serve.json'}")


def compare(results: dict) -> list[dict]:
    """Per level: the server's steady and whole-run tok/s against the engine's isolated rate."""
    engine = {r["clients"]: r for r in (results.get("engine_baseline") or {}).get("levels", []) if "tok_s" in r}
    rows = []
    for r in results["levels"]:
        e = engine.get(r["clients"], {})
        e_tok_s = e.get("tok_s")
        rows.append(dict(clients=r["clients"], server_steady_tok_s=r["steady_tok_s"],
                         server_whole_run_tok_s=r["whole_run_tok_s"], engine_tok_s=e_tok_s,
                         server_steady_step_ms=r["steady_step_ms"], engine_step_ms=e.get("step_ms_mean"),
                         steady_over_engine=r["steady_tok_s"] / e_tok_s if e_tok_s and r["steady_tok_s"] else None,
                         whole_run_over_engine=r["whole_run_tok_s"] / e_tok_s if e_tok_s else None))
    return rows


def _server_per_step(before: tuple, after: tuple) -> dict:
    steps = after[0] - before[0] if None not in (before[0], after[0]) else None
    cpu = after[1] - before[1] if None not in (before[1], after[1]) else None
    return dict(engine_steps=steps,
                server_cpu_ms_per_step=cpu / steps * 1e3 if cpu is not None and steps else None)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


LEVEL_HEADER = (" clients  reqs  err  whole-run tok/s  steady tok/s (ms/step)  TTFT p50/p99 ms    ITL p50/p99 ms  "
                " ITL max ms  stream tok/s  server CPU ms/step")


def _level_line(r: dict) -> str:
    return (f" {r['clients']:7d} {r['requests']:5d} {r['errors']:4d} {r['whole_run_tok_s']:16.1f}  "
            f"{_f(r['steady_tok_s']):>12} ({_f(r['steady_step_ms']):>6})  "
            f"{_f(r['ttft_p50_ms']):>7} / {_f(r['ttft_p99_ms']):<7}  "
            f"{_f(r['itl_p50_ms']):>6} / {_f(r['itl_p99_ms']):<7} "
            f"{_f(r['itl_max_ms']):>9}  {_f(r['stream_tok_s_p50']):>12}  {_f(r.get('server_cpu_ms_per_step')):>18}")


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
    a.plot(xs, [r["whole_run_tok_s"] for r in rows], "o-", label="server, whole run")
    a.plot(xs, [r["steady_tok_s"] for r in rows], "s-", label="server, steady window")
    engine = [c for c in results.get("comparison", []) if c["engine_tok_s"]]
    if engine:
        a.plot([c["clients"] for c in engine], [c["engine_tok_s"] for c in engine], "^--", label="engine alone")
    a.legend()
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
