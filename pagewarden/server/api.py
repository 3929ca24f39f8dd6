"""OpenAI-compatible HTTP API (as vLLM serves it) on top of ``AsyncEngine``.

The HTTP layer never touches KV state: it validates input, submits through the async
engine, and streams results back as server-sent events.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagewarden
from pagewarden.engine.async_engine import (
    AdmissionRejected,
    AsyncEngine,
    EngineDeadError,
    RequestStream,
)
from pagewarden.engine.core import RequestRejected
from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.metrics import prometheus
from pagewarden.sampling_params import SamplingParams, SamplingParamsError
from pagewarden.server.protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    429: "RateLimitError",
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
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.status, exc.message, exc.param), exc.status, headers=exc.headers
    )


def cache_salt_for(api_key: str) -> str:
    """Per-tenant prefix-cache salt: different keys never share cached blocks."""
    return hashlib.sha256(b"pagewarden-tenant:" + api_key.encode()).hexdigest()[:32]


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body is {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}") from None
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param or 'body'}: {err['msg']}", param) from None


def _sampling_params(
    req, max_tokens: int | None, logprobs: int | None, max_n: int
) -> SamplingParams:
    if req.n > max_n:
        raise APIError(400, f"n must be at most {max_n}, got {req.n}", "n")
    if getattr(req, "best_of", None) not in (None, req.n):
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    try:
        return SamplingParams(
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), exc.param) from None


class _Server:
    """Per-app state: the engine, the model name, auth and limits."""

    def __init__(self, engine: AsyncEngine, model: str, api_keys: list[str], max_n: int) -> None:
        self.engine, self.model, self.api_keys, self.max_n = engine, model, api_keys, max_n

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

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    async def submit(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        salt: str | None,
        prefix: str,
    ) -> list[RequestStream]:
        """Add every prompt or none; maps engine refusals to API errors."""
        streams: list[RequestStream] = []
        base = f"{prefix}-{uuid.uuid4().hex}"
        try:
            for i, (text, ids) in enumerate(prompts):
                if not ids:
                    raise APIError(400, "the prompt is empty", "prompt")
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
                raise APIError(429, str(exc), None, {"Retry-After": str(exc.retry_after)}) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc)) from None
            raise
        return streams


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream to finish; aborts all if the client disconnects."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def collect() -> None:
        async for i, out in _merge(streams):
            finals[i] = out

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        task.result()
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    finally:
        for s in streams:
            s.abort()
    return finals  # type: ignore[return-value]


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _completion_logprobs(tok, c: CompletionOutput, start: int, offset: int) -> dict:
    lps = c.logprobs[start:] if c.logprobs else []
    tokens = [tok.decode([lp.token_id]) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{tok.decode([t]): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(tok, c: CompletionOutput, start: int) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = tok.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    lps = c.logprobs[start:] if c.logprobs else []
    return {
        "content": [
            dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in lps
        ]
    }


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | list[str] | None = None,
    max_n: int = 8,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app; the caller owns ``engine`` (and shuts it down)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    srv = _Server(engine, served_model_name, keys, max_n)
    app = FastAPI(
        title="pagewarden",
        version=pagewarden.__version__ if hasattr(pagewarden, "__version__") else "0.1.0",
    )
    app.state.server = srv
    registry = prometheus.build_registry(engine.engine_stats, engine.stats, served_model_name)
    tok = engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(APIError(400, str(exc.errors()[:1])))

    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive():
            return Response(status_code=200)
        return JSONResponse(error_body(503, "the engine is not running"), 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": getattr(pagewarden, "__version__", "0.1.0")}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = prometheus.render(registry)
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        srv.authorize(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pagewarden",
                    "root": served_model_name,
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    async def read_request(request: Request, model: type) -> tuple[str | None, Any]:
        """Authorize, read and validate a body; returns (cache salt, parsed request)."""
        salt = srv.authorize(request)
        req = _parse(model, await _read_body(request, max_body_bytes))
        srv.check_model(req.model)
        return salt, req

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        salt, req = await read_request(request, CompletionRequest)
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        p = req.prompt
        if isinstance(p, str):
            raw = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [p]
        else:
            raw = list(p)
        if not raw:
            raise APIError(400, "the prompt is empty", "prompt")
        prompts = [(x, tok.encode(x)) if isinstance(x, str) else (None, list(x)) for x in raw]
        params = _sampling_params(req, req.max_tokens, req.logprobs, max_n)
        streams = await srv.submit(prompts, params, salt, "cmpl")
        rid, created = streams[0].request_id.rsplit("-", 1)[0], int(time.time())
        n_prompt = sum(len(ids) for _, ids in prompts)
        prefix = [
            (text if text is not None else tok.decode(ids)) if req.echo else ""
            for text, ids in prompts
        ]

        def choice_index(i: int, c: CompletionOutput) -> int:
            return i * req.n + c.index

        if not req.stream:
            finals = await _final_outputs(request, streams)
            choices = []
            for i, out in enumerate(finals):
                for c in out.outputs:
                    choices.append(
                        {
                            "index": choice_index(i, c),
                            "text": prefix[i] + c.text,
                            "logprobs": (
                                _completion_logprobs(tok, c, 0, len(prefix[i]))
                                if req.logprobs is not None
                                else None
                            ),
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
            choices.sort(key=lambda ch: ch["index"])
            n_gen = sum(len(c.token_ids) for out in finals for c in out.outputs)
            return JSONResponse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": served_model_name,
                    "choices": choices,
                    "usage": _usage(n_prompt, n_gen),
                }
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            sent_text: dict[int, int] = {}
            sent_lp: dict[int, int] = {}
            done: set[int] = set()
            n_gen = 0
            try:
                async for i, out in _merge(streams):
                    for c in out.outputs:
                        idx = choice_index(i, c)
                        if idx in done:
                            continue
                        first = idx not in sent_text
                        delta = (prefix[i] if first else "") + c.text[sent_text.get(idx, 0) :]
                        n_lp = len(c.logprobs or [])
                        if not delta and c.finish_reason is None:
                            continue
                        choice = {
                            "index": idx,
                            "text": delta,
                            "logprobs": (
                                _completion_logprobs(
                                    tok, c, sent_lp.get(idx, 0), sent_text.get(idx, 0)
                                )
                                if req.logprobs is not None
                                else None
                            ),
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                        sent_text[idx], sent_lp[idx] = len(c.text), n_lp
                        if c.finish_reason is not None:
                            done.add(idx)
                            n_gen += len(c.token_ids)
                        yield _sse(
                            {
                                "id": rid,
                                "object": "text_completion",
                                "created": created,
                                "model": served_model_name,
                                "choices": [choice],
                            }
                        )
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": served_model_name,
                            "choices": [],
                            "usage": _usage(n_prompt, n_gen),
                        }
                    )
            except EngineDeadError as exc:
                yield _sse(error_body(503, str(exc)))
            finally:
                for s in streams:
                    s.abort()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        salt, req = await read_request(request, ChatCompletionRequest)
        if req.tools:
            raise APIError(400, "tools are not supported", "tools")
        rf = req.response_format
        if rf and rf.get("type") not in (None, "text"):
            raise APIError(400, "only response_format type 'text' is supported", "response_format")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            rendered = tok.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - template errors are the client's input
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        if isinstance(rendered, str):
            text, ids = rendered, tok.encode(rendered)
        else:
            text, ids = None, list(rendered)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
        elif req.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        params = _sampling_params(req, max_tokens, top, max_n)
        streams = await srv.submit([(text, ids)], params, salt, "chatcmpl")
        rid, created = streams[0].request_id.rsplit("-", 1)[0], int(time.time())

        if not req.stream:
            out = (await _final_outputs(request, streams))[0]
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(tok, c, 0) if req.logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in out.outputs
            ]
            n_gen = sum(len(c.token_ids) for c in out.outputs)
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": served_model_name,
                    "choices": choices,
                    "usage": _usage(len(ids), n_gen),
                }
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": served_model_name,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return _sse(body)

        async def events() -> AsyncIterator[str]:
            sent_text = [0] * req.n
            sent_lp = [0] * req.n
            done = [False] * req.n
            n_gen = 0
            try:
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(req.n)
                    ]
                )
                async for _, out in _merge(streams):
                    for c in out.outputs:
                        if done[c.index]:
                            continue
                        delta = c.text[sent_text[c.index] :]
                        if not delta and c.finish_reason is None:
                            continue
                        choice = {
                            "index": c.index,
                            "delta": {"content": delta} if delta else {},
                            "logprobs": (
                                _chat_logprobs(tok, c, sent_lp[c.index]) if req.logprobs else None
                            ),
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                        sent_text[c.index], sent_lp[c.index] = len(c.text), len(c.logprobs or [])
                        if c.finish_reason is not None:
                            done[c.index] = True
                            n_gen += len(c.token_ids)
                        yield chunk([choice])
                if include_usage:
                    yield chunk([], _usage(len(ids), n_gen))
            except EngineDeadError as exc:
                yield _sse(error_body(503, str(exc)))
            finally:
                for s in streams:
                    s.abort()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
