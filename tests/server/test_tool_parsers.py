"""Tool-call parsers and the streamed shaping of tool calls (no server)."""

from __future__ import annotations

import json
import random

import pytest

from pagewarden.server.tool_parsers import TOOL_PARSERS, RequiredToolParser
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


def _assemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls as the openai client assembles them; checks the order: a call's
    first delta has its id, type, name and empty arguments, later ones only arguments."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [(name, args) for name, args in calls.values()]


def _stream(parser, text: str, cuts: list[int]) -> list[dict]:
    out = []
    for end in cuts:
        out += parser.feed(text[:end])
    return out + parser.feed(text, final=True)


HERMES_TWO_CALLS = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"a": "]"}]}}'
    '\n</tool_call>\n<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>'
)
CASES = [
    ("hermes", HERMES_TWO_CALLS),
    ("hermes", 'Sure <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>'),
    ("hermes", "no call, only <tool talk"),
    ("hermes", "x <tool_call>{not json</tool_call>"),
    ("hermes", '<tool_call>{"na\\qme": "f"}</tool_call>'),  # a bad escape: not a call
    ("hermes", '<tool_call>{"name": "f\\q", "arguments": {}}</tool_call>'),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
    ),
    ("llama3_json", '{"name": "a", "arguments": {"x": [1, 2]}}'),
    ("llama3_json", "Hello there"),
    (
        "required",
        '[{"name": "g", "parameters": {"city": "Paris"}}, {"name": "t", "parameters": {}}]',
    ),
]


def _parser(name: str):
    return RequiredToolParser() if name == "required" else TOOL_PARSERS[name]()


@pytest.mark.parametrize("name,text", CASES)
def test_streamed_deltas_add_up_to_the_parsed_output(name, text):
    """Fed character by character and in random pieces, the streamed calls equal what
    the non-streamed parse answers, arguments byte for byte."""
    whole = _parser(name).parse(text)
    expected = [(c.name, c.arguments) for c in whole.tool_calls]
    rng = random.Random(0)
    cuts_list = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) // 3))) for _ in range(30)
    ]
    for cuts in cuts_list:
        content, calls = _assemble(_stream(_parser(name), text, cuts))
        assert calls == expected
        if not calls:
            assert content == text  # not a call after all: all of it is content


def test_a_bad_escape_after_the_name_is_streamed_but_not_parsed_as_a_call():
    """Streaming cannot take back a call whose name went out; the whole response gives
    the output as content (and nothing raises)."""
    text = '<tool_call>{"name": "f", "arguments": "\\q"}</tool_call>'
    _, calls = _assemble(_stream(TOOL_PARSERS["hermes"](), text, list(range(1, len(text)))))
    assert calls == [("f", '"\\q"')]
    assert TOOL_PARSERS["hermes"]().parse(text).content == text


def test_hermes_tag_split_across_tokens_streams_name_then_arguments():
    p = TOOL_PARSERS["hermes"]()
    pieces = [
        "Sure",
        " <tool",
        "_call",
        '>\n{"na',
        'me": "get_',
        'weather", "argu',
        'ments": {"ci',
        'ty": "Par',
        'is"}}',
        "\n</tool_",
        "call>",
    ]
    text, steps = "", []
    for piece in pieces:
        text += piece
        steps.append(p.feed(text))
    steps.append(p.feed(text, final=True))
    assert steps[0] == [{"content": "Sure"}]
    assert steps[1] == [{"content": " "}]  # "<tool" held back: it may begin a tag
    assert steps[2] == steps[3] == steps[4] == []
    (head,) = steps[5][0]["tool_calls"]
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"]
    assert len(steps[5]) == 1  # the arguments' key is not complete yet
    assert steps[6][0]["tool_calls"][0]["function"] == {"arguments": '{"ci'}
    assert steps[7][0]["tool_calls"][0]["function"] == {"arguments": 'ty": "Par'}
    assert steps[8][0]["tool_calls"][0]["function"] == {"arguments": 'is"}'}
    assert steps[9] == steps[10] == steps[11] == [] and p.called


def test_parallel_tool_calls_false_keeps_the_first_call():
    p = TOOL_PARSERS["hermes"](max_calls=1)
    content, calls = _assemble(_stream(p, HERMES_TWO_CALLS, list(range(1, len(HERMES_TWO_CALLS)))))
    assert [c[0] for c in calls] == ["get_weather"]
    parsed = TOOL_PARSERS["hermes"](max_calls=1).parse(HERMES_TWO_CALLS)
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]


def test_streamed_auto_holds_back_a_possible_tool_call_start():
    shaper = StreamShaper(ToolPlan("auto", parser="hermes"))
    sent = []
    full = 'Sure <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for end in range(1, len(full) + 1):
        deltas, _ = shaper.deltas(full[:end], None)
        sent += deltas
    deltas, reason = shaper.deltas(full, "stop")
    content, calls = _assemble(sent + deltas)
    assert content == "Sure "
    assert calls == [("f", '{"a": 1}')] and reason == "tool_calls"


def test_streamed_required_calls_finish_with_tool_calls_and_length_keeps_its_reason():
    text = '[{"name": "g", "parameters": {"city": "Paris"}}]'
    shaper = StreamShaper(ToolPlan("required"))
    sent, _ = shaper.deltas(text[:35], None)
    assert _assemble(sent)[1] == [("g", '{"city')]  # the arguments stream as they come
    rest, reason = shaper.deltas(text, "stop")
    assert _assemble(sent + rest)[1] == [("g", '{"city": "Paris"}')] and reason == "tool_calls"
    cut = StreamShaper(ToolPlan("required"))
    assert cut.deltas(text[:30], "length")[1] == "length"


def test_streamed_named_sends_arguments_as_generated():
    shaper = StreamShaper(ToolPlan("named", name="f"))
    a, _ = shaper.deltas('{"a"', None)
    b, reason = shaper.deltas('{"a": 1}', "stop")
    assert a[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in a + b)
    assert args == '{"a": 1}' and reason == "stop"
