"""Errors in OpenAI's ``{"error": {...}}`` shape, and the handlers that render them."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagewarden.server")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error returned to the client in OpenAI's ``{"error": {...}}`` shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.code = code  # OpenAI's error code (``context_length_exceeded``); None: the status


#: A validation error reports at most this many of the problems it found.
MAX_REPORTED_ERRORS = 5


def _path_key(part: Any) -> tuple[int, int, str]:
    return (0, part, "") if isinstance(part, int) else (1, 0, str(part))


def validation_error(errors: Iterable[dict], field_order: Sequence[str] = ()) -> APIError:
    """One 400 for every problem a validator found, in an order that is the request's own.

    The validation library lists errors in an order of its choosing, which changes between
    its versions. Here they are sorted by the top-level field's place in ``field_order`` (the
    body's own keys, then the model's missing fields), then by the rest of the path; each is
    ``field.path: message``, at most ``MAX_REPORTED_ERRORS`` of them, and ``param`` is the
    first one's path.
    """
    rank = {name: i for i, name in enumerate(field_order)}
    items = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if loc and loc[0] == "body":  # FastAPI's request validation prefixes the source
            loc = loc[1:]
        head = rank.get(str(loc[0]), len(rank)) if loc else -1
        path = ".".join(str(p) for p in loc)
        items.append(((head, [_path_key(p) for p in loc], str(err.get("msg", ""))), path, err))
    items.sort(key=lambda item: item[0])
    parts, seen = [], set()
    for (_, _, msg), path, _err in items:
        if (path, msg) not in seen:
            seen.add((path, msg))
            parts.append(f"{path or 'body'}: {msg}")
    message = "; ".join(parts[:MAX_REPORTED_ERRORS])
    if len(parts) > MAX_REPORTED_ERRORS:
        message += f" (and {len(parts) - MAX_REPORTED_ERRORS} more)"
    param = items[0][1] or None if items else None
    return APIError(400, message or "the request is invalid", param)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status if code is None else code,
        }
    }


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.status, exc.message, exc.param, exc.code), exc.status, headers=exc.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error shape; nothing leaks a traceback."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))
