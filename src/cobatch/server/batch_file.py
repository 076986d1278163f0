"""`cobatch run-batch`: a JSONL file of OpenAI batch requests answered by the server's own app, in-process.

Each input line is a request of OpenAI's batch file format (vLLM's `run-batch` reads the same):

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}

and each output line, in the input's order, its answer:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...", "body": {...}},
     "error": null}

The requests go through the same routes, validation and errors as `cobatch serve` (an ASGI client, no socket), as
many at once as the engine has slots and queue for, so the file is decoded in full batches. A request the server
refuses keeps its status and error body in `response`; a line that is not a request at all (not UTF-8 or not
JSON, no custom_id or one an earlier line has, another method or route) gets `error` and no response, and the
other lines are answered all the same. Streaming is refused: a batch has no stream. The answers are written to
OUTPUT.partial, renamed to the output file when the last is in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import httpx

from cobatch.errors import UserError
from cobatch.output_files import check_output_path, partial_file

# The routes a batch line may name: the ones OpenAI's batch API takes, and Anthropic's messages
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")
BUSY_RETRY_S = 0.05          # a 429 (slots and queue full: requests with n > 1) is tried again after this, while
                             # other requests are running (alone, it would never fit: its answer is the 429)


def request_of(line: bytes | str) -> tuple[str | None, dict | str]:
    """(custom_id, the request) of one input line, or (custom_id if readable, why it is not a request)."""
    try:
        item = json.loads(line)
    except UnicodeDecodeError as exc:
        return None, f"the line is not UTF-8 text ({exc.reason} at byte {exc.start})"
    except (ValueError, RecursionError) as exc:
        return None, f"the line is not JSON: {exc}"
    if not isinstance(item, dict):
        return None, "the line is not a JSON object"
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, f"custom_id: a non-empty string is required (got {custom_id!r})"
    if item.get("method", "POST") != "POST":
        return custom_id, f"method {item.get('method')!r}: a batch request is a POST"
    if item.get("url") not in BATCH_URLS:
        return custom_id, f"url {item.get('url')!r}: one of {', '.join(BATCH_URLS)}"
    body = item.get("body")
    if not isinstance(body, dict):
        return custom_id, "body (the request's JSON object) is missing"
    if body.get("stream"):
        return custom_id, "stream: a batch request is answered whole"
    try:                # what JSON cannot hold (NaN, a lone surrogate) is this line's error, not the batch's
        content = json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError) as exc:
        return custom_id, f"body: {exc}"
    return custom_id, {"url": item["url"], "content": content}


def output_line(custom_id: str | None, status: int | None = None, body: Any = None, error: str | None = None) -> str:
    response = None if status is None else {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}
    record = {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id, "response": response,
              "error": None if error is None else {"code": "invalid_request", "message": error}}
    text = json.dumps(record, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:      # a lone surrogate (a custom_id's "\ud800") stays the escape it came as
        return json.dumps(record)
    return text


async def answer(client: httpx.AsyncClient, request: dict, others_running: Callable[[], bool]) -> tuple[int, Any]:
    """The app's status and JSON body for one request; a 429 (no slot and no room in the queue) is tried again while
    other requests run and may free slots."""
    while True:
        reply = await client.post(request["url"], content=request["content"],
                                  headers={"content-type": "application/json"})
        if reply.status_code != 429 or not others_running():
            try:
                return reply.status_code, reply.json()
            except ValueError:
                return reply.status_code, reply.text
        await asyncio.sleep(BUSY_RETRY_S)


async def answer_lines(app, lines: Iterator[bytes], out: IO[str], concurrency: int, progress=None) -> dict:
    """Answer every request line through `app` (its lifespan run here), at most `concurrency` at once, writing each
    output line in the input's order as soon as those before it are written. Returns counts for the summary."""
    counts = {"requests": 0, "ok": 0, "refused": 0, "invalid": 0, "tokens": 0}
    done: dict[int, str] = {}
    next_to_write = 0
    slots = asyncio.Semaphore(concurrency)
    running = 0

    def flush() -> None:
        nonlocal next_to_write
        while next_to_write in done:
            out.write(done.pop(next_to_write) + "\n")
            next_to_write += 1
        out.flush()

    async def run(index: int, custom_id: str, request: dict) -> None:
        nonlocal running
        running += 1
        try:
            status, body = await answer(client, request, lambda: running > 1)
        finally:
            running -= 1
            slots.release()
        counts["ok" if status < 400 else "refused"] += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):      # OpenAI's completion_tokens, Anthropic's and the Responses API's output_tokens
            counts["tokens"] += usage.get("completion_tokens") or usage.get("output_tokens") or 0
        done[index] = output_line(custom_id, status, body)
        flush()
        if progress is not None:
            progress.update(1)

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)    # a failing request gets its 500
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
            tasks = []
            index = 0
            seen: set[str] = set()
            for line in lines:
                if not line.strip():
                    continue
                counts["requests"] += 1
                custom_id, request = request_of(line)
                if custom_id in seen:           # OpenAI's batch API takes each custom_id once
                    request = f"custom_id {custom_id!r} is not unique: an earlier line has it"
                elif custom_id is not None:
                    seen.add(custom_id)
                if isinstance(request, str):
                    counts["invalid"] += 1
                    done[index] = output_line(custom_id, error=request)
                    flush()
                    if progress is not None:
                        progress.update(1)
                else:
                    await slots.acquire()
                    tasks.append(asyncio.create_task(run(index, custom_id, request)))
                index += 1
            await asyncio.gather(*tasks)
    flush()
    return counts


def run_batch(args) -> int:
    """`cobatch run-batch`: load the model as `serve` does, answer the input file into the output file."""
    from tqdm import tqdm

    from cobatch.server.app import _check_serve_args, create_app, engine_options, server_options

    _check_serve_args(args)           # serve's flags, checked as serve checks them (and the model path)
    if getattr(args, "data_parallel_size", 1) != 1:
        raise UserError("run-batch runs one engine: --data-parallel-size is serve's")
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    source = _input_lines(args.input_file)
    # the requests come from this process (no key), for this one model whatever they name
    options = dataclasses.replace(server_options(args), api_keys=(), accept_any_model=True)
    with _answers_file(args.output_file, args.input_file) as out:
        from cobatch.parallel import launch
        llm = launch.load(args.model_path or args.model, engine_options(args))
        app = create_app(llm, options)
        start = time.perf_counter()
        with tqdm(desc="requests", unit="req", file=sys.stderr, disable=not sys.stderr.isatty()) as progress:
            counts = asyncio.run(answer_lines(app, source, out, args.parallel + args.max_queue, progress))
    seconds = time.perf_counter() - start
    print(f"cobatch run-batch: {counts['requests']} requests in {seconds:.1f} s: {counts['ok']} answered, "
          f"{counts['refused']} refused, {counts['invalid']} not requests; {counts['tokens']} tokens generated "
          f"({counts['tokens'] / seconds:.0f} tok/s)", file=sys.stderr)
    return 0


def _input_lines(path: str) -> Iterator[bytes]:
    """The input's lines as bytes: each decoded on its own, so a line that is not UTF-8 is that line's error."""
    if path == "-":
        return iter(sys.stdin.buffer)
    try:
        file = open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"--input-file {path}: no such file") from None
    except OSError as exc:
        raise UserError(f"--input-file {path}: {exc.strerror}") from None
    return _lines_of(file)


def _lines_of(file: IO[bytes]) -> Iterator[bytes]:
    with file:
        yield from file


@contextmanager
def _answers_file(path: str, input_path: str) -> Iterator[IO[str]]:
    """The output file (stdout for '-') for the block; a file appears at `path` only when the block completes."""
    if path == "-":
        yield sys.stdout
        return
    file = check_output_path(path, "--output-file", None if input_path == "-" else input_path)
    with partial_file(file) as partial:
        try:
            out = partial.open("w", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--output-file {path}: {exc.strerror}") from None
        with out:
            yield out
