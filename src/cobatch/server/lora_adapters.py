"""LoRA adapters while serving: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with
`serve --allow-runtime-lora-updating`, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), and llama.cpp's
GET /lora-adapters listing what is loaded.

An adapter is read from disk off the engine thread, then put into a free slot on it, between two steps
(models/lora.py: the tensors the decode graphs read are written in place). Once loaded it is a model of its own
(/v1/models), as the start-up ones are.
"""

from __future__ import annotations


from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from cobatch.errors import UserError
from cobatch.loader.lora import load_adapter
from cobatch.server.context import ServerContext, get_context
from cobatch.server.errors import bad_request
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


async def _allowed_body(request: Request, model: type[BaseModel]):
    """(the server, the request's body), where loading adapters while serving is on."""
    ctx = get_context(request)
    if not ctx.llm.options.runtime_lora:
        raise bad_request("loading LoRA adapters while serving is off: start the server with "
                          "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                          code="runtime_lora_updating_disabled")
    return ctx, await read_body(request, model, ctx.options.max_body_bytes)


async def _on_engine(ctx: ServerContext, fn) -> None:
    """fn on the engine thread (where the model's slots and the queue hold still); its UserError a 400."""
    try:
        await ctx.worker.run(fn)
    except UserError as exc:
        raise bad_request(str(exc), param="lora_name") from None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
@accepts(LoadLoraAdapterRequest)
async def load_lora_adapter(request: Request):
    ctx, body = await _allowed_body(request, LoadLoraAdapterRequest)
    if not body.lora_name or body.lora_name in ctx.model_names:
        raise bad_request(f"the LoRA adapter name {body.lora_name!r} is empty or already served", param="lora_name")
    try:
        adapter = await run_in_threadpool(load_adapter, body.lora_path, ctx.llm.config, body.lora_name)
    except UserError as exc:
        raise bad_request(str(exc), param="lora_path") from None
    await _on_engine(ctx, lambda: ctx.llm.engine.load_adapter(adapter))
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
@accepts(UnloadLoraAdapterRequest)
async def unload_lora_adapter(request: Request):
    ctx, body = await _allowed_body(request, UnloadLoraAdapterRequest)

    def unload() -> None:           # (on the engine thread, where the queue holds still)
        waiting = sum(h.params.adapter == body.lora_name for h in ctx.worker.queued())
        if waiting:
            raise UserError(f"LoRA adapter {body.lora_name!r} is wanted by {waiting} queued "
                            f"request{'s' if waiting > 1 else ''}")
        ctx.llm.engine.unload_adapter(body.lora_name)

    await _on_engine(ctx, unload)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


@router.get("/lora-adapters")
async def lora_adapters(request: Request) -> list[dict]:
    """llama.cpp's list: each loaded adapter's id (its slot, from 0 as llama.cpp counts), path and scale."""
    lora = getattr(get_context(request).llm.model, "lora", None)
    adapters = [] if lora is None else [(i, a) for i, a in enumerate(lora.adapters) if a is not None]
    return [{"id": i, "name": a.name, "path": str(a.path), "scale": a.scale} for i, a in adapters]
