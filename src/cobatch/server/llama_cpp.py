"""llama.cpp server's own API: POST /completion, POST /infill and GET /props.

What editor plugins (llama.vim, llama.vscode) and scripts written for llama.cpp's server call. The requests
run through the same generation core as the OpenAI routes; only the field names, the defaults (llama.cpp's:
temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) and the answer's shape differ. Streams are SSE
`data: {...}` lines without a [DONE] marker, the last one with "stop": true, as llama.cpp sends them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from cobatch.errors import UserError
from cobatch.server.context import ServerContext, get_context
from cobatch.server.errors import bad_request
from cobatch.server.generation import (Choices, Completed, Finish, Generation, GenerationRequest, TokenLogprob,
                                       interleave, make_sampling_params)
from cobatch.server.output_events import ContentDelta
from cobatch.server.prompting import StructuredOutput, check_prompt_fits, max_new_tokens, output_grammar, raw_prompts
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body
from cobatch.server.sampler_fields import LlamaCppSamplers
from cobatch.server.responses import EventStreamResponse, GeneratedJSONResponse, sse_data

router = APIRouter()

MAX_PROMPTS = 64        # prompts in one /completion request: each is a session in the engine's queue


class LoraScale(BaseModel):
    id: int
    scale: float


class CompletionRequest(LlamaCppSamplers):
    model_config = ConfigDict(extra="ignore")       # the fields of llama.cpp it does not know are ignored
    # one prompt (text or token ids), or several (texts or id lists: answered as a list, streamed with an index)
    prompt: str | list[int] | list[str] | list[list[int]] = ""
    n_predict: int = Field(-1, ge=-1, description="-1: until the end of turn or the context is full")
    # Unset: the server's default (serve --temperature ...), else llama.cpp's (LLAMA_CPP_SAMPLING)
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0, description="0: off")
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int = Field(-1, description="-1: random")
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] = Field(default_factory=list, max_length=16)
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=20, description="top alternatives per token (completion_probabilities)")
    ignore_eos: bool = False
    grammar: str | None = None                    # GBNF (or Lark)
    json_schema: dict[str, Any] | None = None
    return_tokens: bool = False
    # [[token id or text, bias or false], ...] (false: never), or {"token id": bias}
    logit_bias: list[list[Any]] | dict[str, float] | None = None
    # llama.cpp's: only these fields of the answer (not streamed), "a/b" naming b inside a, each under its path
    response_fields: list[str] | None = Field(None, max_length=64)
    # llama.cpp's per-request LoRA scales, by adapter id (GET /lora-adapters); scale 0: not applied
    lora: list[LoraScale] | None = None


# llama.cpp server's sampling defaults, for /completion and /infill fields neither the request nor serve sets
LLAMA_CPP_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_last_n": 64}


class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="ignore")
    filename: str = "tmp"
    text: str = ""


class InfillRequest(CompletionRequest):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)


def _adapter(ctx: ServerContext, scales: list[LoraScale] | None) -> str | None:
    """The LoRA adapter llama.cpp's `lora` field applies: the one entry of a non-zero scale, which must be the
    adapter's own (each runs at the scale it was loaded with: --lora-scaled), or none."""
    applied = [s for s in scales or () if s.scale != 0]
    if not applied:
        return None
    lora = getattr(ctx.llm.model, "lora", None)
    adapter = lora.adapters[applied[0].id] if lora is not None and 0 <= applied[0].id < lora.capacity else None
    if len(applied) > 1 or adapter is None or applied[0].scale != adapter.scale:
        raise bad_request("lora: one loaded adapter (an id of GET /lora-adapters) at the scale it was loaded with "
                          "(serve --lora-scaled sets it); several at once or other scales are not supported",
                          param="lora")
    return adapter.name


@router.get("/props")
async def props(request: Request):
    ctx = get_context(request)
    llm = ctx.llm
    return {"model_path": str(llm.path), "model_alias": ctx.model_name, "total_slots": ctx.worker.num_slots,
            "chat_template": llm.template.source if llm.template is not None else "",
            "default_generation_settings": {"n_ctx": llm.engine.max_context, **_defaults(ctx)},
            "modalities": {"vision": False, "audio": False}, "build_info": "cobatch"}


def _sampling_defaults(ctx: ServerContext) -> dict:
    """The sampling fields a /completion request leaves unset: the server's, else llama.cpp's."""
    return {**LLAMA_CPP_SAMPLING, **ctx.options.sampling_defaults}


def _defaults(ctx: ServerContext) -> dict:
    """What a /completion request that sets nothing samples with."""
    d, sampling = CompletionRequest(), _sampling_defaults(ctx)
    return {"params": {"n_predict": sampling.get("max_tokens", d.n_predict), "temperature": sampling["temperature"],
                       "top_k": sampling["top_k"], "top_p": sampling["top_p"], "min_p": sampling["min_p"],
                       "typical_p": sampling.get("typical_p", 1.0),
                       "top_n_sigma": sampling.get("top_n_sigma", -1.0),
                       "xtc_probability": sampling.get("xtc_probability", 0.0),
                       "xtc_threshold": sampling.get("xtc_threshold", 0.1),
                       "dry_multiplier": sampling.get("dry_multiplier", 0.0),
                       "dry_base": sampling.get("dry_base", 1.75),
                       "dry_allowed_length": sampling.get("dry_allowed_length", 2),
                       "dry_penalty_last_n": sampling.get("dry_penalty_last_n", -1),
                       "mirostat": sampling.get("mirostat", 0), "mirostat_tau": sampling.get("mirostat_tau", 5.0),
                       "mirostat_eta": sampling.get("mirostat_eta", 0.1),
                       "dynatemp_range": sampling.get("dynatemp_range", 0.0),
                       "dynatemp_exponent": sampling.get("dynatemp_exponent", 1.0),
                       "seed": sampling.get("seed", d.seed), "repeat_penalty": sampling.get("repetition_penalty", 1.0),
                       "repeat_last_n": sampling["repeat_last_n"],
                       "presence_penalty": sampling.get("presence_penalty", 0.0),
                       "frequency_penalty": sampling.get("frequency_penalty", 0.0),
                       "stop": d.stop}}


@router.post("/completion")
@router.post("/completions")
@accepts(CompletionRequest)
async def completion(request: Request):
    ctx = get_context(request)
    body = await read_body(request, CompletionRequest, ctx.options.max_body_bytes)
    prompts = await run_in_threadpool(raw_prompts, ctx.llm, body.prompt, None, "prompt", MAX_PROMPTS)
    return await _run(request, ctx, body, [ids for ids, _ in prompts])


@router.post("/infill")
@accepts(InfillRequest)
async def infill(request: Request):
    ctx = get_context(request)
    body = await read_body(request, InfillRequest, ctx.options.max_body_bytes)
    if not isinstance(body.prompt, str):
        raise bad_request("/infill takes a text prompt (the start of the middle)", param="prompt")
    try:
        ids = await run_in_threadpool(ctx.llm.encode_infill, body.input_prefix, body.input_suffix,
                                      [(f.filename, f.text) for f in body.input_extra], body.prompt)
    except UserError as exc:
        raise bad_request(str(exc), param="input_suffix") from None
    return await _run(request, ctx, body, [ids])


def _logit_bias(ctx: ServerContext, raw: list[list[Any]] | dict[str, float] | None
                ) -> tuple[tuple[tuple[int, float], ...] | None, tuple[tuple[int], ...] | None]:
    """llama.cpp's logit_bias -> (bias pairs, tokens banned outright). A text entry biases each of its tokens;
    a bias of false means the token is never sampled (a one-token bad word: banned at every step)."""
    if not raw:
        return None, None
    entries = list(raw.items()) if isinstance(raw, dict) else raw
    bias, banned = {}, []
    for i, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise bad_request("logit_bias entries are [token id or text, bias or false]", param=f"logit_bias.{i}")
        key, value = entry
        if isinstance(key, str) and not isinstance(raw, dict):
            tokens = ctx.llm.tokenizer.encode(key, add_special=False)
        elif isinstance(key, (bool, float)):       # int() would quietly make 1.5 or true token 1
            raise bad_request("logit_bias keys must be token ids", param=f"logit_bias.{i}")
        else:
            try:
                tokens = [int(key)]
            except (TypeError, ValueError):
                raise bad_request("logit_bias keys must be token ids", param=f"logit_bias.{i}") from None
        if value is False:
            banned += tokens
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            for token in tokens:
                bias[token] = float(value)
        else:
            raise bad_request("a logit_bias value is a number or false", param=f"logit_bias.{i}")
    return (tuple(sorted(bias.items())) or None), (tuple((t,) for t in dict.fromkeys(banned)) or None)


async def _run(request: Request, ctx: ServerContext, body: CompletionRequest, prompts: list[list[int]]):
    """Generate for each prompt: one prompt answers llama.cpp's object (or stream), several a list of them (or
    their streams interleaved, each line with its prompt's index), as llama.cpp's server does."""
    for ids in prompts:
        check_prompt_fits(ctx.llm, len(ids), "prompt")
    if body.n_predict == 0:
        raise bad_request("n_predict must be -1 or at least 1", param="n_predict")
    if body.grammar is not None and body.json_schema is not None:
        raise bad_request("give grammar or json_schema, not both", param="json_schema")
    structured = (StructuredOutput("grammar", body.grammar, "grammar") if body.grammar is not None else
                  StructuredOutput("json", body.json_schema, "json_schema") if body.json_schema is not None else None)
    grammar = await output_grammar(ctx.llm, None, force_call=False, parallel=False, structured=structured)
    bias, banned = _logit_bias(ctx, body.logit_bias)
    requests = [GenerationRequest("llama.cpp", ids, _params(ctx, body, grammar, bias, banned, len(ids)),
                                  list(body.stop)) for ids in prompts]
    choices = Choices(ctx.generation, requests, 1)
    gens = choices.generations
    if len(gens) == 1:
        if body.stream:
            return EventStreamResponse(_stream(ctx, gens[0], body), choices.close)
        return GeneratedJSONResponse(lambda: _result(ctx, gens[0], body), choices.close, request.url.path)
    if body.stream:
        return EventStreamResponse(interleave([_stream(ctx, g, body, i) for i, g in enumerate(gens)]), choices.close)

    async def results() -> list[dict]:
        return [{"index": i, **await _result(ctx, g, body)} for i, g in enumerate(gens)]
    return GeneratedJSONResponse(results, choices.close, request.url.path)


def _params(ctx: ServerContext, body: CompletionRequest, grammar, bias, banned, n_prompt: int):
    """A prompt's sampling parameters: the request's fields over the server's and llama.cpp's defaults, its length
    cut to the room its prompt leaves."""
    return make_sampling_params(
        ctx.llm.tokenizer.vocab_size, _sampling_defaults(ctx), tokenizer=ctx.llm.tokenizer,
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        min_p=body.min_p, seed=None if body.seed == -1 else body.seed, repetition_penalty=body.repeat_penalty,
        **body.sampler_fields(),
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos,
        # token ids travel with the logprobs: ask for them (top 0) when the client wants ids only
        logprobs=body.n_probs if body.n_probs or body.return_tokens else None, grammar=grammar,
        logit_bias=bias, bad_words=banned, adapter=_adapter(ctx, body.lora),
        max_tokens=max_new_tokens(ctx, None if body.n_predict == -1 else body.n_predict, n_prompt))


async def _result(ctx: ServerContext, gen: Generation, body: CompletionRequest) -> dict:
    done: Completed = await gen.collect()
    out = {"content": done.content, **_final(ctx, gen, done.finish)}
    if body.n_probs:
        out["completion_probabilities"] = _probabilities(ctx, done.logprobs)
    if body.return_tokens:
        out["tokens"] = [p.token_id for p in done.logprobs]
    return out if body.response_fields is None else _fields(out, body.response_fields)


_MISSING = object()


def _fields(answer: dict, paths: list[str]) -> dict:
    """llama.cpp's response_fields: each path's value ("timings/predicted_n" inside "timings") under the path
    itself; a path the answer lacks is left out."""
    picked = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            picked[path] = value
    return picked



async def _stream(ctx: ServerContext, gen: Generation, body: CompletionRequest,
                  index: int | None = None) -> AsyncIterator[str]:
    """A generation's stream lines; `index`: its prompt's, on every line, where the request gave several."""
    tag = {} if index is None else {"index": index}
    async for item in gen.events():
        if isinstance(item, Finish):
            yield sse_data({**tag, "content": "", **_final(ctx, gen, item)})
            return
        text = "".join(e.text for e in item.events if isinstance(e, ContentDelta))
        chunk: dict[str, Any] = {**tag, "content": text, "stop": False, "id_slot": gen.handle.slot}
        if body.n_probs:
            chunk["completion_probabilities"] = _probabilities(ctx, item.logprobs)
        if body.return_tokens:
            chunk["tokens"] = [p.token_id for p in item.logprobs]
        if text or item.logprobs:
            yield sse_data(chunk)


def _final(ctx: ServerContext, gen: Generation, finish: Finish) -> dict:
    """The fields of llama.cpp's last answer (or last stream line): why it stopped, counts, timings."""
    usage = finish.usage
    stop_type = "word" if finish.stop_string is not None else ("limit" if finish.reason == "length" else "eos")
    elapsed_ms = (time.perf_counter() - gen.arrival) * 1e3
    return {"stop": True, "id_slot": gen.handle.slot, "model": ctx.model_name, "stop_type": stop_type,
            "stopping_word": finish.stop_string or "", "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens, "tokens_cached": usage.cached_tokens, "truncated": False,
            "timings": {"prompt_n": usage.prompt_tokens - usage.cached_tokens, "predicted_n": usage.completion_tokens,
                        "predicted_ms": elapsed_ms,
                        "predicted_per_second": usage.completion_tokens / elapsed_ms * 1e3 if elapsed_ms else 0.0}}


def _probabilities(ctx: ServerContext, logprobs: list[TokenLogprob]) -> list[dict]:
    tok = ctx.llm.tokenizer

    def entry(token_id: int, logprob: float) -> dict:
        return {"id": token_id, "token": tok.decode([token_id]), "logprob": logprob}

    return [{**entry(p.token_id, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top or ()]}
            for p in logprobs]
