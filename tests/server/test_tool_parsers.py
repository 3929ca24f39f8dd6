"""Tool-call parsers and the streamed shaping of tool calls (no server)."""

from __future__ import annotations

import json

from pagewarden.server.tool_parsers import TOOL_PARSERS
from pagewarden.server.tools import StreamShaper, ToolPlan


def test_hermes_calls_and_content():
    p = TOOL_PARSERS["hermes"]()
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    out = p.parse(text)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert p.parse("no calls here").tool_calls == []
    broken = "<tool_call>{not json</tool_call>"
    assert p.parse(broken).content == broken and p.parse(broken).tool_calls == []


def test_llama3_json_calls():
    p = TOOL_PARSERS["llama3_json"]()
    out = p.parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    )
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert p.parse("Hello there").tool_calls == []


def test_streamed_auto_holds_back_a_possible_tool_call_start():
    shaper = StreamShaper(ToolPlan("auto", parser="hermes"))
    sent = []
    full = 'Sure <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for end in range(1, len(full) + 1):
        deltas, _ = shaper.deltas(full[:end], None)
        sent += deltas
    deltas, reason = shaper.deltas(full, "stop")
    content = "".join(d.get("content", "") for d in sent)
    assert content == "Sure "
    (call,) = deltas[0]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'} and reason == "tool_calls"


def test_streamed_named_sends_arguments_as_generated():
    shaper = StreamShaper(ToolPlan("named", name="f"))
    a, _ = shaper.deltas('{"a"', None)
    b, reason = shaper.deltas('{"a": 1}', "stop")
    assert a[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in a + b)
    assert args == '{"a": 1}' and reason == "stop"
