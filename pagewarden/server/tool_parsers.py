"""Tool-call parsers: a model's own tool-call format back into OpenAI tool calls, for
``tool_choice: "auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``, as vLLM).

A parser is one class in ``TOOL_PARSERS``; a new format is one new class and one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # text outside the tool calls; None when there is none
    tool_calls: list[ParsedToolCall]


def _call(obj: object, args_key: str) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class HermesToolParser:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
    number of them, after optional text."""

    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        if self.start not in text:
            return ParsedOutput(text, [])
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:  # not a call after all: leave the text as it was
                return ParsedOutput(text, [])
            calls.append(call)
        content = text[: text.index(self.start)].strip()
        return ParsedOutput(content or None, calls)


class Llama3JsonToolParser:
    """Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after
    ``<|python_tag|>``, several separated by ``;``; the whole output is the calls."""

    start = "{"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ParsedOutput(text, [])
            call = _call(obj, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
        return ParsedOutput(None, calls)


#: Parsers by ``--tool-call-parser`` name (vLLM's names).
TOOL_PARSERS = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
