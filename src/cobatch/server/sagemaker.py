"""Amazon SageMaker's container contract, as vLLM's server keeps it: GET /ping answers as /health does, and
POST /invocations takes a chat, completions or embeddings request, told apart by its body, and answers it as its
own route would (streamed too, errors and all)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cobatch.server.errors import ApiError, bad_request, error_response

# The field that tells a request's kind, and the route that answers it, in the order they are tried
INVOCATION_ROUTES = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"), ("input", "/v1/embeddings"))


class InvocationsMiddleware:
    """POST /invocations read whole (within the body limit), then handed to the route its body names."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/invocations" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await self._refuse(ApiError(413, f"request body is over the limit of {self.max_body_bytes} "
                                                        "bytes"), scope, receive, send)
            if not message.get("more_body", False):
                break
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return await self._refuse(bad_request("malformed JSON body"), scope, receive, send)
        path = next((route for field, route in INVOCATION_ROUTES if isinstance(data, dict) and field in data), None)
        if path is None:
            return await self._refuse(bad_request("an invocation is a chat (messages), completions (prompt) or "
                                                  "embeddings (input) request"), scope, receive, send)
        sent = False

        async def replay() -> Message:          # the body once, then what the client does (a disconnect)
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app({**scope, "path": path, "raw_path": path.encode()}, replay, send)

    @staticmethod
    async def _refuse(err: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(err, scope["path"])(scope, receive, send)
