"""``POST /v1/chat/completions``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagewarden.engine.async_engine import EngineDeadError, RequestStream
from pagewarden.server.context import ServerContext
from pagewarden.server.errors import APIError, error_body
from pagewarden.server.protocol import ChatCompletionRequest
from pagewarden.server.responses import (
    chat_logprobs,
    sampling_params,
    sse,
    usage,
    vllm_prompt_logprobs,
)
from pagewarden.server.streams import final_outputs, merge


@dataclass
class _Job:
    ctx: ServerContext
    req: ChatCompletionRequest
    streams: list[RequestStream]
    n_prompt: int
    rid: str
    created: int

    def chunk(self, choices: list[dict], usage_: dict | None = None) -> str:
        body = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        if usage_ is not None:
            body["usage"] = usage_
        return sse(body)


def _render(req: ChatCompletionRequest, ctx: ServerContext) -> tuple[str | None, list[int]]:
    """The prompt (text, token ids) the chat template makes of the messages."""
    if req.tools:
        raise APIError(400, "tools are not supported", "tools")
    rf = req.response_format
    if rf and rf.get("type") not in (None, "text"):
        raise APIError(400, "only response_format type 'text' is supported", "response_format")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        rendered = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the client's input
        raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
    if isinstance(rendered, str):
        return rendered, ctx.tokenizer.encode(rendered)
    return None, list(rendered)


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    salt, req = await ctx.read_request(request, ChatCompletionRequest)
    text, ids = await asyncio.to_thread(_render, req, ctx)  # request-sized: off the loop
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    params = sampling_params(req, max_tokens, top, ctx.limits, req.prompt_logprobs)
    streams = await ctx.submit([(text, ids)], params, salt, "chatcmpl", request)
    job = _Job(ctx, req, streams, len(ids), ctx.response_id("chatcmpl", request), int(time.time()))
    if not req.stream:
        return await _full_response(job, request)
    return StreamingResponse(_events(job), media_type="text/event-stream")


async def _full_response(job: _Job, request: Request) -> JSONResponse:
    out = (await final_outputs(request, job.streams))[0]
    tok = job.ctx.tokenizer
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(tok, c, 0) if job.req.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in out.outputs
    ]
    n_gen = sum(len(c.token_ids) for c in out.outputs)
    body = {
        "id": job.rid,
        "object": "chat.completion",
        "created": job.created,
        "model": job.req.model,
        "choices": choices,
        "usage": usage(job.n_prompt, n_gen),
    }
    if job.req.prompt_logprobs is not None:  # vLLM puts them beside the choices
        body["prompt_logprobs"] = vllm_prompt_logprobs(tok, out, job.req.prompt_logprobs)
    return JSONResponse(body)


async def _events(job: _Job) -> AsyncIterator[str]:
    n, tok = job.req.n, job.ctx.tokenizer
    sent_text, sent_lp, sent_tokens, done = [0] * n, [0] * n, [0] * n, [False] * n
    n_gen = 0
    try:
        yield job.chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(n)
            ]
        )
        async for _, out in merge(job.streams):
            for c in out.outputs:
                if done[c.index]:
                    continue
                delta = c.text[sent_text[c.index] :]
                # A chunk for every step that generated tokens, even with no text yet
                # (see completions._events).
                new_tokens = len(c.token_ids) > sent_tokens[c.index]
                if not delta and not new_tokens and c.finish_reason is None:
                    continue
                sent_tokens[c.index] = len(c.token_ids)
                choice = {
                    "index": c.index,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": chat_logprobs(tok, c, sent_lp[c.index])
                    if job.req.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                sent_text[c.index], sent_lp[c.index] = len(c.text), len(c.logprobs or [])
                if c.finish_reason is not None:
                    done[c.index] = True
                    n_gen += len(c.token_ids)
                yield job.chunk([choice])
        opts = job.req.stream_options
        if opts and opts.include_usage:
            yield job.chunk([], usage(job.n_prompt, n_gen))
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc)))
    finally:
        for s in job.streams:
            s.abort()
    yield "data: [DONE]\n\n"
