"""Embeddings: OpenAI's POST /v1/embeddings, and llama.cpp's POST /embedding and /embeddings (its own shapes).

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


class LlamaCppEmbeddingRequest(BaseModel):
    """llama.cpp's native form: `content` (or `input`) and its normalizations."""
    model_config = ConfigDict(extra="ignore")
    content: str | list[str] | list[int] | list[list[int]] | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    embd_normalize: int = Field(2, ge=-1, description="-1: none, 0: max absolute to int16's range, 1: taxicab, "
                                                      "2: euclidean, p > 2: the p-norm")


def normalized(vector: list[float], p: int = 2) -> list[float]:
    """llama.cpp's embd_normalize: the vector over its p-norm (p = 1, 2 or more), over its largest magnitude
    / 32760 (0: int16's range, as floats), or as it is (-1); a zero vector stays zero."""
    if p == -1:
        return vector
    largest = max((abs(v) for v in vector), default=0.0)
    if largest == 0:
        return vector
    if p == 0:
        norm = largest / 32760.0
    elif p == 2:
        norm = math.sqrt(sum(v * v for v in vector))
    else:           # over the largest first, so that no power overflows whatever p
        norm = largest * sum((abs(v) / largest) ** p for v in vector) ** (1.0 / p)
    return [v / norm for v in vector]


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
    vectors, n_prompt = await _embed(ctx, body.input, "input", ctx.adapter_for(body.model))
    data = [{"object": "embedding", "index": i, "embedding": encoded(normalized(v), body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": ctx.answered_by(body.model),
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt}}


@router.post("/embedding")
@router.post("/embeddings")
@accepts(LlamaCppEmbeddingRequest)
async def llama_cpp_embeddings(request: Request):
    """llama.cpp's shape: a list of {"index", "embedding": [[...]]}, one pooled vector an input."""
    ctx = get_context(request)
    body = await read_body(request, LlamaCppEmbeddingRequest, ctx.options.max_body_bytes)
    given, param = (body.content, "content") if body.content is not None else (body.input, "input")
    if given is None:
        raise bad_request("content is required: a text, token ids, or a list of either", param="content")
    vectors, _ = await _embed(ctx, given, param, None)
    return [{"index": i, "embedding": [normalized(v, body.embd_normalize)]} for i, v in enumerate(vectors)]


async def _embed(ctx, inputs, param: str, adapter: str | None) -> tuple[list[list[float]], int]:
    """Each input's embedding (the final-normed hidden state of its last token, not normalized) and the prompt
    tokens they took, through the engine's batched steps."""
    prompts = await run_in_threadpool(raw_prompts, ctx.llm, inputs, None, param, MAX_INPUTS)
    requests = []
    for ids, _ in prompts:
        check_prompt_fits(ctx.llm, len(ids), param)
        params = SamplingParams(temperature=0, max_tokens=1, embed=True, adapter=adapter)
        requests.append(GenerationRequest("embeddings", ids, params, report_output=False))
    choices = Choices(ctx.generation, requests, 1)
    try:
        done = await choices.collect()
    finally:
        choices.close()
    return [d.embedding for d in done], choices.total_usage([d.finish for d in done]).prompt_tokens
