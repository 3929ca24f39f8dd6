"""``POST /v1/completions``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagewarden.engine.async_engine import EngineDeadError, RequestStream
from pagewarden.engine.outputs import CompletionOutput
from pagewarden.server.context import ServerContext
from pagewarden.server.errors import APIError, error_body
from pagewarden.server.protocol import CompletionRequest
from pagewarden.server.responses import completion_logprobs, sampling_params, sse, usage
from pagewarden.server.streams import final_outputs, merge


@dataclass
class _Job:
    """One completions request once submitted: what its responses are built from."""

    ctx: ServerContext
    req: CompletionRequest
    streams: list[RequestStream]
    prefix: list[str]  # per prompt: the echoed prompt text, or ""
    n_prompt: int
    rid: str
    created: int

    def choice(self, i: int, c: CompletionOutput, text: str, lp_start: int, offset: int) -> dict:
        lp = None
        if self.req.logprobs is not None:
            lp = completion_logprobs(self.ctx.tokenizer, c, lp_start, offset)
        return {
            "index": i * self.req.n + c.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def body(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            **extra,
        }


def _prompts(req: CompletionRequest, ctx: ServerContext) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt, within the per-request prompt limit."""
    p = req.prompt
    raw = [p] if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else list(p)
    if not raw:
        raise APIError(400, "the prompt is empty", "prompt")
    limit = ctx.limits.max_prompts_per_request
    if len(raw) > limit:
        raise APIError(400, f"at most {limit} prompts per request, got {len(raw)}", "prompt")
    tok = ctx.tokenizer
    return [(x, tok.encode(x)) if isinstance(x, str) else (None, list(x)) for x in raw]


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    salt, req = await ctx.read_request(request, CompletionRequest)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    prompts = _prompts(req, ctx)
    params = sampling_params(req, req.max_tokens, req.logprobs, ctx.limits)
    streams = await ctx.submit(prompts, params, salt, "cmpl")
    job = _Job(
        ctx,
        req,
        streams,
        [
            (text if text is not None else ctx.tokenizer.decode(ids)) if req.echo else ""
            for text, ids in prompts
        ],
        sum(len(ids) for _, ids in prompts),
        streams[0].request_id.rsplit("-", 1)[0],
        int(time.time()),
    )
    if not req.stream:
        return await _full_response(job, request)
    return StreamingResponse(_events(job), media_type="text/event-stream")


async def _full_response(job: _Job, request: Request) -> JSONResponse:
    finals = await final_outputs(request, job.streams)
    choices = [
        job.choice(i, c, job.prefix[i] + c.text, 0, len(job.prefix[i]))
        for i, out in enumerate(finals)
        for c in out.outputs
    ]
    choices.sort(key=lambda ch: ch["index"])
    n_gen = sum(len(c.token_ids) for out in finals for c in out.outputs)
    return JSONResponse(job.body(choices, usage=usage(job.n_prompt, n_gen)))


async def _events(job: _Job) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    n_gen = 0
    try:
        async for i, out in merge(job.streams):
            for c in out.outputs:
                idx = i * job.req.n + c.index
                if idx in done:
                    continue
                first = idx not in sent_text
                delta = (job.prefix[i] if first else "") + c.text[sent_text.get(idx, 0) :]
                # One chunk per step that generated tokens, even when their text is held
                # back (an incomplete UTF-8 character, a possible stop string), as vLLM
                # does: a client timing tokens by chunks would see two steps as one gap.
                new_tokens = len(c.token_ids) > sent_tokens.get(idx, 0)
                if not delta and not new_tokens and c.finish_reason is None:
                    continue
                sent_tokens[idx] = len(c.token_ids)
                choice = job.choice(i, c, delta, sent_lp.get(idx, 0), sent_text.get(idx, 0))
                sent_text[idx], sent_lp[idx] = len(c.text), len(c.logprobs or [])
                if c.finish_reason is not None:
                    done.add(idx)
                    n_gen += len(c.token_ids)
                yield sse(job.body([choice]))
        opts = job.req.stream_options
        if opts and opts.include_usage:
            yield sse(job.body([], usage=usage(job.n_prompt, n_gen)))
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc)))
    finally:
        for s in job.streams:
            s.abort()
    yield "data: [DONE]\n\n"
