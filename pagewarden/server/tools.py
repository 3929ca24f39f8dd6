"""Tool calling on chat completions, as vLLM serves it.

``tool_choice`` decides how the output becomes tool calls:

- ``none`` (or no tools): plain text.
- ``auto``: the model writes calls in its own format, parsed back by the parser named by
  ``--tool-call-parser`` (``tool_parsers.py``); needs ``--enable-auto-tool-choice``.
- ``required``: the grammar forces a JSON list of ``{"name", "parameters"}`` objects, one
  per call, each valid for its function's ``parameters`` schema (one call at most with
  ``parallel_tool_calls: false``).
- a named function: the grammar forces that function's arguments.

Legacy ``functions`` / ``function_call`` map onto ``tools`` / ``tool_choice``. Tools and
tool results reach the prompt through the model's chat template; a template that knows
nothing of tools gets them in the Hermes format (a ``<tools>`` system prompt,
``<tool_call>`` and ``<tool_response>`` blocks), which the ``hermes`` parser reads back.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pagewarden.models.chat_template import template_variables
from pagewarden.server.errors import APIError
from pagewarden.server.protocol import ChatCompletionRequest, ChatMessage
from pagewarden.server.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCall,
    RequiredToolParser,
    StreamingToolParser,
)
from pagewarden.structured_outputs import StructuredOutputsParams

_ANY_OBJECT: dict = {"type": "object"}


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool flags (``--enable-auto-tool-choice``, ``--tool-call-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool-call parser {self.tool_call_parser!r}; "
                f"choose one of {', '.join(TOOL_PARSERS)}"
            )


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt and its output."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] = field(default_factory=list)  # OpenAI tool dicts, for the template
    name: str | None = None  # the named function
    spec: StructuredOutputsParams | None = None
    parser: str | None = None
    parallel: bool | None = None  # parallel_tool_calls; False: one call at most


def plan_tools(req: ChatCompletionRequest, config: ToolConfig) -> ToolPlan:
    """How ``req``'s tools and tool choice are served; 400 for what cannot be."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if req.functions:
        if tools:
            raise APIError(400, "send tools or the legacy functions, not both", "functions")
        tools = [
            {"type": "function", "function": f.model_dump(exclude_none=True)} for f in req.functions
        ]
        fc = req.function_call
        choice = (
            fc
            if isinstance(fc, str)
            else ({"type": "function", "function": {"name": fc.name}} if fc is not None else None)
        )
    elif req.function_call is not None:
        raise APIError(400, "function_call needs functions", "function_call")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise APIError(
                400,
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                "and --tool-call-parser",
                "tool_choice",
            )
        return ToolPlan(
            "auto", tools, parser=config.tool_call_parser, parallel=req.parallel_tool_calls
        )
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": fn.get("parameters") or _ANY_OBJECT,
                },
                "required": ["name", "parameters"],
            }
            for name, fn in by_name.items()
        ]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, spec=StructuredOutputsParams.from_schema(schema))
    name = (
        choice.function.name
        if not isinstance(choice, (str, dict))
        else (choice["function"]["name"] if isinstance(choice, dict) else None)
    )
    if name not in by_name:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
        )
    params = by_name[name].get("parameters") or _ANY_OBJECT
    return ToolPlan("named", tools, name=name, spec=StructuredOutputsParams.from_schema(params))


# ---- the prompt ----------------------------------------------------------------------


def template_knows_tools(template: str | None) -> bool:
    """Whether the chat template renders tools itself (it reads the ``tools`` variable);
    one that does not gets them in the Hermes format."""
    return bool(template) and "tools" in template_variables(template)  # type: ignore[arg-type]


def _arguments(text: str) -> object:
    """Arguments as templates expect them: a dict when the text is a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_messages(
    req: ChatCompletionRequest, plan: ToolPlan, native: bool
) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to render; ``native``: the template renders tools itself."""
    messages = []
    for i, m in enumerate(req.messages):
        messages.append(_message(m, i, native))
    tools = plan.tools or None  # tool_choice none too: vLLM keeps them in the prompt
    if tools and not native:
        prompt = _hermes_system_prompt(tools)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}"
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        tools = None
    return messages, tools


def _message(m: ChatMessage, i: int, native: bool) -> dict:
    calls = list(m.tool_calls or [])
    if m.function_call is not None:
        calls.append(_legacy_call(m, i))
    if m.content is None and not calls:
        raise APIError(400, "content may be null only beside tool_calls", f"messages.{i}.content")
    role = "tool" if m.role == "function" else m.role
    d: dict = {"role": role, "content": m.text() if m.content is not None else None}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if calls:
        d["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in calls
        ]
    if native:
        return d
    # Hermes format for a template that knows only role and content.
    text = d["content"] or ""
    if calls:
        blocks = [
            "<tool_call>\n"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "\n</tool_call>"
            for c in d["tool_calls"]
        ]
        text = "\n".join(([text] if text else []) + blocks)
    if role == "tool":
        text = f"<tool_response>\n{text}\n</tool_response>"
    return {"role": role, "content": text}


def _legacy_call(m: ChatMessage, i: int):
    from pagewarden.server.protocol import ToolCall

    assert m.function_call is not None
    return ToolCall(id=f"call_legacy_{i}", function=m.function_call)


def _hermes_system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The function "
        f"signatures are within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


# ---- the output ----------------------------------------------------------------------


def _call_dict(call: ParsedToolCall) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _parser(plan: ToolPlan) -> StreamingToolParser | None:
    """The parser that reads ``plan``'s output back into calls (None: plain text or a
    named function's arguments)."""
    if plan.mode == "required":
        return RequiredToolParser()
    if plan.mode == "auto":
        assert plan.parser is not None
        return TOOL_PARSERS[plan.parser](max_calls=1 if plan.parallel is False else None)
    return None


def output_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, tool calls) of one finished output."""
    if plan.mode == "named":
        assert plan.name is not None
        return None, [ParsedToolCall(plan.name, text)]
    parser = _parser(plan)
    if parser is None:
        return text, []
    parsed = parser.parse(text)
    return parsed.content, parsed.tool_calls


def finish_reason(plan: ToolPlan, called: bool, reason: str | None) -> str | None:
    """``tool_calls`` when the model called tools and stopped by itself; a named
    function's call ends with ``stop``, as OpenAI's does."""
    if called and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def message(plan: ToolPlan, text: str, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice, and its finish reason."""
    content, calls = output_calls(plan, text)
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [_call_dict(c) for c in calls]
    return msg, finish_reason(plan, bool(calls), reason)


class StreamShaper:
    """One streamed choice: its text deltas as ``delta`` dicts, tool calls included (a
    call's name first, then its arguments as they are generated, as vLLM streams them)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = _parser(plan)
        self.sent = 0  # characters of the text already sent (plain text, named arguments)
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"

    def deltas(self, text: str, reason: str | None) -> tuple[list[dict], str | None]:
        """Deltas for ``text`` (the choice's whole text so far); at the end (``reason``
        set) also the finish reason to send."""
        if self.parser is not None:
            out = self.parser.feed(text, final=reason is not None)
            return out, finish_reason(self.plan, self.parser.called, reason)
        if self.plan.mode != "named":
            return self._content(text), reason
        out = []
        if self.sent == 0 and (text or reason is not None):
            head = {
                "index": 0,
                "id": self.call_id,
                "type": "function",
                "function": {"name": self.plan.name, "arguments": ""},
            }
            out.append({"tool_calls": [head]})
        if len(text) > self.sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.sent :]}}]})
            self.sent = len(text)
        return out, reason

    def _content(self, text: str) -> list[dict]:
        if len(text) <= self.sent:
            return []
        delta = text[self.sent :]
        self.sent = len(text)
        return [{"content": delta}]
