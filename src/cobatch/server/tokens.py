"""POST /tokenize, /detokenize and /apply-template, as vLLM and the llama.cpp server offer them (both request
shapes).

/tokenize takes a raw prompt (`prompt`, or llama.cpp's `content`; `add_special_tokens` / `add_special`) or a
chat (`messages`, rendered with the model's template as /v1/chat/completions would) and answers the token ids,
their count and the context size; `return_token_strs` / `with_pieces` adds each token's text.
/detokenize takes `tokens` and answers the text under both names (`prompt`, `content`).
/apply-template (llama.cpp's) takes `messages` and answers the prompt text the model would read (`prompt`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from cobatch.server.context import get_context
from cobatch.server.errors import bad_request
from cobatch.server.openai import ChatMessage, template_messages
from cobatch.server.prompting import chat_text, render_chat
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None      # vLLM's: template variables of `messages`' render
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    return_token_strs: bool = False
    with_pieces: bool = False


class ApplyTemplateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage]
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
@accepts(TokenizeRequest)
async def tokenize(request: Request) -> dict[str, Any]:
    ctx = get_context(request)
    body = await read_body(request, TokenizeRequest, ctx.options.max_body_bytes)
    text = body.prompt if body.prompt is not None else body.content
    if (text is None) == (body.messages is None):
        raise bad_request("give either a prompt (or content) or messages", param="prompt")
    llm = ctx.llm
    if body.messages is not None:
        ids, _ = await run_in_threadpool(render_chat, llm, template_messages(body.messages), None,
                                         body.chat_template_kwargs)
    else:
        special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
        ids = await run_in_threadpool(llm.tokenizer.encode, text, special is not False)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": llm.engine.max_context}
    if body.return_token_strs or body.with_pieces:
        out["token_strs"] = [llm.tokenizer.token_text(t) for t in ids]
    return out


@router.post("/detokenize")
@accepts(DetokenizeRequest)
async def detokenize(request: Request) -> dict[str, str]:
    ctx = get_context(request)
    body = await read_body(request, DetokenizeRequest, ctx.options.max_body_bytes)
    tok = ctx.llm.tokenizer
    bad = next((t for t in body.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {tok.vocab_size})", param="tokens")
    text = tok.decode(body.tokens)
    return {"prompt": text, "content": text}


@router.post("/apply-template")
@accepts(ApplyTemplateRequest)
async def apply_template(request: Request) -> dict[str, str]:
    ctx = get_context(request)
    body = await read_body(request, ApplyTemplateRequest, ctx.options.max_body_bytes)
    return {"prompt": await run_in_threadpool(chat_text, ctx.llm, template_messages(body.messages), None,
                                              body.chat_template_kwargs)}
