"""End-to-end tests of the OpenAI-compatible server with the tiny random Llama."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.engine.config import EngineConfig
from pagewarden.server.api import build_app

MODEL = "tiny"


class _Running:
    def __init__(self, engine: AsyncEngine, api_key: str | None = None) -> None:
        self.engine = engine
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine, MODEL, api_key),
                                                    host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


def _engine(model_dir, **kw) -> AsyncEngine:
    cfg = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=16,
                       max_model_len=256)
    return AsyncEngine(cfg, **kw)


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    s = _Running(_engine(tiny_llama_dir))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _used_blocks(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r'^pagewarden:kv_blocks_used\{[^}]*\} (\S+)$', text, re.M).group(1))


def test_completion_stream_equals_nonstream(client):
    kw = dict(model=MODEL, prompt="hello world", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_and_n_and_seed(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 0
    kw = dict(model=MODEL, prompt="abc", max_tokens=8, n=3, temperature=1.0, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert len(a.choices) == 3
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_endpoints(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert "pagewarden:num_requests_running" in httpx.get(srv.url + "/metrics").text


@pytest.mark.parametrize("body,status", [
    (b"{not json", 400),
    (b'\xff\xfe{"model": "tiny"}', 400),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', 400),
    (b'{"model": "tiny", "prompt": "x", "bogus": 1}', 400),
    (b'{"model": "tiny", "prompt": ""}', 400),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400),
    (b'{"model": "tiny", "prompt": "x", "temperature": -1}', 400),
    (b'{"model": "tiny", "prompt": "x", "top_p": 0}', 400),
    (b'{"model": "tiny", "prompt": "x", "n": 100}', 400),
    (b'{"model": "nope", "prompt": "x"}', 404),
    (b'{"model": "tiny", "prompt": "x", "user": "u1", "max_tokens": 2}', 200),
])
def test_bad_inputs(srv, body, status):
    r = httpx.post(srv.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_long_prompt_400(srv):
    r = httpx.post(srv.url + "/v1/completions",
                   json={"model": MODEL, "prompt": list(range(1, 300)), "max_tokens": 1})
    assert r.status_code == 400


def test_body_too_large_413(srv):
    r = httpx.post(srv.url + "/v1/completions", content=b"x" * (100 * 1024 * 1024))
    assert r.status_code == 413


def test_disconnect_frees_blocks(srv):
    with httpx.stream("POST", srv.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 200,
                            "ignore_eos": True, "stream": True}) as r:
        for _ in r.iter_lines():
            break
    deadline = time.time() + 10
    while _used_blocks(srv.url) != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert _used_blocks(srv.url) == 0


def test_concurrent_streams_match(srv, client):
    prompts = [f"prompt number {i}" for i in range(64)]
    want = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                         temperature=0).choices[0].text for p in prompts}

    async def one(ac: openai.AsyncOpenAI, p: str) -> str:
        s = await ac.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                        stream=True)
        return "".join([c.choices[0].text async for c in s if c.choices])

    async def main() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(ac, p) for p in prompts))

    got = asyncio.run(main())
    assert got == [want[p] for p in prompts]


def test_api_key_and_429(tiny_llama_dir):
    s = _Running(_engine(tiny_llama_dir, max_waiting_requests=1), api_key="k1")
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 401
        h = {"Authorization": "Bearer k1"}
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            codes = list(ex.map(lambda _: httpx.post(s.url + "/v1/completions", json=body,
                                                     headers=h, timeout=60), range(16)))
        statuses = {r.status_code for r in codes}
        assert statuses <= {200, 429} and 429 in statuses
        assert any("retry-after" in r.headers for r in codes if r.status_code == 429)
    finally:
        s.stop()

