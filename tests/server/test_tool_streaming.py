"""Streamed tool calls in the Llama 3 JSON format (``--tool-call-parser llama3_json``)
through the ``openai`` client, on a tiny model whose output a regex forces into that
format: the streamed calls equal the non-streamed ones for the same seed."""

from __future__ import annotations

import openai
import pytest
from test_api import MODEL, _Running

from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.engine.config import EngineConfig
from pagewarden.server.tools import ToolConfig

LLAMA3_REGEX = (
    r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{2,8}"\}\}; '
    r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'
)
# Renders tools itself, briefly: the Hermes prompt would not fit the tiny model's context.
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}},
        },
    }
    for name, arg in (("get_weather", "city"), ("get_time", "zone"))
]


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    # The C++ kernels are not under test here (their first build takes minutes).
    env = pytest.MonkeyPatch()
    env.setenv("PAGEWARDEN_NO_CPU_EXT", "1")
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        chat_template=TEMPLATE,
    )
    s = _Running(AsyncEngine(cfg), tool_config=ToolConfig(True, "llama3_json"))
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    s.stop()
    env.undo()


def test_llama3_json_calls_stream_as_the_whole_response(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris and the time?"}],
        tools=TOOLS,
        tool_choice="auto",
        temperature=1.0,
        seed=5,
        max_tokens=120,
        extra_body={"structured_outputs": {"regex": LLAMA3_REGEX}},
    )
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [n for n, _ in expected] == ["get_weather", "get_time"]
    calls: dict[int, list[str]] = {}
    content, reason, pieces = "", None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reason = ch.finish_reason or reason
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, tc.function.arguments]
                else:
                    calls[tc.index][1] += tc.function.arguments
                    pieces += 1
    assert [tuple(v) for _, v in sorted(calls.items())] == expected
    assert content == "" and reason == "tool_calls" and pieces > 2
