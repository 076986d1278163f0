"""Reading a request body: size limit (413), JSON (400 on malformed), pydantic model (400 naming the field)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cobatch.server.errors import ApiError, bad_request

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
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise bad_request(*describe_validation_error(exc)) from None


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
