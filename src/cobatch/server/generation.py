"""The generation core both protocols share: submit a prompt, turn the engine's tokens into events.

A protocol adapter builds a GenerationRequest, calls `Generation.start()` (which may refuse: 429 / 503)
and then either streams the Chunk/Finish items of `events()` as its own SSE frames, or `collect()`s them
into one Completed result. Timings, token counts and the per-request log line live here, once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from cobatch.engine.dry import BreakerIndex
from cobatch.engine.sampler import SamplingParams, uses_dry
from cobatch.server.engine_thread import EngineFailure, EngineWorker, QueueFull, RequestHandle, ShuttingDown
from cobatch.server.errors import ApiError
from cobatch.server.metrics import ServerMetrics
from cobatch.server.output_events import (ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart,
                                          merged)
from cobatch.server.output_parser import REASONING_MARKER_TOKENS, OutputParser
from cobatch.server.stream import TextStream
from cobatch.server.tool_call_readers import TOOL_MARKER_TOKENS
from cobatch.tokenizer import Tokenizer

log = logging.getLogger("cobatch.server")
request_log = logging.getLogger("cobatch.server.requests")     # a line per finished request (--disable-log-requests)

RETRY_AFTER_S = 1


@dataclass(slots=True)
class GenerationRequest:
    api: str                                  # "chat" | "completions" | "messages" | ...: for metrics and logs
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False                # the matched stop string ends the text
                                              # (vLLM's include_stop_str_in_output)
    skip_special: bool = True                 # special tokens give no text (vLLM's skip_special_tokens)
    tools: list[dict] | None = None           # the declared function tools ({"function": {"name", "parameters"}});
                                              # None: tool calls are not parsed
    parse_reasoning: bool = False
    start_in_reasoning: bool = False
    report_output: bool = True                # False: max_tokens 0 (the one token sampled is not reported)
    report_token_ids: bool = False            # every chunk carries the ids of the tokens it stands for (vLLM's
                                              # return_token_ids), also a chunk of no text


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None                     # None: the prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] | None
    rank: int | None = None                   # a prompt token's: 1 + the tokens more likely than it


@dataclass(slots=True)
class Chunk:
    events: list[Event]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # params.prompt_logprobs asked for
    token_ids: list[int] = field(default_factory=list)       # request.report_token_ids: the sampled tokens


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    accepted_prediction_tokens: int = 0      # drafts from the request's prediction that were kept ...
    rejected_prediction_tokens: int = 0      # ... and that were not (OpenAI's Predicted Outputs)


@dataclass(slots=True)
class Finish:
    reason: str                     # "stop" | "length" | "tool_calls"
    stop_string: str | None         # the stop string that ended it, if one did
    usage: Usage


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str


@dataclass(slots=True)
class Completed:
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    logprobs: list[TokenLogprob]
    finish: Finish
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    embedding: list[float] | None = None      # params.embed: the last prompt token's final hidden state
    token_ids: list[int] = field(default_factory=list)       # request.report_token_ids: every sampled token


class Generation:
    def __init__(self, worker: EngineWorker, metrics: ServerMetrics, tokenizer: Tokenizer, request: GenerationRequest):
        self.worker, self.metrics, self.tokenizer, self.request = worker, metrics, tokenizer, request
        self.arrival = time.perf_counter()
        self.handle: RequestHandle | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0                  # prompt tokens found in the prefix cache (known at the first token)
        self.finish: Finish | None = None       # set when events() ends normally
        self.embedding: list[float] | None = None   # params.embed: set when the prompt's last token is computed
        self._done = False

    def start(self) -> None:
        """Hand the request to the engine thread; refuses with 429 (queue full) or 503 (stopping), which the app's
        error handler counts in cobatch_http_errors."""
        try:
            self.handle = self.worker.submit(self.request.prompt_ids, self.request.params)
        except QueueFull as exc:
            raise ApiError(429, f"server busy: {exc}; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def usage_so_far(self) -> Usage:
        """The usage up to now (vLLM's continuous_usage_stats): the final one once the request has ended."""
        if self.finish is not None:
            return self.finish.usage
        return Usage(len(self.request.prompt_ids), self.completion_tokens, self.cached_tokens)

    def close(self) -> None:
        """Abort the request if it is still running (client gone); idempotent."""
        if self.handle is not None and not self._done:
            self._done = True
            self.worker.abort(self.handle)
            self.metrics.requests.labels(self.request.api, "abort").inc()
            request_log.info("%s %s slot=%s prompt=%d completion=%d total=%.3fs finish=abort (client disconnected)",
                             self.request.api, self.handle.id, self.handle.slot, len(self.request.prompt_ids),
                             self.completion_tokens, time.perf_counter() - self.arrival)

    async def events(self) -> AsyncIterator[Chunk | Finish]:
        assert self.handle is not None, "start() first"
        req, handle, metrics = self.request, self.handle, self.metrics
        tools = req.tools
        markers = REASONING_MARKER_TOKENS + (TOOL_MARKER_TOKENS if tools is not None else ())
        text = TextStream(self.tokenizer, req.stop, include_stop=req.include_stop, skip_special=req.skip_special,
                          keep_special=self.tokenizer.special_ids(markers))
        functions = [t["function"] for t in tools or ()]
        parser = OutputParser(tool_names=[f["name"] for f in functions] if tools is not None else None,
                              tool_schemas={f["name"]: f.get("parameters") for f in functions},
                              reasoning=req.parse_reasoning, start_in_reasoning=req.start_in_reasoning)
        want_logprobs = req.params.logprobs is not None
        completion = 0
        first = last = None
        # What the outputs read so far make; yielded as one chunk once no further output is waiting, so that a
        # stream whose reader fell behind by several engine steps catches up in one frame, not one a token
        events: list[Event] = []
        logprobs: list[TokenLogprob] = []
        prompt: list[TokenLogprob] = []
        tokens: list[int] = []
        try:
            while True:
                out = await handle.outputs.get()
                if isinstance(out, EngineFailure):
                    self._done = True
                    raise ApiError(400 if out.user_error else 500, out.message)
                now = time.perf_counter()
                if out.embedding is not None:
                    self.embedding = out.embedding
                prompt += [TokenLogprob(*entry) for entry in out.prompt_logprobs or ()]
                if out.new_token is not None and req.report_output:
                    completion = self.completion_tokens = completion + 1
                    if first is None:
                        first, self.cached_tokens = now, out.num_cached_tokens
                        metrics.ttft.observe(now - self.arrival)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                    if req.report_token_ids:
                        tokens.append(out.new_token)
                    # The token that ended the request gives no text, unless asked for (as vLLM does)
                    if not out.stop_token or req.include_stop:
                        events += parser.push(text.push(out.new_token))
                    if want_logprobs and out.logprob is not None:
                        logprobs.append(TokenLogprob(out.new_token, out.logprob, out.top_logprobs or []))
                if text.stop_matched is None and out.finished:
                    if out.finish_reason == "abort":     # aborted by the server itself (shutting down)
                        self._done = True
                        raise ApiError(503, "request aborted: the server is shutting down")
                    if out.finish_reason == "grammar_error":
                        self._done = True
                        raise ApiError(400, "the output constraint (response_format, structured output, grammar or "
                                            "forced tool call) could not be followed: it is beyond the limits of the "
                                            "constraint engine; simplify it")
                    events += parser.push(text.finish())
                ended = text.stop_matched is not None or out.finished
                if ended:
                    events += parser.finish()
                if (events or logprobs or prompt or tokens) and (ended or handle.outputs.empty()):
                    yield Chunk(merged(events), logprobs, prompt, tokens)
                    events, logprobs, prompt, tokens = [], [], [], []
                if ended:
                    if text.stop_matched is not None:
                        self.worker.abort(handle)        # the engine does not know about stop strings
                        reason = "stop"
                    else:
                        reason = out.finish_reason
                    if reason == "stop" and parser.num_tool_calls and text.stop_matched is None:
                        reason = "tool_calls"
                    self._done = True
                    usage = Usage(len(req.prompt_ids), completion, self.cached_tokens, out.prediction_accepted,
                                  out.prediction_rejected)
                    self._record(reason, usage, first, now)
                    self.finish = Finish(reason, text.stop_matched, usage)
                    yield self.finish
                    return
        finally:
            self.close()

    def _record(self, reason: str, usage: Usage, first: float | None, end: float) -> None:
        m = self.metrics
        m.requests.labels(self.request.api, reason).inc()
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.prefix_cache_hit_tokens.inc(usage.cached_tokens)
        m.duration.observe(end - self.arrival)
        ttft = f"{first - self.arrival:.3f}s" if first is not None else "-"     # "-": no token came (embeddings)
        decode_s = end - first if first is not None else 0.0
        rate = (usage.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0
        adapter = f" adapter={self.request.params.adapter}" if self.request.params.adapter else ""
        request_log.info("%s %s slot=%s prompt=%d cached=%d completion=%d ttft=%s total=%.3fs decode=%.1f "
                         "tok/s finish=%s%s", self.request.api, self.handle.id, self.handle.slot, usage.prompt_tokens,
                         usage.cached_tokens, usage.completion_tokens, ttft, end - self.arrival, rate, reason,
                         adapter)

    async def collect(self) -> Completed:
        """Run to the end and gather everything (the non-streaming responses)."""
        content, reasoning, calls, logprobs, prompt_logprobs, token_ids = [], [], {}, [], [], []
        finish = None
        async for item in self.events():
            if isinstance(item, Finish):
                finish = item
                continue
            logprobs += item.logprobs
            prompt_logprobs += item.prompt_logprobs
            token_ids += item.token_ids
            for e in item.events:
                if isinstance(e, ContentDelta):
                    content.append(e.text)
                elif isinstance(e, ReasoningDelta):
                    reasoning.append(e.text)
                elif isinstance(e, ToolCallStart):
                    calls[e.index] = ToolCall(e.name, "")
                elif isinstance(e, ToolCallArgsDelta):
                    calls[e.index].arguments += e.text
        assert finish is not None
        return Completed("".join(content), "".join(reasoning), [calls[i] for i in sorted(calls)], logprobs, finish,
                         prompt_logprobs, self.embedding, token_ids)


class Choices:
    """The choices of one HTTP request: n generations (OpenAI's `n`) of each of its prompts (a completions
    request may carry several), started together and closed together, in the order prompt-major. Choice i of
    a prompt samples with seed + i when the request gives a seed (the same seed would give n equal samples),
    else with its own random seed. Each prompt is counted once in the usage."""

    def __init__(self, make: Callable[[GenerationRequest], Generation], requests: list[GenerationRequest], n: int):
        self.n = n
        self.generations: list[Generation] = []
        try:
            for request in requests:
                for i in range(n):
                    params = request.params
                    if params.seed is not None:
                        params = dataclasses.replace(params, seed=params.seed + i)
                    gen = make(dataclasses.replace(request, params=params))
                    gen.start()
                    self.generations.append(gen)
        except BaseException:
            self.close()            # e.g. the queue took some choices but not all: give those back
            raise

    def close(self) -> None:
        for gen in self.generations:
            gen.close()

    async def collect(self) -> list[Completed]:
        return list(await asyncio.gather(*(gen.collect() for gen in self.generations)))

    def total_usage(self, finishes: list[Finish]) -> Usage:
        """The usage of all choices, finishes given in the generations' order."""
        per_prompt = finishes[::self.n]
        return Usage(sum(f.usage.prompt_tokens for f in per_prompt), sum(f.usage.completion_tokens for f in finishes),
                     sum(f.usage.cached_tokens for f in per_prompt),
                     sum(f.usage.accepted_prediction_tokens for f in finishes),
                     sum(f.usage.rejected_prediction_tokens for f in finishes))


async def interleave(streams: list[AsyncGenerator[str, None]]) -> AsyncIterator[str]:
    """The items of several async iterators, each in its order, interleaved as they come. The first error
    of any of them ends the whole (the others are cancelled, which closes their generations)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncGenerator[str, None]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except Exception as exc:        # handed to the consumer, which raises it
            await queue.put(exc)
        finally:
            await stream.aclose()       # cancelled between two items: still run the stream's cleanup

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def make_sampling_params(vocab_size: int, defaults: dict | None = None, by_priority: bool = False, tokenizer=None,
                         **fields) -> SamplingParams:
    """SamplingParams from a request's fields; one left None takes its value from `defaults` (the server's),
    else SamplingParams' own. A bad value is a 400 naming it, and so is a priority (vLLM's field) where the engine
    does not schedule by priority (`by_priority`), as vLLM refuses it. With DRY on, its sequence breakers become
    the tokenizer's tokens that hold one."""
    if fields.get("priority") and not by_priority:
        raise ApiError(400, f"priority {fields['priority']} needs the priority scheduling policy (the server runs "
                       "fcfs: serve with --scheduling-policy priority)", param="priority")
    fields = {**(defaults or {}), **{k: v for k, v in fields.items() if v is not None}}
    params = SamplingParams(**fields)
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        message = str(exc)
        raise ApiError(400, message, param=message.split(" ", 1)[0]) from None
    if uses_dry(params) and tokenizer is not None:
        params.dry_breaker_ids = _breaker_ids(tokenizer, params.dry_sequence_breakers)
    return params


@functools.lru_cache(maxsize=64)
def _breaker_ids(tokenizer: Tokenizer, breakers: tuple[str, ...]) -> frozenset[int]:
    """A breaker set's tokens (about 15 ms on a 150k vocabulary), kept for the requests that send it again."""
    return _breaker_index(tokenizer).tokens_holding(breakers)


@functools.lru_cache(maxsize=4)
def _breaker_index(tokenizer: Tokenizer) -> BreakerIndex:
    """The tokenizer's texts end to end, made once (a fraction of a second), for every request's breakers."""
    return BreakerIndex(tokenizer.token_bytes, tokenizer.vocab_size)
