"""The server survives hostile single requests, engine death and engine stalls (issue 14)."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import httpx
import openai
import pytest

from pagewarden.sampling_params import SamplingParams
from tests.server.test_api import MODEL, _engine, _Running, _used_blocks

NORMAL = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    s = _Running(_engine(tiny_llama_dir, stall_timeout_s=3.0))
    yield s
    s.stop()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(r"^pagewarden:" + name + r"(\{[^}]*\})? (\S+)$", text, re.M)
    assert m, name
    return float(m.group(2))


def _post(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BIG = 2**64 + 5
CRASH_INPUTS = [
    ("/v1/completions", {**NORMAL, "logprobs": 100000}),
    ("/v1/completions", {**NORMAL, "logprobs": BIG}),
    ("/v1/completions", {**NORMAL, "logprobs": 21}),
    ("/v1/completions", {**NORMAL, "top_k": BIG, "temperature": 1.0}),
    ("/v1/completions", {**NORMAL, "top_k": 100000, "temperature": 1.0}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": BIG}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 100000}),
    ("/v1/completions", {**NORMAL, "min_tokens": 10**20}),
    ("/v1/completions", {**NORMAL, "max_tokens": None, "min_tokens": 1000}),
    ("/v1/completions", {**NORMAL, "n": BIG}),
    ("/v1/completions", {**NORMAL, "seed": BIG}),
    ("/v1/completions", {**NORMAL, "repetition_penalty": 1e-300, "temperature": 1.0}),
    ("/v1/completions", {**NORMAL, "temperature": 1e300}),
    ("/v1/completions", {**NORMAL, "stop_token_ids": [BIG]}),
    ("/v1/completions", {**NORMAL, "stop_token_ids": [100000]}),
    ("/v1/completions", {**NORMAL, "prompt": ["x"] * 2000}),
    ("/v1/completions", {**NORMAL, "prompt": [BIG]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}),
]


@pytest.mark.parametrize("path,body", CRASH_INPUTS)
def test_crash_input_is_400_and_the_engine_goes_on(srv, path, body):
    r = _post(srv.url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    ok = _post(srv.url, "/v1/completions", NORMAL)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_request_failing_in_the_engine_fails_alone(srv, monkeypatch):
    """A request that slips past the front door and would break the sampler gets
    finish_reason "error" from the engine core; the engine keeps serving."""
    import asyncio

    import pagewarden.engine.async_engine as ae

    bad = SamplingParams(max_tokens=4, temperature=1.0, logprobs=2)
    bad.logprobs = 10**6  # past the vocabulary (topk raises), behind the front door
    monkeypatch.setattr(ae, "check_request", lambda *a: None)

    async def run() -> list[str | None]:
        stream = await srv.engine.add_request("bad-1", [5, 6, 7], bad)
        return [c.finish_reason async for out in stream for c in out.outputs]

    assert asyncio.run(run()) == ["error"]
    monkeypatch.undo()
    assert _post(srv.url, "/v1/completions", NORMAL).status_code == 200
    assert _used_blocks(srv.url) == 0


def _wait_health(url: str, status: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(url + "/health", timeout=5).status_code == status:
            return
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {status}")


def _kill_mid_request(srv, sig: int) -> httpx.Response:
    import concurrent.futures

    long = {**NORMAL, "max_tokens": 200, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_post, srv.url, "/v1/completions", long, 120)
        deadline = time.time() + 30
        while srv.engine.num_in_flight == 0 and time.time() < deadline:
            time.sleep(0.01)
        os.kill(srv.engine.client.pid, sig)
        return fut.result()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_engine_death_or_stall_is_survived(srv, sig):
    """SIGKILL: the engine dies; SIGSTOP: it stalls with work pending (3 s timeout here).
    Either way the in-flight request fails with 503 and a message, /health is 503 until
    the restarted engine is up, and the server serves again."""
    before = _metric(srv.url, "engine_restarts_total")
    old_pid = srv.engine.client.pid
    r = _kill_mid_request(srv, sig)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "engine core" in message
    if sig == signal.SIGKILL:
        assert "killed by SIGKILL" in message
    # The new process needs seconds to import torch and load: /health says so meanwhile.
    assert httpx.get(srv.url + "/health").status_code == 503
    _wait_health(srv.url, 200)
    assert srv.engine.client.pid != old_pid
    assert _metric(srv.url, "engine_restarts_total") == before + 1
    ok = _post(srv.url, "/v1/completions", NORMAL)
    assert ok.status_code == 200, ok.text
    assert _used_blocks(srv.url) == 0


def test_openai_client_fields_are_accepted(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        reasoning_effort="low",
        modalities=["text"],
        prompt_cache_key="k",
        safety_identifier="s",
        metadata={"a": "b"},
        store=False,
        service_tier="auto",
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    c = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, extra_body={"prompt_cache_key": "k"}
    )
    assert c.choices[0].text is not None


def test_openapi_documents_request_bodies(srv):
    spec = httpx.get(srv.url + "/openapi.json").json()
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert "prompt" in json_props(body["schema"]) or "messages" in json_props(body["schema"])
        assert model in spec["components"]["schemas"]
    assert "ChatMessage" in spec["components"]["schemas"]


def json_props(schema: dict) -> dict:
    return schema.get("properties", {})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_client_disconnect_mid_body_logs_no_traceback(srv):
    import socket

    # uvicorn's loggers do not propagate to the root logger (caplog would see nothing).
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "pagewarden")]
    for lg in loggers:
        lg.addHandler(handler)
    port = int(srv.url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model": '
            )
            time.sleep(0.2)
        time.sleep(0.5)
        assert _post(srv.url, "/v1/completions", NORMAL).status_code == 200
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert not [r for r in handler.records if r.exc_info], [r.getMessage() for r in handler.records]
