"""OpenAI's embeddings endpoint: POST /v1/embeddings.

A generative model's embedding of a text, as vLLM and llama.cpp's server give it: the final-normed hidden
state of the text's last token, L2-normalized (vLLM's LAST pooling for decoder models; llama.cpp normalizes
the same way). Each input is prefilled in the same batched steps as every other session (the engine samples one
token for it, which is discarded), so embedding requests never stall the streams that are decoding.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from cobatch.engine.sampler import SamplingParams
from cobatch.server.context import get_context
from cobatch.server.errors import bad_request
from cobatch.server.generation import Choices, GenerationRequest
from cobatch.server.prompting import check_prompt_fits, raw_prompts
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body

router = APIRouter()

MAX_INPUTS = 64          # inputs in one request: each is a session in the engine's queue


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector] if norm > 0 else vector


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes, base64-encoded (what the openai client asks
    for by default and decodes itself)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings")
@accepts(EmbeddingRequest)
async def embeddings(request: Request):
    ctx = get_context(request)
    body = await read_body(request, EmbeddingRequest, ctx.options.max_body_bytes)
    width = ctx.llm.config.d_model
    if body.dimensions is not None and body.dimensions != width:
        raise bad_request(f"this model's embeddings have {width} dimensions; it cannot shorten them to "
                          f"{body.dimensions}", param="dimensions")
    prompts = await run_in_threadpool(raw_prompts, ctx.llm, body.input, None, "input", MAX_INPUTS)
    requests = []
    for ids, _ in prompts:
        check_prompt_fits(ctx.llm, len(ids), "input")
        params = SamplingParams(temperature=0, max_tokens=1, embed=True, adapter=ctx.adapter_for(body.model))
        requests.append(GenerationRequest("embeddings", ids, params, report_output=False))
    choices = Choices(ctx.generation, requests, 1)
    try:
        done = await choices.collect()
    finally:
        choices.close()
    data = [{"object": "embedding", "index": i, "embedding": encoded(normalized(d.embedding), body.encoding_format)}
            for i, d in enumerate(done)]
    n_prompt = choices.total_usage([d.finish for d in done]).prompt_tokens
    return {"object": "list", "data": data, "model": ctx.answered_by(body.model),
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt}}
