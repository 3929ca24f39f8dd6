"""``/v1/responses`` against a real ``pagewarden serve`` through ``client.responses``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.test_structured_outputs import PERSON, WEATHER_TOOL


@pytest.fixture(scope="module")
def srv(serve_proc):
    return serve_proc


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_text_input_instructions_and_max_output_tokens(client, srv):
    r = client.responses.create(
        model=srv.model,
        input="Say hello.",
        instructions="Answer in French.",
        max_output_tokens=5,
        temperature=0,
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 5
    assert r.usage.input_tokens > 5


def test_message_input_completes(client, srv):
    r = client.responses.create(
        model=srv.model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Pick one."}]}],
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
        max_output_tokens=200,
        temperature=1.0,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_streaming_events_end_in_completed(client, srv):
    events = list(
        client.responses.create(
            model=srv.model,
            input="Count to three.",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = client.responses.create(
        model=srv.model,
        input="Say hi",
        max_output_tokens=200,
        temperature=0,
        stream=True,
        text={"format": {"type": "json_object"}},
    )
    assert [e.type for e in done][-1] == "response.completed"


def test_function_tools_and_tool_results(client, srv):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    r = client.responses.create(
        model=srv.model,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=100,
        temperature=1.0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["function"]["parameters"])
    follow = client.responses.create(
        model=srv.model,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": calls[0].name,
                "arguments": calls[0].arguments,
            },
            {
                "type": "function_call_output",
                "call_id": calls[0].call_id,
                "output": '{"temperature": 21}',
            },
        ],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.output_text


def _streamed_call(events: list) -> tuple:
    """The one function call streamed in ``events``: its added event, argument deltas,
    done event and done item; the events around it in Responses order."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    start = kinds.index("response.output_item.added")
    added = events[start]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert added.item.call_id.startswith("call_") and added.item.name == "get_weather"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = events[kinds.index("response.function_call_arguments.done")]
    item_done = events[kinds.index("response.output_item.done")]
    # the arguments stream between the item's added and done events, then it closes
    assert kinds[start + 1 : start + 1 + len(deltas)] == [d.type for d in deltas]
    assert kinds[start + 1 + len(deltas) :] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(e.item_id == added.item.id and e.output_index == 0 for e in deltas + [done])
    assert "".join(d.delta for d in deltas) == done.arguments == item_done.item.arguments
    assert item_done.item.call_id == added.item.call_id and item_done.item.status == "completed"
    final = events[-1].response.output
    assert len(final) == 1 and final[0].arguments == done.arguments
    assert final[0].call_id == added.item.call_id
    return added, deltas, done


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_streamed_function_call_arrives_in_pieces(client, srv, choice):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    events = list(
        client.responses.create(
            model=srv.model,
            input="Weather in Paris?",
            tools=[tool],
            tool_choice=choice,
            parallel_tool_calls=False,  # one call, then the stop token
            max_output_tokens=100,
            temperature=1.0,
            stream=True,
        )
    )
    added, deltas, done = _streamed_call(events)
    assert len(deltas) > 1  # generated over several steps, not sent whole
    jsonschema.validate(json.loads(done.arguments), WEATHER_TOOL["function"]["parameters"])


def test_stream_helper_assembles_the_call(client, srv):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    with client.responses.stream(
        model=srv.model,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=100,
        temperature=1.0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added, _, done = _streamed_call(events)
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id == added.item.call_id and call.arguments == done.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["function"]["parameters"])


def test_unsupported_is_400(srv):
    base = {"model": srv.model, "input": "hi"}
    for extra, needle in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": [{"type": "image", "url": "x"}]}, "image"),
    ]:
        r = httpx.post(srv.url + "/v1/responses", json={**base, **extra}, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
