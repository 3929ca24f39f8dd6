"""``POST /v1/chat/completions``."""

from __future__ import annotations

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
from pagewarden.server.structured import check, requested_spec
from pagewarden.server.tools import (
    StreamShaper,
    ToolPlan,
    message,
    plan_tools,
    template_knows_tools,
    template_messages,
)


@dataclass
class _Job:
    ctx: ServerContext
    req: ChatCompletionRequest
    streams: list[RequestStream]
    n_prompt: int
    rid: str
    created: int
    plan: ToolPlan
    echo: str  # text put before every choice's content ("" without echo)

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


def render_prompt(
    req: ChatCompletionRequest, ctx: ServerContext, plan: ToolPlan
) -> tuple[str | None, list[int]]:
    """The prompt (text, token ids) the chat template makes of the messages and tools."""
    native = template_knows_tools(getattr(ctx.tokenizer, "chat_template", None))
    messages, tools = template_messages(req, plan, native)
    try:
        rendered = ctx.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=tools,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the client's input
        raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
    if isinstance(rendered, str):
        # The template writes the special tokens (BOS) itself, as in LLM.chat.
        return rendered, ctx.tokenizer.encode(rendered, add_special_tokens=False)
    return None, list(rendered)


def echo_prefix(req: ChatCompletionRequest, plan: ToolPlan) -> str:
    """vLLM's chat ``echo``: the last message's content, when that message has the
    reply's role (an assistant message the model continues); else nothing."""
    if not req.echo:
        return ""
    if plan.mode != "none":
        raise APIError(400, "echo cannot be combined with tool calls (tool_choice)", "echo")
    if req.logprobs:
        raise APIError(
            400,
            "echo with logprobs is not supported on chat completions (the echoed text has "
            "no logprobs); use /v1/completions with echo and logprobs to score a prompt",
            "echo",
        )
    last = req.messages[-1]
    if last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text for p in last.content)  # vLLM joins text parts by lines


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    salt, req = await ctx.read_request(request, ChatCompletionRequest)
    ctx.prompt_limit.check_messages(req.messages)  # by size, before any rendering
    plan = plan_tools(req, ctx.tool_config)
    echo = echo_prefix(req, plan)
    # Rendering and tokenizing are request-sized work: off the event loop.
    text, ids = await ctx.prompt_work(render_prompt, req, ctx, plan)
    spec, param = requested_spec(req)
    if plan.spec is not None:
        if spec is not None:
            raise APIError(400, f"{param} cannot be combined with tool_choice {plan.mode}", param)
        spec, param = plan.spec, "tools"
    await check(spec, param)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    params = sampling_params(req, max_tokens, top, ctx.limits, spec, req.prompt_logprobs)
    streams = await ctx.submit([(text, ids)], params, salt, "chatcmpl", request)
    job = _Job(
        ctx,
        req,
        streams,
        len(ids),
        ctx.response_id("chatcmpl", request),
        int(time.time()),
        plan,
        echo,
    )
    if not req.stream:
        return await _full_response(job, request)
    return StreamingResponse(_events(job), media_type="text/event-stream")


async def _full_response(job: _Job, request: Request) -> JSONResponse:
    out = (await final_outputs(request, job.streams))[0]
    tok = job.ctx.tokenizer
    choices = []
    for c in out.outputs:
        msg, reason = message(job.plan, c.text, c.finish_reason)
        if job.echo:
            msg["content"] = job.echo + (msg["content"] or "")
        choices.append(
            {
                "index": c.index,
                "message": msg,
                "logprobs": chat_logprobs(tok, c, 0) if job.req.logprobs else None,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
        )
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
    sent_lp, sent_tokens, done = [0] * n, [0] * n, [False] * n
    shapers = [StreamShaper(job.plan) for _ in range(n)]
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
        if job.echo:
            yield job.chunk(
                [
                    {
                        "index": i,
                        "delta": {"content": job.echo},
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
                deltas, reason = shapers[c.index].deltas(c.text, c.finish_reason)
                # A chunk for every step that generated tokens, even with no text yet
                # (see completions._events).
                new_tokens = len(c.token_ids) > sent_tokens[c.index]
                if not deltas and not new_tokens and c.finish_reason is None:
                    continue
                sent_tokens[c.index] = len(c.token_ids)
                lp = chat_logprobs(tok, c, sent_lp[c.index]) if job.req.logprobs else None
                sent_lp[c.index] = len(c.logprobs or [])
                # Tool-call deltas go one per chunk; the last chunk carries the reason.
                for k, delta in enumerate(deltas or [{}]):
                    last = k == max(len(deltas), 1) - 1
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": lp if k == 0 else None,
                        "finish_reason": reason if last else None,
                        "stop_reason": c.stop_reason if last else None,
                    }
                    yield job.chunk([choice])
                if c.finish_reason is not None:
                    done[c.index] = True
                    n_gen += len(c.token_ids)
        opts = job.req.stream_options
        if opts and opts.include_usage:
            yield job.chunk([], usage(job.n_prompt, n_gen))
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc)))
    finally:
        for s in job.streams:
            s.abort()
    yield "data: [DONE]\n\n"
