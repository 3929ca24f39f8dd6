"""Chat templates that render tools themselves get the request's ``tools`` and tool-call
history exactly as transformers' ``apply_chat_template(tools=...)`` gives them; a
template that ignores tools gets them in the Hermes format instead (server/tools.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagewarden.models.tokenizer import Tokenizer
from pagewarden.server.chat import render_prompt
from pagewarden.server.protocol import ChatCompletionRequest
from pagewarden.server.tools import ToolConfig, plan_tools
from tests.conftest import CHAT_TEMPLATE, make_tiny_tokenizer

transformers = pytest.importorskip("transformers")

# In the style of Qwen2.5's template: the tools as JSON lines in the system prompt, past
# calls as <tool_call> blocks, consecutive tool results in one user turn.
QWEN_STYLE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nFunction signatures, one per line:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nCall a function as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# In the style of Llama 3.1's template: "Environment: ipython", the tools as indented JSON
# in the first user turn, calls as {"name", "parameters"}, tool results as ipython turns.
LLAMA_STYLE = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content | trim %}{%- set rest = messages[1:] %}
{%- else %}
    {%- set system = '' %}{%- set rest = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- system + '<|eot_id|>' }}
{%- if tools is not none %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\nAnswer with a JSON function call {"name": ..., "parameters": ...}.\n\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) + '\n\n' }}{%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for m in rest %}
    {%- if m.role in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if m.content is mapping %}{{- m.content | tojson }}{%- else %}{{- m.content }}{%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif m.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for c in m.tool_calls %}
            {{- '{"name": "' + c.function.name + '", "parameters": ' + c.function.arguments | tojson + '}' }}
            {%- if not loop.last %}{{- '; ' }}{%- endif %}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Ignores tools, though it names tool_calls in a comment (the old test read the text).
COMMENT_ONLY = "{# tool_calls are not rendered #}" + CHAT_TEMPLATE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
    },
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "user", "content": "And tomorrow?"},
]


def _tokenizer_dir(tmp_path: Path, template: str) -> Path:
    make_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template})
    )
    return tmp_path


def _ours(path: Path, tool_choice: str = "auto", messages=MESSAGES) -> str:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": TOOLS, "tool_choice": tool_choice}
    )
    plan = plan_tools(req, ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    ctx = SimpleNamespace(tokenizer=Tokenizer.from_hf_dir(path))
    text, ids = render_prompt(req, ctx, plan)
    assert text is not None and ids
    return text


def _transformers(path: Path, messages=MESSAGES) -> str:
    """What transformers renders for the messages as vLLM hands them to a template:
    a call's arguments parsed into a dict."""
    messages = json.loads(json.dumps(messages))
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("template", [QWEN_STYLE, LLAMA_STYLE], ids=["qwen2.5", "llama3.1"])
def test_native_tool_templates_render_as_transformers(tmp_path, template):
    path = _tokenizer_dir(tmp_path, template)
    ours = _ours(path)
    assert ours == _transformers(path)
    assert '"get_time"' in ours and "Paris" in ours  # the tools and the history are in it
    assert "You may call one or more functions" not in ours  # no Hermes fallback
    # tool_choice none keeps the tools in the prompt, as vLLM does
    assert _ours(path, tool_choice="none") == ours


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, COMMENT_ONLY], ids=["plain", "comment"])
def test_templates_that_ignore_tools_get_the_hermes_format(tmp_path, template):
    path = _tokenizer_dir(tmp_path, template)
    ours = _ours(path)
    assert ours != _transformers(path)  # transformers would drop the tools silently
    assert "You may call one or more functions" in ours
    for tool in TOOLS:
        assert json.dumps(tool) in ours
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in ours
    )
    assert "<tool_response>\n12:00\n</tool_response>" in ours
