"""API errors, rendered in the error shape of the protocol the client speaks.

OpenAI: {"error": {"message", "type", "param", "code"}}.
Anthropic: {"type": "error", "error": {"type", "message"}}.
The route decides the shape (paths under /v1/messages speak Anthropic), so a client's SDK can always
parse the error it gets, whatever went wrong.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    409: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
}


class ApiError(Exception):
    """An error answered to the client; `message` is meant for the caller."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: ApiError, anthropic: bool) -> dict:
    openai_type, anthropic_type = _TYPES.get(err.status, ("invalid_request_error", "invalid_request_error"))
    if anthropic:
        return {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    return {"error": {"message": err.message, "type": openai_type, "param": err.param, "code": err.code}}


def error_response(err: ApiError, path: str) -> JSONResponse:
    return JSONResponse(error_body(err, is_anthropic_path(path)), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
