"""``X-Request-Id``: a client's id for its request, echoed back on the response.

A raw ASGI middleware (no per-request task or body copy) reads the header once: an id of
1 to ``MAX_ID_CHARS`` characters from ``[A-Za-z0-9._:-]`` is kept, anything else (or
none) is replaced by a generated one, so what reaches logs, engine request ids and
flight records is always short and printable. The id goes back in the response's
``X-Request-Id`` header and into ``scope["state"]``, where routes read it
(``request_id``).
"""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request

MAX_ID_CHARS = 128
_VALID = re.compile(rb"[A-Za-z0-9._:\-]{1,%d}" % MAX_ID_CHARS)
_HEADER = b"x-request-id"


class RequestIdMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope["headers"] if k == _HEADER), None)
        from_client = sent is not None and _VALID.fullmatch(sent) is not None
        rid = sent.decode("ascii") if from_client and sent is not None else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["request_id_from_client"] = from_client
        header = (_HEADER, rid.encode("ascii"))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != _HEADER]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(request: Request | None) -> str:
    """The request's id: the client's valid ``X-Request-Id`` or a generated one."""
    if request is None:
        return uuid.uuid4().hex
    state = request.scope.setdefault("state", {})
    if state.get("request_id") is None:  # an app without the middleware: one id per request
        state["request_id"] = uuid.uuid4().hex
    return state["request_id"]


def client_request_id(request: Request) -> str | None:
    """The id the client sent, when it was valid; None otherwise."""
    state = request.scope.get("state", {})
    return state.get("request_id") if state.get("request_id_from_client") else None
