"""``POST /v1/completions``.

``echo`` puts the prompt before each completion's text; with ``logprobs`` its tokens come
first in the logprobs too (the first token's logprob is null), from the engine's prompt
logprobs. ``max_tokens: 0`` with ``echo`` scores the prompt only (lm-evaluation-harness's
loglikelihood requests): the engine samples one token, which is not shown or counted.
vLLM's ``prompt_logprobs`` adds each choice's ``prompt_logprobs`` in vLLM's format.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagewarden.engine.async_engine import EngineDeadError, RequestStream
from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.server.context import ServerContext
from pagewarden.server.errors import APIError, error_body
from pagewarden.server.protocol import CompletionRequest
from pagewarden.server.responses import (
    completion_logprobs,
    echo_logprobs,
    sampling_params,
    sse,
    usage,
    vllm_prompt_logprobs,
)
from pagewarden.server.streams import final_outputs, merge
from pagewarden.server.structured import check, requested_spec
from pagewarden.structured_outputs import StructuredOutputsParams


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

    @property
    def prompt_only(self) -> bool:
        """``max_tokens: 0`` with echo: the sampled token is not part of the answer."""
        return self.req.echo and self.req.max_tokens == 0

    def visible(self, c: CompletionOutput) -> CompletionOutput:
        if not self.prompt_only:
            return c
        done = "length" if c.finish_reason is not None else None
        return CompletionOutput(c.index, "", [], done, None, [] if c.logprobs is not None else None)

    def choice(
        self,
        i: int,
        out: RequestOutput,
        c: CompletionOutput,
        text: str,
        lp_start: int,
        offset: int,
        first: bool,
    ) -> dict:
        """The choice of completion ``c`` of prompt ``i``: ``text`` and the logprobs from
        ``lp_start``; ``first``: the first choice sent for it (it carries the prompt)."""
        req, tok = self.req, self.ctx.tokenizer
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(tok, c, lp_start, offset)
            if req.echo and first:
                lp = echo_logprobs(tok, out, req.logprobs, lp)
        body = {
            "index": i * req.n + c.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.prompt_logprobs is not None and first:
            body["prompt_logprobs"] = vllm_prompt_logprobs(tok, out, req.prompt_logprobs)
        return body

    def body(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            **extra,
        }


def _raw_prompts(req: CompletionRequest, ctx: ServerContext) -> list[str | list[int]]:
    """The request's prompts, each within the size that can fit the context: checked in
    time that does not grow with a prompt's length (validation typed the list whole)."""
    p = req.prompt
    raw = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not raw:
        raise APIError(400, "the prompt is empty", "prompt")
    limit = ctx.limits.max_prompts_per_request
    if len(raw) > limit:
        raise APIError(400, f"at most {limit} prompts per request, got {len(raw)}", "prompt")
    ctx.prompt_limit.check_prompts(raw)
    return raw  # type: ignore[return-value]


def _tokenized(
    raw: list[str | list[int]], ctx: ServerContext
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt."""
    tok = ctx.tokenizer
    return [(x, tok.encode(x)) if isinstance(x, str) else (None, list(x)) for x in raw]


def _engine_params(
    req: CompletionRequest, ctx: ServerContext, spec: StructuredOutputsParams | None
):
    """The request's ``SamplingParams``: ``max_tokens: 0`` (echo only) samples one token;
    echo with logprobs asks the engine for prompt logprobs; ``spec`` is its checked
    structured-outputs constraint."""
    max_tokens = req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        max_tokens = 1
    wanted = [req.prompt_logprobs]
    if req.echo and req.logprobs is not None:
        wanted.append(req.logprobs)
    asked = [k for k in wanted if k is not None]
    return sampling_params(
        req, max_tokens, req.logprobs, ctx.limits, spec, max(asked) if asked else None
    )


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    salt, req = await ctx.read_request(request, CompletionRequest)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    raw = _raw_prompts(req, ctx)  # refused by size before any tokenizing
    spec, param = requested_spec(req)
    await check(spec, param)
    params = _engine_params(req, ctx, spec)
    # Tokenizing is request-sized work: off the event loop.
    prompts = await ctx.prompt_work(_tokenized, raw, ctx)
    streams = await ctx.submit(prompts, params, salt, "cmpl", request)
    echoed = await ctx.prompt_work(
        lambda: [
            (text if text is not None else ctx.tokenizer.decode(ids)) if req.echo else ""
            for text, ids in prompts
        ]
    )
    job = _Job(
        ctx,
        req,
        streams,
        echoed,
        sum(len(ids) for _, ids in prompts),
        ctx.response_id("cmpl", request),
        int(time.time()),
    )
    if not req.stream:
        return await _full_response(job, request)
    return StreamingResponse(_events(job), media_type="text/event-stream")


async def _full_response(job: _Job, request: Request) -> JSONResponse:
    finals = await final_outputs(request, job.streams)
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            c = job.visible(c)
            choices.append(
                job.choice(i, out, c, job.prefix[i] + c.text, 0, len(job.prefix[i]), True)
            )
    choices.sort(key=lambda ch: ch["index"])
    n_gen = sum(len(job.visible(c).token_ids) for out in finals for c in out.outputs)
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
                c = job.visible(c)
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
                offset = sent_text.get(idx, 0) + len(job.prefix[i])
                choice = job.choice(i, out, c, delta, sent_lp.get(idx, 0), offset, first)
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
