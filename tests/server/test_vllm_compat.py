"""A running server as vLLM's consumers see it: its /metrics parsed with
prometheus_client (every ``vllm:*`` series equal to its ``pagewarden:*`` twin), and its
engine-core process's KV events rebuilt by a ZeroMQ subscriber."""

from __future__ import annotations

import re
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.engine.config import EngineConfig
from tests.engine.test_kv_events import KVEventBatch
from tests.metrics.test_vllm_metrics import check_twins
from tests.server.test_api import MODEL, _Running


@pytest.fixture(scope="module")
def sub():
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close(0)


@pytest.fixture(scope="module")
def srv(tiny_llama_dir, sub):
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=32,
        block_size=4,
        max_model_len=128,
        kv_events_endpoint=f"tcp://127.0.0.1:{sub[1]}",
    )
    s = _Running(AsyncEngine(cfg))
    # A SUB socket sends its subscription when it next runs: run it before any request,
    # so the engine's publisher drops nothing (it filters each message when it sends).
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        sub[0].poll(50)
    yield s
    s.stop()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def test_kv_events_from_the_engine_core_process_rebuild_its_cache(srv, sub) -> None:
    sock, _ = sub
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    cached: set[int] = set()
    seqs: list[int] = []
    # One request at a time: no two blocks with the same content are ever sealed at once,
    # so every cached-free block in the pool is in the prefix-cache index.
    for k in range(8):
        prompt = [5, 6, 7, 8, 9, 10, 11, 12] + [20 + k] * (5 + k)
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
        while sock.poll(300):
            _, seq, payload = sock.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            for e in decode(payload).events:
                name = type(e).__name__
                if name == "BlockStoredV":
                    cached |= set(e.block_hashes)
                elif name == "BlockRemovedV":
                    assert set(e.block_hashes) <= cached
                    cached -= set(e.block_hashes)
                else:
                    cached.clear()
        assert _metric(srv.url, "pagewarden:kv_blocks_used") == 0
        assert len(cached) == _metric(srv.url, "pagewarden:kv_blocks_cached"), k
    assert seqs == list(range(len(seqs)))  # nothing missed, from the first message
    assert _metric(srv.url, "pagewarden:block_allocations_total") > 31  # blocks were reused


def test_metrics_twins_agree_on_a_running_server(srv) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    for prompt in ("hello world", "hello world again", "something else"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    text = httpx.get(srv.url + "/metrics").text
    check_twins(text)
    assert _metric(srv.url, "vllm:request_success_total") >= 0
    assert _metric(srv.url, "vllm:prompt_tokens_total") > 0
