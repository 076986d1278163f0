"""OpenAI's Responses API: POST /v1/responses, plain or streamed (what OpenAI's newer SDKs and agent
frameworks speak), and GET / DELETE /v1/responses/{id}.

Input items (messages, function calls and their outputs) become chat messages for the model's template; the
output (reasoning, text, function calls) comes from the generation core the other protocols share, turned into
output items here. A response is stored unless `store` is false (server/response_store.py), so a request may
continue it by `previous_response_id` instead of sending the whole conversation again.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from cobatch.server.context import ServerContext, get_context
from cobatch.server.errors import ApiError, bad_request, error_body
from cobatch.server.generation import Finish, Generation, GenerationRequest, make_sampling_params
from cobatch.server.openai import arguments_object, call_id, effort_kwargs
from cobatch.server.output_events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from cobatch.server.prompting import check_prompt_fits, max_new_tokens, named_tool_only, output_grammar, render_chat
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body
from cobatch.server.response_store import ResponseStore
from cobatch.server.responses import EventStreamResponse, GeneratedJSONResponse, sse_event

router = APIRouter()
log = logging.getLogger("cobatch.server")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-2 ** 62, le=2 ** 62, description="lower runs first (--scheduling-policy priority)")
    cache_salt: str | None = Field(None, description="prefix-cache blocks are shared only with the same salt")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None       # its effort goes to the template, as the chat route's does
    # "auto": the oldest turns are dropped until the input fits the context (OpenAI's); "disabled": a 400
    truncation: Literal["auto", "disabled"] = "disabled"


# --- input -> chat messages ----------------------------------------------------------------------------

def _text(content: str | list[dict[str, Any]] | None, where: str, field: str = "content") -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{field} must be a string or a list of text parts", param=f"{where}.{field}")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request("a content part must be an object such as {\"type\": \"input_text\", \"text\": ...}",
                              param=f"{where}.{field}.{i}")
        if part.get("type") in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise bad_request(f"content part of type {part.get('type')!r} is not supported (text only)",
                              param=f"{where}.content.{i}")
    return "".join(parts)


def chat_messages(body: ResponsesRequest, earlier: list[dict] | None = None) -> list[dict]:
    """instructions + the earlier turns (previous_response_id's conversation) + input items -> the messages a chat
    template takes."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    return system + (earlier or []) + input_messages(body)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The input items as chat messages."""
    out: list[dict] = []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise bad_request("input is an empty list: give a text or at least one item", param="input")
    for i, item in enumerate(body.input):
        where, kind = f"input.{i}", item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"a message's role is user, assistant, system or developer (got "
                                  f"{item.get('role')!r})", param=f"{where}.role")
            if item.get("content") is None:
                raise bad_request("a message needs its content", param=f"{where}.content")
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": arguments_object(item.get("arguments") or "{}", where)}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)       # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if output is None:
                raise bad_request("a function_call_output item needs its output", param=f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": output if isinstance(output, str) else _text(output, where, "output")})
        elif kind == "reasoning":
            continue                                     # earlier reasoning is not shown to the model again
        else:
            raise bad_request(f"input item of type {kind!r} is not supported", param=where)
    return out


def _string(item: dict, key: str, where: str) -> str:
    """An input item's required non-empty string field (a call's name and call_id)."""
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"a {item.get('type')} item needs {key}, a non-empty string", param=f"{where}.{key}")
    return value


def _chat_tools(body: ResponsesRequest) -> list[dict] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "strict"})}
             for t in body.tools]
    if isinstance(body.tool_choice, dict):               # {"type": "function", "name": ...}
        tools = named_tool_only(tools, body.tool_choice.get("name"))
    return tools


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format (flat: {"type": "json_schema", "schema": ...}) -> chat's response_format shape."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request('text.format is an object such as {"type": "json_schema", "schema": ...}',
                          param="text.format")
    if not fmt or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}


def _render_input(ctx: ServerContext, body: ResponsesRequest, messages: list[dict],
                  tools: list[dict] | None) -> tuple[list[int], bool]:
    """render_chat of the conversation; with truncation "auto", its oldest turns (a message and the tool results
    after it; the instructions and the last turn stay) dropped one by one until it fits the context."""
    effort = (body.reasoning or {}).get("effort")
    kwargs = effort_kwargs(effort if isinstance(effort, str) else None, None)
    while True:
        ids, in_think = render_chat(ctx.llm, messages, tools, kwargs, param="input")
        system = 1 if messages and messages[0]["role"] == "system" else 0
        turns = [i for i in range(system, len(messages)) if messages[i]["role"] != "tool"]
        if body.truncation != "auto" or len(ids) < ctx.llm.engine.max_context or len(turns) < 2:
            return ids, in_think
        messages = messages[:system] + messages[turns[1]:]


# --- the route -------------------------------------------------------------------------------------------

@router.post("/v1/responses")
@accepts(ResponsesRequest)
async def create_response(request: Request):
    ctx = get_context(request)
    body = await read_body(request, ResponsesRequest, ctx.options.max_body_bytes)
    earlier = []
    if body.previous_response_id:
        earlier = ctx.responses.conversation(body.previous_response_id)
        if earlier is None:
            raise bad_request(f"previous response with id {body.previous_response_id!r} not found, or one before "
                              "it (not stored, deleted, or forgotten: the server keeps the latest "
                              f"{ctx.responses.capacity})", param="previous_response_id")
    tools = _chat_tools(body)
    grammar = await output_grammar(ctx.llm, tools, parallel=body.parallel_tool_calls is not False,
                                   force_call=body.tool_choice == "required" or isinstance(body.tool_choice, dict),
                                   response_format=_response_format(body.text), format_param="text.format")
    prompt_ids, in_think = await run_in_threadpool(_render_input, ctx, body, chat_messages(body, earlier), tools)
    check_prompt_fits(ctx.llm, len(prompt_ids), "input")
    params = make_sampling_params(ctx.llm.tokenizer.vocab_size, ctx.options.sampling_defaults,
                                  ctx.by_priority, priority=body.priority, cache_salt=body.cache_salt,
                                  temperature=body.temperature, top_p=body.top_p,
                                  grammar=grammar, adapter=ctx.adapter_for(body.model),
                                  max_tokens=max_new_tokens(ctx, body.max_output_tokens, len(prompt_ids)))
    gen = ctx.generation(GenerationRequest(
        "responses", prompt_ids, params, [], parse_reasoning=ctx.options.parse_reasoning, start_in_reasoning=in_think,
        tools=tools or None))
    gen.start()
    shell = _Shell(ctx, body, input_messages(body) if body.store else None)
    if body.stream:
        return EventStreamResponse(_stream(gen, shell), gen.close)
    return GeneratedJSONResponse(lambda: _result(gen, shell), gen.close, request.url.path)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str):
    return _stored(get_context(request).responses, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    store = get_context(request).responses
    _stored(store, response_id)
    store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _stored(store: ResponseStore, response_id: str):
    stored = store.get(response_id)
    if stored is None:
        raise ApiError(404, f"no stored response with id {response_id!r}", param="response_id")
    return stored


class _Shell:
    """The response object around the output items: ids, the request's echoed settings, status and usage; stored
    once it has ended, with its turn's input messages, unless `store` is false (`given` None)."""

    def __init__(self, ctx: ServerContext, body: ResponsesRequest, given: list[dict] | None):
        self.id, self.created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        self.store, self.given, self.previous = ctx.responses, given, body.previous_response_id
        self.fields = {"model": ctx.answered_by(body.model), "instructions": body.instructions,
                       "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
                       "top_p": body.top_p, "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                       "tool_choice": body.tool_choice or "auto",
                       "parallel_tool_calls": body.parallel_tool_calls is not False,
                       "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
                       "store": body.store, "previous_response_id": body.previous_response_id, "error": None,
                       "truncation": body.truncation, "reasoning": body.reasoning or {"effort": None, "summary": None}}

    def response(self, output: list[dict], finish: Finish | None) -> dict:
        status, incomplete, usage = "in_progress", None, None
        if finish is not None:
            status = "incomplete" if finish.reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if finish.reason == "length" else None
            u = finish.usage
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "output": output, "incomplete_details": incomplete, "usage": usage, **self.fields}

    def ended(self, output: list[dict], finish: Finish) -> dict:
        """The final response object, stored when asked for."""
        response = self.response(output, finish)
        if self.given is not None:
            self.store.put(response, self.given + _output_messages(output), self.previous)
        return response


def _output_messages(items: list[dict]) -> list[dict]:
    """A response's output items as the assistant's chat message (its reasoning is not shown to the model again)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = []
    for item in items:
        if item["type"] == "function_call":
            try:
                arguments = json.loads(item["arguments"] or "{}")
            except ValueError:
                arguments = item["arguments"]       # cut off mid-arguments: the text as it came
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": arguments}})
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class _Output:
    """Output items built from the generation's events. push/close return the stream events (without their
    sequence numbers) that the change causes; the non-streamed answer uses only `items`."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None                   # the item being written
        self._calls: dict[int, dict] = {}                # the parser's call index -> its item

    def push(self, event) -> list[dict]:
        if isinstance(event, ContentDelta):
            return self._into("message", event.text)
        if isinstance(event, ReasoningDelta):
            return self._into("reasoning", event.text)
        if isinstance(event, ToolCallStart):
            out = self.close()
            item = {"id": "fc_" + uuid.uuid4().hex[:24], "type": "function_call", "call_id": call_id(),
                    "name": event.name, "arguments": "", "status": "in_progress"}
            self._calls[event.index] = item
            return out + self._open_item(item)
        assert isinstance(event, ToolCallArgsDelta)
        item = self._calls[event.index]
        item["arguments"] += event.text
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": self.items.index(item), "delta": event.text}]

    def _into(self, kind: str, text: str) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            if kind == "message":
                item = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                        "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": []}]}
                out += self._open_item(item)
                out.append({"type": "response.content_part.added", **self._where(item),
                            "part": {"type": "output_text", "text": "", "annotations": []}})
            else:
                item = {"id": "rs_" + uuid.uuid4().hex[:24], "type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
                out += self._open_item(item)
        item = self._open
        item["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [{"type": delta, **self._where(item), "delta": text, **extra}]

    def _open_item(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        snapshot = {**item, "content": []} if item["type"] == "message" else dict(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": snapshot}]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def close(self) -> list[dict]:
        """Finish the open item: its done events."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [{"type": "response.output_text.done", **self._where(item), "text": part["text"], "logprobs": []},
                    {"type": "response.content_part.done", **self._where(item), "part": part}]
        elif item["type"] == "reasoning":
            out.append({"type": "response.reasoning_text.done", **self._where(item),
                        "text": item["content"][0]["text"]})
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                        "output_index": self.items.index(item), "arguments": item["arguments"]})
        return out + [{"type": "response.output_item.done", "output_index": self.items.index(item), "item": item}]


async def _result(gen: Generation, shell: _Shell) -> dict:
    output = _Output()
    finish = None
    async for chunk in gen.events():
        if isinstance(chunk, Finish):
            finish = chunk
        else:
            for event in chunk.events:
                output.push(event)
    output.close()
    return shell.ended(output.items, finish)


async def _stream(gen: Generation, shell: _Shell) -> AsyncIterator[str]:
    sequence = iter(range(1 << 62))

    def frame(event: dict) -> str:
        return sse_event(event["type"], {**event, "sequence_number": next(sequence)})

    output = _Output()
    yield frame({"type": "response.created", "response": shell.response([], None)})
    yield frame({"type": "response.in_progress", "response": shell.response([], None)})
    try:
        async for chunk in gen.events():
            if isinstance(chunk, Finish):
                for event in output.close():
                    yield frame(event)
                done = shell.ended(output.items, chunk)
                kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
                yield frame({"type": kind, "response": done})
                return
            for e in chunk.events:
                for event in output.push(e):
                    yield frame(event)
    except Exception as exc:            # ends the stream with an event the client can parse
        if not isinstance(exc, ApiError):
            log.exception("responses stream failed")
        err = exc if isinstance(exc, ApiError) else ApiError(500, f"internal server error: {type(exc).__name__}")
        yield frame({"type": "error", "code": err.code or error_body(err, anthropic=False)["error"]["type"],
                     "message": err.message, "param": err.param})
