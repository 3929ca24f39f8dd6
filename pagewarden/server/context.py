"""Per-app state shared by the routes: engine, model name, auth, limits, submission."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pagewarden.engine.async_engine import (
    AdmissionRejected,
    AsyncEngine,
    EngineDeadError,
    RequestStream,
)
from pagewarden.engine.core import RequestRejected
from pagewarden.sampling_params import SamplingParams
from pagewarden.server.admission import AdmissionController
from pagewarden.server.errors import APIError, validation_error
from pagewarden.server.json_budget import JsonBudget
from pagewarden.server.prompt_size import prompt_size_limit
from pagewarden.server.protocol import unsupported_field
from pagewarden.server.request_id import client_request_id, request_id
from pagewarden.server.tools import ToolConfig

DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
#: Threads that tokenize, render chat templates and detokenize prompts for one app.
PROMPT_WORKERS = 2
#: Bodies at least this large are parsed one at a time, each followed by as long a pause
#: as it took (see ``ServerContext.parse``).
LARGE_BODY_BYTES = 1 << 20

T = TypeVar("T")


@dataclass(frozen=True)
class ServerLimits:
    """Front-door bounds on what one request may ask for (vLLM's names where they exist)."""

    max_n: int = 8
    max_logprobs: int = 20  # as vLLM's --max-logprobs
    max_prompts_per_request: int = 32
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def cache_salt_for(api_key: str) -> str:
    """Per-tenant prefix-cache salt: different keys never share cached blocks."""
    return hashlib.sha256(b"pagewarden-tenant:" + api_key.encode()).hexdigest()[:32]


class ServerContext:
    """What every route needs; one per app."""

    def __init__(
        self,
        engine: AsyncEngine,
        served_names: list[str],
        api_keys: list[str],
        limits: ServerLimits,
        admission: AdmissionController,
    ) -> None:
        assert served_names, "a server serves its model under at least one name"
        # The first name is the primary one: metrics labels, the dashboard, the default.
        self.served_names = list(dict.fromkeys(served_names))
        self.model = self.served_names[0]
        self.engine, self.api_keys = engine, api_keys
        self.limits, self.admission = limits, admission
        self.tokenizer = engine.tokenizer
        # What a prompt may be before it is tokenized (prompt_size.py).
        self.prompt_limit = prompt_size_limit(self.tokenizer, engine.max_model_len)
        # What a body may hold before it is parsed (json_budget.py).
        self.json_budget = JsonBudget.for_server(
            engine.max_model_len, limits.max_prompts_per_request
        )
        # Request-sized prompt work runs here, never on the event loop, on a fixed number
        # of threads: a flood queues behind them instead of taking every core.
        self._prompt_pool = ThreadPoolExecutor(PROMPT_WORKERS, "pagewarden-prompt")
        self._large_body = asyncio.Lock()
        # tool calling flags (server/tools.py); build_app sets them
        self.tool_config = ToolConfig()

    async def prompt_work(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the prompt pool (tokenizing, template rendering, decoding)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_pool, functools.partial(fn, *args))

    def authorize(self, request: Request) -> str | None:
        """Return the tenant's cache salt (None without keys); 401 on a bad key."""
        if not self.api_keys:
            return None
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        for key in self.api_keys:
            if token and hmac.compare_digest(token.encode(), key.encode()):
                return cache_salt_for(key)
        raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer KEY'")

    async def read_request(self, request: Request, model: type[BaseModel]):
        """Authorize, read and validate a body; returns (cache salt, parsed request)."""
        salt = self.authorize(request)
        req = await self.parse(model, await read_body(request, self.limits.max_body_bytes))
        # The name the client used, or the primary one when it sent none.
        req.model = self.resolve_model(req.model)  # type: ignore[attr-defined]
        field = unsupported_field(req)
        if field is not None:
            raise APIError(400, f"{field} is not supported by this server", field)
        return salt, req

    async def parse(self, model: type[BaseModel], body: bytes) -> BaseModel:
        """``parse_body`` once the body's JSON values fit ``json_budget`` (413 otherwise,
        before any is parsed); a large body waits its turn and leaves the loop free after.

        JSON parsing holds the GIL (a worker thread would not free the loop), and the
        largest body the budget lets through takes tens of milliseconds: eight arriving
        together would hold ``/health`` for all of theirs. Scanned a piece at a time, then
        parsed one at a time, each parse followed by a pause as long as it took, large
        bodies take at most half the event loop however many arrive."""
        if len(body) < LARGE_BODY_BYTES:
            await self.json_budget.check(body)  # at most 4 pieces
            return parse_body(model, body)
        async with self._large_body:
            await self.json_budget.check(body)
            start = time.perf_counter()
            try:
                return parse_body(model, body)
            finally:
                await asyncio.sleep(time.perf_counter() - start)

    def resolve_model(self, name: str | None) -> str:
        """``name`` if it is one of the served names, the primary name for None; 404
        (listing the served names) otherwise."""
        if name is None:
            return self.model
        if name not in self.served_names:
            names = ", ".join(f"`{n}`" for n in self.served_names)
            shown = name if len(name) <= 200 else name[:200] + "..."
            raise APIError(404, f"The model `{shown}` does not exist. Served: {names}.", "model")
        return name

    def retry_headers(self) -> dict[str, str]:
        seconds = self.admission.retry_after_s()
        return {
            "Retry-After": str(max(1, math.ceil(seconds))),
            "retry-after-ms": str(int(seconds * 1000)),
        }

    def response_id(self, prefix: str, request: Request | None = None) -> str:
        """The ``id`` of a response: ``prefix-`` and the request's id (``request_id.py``)."""
        return f"{prefix}-{request_id(request)}"

    async def submit(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        salt: str | None,
        prefix: str,
        request: Request | None = None,
    ) -> list[RequestStream]:
        """Add every prompt or none; maps engine refusals to API errors.

        Engine request ids are ``{prefix}-{request id}-{i}``, so logs and flight records
        carry the client's ``X-Request-Id``; a client's id gets a random part too, since
        two clients may send the same one."""
        streams: list[RequestStream] = []
        base = self.response_id(prefix, request)
        if request is not None and client_request_id(request) is not None:
            base = f"{base}-{uuid.uuid4().hex[:8]}"
        try:
            for i, (text, ids) in enumerate(prompts):
                streams.append(
                    await self.engine.add_request(
                        f"{base}-{i}", ids, params, prompt=text, cache_salt=salt
                    )
                )
        except BaseException as exc:
            for s in streams:
                s.abort()
            if isinstance(exc, RequestRejected):
                raise APIError(400, str(exc), exc.param or "prompt") from None
            if isinstance(exc, AdmissionRejected):
                raise APIError(429, str(exc), None, self.retry_headers()) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc)) from None
            raise
        return streams


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, 413 past ``limit``; a client that hangs up mid-body gets 499."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body is {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client disconnected while sending the body") from None
    return b"".join(chunks)


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        if not body.isascii():  # ASCII is UTF-8; isascii costs a tenth of decoding
            body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        invalid = next((e for e in errors if e["type"] == "json_invalid"), None)
        if invalid is not None:
            raise APIError(400, f"the request body is not valid JSON: {invalid['msg']}") from None
        raise validation_error(errors, _field_order(model, body)) from None


def _field_order(model: type[BaseModel], body: bytes) -> list[str]:
    """The body's own top-level keys in the order sent, then the model's other fields."""
    try:
        sent = json.loads(body)
    except ValueError:
        sent = None
    keys = [str(k) for k in sent] if isinstance(sent, dict) else []
    names = [field.alias or name for name, field in model.model_fields.items()]
    return keys + [name for name in names if name not in set(keys)]
