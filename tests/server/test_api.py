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
from pagewarden.server.admission import AdmissionController
from pagewarden.server.api import build_app

MODEL = "tiny"


class _Running:
    def __init__(
        self,
        engine: AsyncEngine,
        api_key: str | list[str] | None = None,
        admission: bool = False,
        served: str | list[str] = MODEL,
        shutdown_engine: bool = True,
        **app_options,
    ) -> None:
        # ``served``: the model names; ``shutdown_engine``: stop() shuts the engine down
        # (False where several servers share one engine).
        # Most tests send more at once than the tiny pool's default admission limit;
        # tests of admission itself pass admission=True (the server's default).
        ctl = None if admission else AdmissionController(1, fixed_limit=1000)
        self.engine, self.shutdown_engine = engine, shutdown_engine
        self.server = uvicorn.Server(
            uvicorn.Config(
                build_app(engine, served, api_key, admission=ctl, **app_options),
                host="127.0.0.1",
                port=0,
                log_level="warning",
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        if self.shutdown_engine:
            self.engine.shutdown()


def _engine(model_dir, **kw) -> AsyncEngine:
    cfg = EngineConfig(
        model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=256
    )
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
    return float(re.search(r"^pagewarden:kv_blocks_used\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_completion_stream_equals_nonstream(client):
    kw = dict(
        model=MODEL,
        prompt="hello world",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # One chunk per generated token, including tokens whose text is held back (an
    # incomplete UTF-8 character): clients time tokens by chunks, as vLLM's bench does.
    assert len([c for c in chunks if c.choices]) == 12


def test_chat_and_n_and_seed(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 0
    kw = dict(model=MODEL, prompt="abc", max_tokens=8, n=3, temperature=1.0, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert len(a.choices) == 3
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_endpoints(srv):
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert "pagewarden:num_requests_running" in httpx.get(srv.url + "/metrics").text


@pytest.mark.parametrize(
    "body,status",
    [
        (b"{not json", 400),
        (b'\xff\xfe{"model": "tiny"}', 400),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', 400),
        (b'{"model": "tiny", "prompt": "x", "bogus": 1, "max_tokens": 2}', 200),  # logged
        (b'{"model": "tiny", "prompt": "x", "n": "2"}', 400),
        (b'{"model": "tiny", "prompt": null}', 400),
        (b'{"model": "tiny", "prompt": ""}', 400),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400),
        (b'{"model": "tiny", "prompt": "x", "temperature": -1}', 400),
        (b'{"model": "tiny", "prompt": "x", "top_p": 0}', 400),
        (b'{"model": "tiny", "prompt": "x", "n": 100}', 400),
        (b'{"model": "nope", "prompt": "x"}', 404),
        (b'{"model": "tiny", "prompt": "x", "user": "u1", "max_tokens": 2}', 200),
    ],
)
def test_bad_inputs(srv, body, status):
    r = httpx.post(
        srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    if status != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_long_prompt_400(srv):
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": MODEL, "prompt": list(range(1, 300)), "max_tokens": 1},
    )
    assert r.status_code == 400


def test_body_too_large_413(srv):
    r = httpx.post(
        srv.url + "/v1/completions",
        content=b"x" * (100 * 1024 * 1024),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413


def test_disconnect_frees_blocks(srv):
    with httpx.stream(
        "POST",
        srv.url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "hello",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        for _ in r.iter_lines():
            break
    deadline = time.time() + 10
    while _used_blocks(srv.url) != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert _used_blocks(srv.url) == 0


def test_concurrent_streams_match(srv, client):
    prompts = [f"prompt number {i}" for i in range(64)]
    want = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in prompts
    }

    async def one(ac: openai.AsyncOpenAI, p: str) -> str:
        s = await ac.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True
        )
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
            codes = list(
                ex.map(
                    lambda _: httpx.post(
                        s.url + "/v1/completions", json=body, headers=h, timeout=60
                    ),
                    range(16),
                )
            )
        statuses = {r.status_code for r in codes}
        assert statuses <= {200, 429} and 429 in statuses
        assert any("retry-after" in r.headers for r in codes if r.status_code == 429)
    finally:
        s.stop()


def _stop_from(text: str) -> tuple[str, str]:
    """A stop string taken from the second half of ``text`` and the text expected before it.

    Windows holding U+FFFD (a token that ends inside a UTF-8 character) are skipped: the
    text there is still being decoded when the stop check runs.
    """
    for start in range(len(text) // 2, len(text) - 1):
        stop = text[start : start + 2]
        if "\ufffd" not in stop:
            return stop, text[: text.index(stop)]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_completion_stream_and_nonstream(client):
    kw = dict(
        model=MODEL,
        prompt="stop strings",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    greedy = client.completions.create(**kw).choices[0].text
    stop, want = _stop_from(greedy)
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_stream_stop_and_logprobs(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me"}],
        max_completion_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    text = full.choices[0].message.content
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 40
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # Greedy: the chosen token is the most likely one.
    assert all(t.logprob >= max(x.logprob for x in t.top_logprobs) - 1e-4 for t in content)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert len(chunks) == 1 + 40  # the role chunk, then one per token
    stop, want = _stop_from(text)
    r = client.chat.completions.create(stop=stop, **kw)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(len(d) >= 1 and len(d) <= 4 for d in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


def test_max_queued_tokens_429(tiny_llama_dir):
    # A request is admitted when nothing waits (so a large one is never starved); past
    # that, the prompt tokens of requests without a first token are capped at 24.
    s = _Running(_engine(tiny_llama_dir, max_queued_tokens=24))
    try:
        body = {"model": MODEL, "prompt": list(range(1, 20)), "max_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            codes = list(
                ex.map(
                    lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=60),
                    range(16),
                )
            )
        statuses = [r.status_code for r in codes]
        assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses
        rejected = [r for r in codes if r.status_code == 429]
        assert all(
            "retry-after" in r.headers and "prompt tokens waiting" in r.json()["error"]["message"]
            for r in rejected
        )
        metrics = httpx.get(s.url + "/metrics").text
        m = re.search(r"^pagewarden:admission_rejections_total\S* (\S+)$", metrics, re.M)
        assert m and float(m.group(1)) == len(rejected)
        assert _used_blocks(s.url) == 0
    finally:
        s.stop()


def test_integrity_metrics_are_exported(srv, client):
    client.completions.create(
        model=MODEL,
        prompt="integrity",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = httpx.get(srv.url + "/metrics").text

    def value(pattern: str) -> float:
        return float(re.search(r"^" + pattern + r" (\S+)$", text, re.M).group(1))

    assert value(r'pagewarden:integrity_level\{[^}]*level="standard"[^}]*\}') == 1.0
    assert value(r'pagewarden:integrity_checks_total\{[^}]*kind="slot_tag"[^}]*\}') > 20
    # The request's first full block is sealed, then re-verified by the scrubber; every
    # scrub recomputes a block checksum.
    scrubbed = value(r'pagewarden:integrity_checks_total\{[^}]*kind="scrub"[^}]*\}')
    assert scrubbed > 0
    assert (
        value(r'pagewarden:integrity_checks_total\{[^}]*kind="block_checksum"[^}]*\}') >= scrubbed
    )
    failures = re.findall(r"^pagewarden:integrity_failures_total\{[^}]*\} (\S+)$", text, re.M)
    assert len(failures) >= 9 and all(float(v) == 0.0 for v in failures)
    assert value(r"pagewarden:integrity_recoveries_total\{[^}]*\}") == 0.0
    assert value(r"pagewarden:kv_blocks_retired\{[^}]*\}") == 0.0
    # The host tier is off by default: swap gauges and counters exist and read zero.
    assert value(r"pagewarden:num_requests_swapped\{[^}]*\}") == 0.0
    assert value(r"pagewarden:kv_swapped_out_blocks_total\{[^}]*\}") == 0.0
    assert value(r"pagewarden:kv_swapped_in_blocks_total\{[^}]*\}") == 0.0
