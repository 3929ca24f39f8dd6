"""What eval harnesses and browsers send: echo with logprobs, prompt-only scoring,
prompt_logprobs, /tokenize and /detokenize, logit_bias, CORS, X-Request-Id."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
import torch

from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.engine.config import EngineConfig
from pagewarden.server.cors import CorsPolicy, CorsPolicyError
from tests.server.test_api import _Running

transformers = pytest.importorskip("transformers")

MODEL = "tiny"
PROMPT = "Hello world! The quick brown fox"
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    # 8-token chunks: a prompt is scored over several steps (chunked prefill).
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=8,
    )
    s = _Running(AsyncEngine(cfg))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def prompt_ids(srv) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 4 and body["max_model_len"] == 256
    return body["tokens"]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompt_ids) -> torch.Tensor:
    """log_softmax of a float32 transformers forward: row i scores token i + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)


def _post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def test_echo_scores_the_prompt_only(client, prompt_ids, reference):
    """lm-evaluation-harness's loglikelihood request."""
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) == len(lp.token_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(prompt_ids)):
        want = float(reference[i - 1, prompt_ids[i]])
        assert abs(lp.token_logprobs[i] - want) < TOLERANCE, i
        assert len(lp.top_logprobs[i]) == 1
        (best_lp,) = lp.top_logprobs[i].values()
        assert abs(best_lp - float(reference[i - 1].max())) < TOLERANCE


def test_echo_with_generation_puts_the_prompt_first(client, prompt_ids, reference):
    out = client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        echo=True,
        logprobs=2,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3 and out.usage.completion_tokens == 3
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert abs(lp.token_logprobs[1] - float(reference[0, prompt_ids[1]])) < TOLERANCE
    assert lp.text_offset[len(prompt_ids)] == len(PROMPT)


def test_vllm_prompt_logprobs(srv, prompt_ids, reference):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for i in range(1, len(prompt_ids)):
        entry = plp[i][str(prompt_ids[i])]
        assert abs(entry["logprob"] - float(reference[i - 1, prompt_ids[i]])) < TOLERANCE
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        ranked = sorted(plp[i].values(), key=lambda e: e["rank"])
        assert ranked[0]["rank"] == 1 and 2 <= len(plp[i]) <= 3


def test_echo_streamed(srv, prompt_ids):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 0,
        "max_tokens": 0,
        "stream": True,
    }
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == PROMPT
    assert chunks[-1]["finish_reason"] == "length"
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert len(tokens) == len(prompt_ids) and tokens[0] is None


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt_logprobs": 21}, "prompt_logprobs"),  # --max-logprobs
        ({"echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_scoring_limits(srv, extra, param):
    r = _post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_messages_and_detokenize(srv, prompt_ids):
    msgs = [{"role": "user", "content": "hi there"}]
    r = _post(srv, "/tokenize", {"messages": msgs, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    chat = _post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert body["count"] == chat.json()["usage"]["prompt_tokens"]  # the prompt chat runs
    text = _post(srv, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert "hi there" in text
    assert _post(srv, "/detokenize", {"model": MODEL, "tokens": prompt_ids}).json() == {
        "prompt": PROMPT
    }


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenize_bad_input(srv, path, body, param):
    r = _post(srv, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_logit_bias(client, srv):
    kw = dict(model=MODEL, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
    forced = client.completions.create(temperature=0, logit_bias={"42": 100}, logprobs=0, **kw)
    assert [t for t in _token_ids(srv, forced)] == [42] * 4
    sampled = client.completions.create(temperature=1.0, seed=5, logit_bias={42: 100}, **kw)
    assert _ids_of(srv, sampled.choices[0].text) == [42] * 4 or sampled.choices[0].text == (
        forced.choices[0].text
    )
    plain = client.completions.create(temperature=0, logprobs=0, **kw)
    first = _token_ids(srv, plain)[0]
    banned = client.completions.create(
        temperature=0, logit_bias={str(first): -100}, logprobs=0, **kw
    )
    assert _token_ids(srv, banned)[0] != first


def _token_ids(srv, completion) -> list[int]:
    return _ids_of(srv, "".join(completion.choices[0].logprobs.tokens))


def _ids_of(srv, text: str) -> list[int]:
    return _post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]


@pytest.mark.parametrize(
    "bias",
    [{"abc": 1}, {"1": 101}, {"999999": 1}, {str(i): 1 for i in range(301)}, {"1": "x"}],
)
def test_logit_bias_is_validated(srv, bias):
    r = _post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": bias})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("logit_bias")


def test_cors_preflight_and_simple_requests(srv):
    origin = {"Origin": "https://app.example"}
    r = httpx.options(
        srv.url + "/v1/chat/completions",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in r.headers
    r = httpx.get(srv.url + "/v1/models", headers=origin)
    assert r.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_cors_never_pairs_credentials_with_any_origin():
    with pytest.raises(CorsPolicyError):
        CorsPolicy(allow_credentials=True)
    CorsPolicy(allowed_origins=("https://a.example",), allow_credentials=True)


def test_x_request_id_is_echoed(srv):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = _post(srv, "/v1/completions", body, headers={"X-Request-Id": "eval-42.a:b"})
    assert r.headers["x-request-id"] == "eval-42.a:b"
    assert r.json()["id"] == "cmpl-eval-42.a:b"
    for bad in ("has space", "x" * 200, "ünï"):
        r = _post(srv, "/v1/completions", body, headers={"X-Request-Id": bad.encode()})
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert rid != bad and len(rid) == 32 and r.json()["id"] == f"cmpl-{rid}"
    r = _post(srv, "/v1/completions", {"prompt": 5})  # errors carry it too
    assert r.status_code == 400 and len(r.headers["x-request-id"]) == 32


def test_the_same_request_id_twice_at_once(srv):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
    headers = {"X-Request-Id": "dup"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rs = list(
            pool.map(lambda _: _post(srv, "/v1/completions", body, headers=headers), range(4))
        )
    assert [r.status_code for r in rs] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in rs)


def test_chat_prompt_logprobs(srv):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 1,
        "prompt_logprobs": 1,
    }
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    assert all(entry and all(e["logprob"] <= 0 for e in entry.values()) for entry in plp[1:])


def test_chat_echo_puts_the_last_assistant_message_first(client):
    """vLLM's chat echo: the last message's content before the reply when that message
    is the assistant's (the model continues it), streamed and not, for every choice."""
    lead = "The answer, in short, is"
    msgs = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": lead}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=5, temperature=0, n=2)
    plain = client.chat.completions.create(**kw)
    echoed = client.chat.completions.create(extra_body={"echo": True}, **kw)
    assert [c.message.content for c in echoed.choices] == [
        lead + c.message.content for c in plain.choices
    ]
    assert echoed.usage == plain.usage
    streamed = ["", ""]
    for chunk in client.chat.completions.create(stream=True, extra_body={"echo": True}, **kw):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [c.message.content for c in echoed.choices]
    # the last message is the user's: nothing to echo
    user_last = dict(kw, messages=msgs[:1])
    a = client.chat.completions.create(extra_body={"echo": True}, **user_last)
    b = client.chat.completions.create(**user_last)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"logprobs": True}, "echo with logprobs"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "echo cannot be combined with tool calls",
        ),
    ],
)
def test_chat_echo_refuses_what_it_cannot_serve(srv, extra, needle):
    body = {
        "model": MODEL,
        "messages": [{"role": "assistant", "content": "Once"}],
        "echo": True,
        "max_tokens": 2,
        **extra,
    }
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "echo"
