"""Responses streaming events from chat deltas (server/responses_stream.py): items open
and close in output order, arguments stream as deltas, the closed items repeat them."""

from __future__ import annotations

import json

from pagewarden.server.responses_stream import EventWriter, OutputStream


def _bodies(events: list[str]) -> list[dict]:
    out = []
    for e in events:
        kind, data = e.strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == "event: " + body["type"]
        out.append(body)
    return out


def test_content_then_two_calls():
    ev = EventWriter()
    stream = OutputStream(ev)
    head = {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    events = stream.feed([{"content": "Sure. "}, {"content": "Calling."}, {"tool_calls": [head]}])
    events += stream.feed([{"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]}])
    events += stream.feed([{"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}])
    second = {**head, "index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}
    events += stream.feed([{"tool_calls": [second]}]) + stream.close()
    bodies = _bodies(events)
    assert [b["type"] for b in bodies] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    added = bodies[7]["item"]
    assert added == {
        "type": "function_call",
        "id": added["id"],
        "call_id": "call_a",
        "name": "f",
        "arguments": "",
        "status": "in_progress",
    }
    assert [b["delta"] for b in bodies[8:10]] == ['{"x": ', "1}"]
    assert {b["output_index"] for b in bodies[7:12]} == {1}
    assert bodies[10]["arguments"] == '{"x": 1}' and bodies[10]["item_id"] == added["id"]
    msg, call_a, call_b = stream.items
    assert msg["content"][0]["text"] == "Sure. Calling." and msg["id"] == bodies[0]["item"]["id"]
    assert call_a == {**added, "arguments": '{"x": 1}', "status": "completed"}
    assert bodies[11]["item"] == call_a
    assert (call_b["call_id"], call_b["name"], call_b["arguments"]) == ("call_b", "g", "{}")
    assert bodies[15]["output_index"] == 2


def test_an_empty_message_still_opens_and_closes():
    stream = OutputStream(EventWriter())
    bodies = _bodies(stream.start_message() + stream.close())
    assert [b["type"] for b in bodies][-1] == "response.output_item.done"
    assert stream.items[0]["content"][0]["text"] == "" and stream.close() == []
