"""Structured outputs and tool calls against a real ``pagewarden serve`` on the default
model, through the ``openai`` package and ``instructor`` (clients we did not write)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def srv(serve_proc):
    return serve_proc


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _chat(client, srv, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Describe a person as JSON."}])
    return client.chat.completions.create(model=srv.model, **kw)


def test_json_schema_every_output_validates_at_temperature_1(client, srv):
    """100% of 32 samples at temperature 1.0 parse and validate (n=8, four requests)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    texts = []
    for seed in range(4):
        r = _chat(client, srv, response_format=fmt, temperature=1.0, n=8, seed=seed, max_tokens=200)
        for c in r.choices:
            assert c.finish_reason == "stop", c
            texts.append(c.message.content)
    assert len(texts) == 32
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)


def test_every_source_and_sampling_setting_on_completions(client, srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    sources = [
        {"response_format": fmt},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json": PERSON}},
        {"guided_json": PERSON},
    ]
    sampling = dict(
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logprobs=2,
        seed=3,
    )
    for extra in sources:
        r = client.completions.create(
            model=srv.model,
            prompt="A person as JSON:",
            max_tokens=200,
            n=2,
            extra_body=extra,
            **{
                k: v
                for k, v in sampling.items()
                if k
                in (
                    "temperature",
                    "top_p",
                    "logprobs",
                    "seed",
                    "presence_penalty",
                    "frequency_penalty",
                )
            },
        )
        for c in r.choices:
            if "json_object" in json.dumps(extra):
                # any object: its strings may run past max_tokens; a finished one parses
                assert c.finish_reason in ("stop", "length")
                if c.finish_reason == "stop":
                    assert isinstance(json.loads(c.text), dict)
                continue
            assert c.finish_reason == "stop", (extra, c)
            jsonschema.validate(json.loads(c.text), PERSON)
    # vLLM's sampling extensions ride in extra_body
    r = client.completions.create(
        model=srv.model,
        prompt="Pick:",
        max_tokens=10,
        n=3,
        extra_body={
            "structured_outputs": {"choice": ["red", "green", "blue"]},
            "top_k": 50,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
        },
    )
    assert {c.text for c in r.choices} <= {"red", "green", "blue"}


def test_regex_choice_grammar_and_aliases(client, srv):
    cases = [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, r"^[0-9]{3}-[0-9]{4}$"),
        ({"guided_regex": r"(yes|no)"}, r"^(yes|no)$"),
        ({"guided_choice": ["alpha", "beta"]}, r"^(alpha|beta)$"),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, r"^x[0-9]{2}$"),
        ({"guided_grammar": 'root ::= ("ab" | "cd") ("ab" | "cd")? "!"'}, r"^(ab|cd){1,2}!$"),
    ]
    import re

    for extra, pattern in cases:
        r = _chat(client, srv, temperature=1.0, n=3, max_tokens=40, extra_body=extra)
        for c in r.choices:
            assert c.finish_reason == "stop", (extra, c)
            assert re.match(pattern, c.message.content), (extra, c.message.content)


def test_streamed_equals_constraint(client, srv):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    stream = _chat(
        client, srv, response_format=fmt, temperature=1.0, n=2, max_tokens=200, stream=True
    )
    texts = ["", ""]
    reasons = [None, None]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert reasons == ["stop", "stop"]
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)


def test_length_cut_is_finish_reason_length(client, srv):
    r = _chat(client, srv, response_format={"type": "json_object"}, max_tokens=3)
    assert r.choices[0].finish_reason == "length"


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


def test_openai_parse_with_pydantic_model(client, srv):
    r = client.chat.completions.parse(
        model=srv.model,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        max_tokens=200,
        temperature=1.0,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)


def test_instructor(srv):
    import instructor  # in the test extra

    ic = instructor.from_openai(
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0),
        mode=instructor.Mode.JSON_SCHEMA,
    )
    person = ic.chat.completions.create(
        model=srv.model,
        response_model=Person,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=200,
        max_retries=0,
    )
    assert isinstance(person, Person)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                }
            },
            "schema",
        ),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"guided_json": {"not": {"type": "string"}}}, "not"),
        ({"guided_regex": "(ab"}, "regex"),
        ({"structured_outputs": {"grammar": 'root ::= "a" | b'}}, "grammar"),
        ({"guided_choice": []}, "choice"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "at most one"),
        ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "outlines"),
    ],
)
def test_bad_specs_are_400_naming_the_problem(srv, extra, needle):
    body = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


# ---- tools ---------------------------------------------------------------------------


def test_named_tool_choice_forces_valid_arguments(client, srv):
    r = _chat(
        client,
        srv,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        n=4,
        max_tokens=100,
    )
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(
            json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"]
        )


def test_required_tool_choice_and_parallel_calls(client, srv):
    schemas = {
        t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)
    }
    for parallel in (False, True):
        r = _chat(
            client,
            srv,
            messages=[{"role": "user", "content": "Weather in Paris and the time in UTC?"}],
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=1.0,
            seed=1,
            n=4,
            max_tokens=300,
        )
        finished = [c for c in r.choices if c.finish_reason == "tool_calls"]
        # one call at most is a bounded grammar: it always finishes; a list of calls may
        # run past max_tokens (finish_reason "length", no calls parsed)
        assert len(finished) == 4 if not parallel else len(finished) >= 1, r.choices
        for c in r.choices:
            assert c.finish_reason in ("tool_calls", "length")
        for c in finished:
            assert c.message.tool_calls and (parallel or len(c.message.tool_calls) == 1)
            for call in c.message.tool_calls:
                args = json.loads(call.function.arguments)
                jsonschema.validate(args, schemas[call.function.name])


def test_streamed_tool_calls_assemble(client, srv):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        stream = _chat(
            client,
            srv,
            messages=[{"role": "user", "content": "What time is it in UTC?"}],
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=choice,
            max_tokens=200,
            temperature=1.0,
            stream=True,
        )
        calls: dict[int, dict] = {}
        reason = None
        for chunk in stream:
            for ch in chunk.choices:
                reason = ch.finish_reason or reason
                for tc in ch.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function.name:
                        slot["name"] = tc.function.name
                    slot["arguments"] += tc.function.arguments or ""
        assert calls, choice
        for call in calls.values():
            json.loads(call["arguments"])
        assert reason == ("tool_calls" if choice == "required" else "stop")


def _streamed_calls(stream) -> tuple[str, list[tuple[str, str]], str | None, int]:
    """(content, calls, finish reason, argument deltas) of a streamed choice, checking
    the order vLLM streams in: a call's first delta has id, type, name and empty
    arguments; the next ones carry only argument text."""
    content, calls, reason, n_arg_deltas = "", {}, None, 0
    for chunk in stream:
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function"
                    assert tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.function.name is None and tc.function.arguments
                    calls[tc.index][1] += tc.function.arguments
                    n_arg_deltas += 1
    assert sorted(calls) == list(range(len(calls)))
    return content, [(n, a) for n, a in calls.values()], reason, n_arg_deltas


# The hermes format, forced by a regex so that the small model writes it (tool_choice
# auto reads the model's own text back with the hermes parser).
HERMES_REGEX = (
    r"Checking\. <tool_call>\n"
    r'\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", '
    r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>\n<tool_call>\n'
    r'\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
)


@pytest.mark.parametrize(
    "choice,extra",
    [
        ("required", {"parallel_tool_calls": False}),
        ("required", {}),
        ({"type": "function", "function": {"name": "get_weather"}}, {}),
        ("auto", {"extra_body": {"structured_outputs": {"regex": HERMES_REGEX}}}),
    ],
)
def test_streamed_tool_call_arguments_equal_the_non_streamed_ones(client, srv, choice, extra):
    """Same seed, streamed and not: the argument deltas add up to exactly the
    non-streamed arguments, and they arrive in pieces as they are generated."""
    kw = dict(
        messages=[{"role": "user", "content": "Weather in Paris and the time in UTC?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=choice,
        temperature=1.0,
        seed=11,
        max_tokens=200,
        **extra,
    )
    whole = _chat(client, srv, **kw).choices[0]
    assert whole.message.tool_calls, whole
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    content, calls, reason, n_arg_deltas = _streamed_calls(_chat(client, srv, stream=True, **kw))
    assert calls == expected
    assert reason == whole.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
    assert n_arg_deltas > len(calls)  # streamed in pieces, not whole at the end
    if choice == "auto":
        assert [n for n, _ in calls] == ["get_weather", "get_time"]
        assert content == "Checking. " and whole.message.content == "Checking."
    else:
        assert not content and whole.message.content is None
    if extra.get("parallel_tool_calls") is False:
        assert len(calls) == 1


def test_agent_loop_history_renders(client, srv):
    """An assistant message with content null + tool_calls and a tool result replay."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = _chat(
        client,
        srv,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content is not None
    assert r.usage.prompt_tokens > 60  # the tools and the call are in the prompt
    # /tokenize renders the same prompt, tools and calls included
    t = httpx.post(
        srv.url + "/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]}, timeout=60
    )
    assert t.status_code == 200 and t.json()["count"] == r.usage.prompt_tokens, t.text


def test_auto_tool_choice_parses_hermes_calls(client, srv):
    """With tool_choice auto the model's <tool_call> output becomes tool_calls; forced
    here by a grammar on completions, then parsed by the hermes parser on chat."""
    r = _chat(
        client,
        srv,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=60,
        temperature=0,
    )
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        json.loads(c.message.tool_calls[0].function.arguments)
    else:
        assert c.message.content is not None


def test_legacy_functions_map_to_tools(client, srv):
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": srv.model,
            "messages": [{"role": "user", "content": "Time in UTC?"}],
            "functions": [TIME_TOOL["function"]],
            "function_call": {"name": "get_time"},
            "max_tokens": 40,
        },
    )
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")


def test_tool_errors(srv):
    base = {"model": srv.model, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"messages": [{"role": "assistant", "content": None}]}, "content"),
    ]
    for extra, needle in cases:
        r = httpx.post(srv.url + "/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_langchain_chat_openai(srv):
    """LangChain's ChatOpenAI (langchain-openai, in the test extra): invoke, stream,
    bind_tools with a tool-call round trip (the AI message's calls replayed with null
    content, then the tool's result), a streamed required call, with_structured_output."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    sent: list[dict] = []  # the request bodies ChatOpenAI sends

    def keep(request: httpx.Request) -> None:
        sent.append(json.loads(request.read()))

    llm = ChatOpenAI(
        base_url=srv.url + "/v1",
        api_key="x",
        model=srv.model,
        temperature=0,
        max_tokens=12,
        max_retries=0,
        timeout=300,
        http_client=httpx.Client(event_hooks={"request": [keep]}, timeout=300),
    )
    said = llm.invoke("Say hi").content
    assert said and "".join(c.content for c in llm.stream("Say hi")) == said

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    question = HumanMessage("What is the weather in Paris?")
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    replay = [question, ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather]).invoke(replay)
    assert final.content or final.tool_calls
    _, assistant, result = sent[-1]["messages"]
    assert assistant["content"] is None and assistant["tool_calls"][0]["id"] == call["id"]
    assert result == {
        "role": "tool",
        "content": f"sunny in {call['args']['city']}",
        "tool_call_id": call["id"],
    }

    required = llm.bind_tools([get_weather], tool_choice="any").bind(max_tokens=60)
    chunks = list(required.stream([question]))
    assembled = chunks[0]
    for c in chunks[1:]:
        assembled += c
    assert [c["name"] for c in assembled.tool_calls] == ["get_weather"]
    assert sum(1 for c in chunks if c.tool_call_chunks) > 2  # the arguments came in pieces

    for method in ("json_schema", "function_calling", "json_mode"):
        person = (
            llm.with_structured_output(Person, method=method)
            .bind(max_tokens=120)
            .invoke("Describe a person as JSON with a name and an age.")
        )
        assert isinstance(person, Person), method
