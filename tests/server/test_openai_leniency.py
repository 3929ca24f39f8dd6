"""What the OpenAI API and vLLM accept: explicit nulls, unknown fields, model names."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.engine.config import EngineConfig
from pagewarden.server.model_names import (
    DEFAULT_SERVED_NAME,
    ServedNameError,
    served_names,
)
from tests.server.test_api import _Running

NAMES = ["tiny", "tiny-alias"]


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        block_size=16,
        max_model_len=256,
    )
    s = _Running(AsyncEngine(cfg), served=NAMES)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_explicit_nulls_mean_defaults(client):
    out = client.completions.create(
        model="tiny",
        prompt="hello",
        max_tokens=3,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
        stop=None,
        seed=None,
        temperature=None,
        top_p=None,
        echo=None,
        best_of=None,
        stream=None,
        extra_body={"ignore_eos": None, "min_tokens": None, "repetition_penalty": None},
    )
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        n=None,
        logprobs=None,
        top_logprobs=None,
        presence_penalty=None,
        stop=None,
        seed=None,
        stream_options=None,
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None


def test_nested_nulls_and_stream_options(srv):
    r = _post(
        srv,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None},
        },
    )
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")


def test_unknown_fields_accepted_and_logged_once(srv, caplog):
    caplog.set_level(logging.WARNING, logger="pagewarden.server")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "some_new_field_xyz": {"a": 1}}
    for _ in range(3):
        assert _post(srv, "/v1/completions", body).status_code == 200
    logged = [r for r in caplog.records if "some_new_field_xyz" in r.getMessage()]
    assert len(logged) == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", "2"),  # strict types: no string-to-int coercion
        ("temperature", "0.5"),
        ("n", 1.5),
        ("max_tokens", True),
        ("stop", 3),
        ("seed", 2**64),
        ("top_p", 0),
        ("presence_penalty", 5),
    ],
)
def test_known_fields_stay_strict(srv, field, value):
    r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "hi", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field


def test_required_fields_cannot_be_null(srv):
    r = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "path,extra,param",
    [
        # tools are a chat feature: on completions they would be silently dropped
        ("/v1/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
def test_unimplemented_features_are_refused_not_ignored(srv, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update(
        {"prompt": "hi"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = _post(srv, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_harmless_values_of_unimplemented_fields_pass(srv):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "guided_json": None,
    }
    assert _post(srv, "/v1/chat/completions", body).status_code == 200


def test_every_alias_works_and_is_echoed(client, srv):
    for name in NAMES:
        out = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert out.model == name
    assert [m.id for m in client.models.list().data] == NAMES


def test_model_may_be_omitted(srv):
    r = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    r = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    r = _post(srv, "/v1/completions", {"model": None, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_unknown_model_404_lists_served_names(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    message = info.value.body["message"]
    assert "`gpt-4`" in message and "`tiny`" in message and "`tiny-alias`" in message


def test_served_names():
    assert served_names(None, None, "Smollm2 135M") == [DEFAULT_SERVED_NAME, "Smollm2 135M"]
    assert served_names(None, "models/foo.Q4_K_M.gguf", "x") == [
        "models/foo.Q4_K_M.gguf",
        "foo.Q4_K_M",
    ]
    assert served_names(None, "/data/llama/", "x") == ["/data/llama/", "llama"]
    assert served_names(None, "tiny", "x") == ["tiny"]
    assert served_names(["a", "b", "a"], "p", "x") == ["a", "b"]
    for bad in ([" "], ["x" * 300]):
        with pytest.raises(ServedNameError):
            served_names(bad, None, "x")
