"""The FastAPI app: routes of both protocols, /health, /version, /metrics, /slots, /v1/events, the web pages, auth,
CORS, errors; and `cobatch serve`.

`create_app(llm, options)` builds an app around an already loaded model (tests and benchmarks run it
in-process); its lifespan starts and stops the engine thread.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from cobatch import __version__
from cobatch.chat_template import template_kwargs_flags
from cobatch.llm import LLM, kv_cache_dtype_arg
from cobatch.loader.lora import adapter_flags
from cobatch.loader.metadata_overrides import override_flags
from cobatch.server import (anthropic, embeddings, events, llama_cpp, lora_adapters, openai, openai_responses, openapi,
                            slot_files, tokens, webui)
from cobatch.server.context import ServerContext, ServerOptions, get_context
from cobatch.server.errors import ApiError, error_response
from cobatch.server.lifecycle import DrainingServer, Lifecycle, LifecycleMiddleware, LoadingApp
from cobatch.server.sagemaker import InvocationsMiddleware

log = logging.getLogger("cobatch.server")

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/ping", "/version", "/docs", "/openapi.json"})
SLOTS_VIEW_TIMEOUT_S = 10.0


def create_app(llm: LLM, options: ServerOptions | None = None, lifecycle: Lifecycle | None = None) -> FastAPI:
    server = ServerContext(llm, options or ServerOptions())
    if lifecycle is not None:
        server.lifecycle = lifecycle

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.worker.stop)

    docs = server.options.openapi
    app = FastAPI(title="cobatch", version=__version__, lifespan=lifespan, redoc_url=None,
                  docs_url="/docs" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.server = server
    routers = [m.router for m in (openai, openai_responses, anthropic, tokens, embeddings, llama_cpp, slot_files,
                                  events, lora_adapters)]
    for router in routers:
        app.include_router(router)
    if server.options.webui:
        app.include_router(webui.router)
    openapi.install(app, routers)
    _add_error_handlers(app, server)
    _add_service_routes(app)
    app.add_middleware(InvocationsMiddleware, max_body_bytes=server.options.max_body_bytes)   # SageMaker's
    app.add_middleware(LifecycleMiddleware, lifecycle=server.lifecycle)
    app.add_middleware(ApiKeyMiddleware, server=server)
    if server.options.allowed_origins:
        # Added last, so outermost: a browser's preflight is answered before the key check (it carries no
        # key), and errors, the 401 among them, carry the CORS headers the browser needs to read them.
        app.add_middleware(CORSMiddleware, allow_origins=list(server.options.allowed_origins),
                           allow_methods=list(server.options.allowed_methods),
                           allow_headers=list(server.options.allowed_headers))
    if server.options.request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    return app


class RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every answer carries X-Request-Id, the request's own when it sent one,
    else a new one (so a client can quote it against the server's log)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given if given and len(given) <= 256 else uuid.uuid4().hex.encode()

        async def with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, with_id)


def _add_error_handlers(app: FastAPI, server: ServerContext) -> None:
    def reply(request: Request, err: ApiError) -> JSONResponse:
        server.metrics.http_errors.labels(str(err.status)).inc()
        (log.error if err.status >= 500 else log.info)("%s %s -> %d %s", request.method, request.url.path,
                                                        err.status, err.message)
        return error_response(err, request.url.path)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return reply(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return reply(request, ApiError(exc.status_code, str(message), headers=getattr(exc, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:3])
        return reply(request, ApiError(400, message or "invalid request"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return reply(request, ApiError(500, f"internal server error: {type(exc).__name__}"))


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/health")
    @app.get("/v1/health")              # llama.cpp's server answers both
    @app.head("/health")                # load balancers' probes
    @app.get("/ping")                   # SageMaker's (server/sagemaker.py)
    async def health(request: Request):
        server = get_context(request)
        worker = server.worker
        ok = worker.alive and worker.accepting
        body = {"status": "ok" if ok else "unavailable", "model": server.model_name,
                "slots_total": worker.num_slots, "slots_busy": worker.num_active, "queued": worker.queue_depth}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(get_context(request).metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/slots")
    async def slots(request: Request):
        worker = get_context(request).worker
        try:
            view = await asyncio.wait_for(asyncio.wrap_future(worker.call(worker.slots_view)), SLOTS_VIEW_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(503, f"the engine thread did not answer within {SLOTS_VIEW_TIMEOUT_S:g} s (a long step); "
                                "retry later", headers={"Retry-After": "1"}) from None
        return JSONResponse(view)


class ApiKeyMiddleware:
    """When an API key is set, every route but /health, /version, the API docs and the web pages' files wants it, as
    `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients)."""

    def __init__(self, app: ASGIApp, server: ServerContext):
        self.app, self.server = app, server
        self.public = PUBLIC_PATHS | (webui.PUBLIC_PATHS if server.options.webui else frozenset())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        options = self.server.options
        keys = [k.encode() for k in (options.api_key, *options.api_keys) if k]
        if not keys or scope["type"] != "http" or scope["path"] in self.public:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        # every key compared (no early exit), so the time taken does not tell which one came close
        if given is not None and sum(hmac.compare_digest(given, key) for key in keys):
            return await self.app(scope, receive, send)
        self.server.metrics.http_errors.labels("401").inc()
        message = "missing API key" if given is None else "invalid API key"
        response = error_response(ApiError(401, message, code="invalid_api_key",
                                           headers={"WWW-Authenticate": "Bearer"}), scope["path"])
        await response(scope, receive, send)


# --- cobatch serve --------------------------------------------------------------------------------

def _speculative(args):
    from cobatch.engine.speculative import speculative_flags
    return speculative_flags(args)


def _device(args) -> str:
    """--device, or llama.cpp's -ngl 0: the CPU."""
    if getattr(args, "gpu_layers", None) == 0:
        return "cpu"
    return args.device


def _check_serve_args(args) -> None:
    from cobatch.errors import UserError
    if args.model_path and args.model and args.model_path != args.model:
        raise UserError("give the model once: as the positional argument or as --model")
    if getattr(args, "gpu_layers", None) == 0 and args.device not in ("auto", "cpu"):
        raise UserError(f"-ngl 0 (the CPU) contradicts --device {args.device}")
    utilization = getattr(args, "gpu_memory_utilization", None)
    if utilization is not None and not 0 < utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1] (got {utilization})")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1 (got {args.threads})")
    if getattr(args, "pipeline_parallel_size", 1) != 1:
        raise UserError(f"--pipeline-parallel-size {args.pipeline_parallel_size}: cobatch has no pipeline "
                        "parallelism (only 1 is accepted; --tensor-parallel-size shards a model over GPUs)")
    _speculative(args)
    sampling_defaults(args)
    kv_cache_dtype_arg(args)
    for name, low in (("parallel", 1), ("max_queue", 0), ("prefill_chunk", 1), ("max_step_tokens", 1),
                      ("port", 0)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')} must be at least {low} (got {getattr(args, name)})")
    if args.port > 65535:
        raise UserError(f"--port must be at most 65535 (got {args.port})")
    if args.max_body_mb <= 0:
        raise UserError(f"--max-body-mb must be positive (got {args.max_body_mb})")
    if getattr(args, "kv_disk_gb", 1) <= 0:
        raise UserError(f"--kv-disk-gb must be positive (got {args.kv_disk_gb})")
    for flag in ("slot_save_path", "kv_disk_cache"):
        directory = getattr(args, flag, None)
        if directory is not None and Path(directory).exists() and not Path(directory).is_dir():
            raise UserError(f"--{flag.replace('_', '-')} {directory}: not a directory")
    if getattr(args, "graceful_shutdown_s", 0) < 0:
        raise UserError(f"--graceful-shutdown-s must be at least 0 (got {args.graceful_shutdown_s})")
    if getattr(args, "chat_template", None) is not None:
        from cobatch.builtin_templates import template_source
        template_source(args.chat_template)
    api_keys(args)
    _tls(args)
    if getattr(args, "tensor_parallel_size", 1) != 1:
        if args.slot_save_path:
            raise UserError("--slot-save-path is not supported with --tensor-parallel-size > 1 (each rank holds "
                            "its own part of a slot's KV)")
        from cobatch.parallel import launch
        launch.check(args.model_path or args.model, engine_options(args))
    check_model_path(args.model_path or args.model)


def check_model_path(path: str | None) -> None:
    """Before serve binds its port (its flags checked first): a model path that cannot load (missing, a folder
    without config.json, a file that is not GGUF) is one error line, not a server that starts, answers 503 and
    stops."""
    if not path:
        return                        # the default model: model_files says where, or how to install it
    from cobatch.loader.gguf import GGUFFile
    from cobatch.loader.hf import check_checkpoint_folder, is_checkpoint_folder
    if is_checkpoint_folder(path):
        check_checkpoint_folder(Path(path))
    else:
        GGUFFile(path)                # reads the header only


def sampling_defaults(args) -> dict:
    """serve's --temperature / --top-k / --top-p / --min-p / --typical / --xtc-* / --dry-* / --mirostat* /
    --repeat-penalty / --seed / -n (over vLLM's --override-generation-config JSON), as the fields requests that
    leave them unset take; a bad value is a UserError naming it."""
    from cobatch.engine.sampler import SamplingParams
    from cobatch.errors import UserError
    names = ("temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
             "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "mirostat_tau",
             "mirostat_eta", "repeat_last_n", "dynatemp_range", "dynatemp_exponent", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "max_tokens")
    defaults = {**_generation_config_folder(getattr(args, "generation_config", "auto"), names),
                **_generation_config(getattr(args, "override_generation_config", None), names)}
    defaults.update({n: getattr(args, f"default_{n}") for n in names
                     if getattr(args, f"default_{n}", None) is not None})
    try:
        SamplingParams(**defaults).validate()
    except (ValueError, TypeError) as exc:
        raise UserError(f"sampling default: {exc}") from None
    return defaults


def _generation_config_folder(value: str, names: tuple[str, ...]) -> dict:
    """vLLM's --generation-config DIR: the sampling defaults of DIR/generation_config.json (auto: the served
    checkpoint's own, vllm: none; ServerOptions.checkpoint_defaults)."""
    from cobatch.errors import UserError
    from cobatch.loader.hf import generation_defaults
    if value in ("auto", "vllm"):
        return {}
    if not (Path(value) / "generation_config.json").is_file():
        raise UserError(f"--generation-config: auto, vllm, or a folder holding generation_config.json (got {value!r})")
    return {k: v for k, v in generation_defaults(value).items() if k in names}


def _generation_config(raw: str | None, names: tuple[str, ...]) -> dict:
    """vLLM's --override-generation-config JSON (its max_new_tokens is our max_tokens)."""
    from cobatch.errors import UserError, json_object_flag
    if raw is None:
        return {}
    config = json_object_flag(raw, "--override-generation-config")
    config = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in config.items()}
    unknown = sorted(set(config) - set(names))
    if unknown:
        raise UserError(f"--override-generation-config: unknown keys {', '.join(unknown)} (known: "
                        f"{', '.join(n if n != 'max_tokens' else 'max_new_tokens' for n in names)})")
    return config


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a port in use or a bad --host is one error line before the
    model loads, not a uvicorn log line after it."""
    from cobatch.errors import UserError
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r}: {exc.strerror}") from None
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _graphs_note(llm: LLM) -> str:
    """How decode steps run on CUDA: captured graphs (and prefill steps too, where the model allows), or eager
    (experts the device cannot route, or --eager)."""
    runner = llm.engine.runner
    if runner.device.type != "cuda":
        return ""
    if runner.graphs is not None:
        return " (decode and prefill in CUDA graphs)" if runner.step_graphs is not None else " (decode in CUDA graphs)"
    why = "these experts' format has no device routing" if not llm.model.graph_safe else "--eager"
    return f" (decode eager: {why})"


def configure_logging(args) -> None:
    """The server's log to stderr, and with llama.cpp's --log-file to that file too (appended)."""
    from cobatch.errors import UserError
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if getattr(args, "log_file", None):
        try:
            handlers.append(logging.FileHandler(args.log_file, encoding="utf-8"))
        except OSError as exc:
            raise UserError(f"--log-file {args.log_file}: {exc.strerror or exc}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers)
    # vLLM's --disable-log-requests: the line each finished request logs (server/generation.py) goes
    logging.getLogger("cobatch.server.requests").setLevel(
        logging.WARNING if getattr(args, "disable_log_requests", False) else logging.NOTSET)


def runtime_lora(args) -> bool:
    """May LoRA adapters be loaded while serving? The flag, or vLLM's environment variable."""
    env = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
    return args.allow_runtime_lora_updating or env in ("1", "true")


def engine_options(args):
    """The engine configuration `cobatch serve`'s flags ask for."""
    from cobatch.llm import EngineOptions
    return EngineOptions(
        device=_device(args), dtype=args.dtype, kv_cache_dtype=kv_cache_dtype_arg(args), ctx=args.ctx,
        max_num_seqs=args.parallel,
        kv_cache_gb=args.kv_cache_gb, gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
        prefill_chunk=args.prefill_chunk, max_step_tokens=args.max_step_tokens,
        dense_large_batch=getattr(args, "dense_large_batch", False), eager=getattr(args, "eager", False),
        chat_template=getattr(args, "chat_template", None), speculative=_speculative(args),
        chat_template_kwargs=template_kwargs_flags(args),
        quantization=getattr(args, "quantization", "auto"),
        overlap_steps=getattr(args, "async_scheduling", True),
        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
        kv_disk_cache=getattr(args, "kv_disk_cache", None), kv_disk_gb=getattr(args, "kv_disk_gb", 16.0),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1), lora_modules=adapter_flags(args),
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, runtime_lora=runtime_lora(args),
        metadata_overrides=override_flags(args), warmup=getattr(args, "warmup", True))


def serve(args) -> int:
    """Bind the port, answer 503 while the model loads, serve, drain on SIGTERM / SIGINT, exit 0."""
    from cobatch.errors import UserError
    _check_serve_args(args)
    sock = listen_socket(args.host, args.port)
    port = sock.getsockname()[1]          # the one the OS picked for --port 0
    configure_logging(args)
    if getattr(args, "threads", None) is not None:
        import torch
        torch.set_num_threads(args.threads)
    options = server_options(args)
    scheme = "https" if _tls(args) else "http"
    print(f"cobatch loading {args.model_path or args.model or 'the default model'}\n"
          f"  url:      {scheme}://{args.host}:{port}/v1   (OpenAI: /v1/chat/completions, /v1/completions; "
          f"Anthropic: /v1/messages)   /health answers 503 until the model is ready",
          file=sys.stderr, flush=True)
    lifecycle = Lifecycle("loading")
    config = uvicorn.Config(None, host=args.host, port=port, log_level=args.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=args.graceful_shutdown_s,
                            root_path=getattr(args, "root_path", ""), **_tls(args))

    def build(llm: LLM) -> FastAPI:
        app = create_app(llm, options, lifecycle)
        _print_ready(app.state.server, llm, options)
        return app

    uvicorn_server = None
    from cobatch.parallel import launch
    loading = LoadingApp(lambda: launch.load(args.model_path or args.model, engine_options(args)), build, lifecycle,
                         on_failure=lambda: setattr(uvicorn_server, "should_exit", True))
    config.app = loading
    uvicorn_server = DrainingServer(config, lifecycle, grace_s=args.graceful_shutdown_s)
    uvicorn_server.run(sockets=[sock])
    if loading.error is not None:
        from cobatch.model_files import ModelNotFound
        if isinstance(loading.error, (UserError, ModelNotFound, ValueError, OSError)):
            raise UserError(str(loading.error)) from None
        raise loading.error
    return 0


def server_options(args) -> ServerOptions:
    origins = _name_list(getattr(args, "allowed_origins", "*"), "--allowed-origins")
    names = getattr(args, "model_name", None) or []
    names = [names] if isinstance(names, str) else names
    return ServerOptions(model_name=names[0] if names else None, model_aliases=tuple(names[1:]),
                         accept_any_model=getattr(args, "accept_any_model", False),
                         api_keys=api_keys(args), max_queue=args.max_queue,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)), allowed_origins=origins,
                         allowed_methods=_name_list(getattr(args, "allowed_methods", "*"), "--allowed-methods"),
                         allowed_headers=_name_list(getattr(args, "allowed_headers", "*"), "--allowed-headers"),
                         request_id_headers=getattr(args, "enable_request_id_headers", False),
                         checkpoint_defaults=getattr(args, "generation_config", "auto") == "auto",
                         sampling_defaults=sampling_defaults(args), openapi=getattr(args, "openapi", True),
                         metrics_compat=getattr(args, "metrics_compat", None),
                         slot_save_path=getattr(args, "slot_save_path", None), webui=getattr(args, "webui", True),
                         parse_reasoning=getattr(args, "reasoning_format", "auto") != "none",
                         max_logprobs=_max_logprobs(args),
                         tokens_as_ids=getattr(args, "return_tokens_as_token_ids", False))


def _name_list(value: str, flag: str) -> tuple[str, ...]:
    """A CORS flag's names: comma-separated (a, b), or a JSON list as vLLM takes them (["a", "b"])."""
    from cobatch.errors import UserError
    text = value.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UserError(f"{flag}: a JSON list of strings or comma-separated names (got {value!r})")
        return tuple(n.strip() for n in names if n.strip())
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _max_logprobs(args) -> int:
    """vLLM's --max-logprobs, up to the 20 that OpenAI's API and the sampler allow."""
    from cobatch.engine.sampler import MAX_TOP_LOGPROBS
    from cobatch.errors import UserError
    value = getattr(args, "max_logprobs", MAX_TOP_LOGPROBS)
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise UserError(f"--max-logprobs: 0 to {MAX_TOP_LOGPROBS} (got {value})")
    return value


def api_keys(args) -> tuple[str, ...]:
    """The accepted keys: every --api-key, the lines of --api-key-file, and $COBATCH_API_KEY."""
    import os
    from cobatch.errors import UserError
    given = getattr(args, "api_key", None) or []
    keys = [given] if isinstance(given, str) else list(given)
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            lines = open(path).read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--api-key-file: cannot read {path}: {exc}") from None
        from_file = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not from_file:
            raise UserError(f"--api-key-file {path} holds no key")
        keys += from_file
    if any(not k.strip() for k in keys):
        raise UserError("an API key must not be empty")
    env = os.environ.get("COBATCH_API_KEY", "")
    if env and not env.strip():
        raise UserError("$COBATCH_API_KEY holds only spaces: set it to a key, or to nothing for none")
    if env:
        keys.append(env)
    return tuple(dict.fromkeys(keys))


def _tls(args) -> dict:
    """uvicorn's TLS settings for --ssl-keyfile / --ssl-certfile (both or neither; checked readable now)."""
    from cobatch.errors import UserError
    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if not key and not cert:
        return {}
    if not (key and cert):
        raise UserError("--ssl-keyfile and --ssl-certfile go together: give both")
    import ssl
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"--ssl-certfile / --ssl-keyfile: cannot load {cert} with {key}: {exc}") from None
    return {"ssl_keyfile": key, "ssl_certfile": cert}


def _print_ready(server: ServerContext, llm: LLM, options: ServerOptions) -> None:
    pool = llm.engine.pool
    print(f"cobatch serving {server.model_name} ({llm.path})\n"
          f"  slots:    {server.worker.num_slots} (--parallel), queue up to {options.max_queue}\n"
          f"  context:  {llm.engine.max_context} tokens per request\n"
          f"  KV cache: {pool.num_blocks} blocks x {pool.block_size} = {pool.num_blocks * pool.block_size} tokens "
          f"({pool.nbytes / 2**20:.0f} MiB, {str(pool.dtype).removeprefix('torch.')}), prefix cache shared by all "
          f"slots\n"
          f"  device:   {llm.engine.runner.device}{_graphs_note(llm)}  "
          f"api key: {'required' if options.api_key or options.api_keys else 'none'}",
          file=sys.stderr, flush=True)
