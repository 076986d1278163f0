"""What every route needs: the model, the engine thread, the metrics and the server options."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from cobatch.errors import UserError
from cobatch.llm import LLM
from cobatch.server.engine_thread import EngineWorker
from cobatch.server.generation import Generation, GenerationRequest
from cobatch.server.lifecycle import Lifecycle
from cobatch.server.metrics import ServerMetrics
from cobatch.server.response_store import ResponseStore

DEFAULT_MAX_BODY_BYTES = 32 << 20     # a 128k-token prompt as JSON is a few MB; this leaves room


@dataclass(slots=True)
class ServerOptions:
    model_name: str | None = None        # the id served by /v1/models (default: the file name)
    api_key: str | None = None           # when set, every route but /health and /version needs it
    max_queue: int = 64                  # requests waiting for a slot before 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    num_slots: int | None = None         # default: the engine's max_num_seqs (--parallel)
    allowed_origins: tuple[str, ...] = ("*",)   # CORS: origins browsers may call from ("*": any; (): none)
    allowed_methods: tuple[str, ...] = ("*",)   # CORS: the methods and headers they may use (vLLM's flags)
    allowed_headers: tuple[str, ...] = ("*",)
    request_id_headers: bool = False     # answer with X-Request-Id (the request's own, or a new one): vLLM's flag
    # a checkpoint's generation_config.json gives the sampling defaults the flags do not (vLLM's --generation-config
    # auto); False: it does not ("vllm")
    checkpoint_defaults: bool = True
    # Sampling fields a request leaves unset take these values (serve's --temperature, --top-k, ...)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    openapi: bool = True                 # serve /openapi.json and /docs
    model_aliases: tuple[str, ...] = ()  # more names requests may give as `model` (serve --served-model-name A B)
    # A `model` the server does not serve: accepted (in-process use, tests) or 404 (serve, unless --accept-any-model)
    accept_any_model: bool = True
    metrics_compat: str | None = None    # "vllm": /metrics also under vLLM's names
    api_keys: tuple[str, ...] = ()       # keys accepted besides api_key (serve's repeated --api-key, --api-key-file)
    slot_save_path: str | None = None    # the directory of POST /slots/{id}?action=save|restore files; None: refused
    webui: bool = True                   # serve the chat page at / and the dashboard at /dashboard (server/webui.py)
    # a reply's <think> block as reasoning_content / thinking blocks; False (llama.cpp's --reasoning-format none):
    # left in the content as the model wrote it
    parse_reasoning: bool = True
    max_logprobs: int = 20               # the most alternatives logprobs may ask for (vLLM's --max-logprobs)
    tokens_as_ids: bool = False          # logprobs name tokens "token_id:ID" (vLLM's --return-tokens-as-token-ids)


class ServerContext:
    def __init__(self, llm: LLM, options: ServerOptions):
        # a checkpoint's generation_config.json gives the defaults the flags did not (vLLM's --generation-config auto)
        checkpoint_defaults = (_valid_defaults(getattr(llm, "generation_defaults", {}))
                               if options.checkpoint_defaults else {})
        options = dataclasses.replace(options, sampling_defaults={**checkpoint_defaults, **options.sampling_defaults})
        self.llm, self.options = llm, options
        self.worker = EngineWorker(llm.engine, max_queue=options.max_queue, num_slots=options.num_slots)
        self.model_name = options.model_name or (llm.path.name if llm.path.is_dir() else llm.path.stem)
        self.metrics = ServerMetrics(self.worker, vllm_names=options.metrics_compat == "vllm",
                                     model_name=self.model_name)
        self._names = (self.model_name, *(a for a in options.model_aliases if a != self.model_name))
        clash = next((a for a in self.adapter_names if a in self._names), None)
        if clash is not None:
            raise UserError(f"the LoRA adapter {clash!r} takes a name the model is served under: name it otherwise")
        self.created = int(time.time())
        self.lifecycle = Lifecycle("ready")     # serve() shares its own, which starts out loading
        self.event_streams = 0                  # open GET /v1/events streams (server/events.py)
        self.responses = ResponseStore()        # the Responses API's stored responses (previous_response_id)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters served now: models of their own, as vLLM lists them (a request names one as its
        `model`). Read on the HTTP side while the engine thread may load one: a dict's keys, copied at once."""
        lora = getattr(getattr(self.llm, "model", None), "lora", None)
        return tuple(lora.slots) if lora is not None else ()

    @property
    def model_names(self) -> tuple[str, ...]:
        return self._names + self.adapter_names

    def adapter_for(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        return model if model in self.adapter_names else None

    @property
    def by_priority(self) -> bool:
        """Does the engine schedule by the requests' priority (--scheduling-policy priority)?"""
        return self.llm.engine.scheduler.by_priority

    def answered_by(self, model: str | None) -> str:
        """The `model` a response names: the adapter the request ran through, else the served model's name."""
        return self.adapter_for(model) or self.model_name

    def generation(self, request: GenerationRequest) -> Generation:
        return Generation(self.worker, self.metrics, self.llm.tokenizer, request)


def get_context(request: Request) -> ServerContext:
    return request.app.state.server


def _valid_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """The model's sampling defaults that SamplingParams accepts (a bad value in generation_config.json is
    dropped with a warning, not a failed start)."""
    from cobatch.engine.sampler import SamplingParams
    kept = {}
    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value}).validate()
            kept[name] = value
        except (ValueError, TypeError) as exc:
            print(f"cobatch: ignoring generation_config.json {name}={value!r}: {exc}", file=sys.stderr)
    return kept
