"""Reading a request body: size limit (413), JSON (400 on malformed), pydantic model (400 naming the field), then
the model name (404) and fields this server does not implement (400)."""

from __future__ import annotations

import json
import re
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cobatch.server.errors import ApiError, bad_request
from cobatch.server.strictness import check_model, refuse_unsupported

Model = TypeVar("Model", bound=BaseModel)


async def read_body(request: Request, model: type[Model], max_bytes: int) -> Model:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {declared} bytes is over the limit of {max_bytes} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise ApiError(413, f"request body is over the limit of {max_bytes} bytes")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(data):
        raise bad_request("the request body holds a lone UTF-16 surrogate escape (e.g. \\ud800): not valid Unicode")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise bad_request(*describe_validation_error(exc)) from None
    server = request.app.state.server
    if "model" in model.model_fields:
        check_model(server.model_names, server.options.accept_any_model, getattr(body, "model"))
    refuse_unsupported(data, model.model_fields)
    return body


# JSON can smuggle a lone surrogate in only as a \uD800-\uDFFF escape (UTF-8 bytes cannot encode one), and
# json.loads keeps it; the tokenizer then fails on the string. Pairs decode to one real character and pass.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(data) -> bool:
    stack = [data]                    # a loop, not recursion: the body may nest as deep as json.loads allows
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack += value.keys()
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return False


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem, e.g. ("temperature: Input should be <= 2", "temperature")."""
    err = exc.errors(include_url=False)[0]
    # Union members add their type name to the location; keep only the request's own field path.
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or not _is_type_tag(str(p))]
    param = ".".join(loc) or None
    extra = f" (got {err['input']!r})" if err["type"] not in ("missing",) and _short(err.get("input")) else ""
    return (f"{param}: {err['msg']}{extra}" if param else f"{err['msg']}{extra}"), param


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "dict") or part.startswith(("list[", "dict[")) \
        or part.endswith("]") or part[:1].isupper()


def _short(value) -> bool:
    return isinstance(value, (int, float, str, bool)) and len(repr(value)) <= 80
