"""OpenAI protocol: /v1/models, /v1/chat/completions, /v1/completions.

Request bodies are pydantic models; the work is the shared generation core, this module only
translates requests into GenerationRequests and events into OpenAI's JSON and SSE chunks.
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

from cobatch.engine.grammar import STRUCTURED_KINDS
from cobatch.engine.sampler import MAX_TOP_LOGPROBS
from cobatch.server.context import ServerContext, get_context
from cobatch.server.errors import ApiError, bad_request, error_body
from cobatch.server.generation import (Choices, Chunk, Completed, Finish, Generation, GenerationRequest,
                                       TokenLogprob, Usage, interleave, make_sampling_params)
from cobatch.server.output_events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from cobatch.server.prompting import (StructuredOutput, check_prompt_fits, max_new_tokens, named_tool_only,
                                      output_grammar, raw_prompts, render_chat)
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body
from cobatch.server.responses import EventStreamResponse, GeneratedJSONResponse, sse_data
from cobatch.server.sampler_fields import LlamaCppSamplers

router = APIRouter()
log = logging.getLogger("cobatch.server")

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16        # `n`: each choice is a session of its own, decoded in the same batch
MAX_PROMPTS = 64        # prompts in one completions request, times n


# --- request bodies ---------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")    # unknown fields are ignored, as vLLM and llama.cpp do


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's: with include_usage, every chunk carries the usage so far


def _stream_usage(body) -> tuple[bool, bool]:
    """(a final chunk with the usage, every chunk with the usage so far) a streamed request asks for."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return include, include and options.continuous_usage_stats


class _SamplingBody(_Body, LlamaCppSamplers):        # llama.cpp's samplers: its OpenAI routes take them too
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate, each an independent sample")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # Structured outputs as vLLM takes them ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}), its
    # older guided_* fields, and llama.cpp's server's `grammar` (GBNF) and `json_schema`
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's sampling extras
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="keep only the prompt's last k tokens")
    priority: int = Field(0, ge=-2 ** 62, le=2 ** 62, description="lower runs first (--scheduling-policy priority)")
    return_token_ids: bool = Field(False, description="vLLM's: the prompt's and the output's token ids beside the text")
    # vLLM's: logprobs name tokens "token_id:ID"; here the server's --return-tokens-as-token-ids decides it
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = Field(None, description="prefix-cache blocks are shared only with the same salt")


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class PredictedContent(_Body):
    """OpenAI's Predicted Outputs: text the answer will mostly be (a file to rewrite with a few edits). It only
    gives speculative decoding its drafts: the answer is the same with or without it."""
    type: Literal["content"]
    content: str | list[dict[str, Any]]


PROMPT_LOGPROBS = "vLLM's: each prompt token's logprob, rank and its k likeliest alternatives (not streamed)"


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    prediction: PredictedContent | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None          # the template's `reasoning_effort` variable, as vLLM passes it
    # vLLM's: the reply continues the final assistant message (a prefill). A final assistant message is
    # continued anyway; continue_final_message true / add_generation_prompt false just insist on one.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=PROMPT_LOGPROBS)
    # the server writes text only: a request for spoken output is refused rather than answered in text
    modalities: list[Literal["text"]] | None = None
    audio: None = Field(None, description="audio output is not supported")


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="0 with echo: only the prompt (and its logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=PROMPT_LOGPROBS)


# --- shared request -> generation ---------------------------------------------------------------------

_STRUCTURED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                      "guided_grammar": "grammar", "grammar": "grammar", "json_schema": "json"}


def _structured(body: _SamplingBody) -> StructuredOutput | None:
    """The one structured output a request asks for beyond response_format (None: none); a 400 if it asks for
    several, or names a kind there is none of."""
    given = [StructuredOutput(kind, getattr(body, field), field) for field, kind in _STRUCTURED_FIELDS.items()
             if getattr(body, field) is not None]
    for key, value in (body.structured_outputs or {}).items():
        if value is None or key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                                    "whitespace_pattern"):   # vLLM's backend options: no meaning here
            continue
        if key == "json_object":
            if value is True:
                given.append(StructuredOutput("json", {"type": "object"}, "structured_outputs.json_object"))
            continue
        if key not in STRUCTURED_KINDS:
            raise bad_request(f"structured_outputs.{key} is not supported (json, regex, choice, grammar, "
                              "json_object)", param="structured_outputs")
        given.append(StructuredOutput(key, value, f"structured_outputs.{key}"))
    if len(given) > 1:
        raise bad_request(f"give one structured output, not {len(given)}: {', '.join(g.param for g in given)}",
                          param=given[1].param)
    return given[0] if given else None


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return stops


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"token id": bias} -> sorted (id, bias) pairs; ranges are checked by SamplingParams."""
    if not raw:
        return None
    try:
        return tuple(sorted((int(key), bias) for key, bias in raw.items()))
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None


def _allowed_token_ids(ids: list[int] | None) -> tuple[int, ...] | None:
    """vLLM's allowed_token_ids (None: any token); an empty list would allow none, and is refused as vLLM does."""
    if ids is not None and not ids:
        raise bad_request("allowed_token_ids is empty: it would allow no token (leave it out to allow any)",
                          param="allowed_token_ids")
    return tuple(ids) if ids else None


def _bad_words(ctx: ServerContext, words: list[str] | None) -> tuple[tuple[int, ...], ...] | None:
    """vLLM's bad_words as token sequences: each word as written, and after a space (mid-text), so it is
    banned at the start of the output and after another word alike."""
    if not words:
        return None
    tokenizer, out = ctx.llm.tokenizer, []
    for i, word in enumerate(words):
        if not word.strip():
            raise bad_request("bad_words entries must not be empty", param=f"bad_words.{i}")
        for text in (word.lstrip(), " " + word.lstrip()):
            out.append(tuple(tokenizer.encode(text, add_special=False)))
    return tuple(dict.fromkeys(out))


def _truncated(body: _SamplingBody, prompt_ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: only the prompt's last k tokens (left truncation)."""
    k = body.truncate_prompt_tokens
    return prompt_ids[-k:] if k is not None and len(prompt_ids) > k else prompt_ids


def _sampling(ctx: ServerContext, body: _SamplingBody, n_prompt: int, max_tokens: int | None,
              logprobs: int | None, grammar: str | None, prompt_logprobs: int | None = None,
              prediction: tuple[int, ...] | None = None):
    if body.return_tokens_as_token_ids is not None and body.return_tokens_as_token_ids != ctx.options.tokens_as_ids:
        raise bad_request("return_tokens_as_token_ids: logprobs name tokens as the server was started "
                          f"({'with' if ctx.options.tokens_as_ids else 'without'} --return-tokens-as-token-ids)",
                          param="return_tokens_as_token_ids")
    limit = ctx.options.max_logprobs
    for name, value in (("top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs", logprobs),
                        ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > limit:
            raise bad_request(f"{name}: at most {limit} (the server's --max-logprobs)", param=name)
    return make_sampling_params(
        ctx.llm.tokenizer.vocab_size, ctx.options.sampling_defaults, ctx.by_priority, tokenizer=ctx.llm.tokenizer,
        priority=body.priority, cache_salt=body.cache_salt,
        temperature=body.temperature, top_p=body.top_p, min_p=body.min_p, seed=body.seed, **body.sampler_fields(),
        top_k=0 if body.top_k == -1 else body.top_k,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, min_tokens=body.min_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
        logit_bias=_logit_bias(body.logit_bias), grammar=grammar,
        allowed_token_ids=_allowed_token_ids(body.allowed_token_ids),
        bad_words=_bad_words(ctx, body.bad_words), prediction=prediction, adapter=ctx.adapter_for(body.model),
        max_tokens=max_new_tokens(ctx, max_tokens, n_prompt))


def effort_kwargs(effort: str | None, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat template's variables with a request's reasoning effort among them (templates such as gpt-oss's
    read `reasoning_effort`); the request's own chat_template_kwargs win."""
    if effort is None:
        return kwargs
    return {"reasoning_effort": effort, **(kwargs or {})}


def _message_text(content: str | list[dict[str, Any]] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not content:
        raise bad_request("content is an empty list of parts: give a string or at least one text part",
                          param=f"{where}.content")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise bad_request(f"content part of type {kind!r} is not supported (text only)",
                              param=f"{where}.content.{i}")
    return "".join(parts)


def _prediction(ctx: ServerContext, prediction: PredictedContent | None) -> tuple[int, ...] | None:
    """The predicted output's tokens, as the answer would hold them (no special tokens added)."""
    text = _message_text(prediction.content, "prediction") if prediction is not None else None
    return tuple(ctx.llm.tokenizer.encode(text, add_special=False)) if text else None


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":     # only an assistant's turn may be calls alone
            raise bad_request(f"a {m.role} message needs its content", param=f"messages.{i}.content")
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _message_text(m.content, f"messages.{i}")}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": arguments_object(c.function.arguments, f"messages.{i}.tool_calls.{j}")}}
                for j, c in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def arguments_object(arguments: str | dict, where: str) -> dict:
    # OpenAI sends arguments as a JSON string; chat templates (Qwen's among them) want the object.
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise bad_request("tool call arguments must be a JSON object encoded as a string",
                          param=f"{where}.function.arguments")
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        raise bad_request("tool call arguments must be a JSON object encoded as a string",
                          param=f"{where}.function.arguments") from None
    if not isinstance(value, dict):
        raise bad_request("tool call arguments must be a JSON object", param=f"{where}.function.arguments")
    return value


def _continues_final(body: ChatCompletionRequest) -> bool:
    """Whether the reply continues the final message: yes when it is the assistant's; a 400 when the request
    insists on that (continue_final_message, add_generation_prompt false) and the final message is another's."""
    final = body.messages[-1]
    if final.role == "assistant" and not final.tool_calls:
        return True
    for name, insists in (("continue_final_message", body.continue_final_message),
                          ("add_generation_prompt", not body.add_generation_prompt)):
        if insists:
            raise bad_request(f"{name} needs the final message to be the assistant's (the text to continue)",
                              param=name)
    return False


def _tools(body: ChatCompletionRequest) -> list[dict] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if isinstance(body.tool_choice, dict):     # a named function: offer only that one
        function = body.tool_choice.get("function")
        if not isinstance(function, dict):
            raise bad_request('tool_choice names a function as {"type": "function", "function": {"name": ...}}',
                              param="tool_choice.function")
        tools = named_tool_only(tools, function.get("name"))
    return tools


# --- formatting --------------------------------------------------------------------------------------

def _token_entry(ctx: ServerContext, token_id: int, logprob: float) -> dict:
    name = _token_text(ctx, token_id)
    raw = name.encode() if ctx.options.tokens_as_ids else ctx.llm.tokenizer.token_bytes(token_id)
    return {"token": name, "logprob": logprob, "bytes": list(raw)}


def _token_text(ctx: ServerContext, token_id: int) -> str:
    """A token's text as logprobs name it (its bytes, a partial UTF-8 character replaced), or with vLLM's
    --return-tokens-as-token-ids "token_id:ID", which names every token, whole or not, apart."""
    if ctx.options.tokens_as_ids:
        return f"token_id:{token_id}"
    return ctx.llm.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _chat_logprobs(ctx: ServerContext, logprobs: list[TokenLogprob]) -> dict:
    return {"content": [{**_token_entry(ctx, lp.token_id, lp.logprob),
                         "top_logprobs": [_token_entry(ctx, t, p) for t, p in lp.top]} for lp in logprobs]}


def _completion_logprobs(ctx: ServerContext, logprobs: list[TokenLogprob], offset: int) -> dict:
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(offset)
        tokens.append(_token_text(ctx, lp.token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp.top is None else {_token_text(ctx, t): p for t, p in lp.top}
                             for lp in logprobs],
            "text_offset": offsets}


def _prompt_logprobs(ctx: ServerContext, entries: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing predicts it), then per token
    {token id: {logprob, rank, decoded_token}} for the token itself and its k likeliest alternatives."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": _token_text(ctx, token_id)}
    out: list[dict | None] = [None]
    for lp in entries:
        found = {str(t): entry(t, p, i + 1) for i, (t, p) in enumerate(lp.top)}
        found[str(lp.token_id)] = entry(lp.token_id, lp.logprob, lp.rank)
        out.append(found)
    return out


def _check_stream_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
    """The fields that hold only with `stream` true, or only with it false (as vLLM checks them)."""
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available when streaming (as in vLLM)", param="prompt_logprobs")
    if not body.stream and body.stream_options is not None:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


def _usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": u.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": u.rejected_prediction_tokens}}


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _stream_error(err: ApiError) -> str:
    return sse_data(error_body(err, anthropic=False))


# --- routes ------------------------------------------------------------------------------------------

@router.get("/v1/models")
@router.get("/models")                  # llama.cpp's server answers both, as clients set base URLs with or without /v1
async def list_models(request: Request) -> dict:
    ctx = get_context(request)
    return {"object": "list", "data": [_model_card(ctx, name) for name in ctx.model_names]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    ctx = get_context(request)
    if model_id not in ctx.model_names:
        raise ApiError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
    return _model_card(ctx, model_id)


def _model_card(ctx: ServerContext, name: str) -> dict:
    card = {"id": name, "object": "model", "created": ctx.created, "owned_by": "cobatch",
            "max_model_len": ctx.llm.engine.max_context}
    if name in ctx.adapter_names:      # as vLLM lists a LoRA adapter: its path, and the model it adapts
        card.update(root=str(ctx.llm.model.lora.adapters[ctx.llm.model.lora.slot(name) - 1].path),
                    parent=ctx.model_name)
    return card


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
@accepts(ChatCompletionRequest)
async def chat_completions(request: Request):
    ctx = get_context(request)
    body = await read_body(request, ChatCompletionRequest, ctx.options.max_body_bytes)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    _check_stream_fields(body)
    tools = _tools(body)
    grammar = await output_grammar(ctx.llm, tools, parallel=body.parallel_tool_calls is not False,
                                   force_call=body.tool_choice == "required" or isinstance(body.tool_choice, dict),
                                   response_format=body.response_format, structured=_structured(body))
    messages = template_messages(body.messages)
    prompt_ids, in_think = await run_in_threadpool(render_chat, ctx.llm, messages, tools,
                                                   effort_kwargs(body.reasoning_effort, body.chat_template_kwargs),
                                                   _continues_final(body))
    prompt_ids = _truncated(body, prompt_ids)
    check_prompt_fits(ctx.llm, len(prompt_ids), "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling(ctx, body, len(prompt_ids), body.max_completion_tokens or body.max_tokens, logprobs, grammar,
                       body.prompt_logprobs, prediction=_prediction(ctx, body.prediction))
    choices = Choices(ctx.generation, [GenerationRequest(
        "chat", prompt_ids, params, _stops(body.stop), include_stop=body.include_stop_str_in_output,
        skip_special=body.skip_special_tokens, parse_reasoning=ctx.options.parse_reasoning, start_in_reasoning=in_think,
        report_token_ids=body.return_token_ids,
        tools=tools or None)], body.n)
    meta = {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()),
            "model": ctx.answered_by(body.model)}
    if body.stream:
        include_usage, continuous = _stream_usage(body)
        streams = [_chat_stream(ctx, gen, meta, include_usage, i, continuous)
                   for i, gen in enumerate(choices.generations)]
        return EventStreamResponse(_ending_in_done(_with_usage(streams, choices, meta, "chat.completion.chunk",
                                                               include_usage)), choices.close)
    return GeneratedJSONResponse(lambda: _chat_result(ctx, choices, meta), choices.close, request.url.path)


async def _chat_result(ctx: ServerContext, choices: Choices, meta: dict) -> dict:
    done = await choices.collect()
    want_logprobs = choices.generations[0].request.params.logprobs is not None
    result = {**meta, "object": "chat.completion", "choices": [_chat_choice(ctx, i, d, want_logprobs)
                                                               for i, d in enumerate(done)],
              "usage": _usage(choices.total_usage([d.finish for d in done]))}
    request = choices.generations[0].request
    if request.params.prompt_logprobs is not None:     # the prompt is every choice's
        result["prompt_logprobs"] = _prompt_logprobs(ctx, done[0].prompt_logprobs)
    if request.report_token_ids:
        result["prompt_token_ids"] = request.prompt_ids
        for choice, d in zip(result["choices"], done):
            choice["token_ids"] = d.token_ids
    return result


def _chat_choice(ctx: ServerContext, index: int, done: Completed, want_logprobs: bool) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": done.content if done.content or not done.tool_calls
                               else None}
    if done.reasoning:
        message["reasoning_content"] = done.reasoning
    if done.tool_calls:
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in done.tool_calls]
    return {"index": index, "message": message, "finish_reason": done.finish.reason,
            "logprobs": _chat_logprobs(ctx, done.logprobs) if want_logprobs else None}


async def _ending_in_done(frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """The frames, then [DONE]. An error mid-stream ends the stream with an error frame the client can parse."""
    try:
        async for frame in frames:
            yield frame
    except ApiError as err:
        yield _stream_error(err)
    except Exception as exc:             # a bug: still end the stream in the protocol's shape
        log.exception("stream failed")
        yield _stream_error(ApiError(500, f"internal server error: {type(exc).__name__}"))
    finally:
        await frames.aclose()            # also when the client left and the response closes us
    yield sse_data("[DONE]")


def _sse_chunk(meta: dict, obj: str, include_usage: bool, choice: dict, running: Generation | None = None,
               top: dict | None = None) -> str:
    """One streamed chunk; with include_usage every chunk carries "usage": null until the final one, or with
    `running` (vLLM's continuous_usage_stats) that choice's usage so far. `top`: fields of the chunk itself."""
    chunk = {**meta, "object": obj, "choices": [choice], **(top or {})}
    if include_usage:
        chunk["usage"] = None if running is None else _usage(running.usage_so_far())
    return sse_data(chunk)


async def _with_usage(streams: list, choices: Choices, meta: dict, obj: str,
                      include_usage: bool) -> AsyncIterator[str]:
    """The choices' frames interleaved; then, when asked for, one chunk with the usage of all of them."""
    async for frame in interleave(streams):
        yield frame
    if include_usage:
        usage = choices.total_usage([gen.finish for gen in choices.generations])
        yield sse_data({**meta, "object": obj, "choices": [], "usage": _usage(usage)})


async def _chat_stream(ctx: ServerContext, gen: Generation, meta: dict, include_usage: bool,
                       index: int, continuous: bool = False) -> AsyncIterator[str]:
    ids = gen.request.report_token_ids

    def frame(delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
              tokens: list[int] | None = None, top: dict | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if ids:         # vLLM's return_token_ids: each chunk's own tokens
            choice["token_ids"] = tokens or []
        return _sse_chunk(meta, "chat.completion.chunk", include_usage, choice, gen if continuous else None, top)

    want_logprobs = gen.request.params.logprobs is not None
    call_ids: dict[int, str] = {}
    yield frame({"role": "assistant", "content": ""}, top={"prompt_token_ids": gen.request.prompt_ids} if ids else None)
    async for item in gen.events():
        if isinstance(item, Finish):
            yield frame({}, item.reason)
            break
        deltas = [_chat_delta(e, call_ids) for e in item.events] or [{"content": ""}]
        logprobs = _chat_logprobs(ctx, item.logprobs) if want_logprobs else None
        for i, delta in enumerate(deltas):
            yield frame(delta, logprobs=logprobs if i == 0 else None, tokens=item.token_ids if i == 0 else None)


def _chat_delta(event, call_ids: dict[int, str]) -> dict:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        call_ids[event.index] = call_id()
        return {"tool_calls": [{"index": event.index, "id": call_ids[event.index], "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    assert isinstance(event, ToolCallArgsDelta)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


@router.post("/v1/completions")
@accepts(CompletionRequest)
async def completions(request: Request):
    ctx = get_context(request)
    body = await read_body(request, CompletionRequest, ctx.options.max_body_bytes)
    grammar = await output_grammar(ctx.llm, None, force_call=False, parallel=False,
                                   response_format=body.response_format, structured=_structured(body))
    prompts = await run_in_threadpool(raw_prompts, ctx.llm, body.prompt, body.suffix, "prompt", MAX_PROMPTS)
    if len(prompts) * body.n > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts x n per request (got {len(prompts)} x {body.n})",
                          param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens 0 needs echo (it returns only the prompt, with its logprobs)",
                          param="max_tokens")
    _check_stream_fields(body)
    # echo + logprobs: the prompt's tokens get logprobs too (lm-eval-harness' loglikelihood requests)
    echo_logprobs = body.logprobs if body.echo else None
    wanted = [k for k in (echo_logprobs, body.prompt_logprobs) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    requests = []
    for ids, _ in prompts:
        ids = _truncated(body, ids)
        check_prompt_fits(ctx.llm, len(ids), "prompt")
        params = _sampling(ctx, body, len(ids), 1 if body.max_tokens == 0 else body.max_tokens,
                           body.logprobs, grammar, prompt_logprobs)
        requests.append(GenerationRequest("completions", ids, params, _stops(body.stop),
                                          include_stop=body.include_stop_str_in_output,
                                          skip_special=body.skip_special_tokens, report_output=body.max_tokens != 0,
                                          report_token_ids=body.return_token_ids))
    choices = Choices(ctx.generation, requests, body.n)
    meta = {"id": "cmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()), "model": ctx.answered_by(body.model)}
    echoes = [text if body.echo else "" for _, text in prompts for _ in range(body.n)]     # one per choice
    if body.stream:
        include_usage, continuous = _stream_usage(body)
        streams = [_completion_stream(ctx, gen, meta, echo, include_usage, i, continuous)
                   for i, (gen, echo) in enumerate(zip(choices.generations, echoes))]
        return EventStreamResponse(_ending_in_done(_with_usage(streams, choices, meta, "text_completion",
                                                               include_usage)), choices.close)
    return GeneratedJSONResponse(lambda: _completion_result(ctx, choices, meta, echoes, echo_logprobs,
                                                            body.prompt_logprobs is not None),
                                 choices.close, request.url.path)


def _echoed_logprobs(gen: Generation, prompt_logprobs: list[TokenLogprob], k: int | None) -> list[TokenLogprob]:
    """The prompt's entries when it is echoed with k logprobs (k None: not echoed with logprobs): its first token
    has none (nothing predicts it), the others their k likeliest alternatives."""
    if k is None:
        return []
    return [TokenLogprob(gen.request.prompt_ids[0], None, None)] + [
        TokenLogprob(lp.token_id, lp.logprob, lp.top[:k]) for lp in prompt_logprobs]


async def _completion_result(ctx: ServerContext, choices: Choices, meta: dict, echoes: list[str],
                             echo_logprobs: int | None, want_prompt_logprobs: bool) -> dict:
    done = await choices.collect()
    want_logprobs = choices.generations[0].request.params.logprobs is not None
    out = [{"index": i, "text": echo + d.content, "finish_reason": d.finish.reason,
            "logprobs": _completion_logprobs(ctx, _echoed_logprobs(gen, d.prompt_logprobs, echo_logprobs)
                                             + d.logprobs, 0 if echo_logprobs is not None else len(echo))
            if want_logprobs else None}
           for i, (d, echo, gen) in enumerate(zip(done, echoes, choices.generations))]
    if want_prompt_logprobs:
        for choice, d in zip(out, done):
            choice["prompt_logprobs"] = _prompt_logprobs(ctx, d.prompt_logprobs)
    for choice, d, gen in zip(out, done, choices.generations):
        if gen.request.report_token_ids:
            choice.update(prompt_token_ids=gen.request.prompt_ids, token_ids=d.token_ids)
    return {**meta, "object": "text_completion", "choices": out,
            "usage": _usage(choices.total_usage([d.finish for d in done]))}


async def _completion_stream(ctx: ServerContext, gen: Generation, meta: dict, echo: str,
                             include_usage: bool, index: int, continuous: bool = False) -> AsyncIterator[str]:
    ids, sent = gen.request.report_token_ids, False

    def frame(text: str, finish_reason: str | None = None, logprobs: dict | None = None,
              tokens: list[int] | None = None) -> str:
        nonlocal sent
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if ids:         # vLLM's return_token_ids: the prompt's on the choice's first chunk, each chunk's own tokens
            choice.update({} if sent else {"prompt_token_ids": gen.request.prompt_ids}, token_ids=tokens or [])
            sent = True
        return _sse_chunk(meta, "text_completion", include_usage, choice, gen if continuous else None)

    want_logprobs = gen.request.params.logprobs is not None
    offset, prompt_logprobs, echoed = len(echo), [], not echo

    async for item in gen.events():
        # The echo goes out with the first output (or the end), once the prompt's logprobs are all in.
        if isinstance(item, Chunk):
            prompt_logprobs += item.prompt_logprobs
        if not echoed and (isinstance(item, Finish) or item.events or item.logprobs or item.token_ids):
            echoed = True
            entries = _echoed_logprobs(gen, prompt_logprobs, gen.request.params.prompt_logprobs)
            yield frame(echo, logprobs=_completion_logprobs(ctx, entries, 0) if want_logprobs and entries else None)
        if isinstance(item, Finish):
            yield frame("", item.reason)
            break
        if not (item.events or item.logprobs or item.token_ids):
            continue
        text = "".join(e.text for e in item.events if isinstance(e, ContentDelta))
        logprobs = _completion_logprobs(ctx, item.logprobs, offset) if want_logprobs else None
        offset += len(text)
        yield frame(text, logprobs=logprobs, tokens=item.token_ids)
