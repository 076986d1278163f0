"""`cobatch serve -dp N`: N engine replicas behind one HTTP front.

Each replica is a `cobatch serve` of its own on 127.0.0.1 (one GPU each, or --tensor-parallel-size GPUs:
CUDA_VISIBLE_DEVICES says which; on the CPU, N processes), started with this command's flags. The front is a small
ASGI proxy on the public address (Front, over HttpReplica; cobatch.deploy.ray puts the same front over Ray Serve
replicas): it tokenizes an OpenAI request's prompt as the replicas do (the model's tokenizer
and chat template, nothing else loaded), asks the PrefixRouter which replica caches the longest prefix of it (else
the least loaded), and streams the request to it and its answer back byte for byte, with an `x-cobatch-replica`
header. /metrics and /slots gather every replica's, labelled by replica; /health is 200 once all replicas are.

A replica that exits takes the front down with one line (the others are stopped); replicas die with the front
(Linux: PR_SET_PDEATHSIG). SIGTERM drains the front, then each replica drains its own requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from cobatch.engine.kv_cache import salted_root
from cobatch.errors import UserError
from cobatch.llm import LLM, _chat_template, _open_model
from cobatch.model_files import default_model_path
from cobatch.parallel.prefix_router import PrefixRouter
from cobatch.server.app import _check_serve_args, _tls, configure_logging, listen_socket
from cobatch.server.errors import ApiError, error_response

BLOCK_SIZE = 16                    # the replicas' KV block size (EngineOptions.block_size)
# Flags the front keeps for itself; a replica gets its own address, no TLS and one replica
_FRONT_FLAGS = {"-dp": 1, "--data-parallel-size": 1, "--host": 1, "--port": 1, "--ssl-keyfile": 1,
                "--ssl-certfile": 1}
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}


def replica_argv(argv: list[str], port: int) -> list[str]:
    """`serve ...` for one replica: the front's flags less its own (see _FRONT_FLAGS), on 127.0.0.1:port."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _FRONT_FLAGS:
            skip = 0 if "=" in arg else _FRONT_FLAGS[name]
            continue
        out.append(arg)
    return out + ["--host", "127.0.0.1", "--port", str(port)]


class PromptTokens:
    """The model's tokenizer and chat template, encoding prompts as the replicas' LLM does (its own methods)."""
    encode_prompt = LLM.encode_prompt
    encode_chat = LLM.encode_chat

    def __init__(self, path: Path, chat_template: str | None):
        _, _, self.tokenizer, model_template = _open_model(path, "auto", torch.device("cpu"))   # nothing loaded
        self.template = _chat_template(chat_template, model_template, self.tokenizer)

    def of_request(self, path: str, body: bytes) -> tuple[list[int] | None, int | None]:
        """(The prompt's token ids of an OpenAI chat / completions request (None: no prompt to match), the root of
        its blocks' chains where it has a cache_salt, else None)."""
        try:
            data = json.loads(body)
            salt = data.get("cache_salt")
            root = salted_root(None, salt) if isinstance(salt, str) and salt else None
            if path == "/v1/chat/completions":
                return self.encode_chat(data["messages"], tools=data.get("tools")), root
            if path == "/v1/completions":
                prompt = data["prompt"]
                if isinstance(prompt, str):
                    return self.encode_prompt(prompt), root
                if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                    return prompt, root
        except Exception:       # noqa: BLE001 -- a malformed request: the replica will say what is wrong
            return None, None
        return None, None


def _labelled(text: str, replica: int, seen: set[str]) -> list[str]:
    """Prometheus text with replica="i" added to every sample; HELP / TYPE lines once."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            if line and line not in seen:
                seen.add(line)
                out.append(line)
            continue
        name, brace, rest = line.partition("{")
        if brace:
            out.append(f'{name}{{replica="{replica}",{rest}' if not rest.startswith("}") else
                       f'{name}{{replica="{replica}"{rest}')
        else:
            metric, _, value = line.partition(" ")
            out.append(f'{metric}{{replica="{replica}"}} {value}')
    return out


class UpstreamError(Exception):
    """A replica that did not answer (its process or actor gone, its connection refused)."""


@dataclass
class Answer:
    """A replica's answer as it streams: status, headers, then the body's chunks (close() when done)."""
    status: int
    headers: dict[str, str]
    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]

    async def read(self) -> bytes:
        try:
            return b"".join([chunk async for chunk in self.chunks])
        finally:
            await self.close()


class HttpReplica:
    """A replica at its own HTTP address (`cobatch serve -dp`: a process on 127.0.0.1)."""

    def __init__(self, url: str):
        self.url = url
        self.client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def opened(self):
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
            self.client = client
            yield

    async def send(self, method: str, path: str, query: str, headers: dict, body: bytes) -> Answer:
        request = self.client.build_request(method, self.url + path, params=query, headers=headers, content=body)
        try:
            answer = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise UpstreamError(str(exc)) from exc
        return Answer(answer.status_code, dict(answer.headers), answer.aiter_raw(), answer.aclose)


class Front:
    """The routing front over replicas with `send` (HttpReplica here; deploy/ray.py's Ray Serve handles)."""

    def __init__(self, replicas: list, tokens: PromptTokens):
        self.replicas, self.tokens = replicas, tokens
        self.router = PrefixRouter(len(replicas), BLOCK_SIZE)
        self.ready = False

    @staticmethod
    def _auth(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k in ("authorization", "x-api-key")}

    async def _get(self, replica, path: str, headers: dict | None = None) -> tuple[int, str | None, bytes]:
        answer = await replica.send("GET", path, "", headers or {}, b"")
        return answer.status, answer.headers.get("content-type"), await answer.read()

    async def wait_ready(self) -> None:
        """Poll each replica's /health until it answers 200 (its model loaded), then size the router."""
        for replica in self.replicas:
            while True:
                try:
                    if (await self._get(replica, "/health"))[0] == 200:
                        break
                except UpstreamError:
                    pass
                await asyncio.sleep(0.2)
        try:
            status, _, body = await self._get(self.replicas[0], "/slots")
            if status == 200:
                for state in self.router.replicas:
                    state.capacity_blocks = json.loads(body)["kv_blocks"]["total"]
        except (UpstreamError, ValueError, KeyError):
            pass                        # (an API key guards /slots: keep the default capacity)
        self.ready = True

    async def health(self, request: Request) -> Response:
        if not self.ready:
            return JSONResponse({"status": "loading", "replicas": len(self.replicas)}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": len(self.replicas)})

    async def _gather(self, request: Request, path: str) -> list[tuple[int, str | None, bytes]] | Response:
        """Every replica's answer to GET path, or the first that is not a 200, as the client's answer."""
        answers = await asyncio.gather(*(self._get(r, path, self._auth(request)) for r in self.replicas))
        bad = next((a for a in answers if a[0] != 200), None)
        if bad is not None:
            return Response(bad[2], status_code=bad[0], media_type=bad[1])
        return answers

    async def metrics(self, request: Request) -> Response:
        answers = await self._gather(request, "/metrics")
        if isinstance(answers, Response):
            return answers
        seen: set[str] = set()
        lines = [line for i, a in enumerate(answers) for line in _labelled(a[2].decode(), i, seen)]
        lines += ["# HELP cobatch_router_requests_total Requests the data-parallel front sent to each replica, by "
                  "why (prefix: it caches the longest prefix; load: the least loaded)",
                  "# TYPE cobatch_router_requests_total counter"]
        for i, state in enumerate(self.router.replicas):
            lines += [f'cobatch_router_requests_total{{replica="{i}",reason="{why}"}} {n}'
                      for why, n in state.routed.items()]
        lines += ["# HELP cobatch_router_in_flight Requests in flight at each replica, as the front counts them",
                  "# TYPE cobatch_router_in_flight gauge"]
        lines += [f'cobatch_router_in_flight{{replica="{i}"}} {s.in_flight}'
                  for i, s in enumerate(self.router.replicas)]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def slots(self, request: Request) -> Response:
        answers = await self._gather(request, "/slots")
        if isinstance(answers, Response):
            return answers
        views = [json.loads(a[2]) for a in answers]
        return JSONResponse({
            "slots": [{"replica": i, **slot} for i, view in enumerate(views) for slot in view["slots"]],
            "queued": sum(view["queued"] for view in views),
            "replicas": [{"replica": i, "in_flight": self.router.replicas[i].in_flight,
                          **{k: v for k, v in view.items() if k != "slots"}} for i, view in enumerate(views)],
        })

    async def proxy(self, request: Request) -> Response:
        path = request.url.path
        if not self.ready:
            return error_response(ApiError(503, "the replicas are loading the model", code="loading"), path)
        if path.startswith("/slots/"):
            return error_response(ApiError(400, "slot save / restore names one replica's slot: it is not "
                                                "supported with --data-parallel-size > 1"), path)
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return error_response(ApiError(400, "loading LoRA adapters while serving would change one replica: it is "
                                                "not supported with --data-parallel-size > 1 (give them at start)"),
                                  path)
        body = await request.body()
        ids, root = (await asyncio.to_thread(self.tokens.of_request, path, body)
                     if request.method == "POST" and path in ("/v1/chat/completions", "/v1/completions")
                     else (None, None))
        replica, hashes = self.router.choose(ids, root)
        self.router.start(replica, hashes)
        headers = {k: v for k, v in request.headers.items() if k not in _HOP_HEADERS}
        try:
            answer = await self.replicas[replica].send(request.method, path, request.url.query, headers, body)
        except UpstreamError as exc:
            self.router.finish(replica)
            return error_response(ApiError(502, f"replica {replica} did not answer: {exc}", code="bad_gateway"), path)

        async def relay():
            try:
                async for chunk in answer.chunks:
                    yield chunk
            finally:
                await answer.close()
                self.router.finish(replica)

        out_headers = {k: v for k, v in answer.headers.items() if k not in _HOP_HEADERS - {"content-length"}}
        out_headers["x-cobatch-replica"] = str(replica)
        return StreamingResponse(relay(), status_code=answer.status, headers=out_headers)

    async def route(self, request: Request) -> Response:
        """One request, by path: the front's own routes, else the replica the router picks."""
        if request.method in ("GET", "HEAD"):
            own = {"/health": self.health, "/metrics": self.metrics, "/slots": self.slots}.get(request.url.path)
            if own is not None:
                return await own(request)
        return await self.proxy(request)

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app):
            async with AsyncExitStack() as stack:
                for replica in self.replicas:
                    if hasattr(replica, "opened"):
                        await stack.enter_async_context(replica.opened())
                task = asyncio.create_task(self.wait_ready())
                yield
                task.cancel()

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
        return Starlette(routes=[Route("/{path:path}", self.route, methods=methods)], lifespan=lifespan)


def _visible_gpus() -> list[str]:
    import torch
    if not torch.cuda.is_available():
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return given.split(",") if given else [str(i) for i in range(torch.cuda.device_count())]


def _die_with_parent() -> None:
    """In a replica, before exec: a SIGTERM when the front's process ends, however it ends (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG


def _free_ports(n: int) -> list[int]:
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class _FrontServer(uvicorn.Server):
    """uvicorn, whose first SIGTERM / SIGINT also tells the replicas to drain (each turns new requests away and
    finishes its own), while the front waits for its open streams; a second stops at once. Not re-raised after
    the shutdown, so the process exits 0."""

    def __init__(self, config: uvicorn.Config, procs: list[subprocess.Popen], stopping: threading.Event):
        super().__init__(config)
        self.procs, self.stopping = procs, stopping

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        self.stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()


def serve(args) -> int:
    """cobatch serve with --data-parallel-size > 1: the replicas, and the front on --host:--port."""
    _check_serve_args(args)
    world = args.data_parallel_size
    if world < 1:
        raise UserError(f"--data-parallel-size must be at least 1 (got {world})")
    tp = getattr(args, "tensor_parallel_size", 1)
    gpus = _visible_gpus() if args.device != "cpu" and getattr(args, "gpu_layers", None) != 0 else []
    if args.device.startswith("cuda") and len(gpus) < world * tp:
        raise UserError(f"--data-parallel-size {world} x --tensor-parallel-size {tp} needs {world * tp} GPUs; "
                        f"{len(gpus)} are visible")
    path = Path(args.model_path or args.model or default_model_path())
    tokens = PromptTokens(path, getattr(args, "chat_template", None))
    sock = listen_socket(args.host, args.port)
    port = sock.getsockname()[1]
    configure_logging(args)
    scheme = "https" if _tls(args) else "http"
    print(f"cobatch loading {path} on {world} data-parallel replicas\n"
          f"  url:      {scheme}://{args.host}:{port}/v1   /health answers 503 until every replica is ready",
          file=sys.stderr, flush=True)
    ports = _free_ports(world)
    procs = []
    for i, replica_port in enumerate(ports):
        env = dict(os.environ)
        if len(gpus) >= world * tp:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * tp:(i + 1) * tp])
        argv = replica_argv(getattr(args, "argv", None) or sys.argv[1:], replica_port)
        procs.append(subprocess.Popen([sys.executable, "-m", "cobatch.cli", *argv], env=env,
                                      preexec_fn=_die_with_parent, stdout=subprocess.DEVNULL))
    stopping = threading.Event()

    def watch(i: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if stopping.is_set():
            return
        print(f"cobatch: error: data-parallel replica {i} exited (code {code}); stopping", file=sys.stderr,
              flush=True)
        for other in procs:
            if other.poll() is None:
                other.terminate()
        os._exit(1)

    for i, proc in enumerate(procs):
        threading.Thread(target=watch, args=(i, proc), daemon=True, name=f"cobatch-dp-watch{i}").start()
    front = Front([HttpReplica(f"http://127.0.0.1:{p}") for p in ports], tokens)
    config = uvicorn.Config(front.app(), log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=args.graceful_shutdown_s, **_tls(args))
    try:
        _FrontServer(config, procs, stopping).run(sockets=[sock])
    finally:
        stopping.set()
        for proc in procs:          # each drains its own requests (its --graceful-shutdown-s)
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=args.graceful_shutdown_s + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0
