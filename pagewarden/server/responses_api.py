"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

A Responses body becomes a chat completion request (``instructions`` the system message,
``input`` the messages, ``function_call`` / ``function_call_output`` items the assistant's
tool calls and the tool results, ``text.format`` the ``response_format``, function
``tools`` the chat tools), so structured outputs and tool calls are served as on chat.
Nothing is stored: ``previous_response_id`` and ``background`` are refused.
(``responses.py`` holds the building blocks of chat and completion responses;
``responses_stream.py`` the streamed events.)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagewarden.engine.async_engine import EngineDeadError
from pagewarden.server.chat import render_prompt
from pagewarden.server.context import ServerContext
from pagewarden.server.errors import APIError, error_body, validation_error
from pagewarden.server.protocol import ChatCompletionRequest, ResponsesRequest
from pagewarden.server.responses import sampling_params
from pagewarden.server.responses_stream import (
    EventWriter,
    OutputStream,
    function_call_item,
    message_item,
)
from pagewarden.server.streams import final_outputs, merge
from pagewarden.server.structured import check, requested_spec
from pagewarden.server.tools import StreamShaper, ToolPlan, output_calls, plan_tools

_TEXT_PARTS = ("input_text", "output_text", "text")


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    400,
                    f"content part type {kind!r} is not supported (text only)",
                    f"{where}.content.{i}",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise APIError(400, "content must be a string or a list of text parts", f"{where}.content")


def _messages(req: ResponsesRequest) -> list[dict]:
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"message role {role!r} is not supported", f"{where}.role")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id", "")),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        else:
            raise APIError(400, f"input item type {kind!r} is not supported", f"{where}.type")
    return messages


def _tools(req: ResponsesRequest) -> list[dict] | None:
    if not req.tools:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.get("type") != "function":
            raise APIError(
                400,
                f"tool type {t.get('type')!r} is not supported (function only)",
                f"tools.{i}.type",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(choice: str | dict | None) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, "tool_choice: only function tools are supported", "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _input_chars(req: ResponsesRequest) -> int:
    """Characters of the instructions and the input's message and tool-output text (what
    the chat template renders besides its own text and tool calls)."""
    chars = len(req.instructions or "")
    if isinstance(req.input, str):
        return chars + len(req.input)
    for item in req.input:
        for text in (item.get("content"), item.get("output")):
            if isinstance(text, str):
                chars += len(text)
            elif isinstance(text, list):
                chars += sum(
                    len(p["text"])
                    for p in text
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
    return chars


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request a Responses body stands for."""
    if req.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server stores no "
            "responses; send the conversation as input",
            "previous_response_id",
        )
    if req.background:
        raise APIError(400, "background responses are not supported", "background")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _tools(req),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
        }
    try:
        return ChatCompletionRequest.model_validate_json(
            json.dumps({k: v for k, v in body.items() if v is not None})
        )
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False, include_input=False)) from None


def _output_items(plan: ToolPlan, text: str) -> list[dict]:
    content, calls = output_calls(plan, text)
    items = [message_item(content)] if content else []
    return items + [function_call_item(c.name, c.arguments) for c in calls]


class _Response:
    """The response object, as built and updated while a request runs."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, n_prompt: int) -> None:
        self.req, self.n_prompt = req, n_prompt
        self.body: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": ctx.model,
            "output": [],
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"}}
            if req.text is None or req.text.format is None
            else {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "error": None,
            "incomplete_details": None,
            "metadata": req.metadata or {},
            "store": False,
            "usage": None,
        }

    def finish(self, output: list[dict], reason: str | None, n_out: int) -> dict:
        self.body["output"] = output
        if reason == "length":
            self.body["status"] = "incomplete"
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.body["status"] = "completed"
        self.body["usage"] = {
            "input_tokens": self.n_prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.n_prompt + n_out,
        }
        return self.body


async def create_response(ctx: ServerContext, request: Request) -> Response:
    salt, req = await ctx.read_request(request, ResponsesRequest)
    # By size, before the conversion, any rendering or tokenizing.
    ctx.prompt_limit.check_text(_input_chars(req), "input", "the input's text")
    chat = to_chat(req)
    plan = plan_tools(chat, ctx.tool_config)
    # Rendering and tokenizing are request-sized work: off the event loop.
    text, ids = await ctx.prompt_work(render_prompt, chat, ctx, plan)
    spec, param = requested_spec(chat)
    if spec is not None and param is not None:
        param = param.replace("response_format.json_schema", "text.format")
    if plan.spec is not None:
        if spec is not None:
            raise APIError(400, f"{param} cannot be combined with tool_choice {plan.mode}", param)
        spec, param = plan.spec, "tools"
    await check(spec, param)
    params = sampling_params(chat, chat.max_tokens, None, ctx.limits, spec)
    streams = await ctx.submit([(text, ids)], params, salt, "resp")
    resp = _Response(ctx, req, len(ids))
    if not req.stream:
        out = (await final_outputs(request, streams))[0].outputs[0]
        body = resp.finish(_output_items(plan, out.text), out.finish_reason, len(out.token_ids))
        return JSONResponse(body)
    return StreamingResponse(_events(resp, plan, streams), media_type="text/event-stream")


async def _events(resp: _Response, plan: ToolPlan, streams) -> AsyncIterator[str]:
    ev = EventWriter()
    yield ev("response.created", response=resp.body)
    yield ev("response.in_progress", response=resp.body)
    shaper, output = StreamShaper(plan), OutputStream(ev)
    try:
        if plan.mode == "none":  # plain text: the message opens at once, even if empty
            for event in output.start_message():
                yield event
        final = None
        async for _, out in merge(streams):
            final = out.outputs[0]
            deltas, _ = shaper.deltas(final.text, final.finish_reason)
            for event in output.feed(deltas):
                yield event
        assert final is not None
        for event in output.close():
            yield event
        body = resp.finish(output.items, final.finish_reason, len(final.token_ids))
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield ev(kind, response=body)
    except EngineDeadError as exc:
        yield ev("error", **error_body(503, str(exc))["error"])
    finally:
        for s in streams:
            s.abort()
