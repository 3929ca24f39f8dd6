"""A scaled-down spike against a real ``pagewarden serve`` with default admission flags.

Bounded (a few seconds of load, loopback only) and checking no timings: no 5xx and no
connection errors, the default flags shed with 429 + a jittered Retry-After, a crash
input sent mid-spike is a 400 and the engine survives it, and the pool drains to zero.
The full-size spike with a real load generator is ``bench/spike.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import httpx
import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "spike.py"


@pytest.fixture(scope="module")
def spike():
    spec = importlib.util.spec_from_file_location("spike_bench", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _until_not_429(client: httpx.AsyncClient, url: str, body: dict) -> httpx.Response:
    for _ in range(600):
        r = await client.post(url, json=body)
        if r.status_code != 429:
            return r
        await asyncio.sleep(float(r.headers["retry-after-ms"]) / 1000)
    raise AssertionError("never admitted")


async def _load(url: str, name: str, seconds: float, clients: int) -> tuple[list, httpx.Response]:
    body = {"model": name, "prompt": "hi", "max_tokens": 8}
    results: list = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds

        async def worker() -> None:
            while loop.time() < end:
                try:
                    results.append(await client.post(url + "/v1/completions", json=body))
                except httpx.HTTPError as exc:  # a dropped connection is a failure
                    results.append(exc)

        async def crash() -> httpx.Response:
            await asyncio.sleep(seconds / 2)
            bad = {**body, "logprobs": 100000}
            return await _until_not_429(client, url + "/v1/completions", bad)

        *_, crashed = await asyncio.gather(*(worker() for _ in range(clients)), crash())
    return results, crashed


def test_scaled_down_spike(spike, tiny_llama_dir):
    proc, url = spike.start_server(
        ["--model", str(tiny_llama_dir), "--dtype", "float32", "--num-kv-blocks", "64",
         "--max-model-len", "256"]
    )  # fmt: skip
    try:
        name = spike.model_name(url)
        results, crashed = asyncio.run(_load(url, name, seconds=4.0, clients=48))
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, errors[:3]
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429}, sorted(set(codes))
        assert codes.count(429) > 0 and codes.count(200) > 0
        rejected = [r for r in results if r.status_code == 429]
        assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)
        assert len({r.headers["retry-after-ms"] for r in rejected}) > 1  # jittered
        assert crashed.status_code == 400 and "logprobs" in crashed.json()["error"]["message"]
        assert spike.drain(url, timeout=120) == 0
        assert httpx.get(url + "/health").status_code == 200
        ok = asyncio.run(_after(url, name))
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert spike.metric(url, "engine_restarts_total") == 0
        assert spike.metric(url, "admission_rejections_total") >= codes.count(429)
        assert 2 <= spike.metric(url, "admission_limit") <= 3  # 63 blocks * 16 / 256 tokens
        assert spike.metric(url, "admission_in_flight") == 0
    finally:
        proc.terminate()
        proc.wait(60)


async def _after(url: str, name: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"model": name, "prompt": "after", "max_tokens": 3, "ignore_eos": True}
        return await _until_not_429(client, url + "/v1/completions", body)
