"""Anthropic protocol: /v1/messages (plain and streamed) and /v1/messages/count_tokens.

Content blocks map onto the chat template's messages: tool_use -> an assistant tool call (arguments as
an object), tool_result -> a "tool" message, thinking -> reasoning_content. A final assistant message is
a prefill: the reply continues it. Usage follows Anthropic's convention: input_tokens counts the prompt
tokens that were computed, cache_read_input_tokens those served from the prefix cache; their sum is what
count_tokens returns for the same input.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from cobatch.server.context import ServerContext, get_context
from cobatch.server.errors import ApiError, bad_request, error_body
from cobatch.server.generation import Completed, Finish, Generation, GenerationRequest, make_sampling_params
from cobatch.server.output_events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from cobatch.server.prompting import check_prompt_fits, named_tool_only, output_grammar, render_chat
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body
from cobatch.server.responses import EventStreamResponse, GeneratedJSONResponse, sse_event

router = APIRouter()
log = logging.getLogger("cobatch.server")

MAX_STOP_SEQUENCES = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Body):
    type: str | None = None       # "custom" (or none); Anthropic's server tools (web_search_..., bash_...) are not run
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class _Conversation(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Conversation):
    pass


# --- request -> prompt --------------------------------------------------------------------------------

def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as plain text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, block in enumerate(value):
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, dict) and block.get("type") == "text":
                raise bad_request(f"{where}.{i}.text: required, a string")
            else:
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise bad_request(f"{where}.{i}: block of type {kind!r} is not supported here (text only)")
        return "\n".join(parts)
    raise bad_request(f"{where}: expected a string or a list of text blocks")


def _field(block: dict, key: str, kind: type, where: str):
    value = block.get(key)
    if not isinstance(value, kind):
        raise bad_request(f"{where}.{key}: required, a {kind.__name__}")
    return value


def _document_text(block: dict, where: str) -> str:
    """A document block of plain text (a "text" source, or a "content" source of text blocks) as the text the
    model reads: its title and context, if given, then the document. PDFs and URLs are not read."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text":
        text = _field(source, "data", str, f"{where}.source")
    elif kind == "content":
        text = _text(source.get("content"), f"{where}.source.content")
    else:
        raise bad_request(f"{where}.source: documents of plain text only (a 'text' or 'content' source), "
                          f"not {kind!r}")
    citations = block.get("citations")
    if isinstance(citations, dict) and citations.get("enabled"):
        raise bad_request(f"{where}.citations: this server does not cite documents (leave citations off)")
    head = [value for value in (block.get("title"), block.get("context")) if isinstance(value, str) and value]
    return "\n\n".join([*head, text])


def _template_messages(body: _Conversation) -> list[dict]:
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, thinking = [], [], []
        for j, block in enumerate(m.content):
            kind, at = block.get("type"), f"{where}.{j}"
            if kind == "text":
                texts.append(_field(block, "text", str, at))
            elif kind == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, at),
                            "content": _text(block.get("content"), f"{at}.content")})
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("input", {}), dict):
                    raise bad_request(f"{at}.input: a tool call's input is an object")
                calls.append({"id": _field(block, "id", str, at), "type": "function",
                              "function": {"name": _field(block, "name", str, at),
                                           "arguments": block.get("input") or {}}})
            elif kind == "thinking" and m.role == "assistant":
                thinking.append(_field(block, "thinking", str, at))
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue
            elif kind == "document" and m.role == "user":
                texts.append(_document_text(block, at))
            else:
                raise bad_request(f"{at}: content block of type {kind!r} is not supported in the {m.role}'s message")
        if not m.content:
            raise bad_request(f"{where}: a message's content is a string or a non-empty list of blocks")
        if m.role == "user":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        out.append(msg)
    return out


def _tools(body: _Conversation) -> list[dict] | None:
    choice = (body.tool_choice or {}).get("type")
    if body.tool_choice is not None and choice not in ("auto", "any", "tool", "none"):
        raise bad_request(f"tool_choice.type {choice!r}: one of auto, any, tool, none")
    server_tool = next((t for t in body.tools or () if t.type not in (None, "custom")), None)
    if server_tool is not None:
        raise bad_request(f"tools: {server_tool.name!r} is a server tool ({server_tool.type}), which this server does "
                          "not run; declare client tools with an input_schema")
    if choice in ("any", "tool") and not body.tools:    # as /v1/messages answers it, so count_tokens does too
        raise bad_request(f"tool_choice.type {choice!r} forces a call and needs tools")
    if not body.tools or choice == "none":
        return None
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools]
    if choice == "tool":      # a named tool: offer only that one
        tools = named_tool_only(tools, body.tool_choice.get("name"), param=None)
    return tools


def _prompt(ctx: ServerContext, body: _Conversation) -> tuple[list[int], bool, list[dict] | None]:
    messages, tools = _template_messages(body), _tools(body)
    prefill = body.messages[-1].role == "assistant"
    if prefill and (messages[-1].get("tool_calls") or not messages[-1].get("content")):
        raise bad_request("a final assistant message (prefill) must be non-empty text")
    thinking = body.thinking or {}
    budget = thinking.get("budget_tokens", 1024)
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise bad_request('thinking.budget_tokens: an integer, as in {"type": "enabled", "budget_tokens": 2048}')
    template_kwargs = {"enable_thinking": True} if thinking.get("type") == "enabled" else None
    ids, in_think = render_chat(ctx.llm, messages, tools, template_kwargs, continue_final=prefill)
    return ids, in_think, tools


# --- routes ------------------------------------------------------------------------------------------

@router.post("/v1/messages/count_tokens")
@accepts(CountTokensRequest)
async def count_tokens(request: Request) -> dict:
    ctx = get_context(request)
    body = await read_body(request, CountTokensRequest, ctx.options.max_body_bytes)
    ids, _, _ = await run_in_threadpool(_prompt, ctx, body)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
@accepts(MessagesRequest)
async def messages(request: Request):
    ctx = get_context(request)
    body = await read_body(request, MessagesRequest, ctx.options.max_body_bytes)
    prompt_ids, in_think, tools = await run_in_threadpool(_prompt, ctx, body)
    check_prompt_fits(ctx.llm, len(prompt_ids), "messages")
    choice = body.tool_choice or {}
    grammar = await output_grammar(ctx.llm, tools, force_call=choice.get("type") in ("any", "tool"),
                                   parallel=not choice.get("disable_parallel_tool_use"))
    params = make_sampling_params(ctx.llm.tokenizer.vocab_size, ctx.options.sampling_defaults,
                                  temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, max_tokens=body.max_tokens, grammar=grammar,
                                  adapter=ctx.adapter_for(body.model))
    gen = ctx.generation(GenerationRequest(
        "messages", prompt_ids, params, list(body.stop_sequences or []), parse_reasoning=ctx.options.parse_reasoning,
        start_in_reasoning=in_think, tools=tools or None))
    gen.start()
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        return EventStreamResponse(_stream(ctx, gen, msg_id), gen.close)
    return GeneratedJSONResponse(lambda: _result(ctx, gen, msg_id), gen.close, request.url.path)


def _stop_reason(finish: Finish) -> str:
    if finish.stop_string is not None:
        return "stop_sequence"
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish.reason, "end_turn")


def _usage(finish: Finish) -> dict:
    u = finish.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


async def _result(ctx: ServerContext, gen: Generation, msg_id: str) -> dict:
    done: Completed = await gen.collect()
    content: list[dict] = []
    if done.reasoning:
        content.append({"type": "thinking", "thinking": done.reasoning, "signature": ""})
    if done.content or not (done.reasoning or done.tool_calls):
        content.append({"type": "text", "text": done.content})
    content += [{"type": "tool_use", "id": _tool_use_id(), "name": c.name, "input": _tool_input(c.arguments)}
                for c in done.tool_calls]
    return {"id": msg_id, "type": "message", "role": "assistant", "model": ctx.answered_by(gen.request.params.adapter),
            "content": content, "stop_reason": _stop_reason(done.finish), "stop_sequence": done.finish.stop_string,
            "usage": _usage(done.finish)}


async def _stream(ctx: ServerContext, gen: Generation, msg_id: str) -> AsyncIterator[str]:
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": ctx.answered_by(gen.request.params.adapter),
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(gen.request.prompt_ids), "output_tokens": 0}}})
    blocks = _BlockWriter()
    try:
        async for item in gen.events():
            if isinstance(item, Finish):
                for frame in blocks.close():
                    yield frame
                yield sse_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(item), "stop_sequence": item.stop_string},
                    "usage": _usage(item)})
                yield sse_event("message_stop", {"type": "message_stop"})
                return
            for event in item.events:
                for frame in blocks.write(event):
                    yield frame
    except ApiError as err:
        yield sse_event("error", error_body(err, anthropic=True))
    except Exception as exc:             # a bug: end the stream with an error the client can parse
        log.exception("stream failed")
        yield sse_event("error", error_body(ApiError(500, f"internal server error: {type(exc).__name__}"),
                                            anthropic=True))


class _BlockWriter:
    """Events -> content_block_start / _delta / _stop frames; a new block whenever the kind changes."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None        # ("text",) | ("thinking",) | ("tool_use", tool index)

    def write(self, event) -> list[str]:
        if isinstance(event, ToolCallStart):
            return self._start(("tool_use", event.index),
                               {"type": "tool_use", "id": _tool_use_id(), "name": event.name, "input": {}})
        frames: list[str] = []
        if isinstance(event, ContentDelta):
            if self.open != ("text",):
                frames += self._start(("text",), {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": event.text}
        elif isinstance(event, ReasoningDelta):
            if self.open != ("thinking",):
                frames += self._start(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
            delta = {"type": "thinking_delta", "thinking": event.text}
        else:
            assert isinstance(event, ToolCallArgsDelta) and self.open == ("tool_use", event.index)
            delta = {"type": "input_json_delta", "partial_json": event.text}
        frames.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                        "delta": delta}))
        return frames

    def _start(self, key: tuple, block: dict) -> list[str]:
        frames = self.close()
        self.index += 1
        self.open = key
        frames.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block}))
        return frames

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]
