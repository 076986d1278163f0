"""cobatch on Ray Serve: engine replicas across a cluster's hosts behind one routing front.

    serve run cobatch.deploy.ray:app_builder replicas=2 flags="--model m.gguf --parallel 64"
    serve run deploy.yaml        # the same arguments under applications[].args (docs/scale-out.md)

`flags` are `cobatch serve`'s own (all but --host, --port, -dp and TLS: Ray Serve's HTTP proxy answers). Each of
the `replicas` engine deployments is one cobatch engine with one replica: the model loaded once, cobatch's own
HTTP app run in process (every route, error body and stream is the one `cobatch serve` gives), asking Ray for
--tensor-parallel-size GPUs (`gpus_per_replica` overrides; 0 on the CPU) and one CPU (`cpus_per_replica`). Ray
places them on the cluster's hosts.
The front deployment is `cobatch serve -dp`'s (parallel/data_parallel.Front): it sends each request to the engine
caching the longest prefix of its prompt, else to the least loaded, and gathers /metrics and /slots by replica.
One deployment per engine, rather than one deployment of N replicas, is what lets the front choose the engine:
Ray's own router would pick among a deployment's replicas by queue length alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import shlex
from contextlib import AsyncExitStack

import ray
from ray import serve

from cobatch.errors import UserError
from cobatch.parallel.data_parallel import _FRONT_FLAGS, Answer, Front, PromptTokens, UpstreamError

# `cobatch serve` flags the front owns (here Ray Serve's proxy): an engine is one replica at an address Ray gives it
_NOT_FOR_ENGINES = _FRONT_FLAGS


def serve_args(flags: list[str]) -> argparse.Namespace:
    """`cobatch serve`'s arguments from its flags, as the CLI parses them; a bad flag is one UserError line."""
    from cobatch.cli import build_parser
    for flag in flags:
        if flag.split("=", 1)[0] in _NOT_FOR_ENGINES:
            raise UserError(f"cobatch.deploy.ray: {flag.split('=', 1)[0]} is Ray Serve's to set, not a flag of "
                            "the engines (replicas=N sets their number)")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = build_parser().parse_args(["serve", *flags])
    except SystemExit:
        lines = said.getvalue().strip().splitlines()
        raise UserError(f"cobatch.deploy.ray: flags: {lines[-1] if lines else 'invalid'}") from None
    args.argv = ["serve", *flags]
    return args


async def asgi_stream(app, method: str, path: str, query: str, headers: dict, body: bytes):
    """Run one HTTP request through an ASGI app in process: yield {"status", "headers"}, then the body's chunks
    as the app sends them (a stream stays a stream). The app sees a disconnect once the caller stops reading."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query.encode(),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
             "client": ("127.0.0.1", 0), "server": ("cobatch", 80)}
    sent = asyncio.Queue()
    done = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while True:
            message = await sent.get()
            if message is None:                 # the app returned (or raised) before finishing its answer
                task.result()
                return
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in message["headers"]}}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        done.set()
        if not task.done():
            task.cancel()


class Engine:
    """One cobatch engine as a Ray Serve replica: `forward` answers an HTTP request with cobatch's own app."""

    def __init__(self, flags: list[str]):
        from cobatch.parallel import launch
        from cobatch.server.app import create_app, engine_options, server_options
        args = serve_args(flags)
        llm = launch.load(args.model_path or args.model, engine_options(args))
        self.app = create_app(llm, server_options(args))
        self._running: AsyncExitStack | None = None
        self._starting = asyncio.Lock()

    async def forward(self, method: str, path: str, query: str, headers: dict, body: bytes):
        async with self._starting:           # the app's lifespan (its engine thread) runs in this replica's loop
            if self._running is None:
                self._running = AsyncExitStack()
                await self._running.enter_async_context(self.app.router.lifespan_context(self.app))
        async for item in asgi_stream(self.app, method, path, query, headers, body):
            yield item


class RayReplica:
    """An engine deployment seen by the front: `send` as parallel/data_parallel.HttpReplica's."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)

    async def send(self, method: str, path: str, query: str, headers: dict, body: bytes) -> Answer:
        stream = self.handle.forward.remote(method, path, query, headers, body)
        try:
            head = await stream.__anext__()
        except Exception as exc:            # noqa: BLE001 -- the actor died or the call failed: a 502 for it
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

        async def chunks():
            async for chunk in stream:
                yield chunk

        async def close():
            stream.cancel()

        return Answer(head["status"], head["headers"], chunks(), close)


READY_WAIT_S = 30.0     # how long a request waits for the front to see every engine answer /health, before a 503


class Ingress:
    """The front as Ray Serve's HTTP ingress: every request goes through Front.route."""

    async def __init__(self, flags: list[str], *engines):
        # async: Ray Serve runs the constructor on the replica's event loop, so the front starts polling the engines'
        # /health now, not at the first request (which would then find it unprepared: a 503 right after serve.run)
        args = serve_args(flags)
        from cobatch.model_files import default_model_path
        path = args.model_path or args.model or default_model_path()
        self.front = Front([RayReplica(h) for h in engines], PromptTokens(path, getattr(args, "chat_template", None)))
        self._ready = asyncio.ensure_future(self.front.wait_ready())

    async def __call__(self, request):
        if not self.front.ready and request.url.path != "/health":
            # serve.run has returned, so the engines are up: the front's poll sees them within moments
            await asyncio.wait({self._ready}, timeout=READY_WAIT_S)
        return await self.front.route(request)


def _on_gpu(parsed: argparse.Namespace) -> bool:
    """Do the engines want GPUs? --device cuda: yes; auto: when the cluster (else this host) has some."""
    if parsed.device == "auto":
        if ray.is_initialized():
            return ray.cluster_resources().get("GPU", 0) > 0
        import torch
        return torch.cuda.is_available()
    return parsed.device.startswith("cuda")


def app_builder(args: dict) -> serve.Application:
    """The Ray Serve application: `replicas` engines (default 1) of `flags`, and the front."""
    flags = shlex.split(str(args.get("flags", "")))
    try:
        replicas = int(args.get("replicas", 1))
    except ValueError:
        raise UserError(f"cobatch.deploy.ray: replicas must be a whole number (got {args.get('replicas')!r})")
    if replicas < 1:
        raise UserError(f"cobatch.deploy.ray: replicas must be at least 1 (got {replicas})")
    parsed = serve_args(flags)                       # bad flags fail here, once, before any replica starts
    gpus = float(args.get("gpus_per_replica", getattr(parsed, "tensor_parallel_size", 1) if _on_gpu(parsed) else 0))
    cpus = float(args.get("cpus_per_replica", 1))
    engines = [serve.deployment(Engine, name=f"cobatch-engine-{i}", num_replicas=1,
                                ray_actor_options={"num_gpus": gpus, "num_cpus": cpus}).bind(flags)
               for i in range(replicas)]
    # the front only tokenizes prompts and relays bytes: it reserves no CPU of its own
    return serve.deployment(Ingress, name="cobatch-front", num_replicas=1,
                            ray_actor_options={"num_cpus": 0}).bind(flags, *engines)
