"""pagewarden on Ray Serve, end to end: a local Ray (2 CPUs), 2 replicas of the tiny Llama.

Requests go through Serve's HTTP proxy with the official ``openai`` client. Checks:
answers equal a single engine's greedy output; the prefix-aware router sends requests
sharing a prefix to the replica that holds it; killing the replica that serves a stream
mid-way leaves the client's stream complete and equal to the uninterrupted answer.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'pagewarden[ray]'")

from ray import serve  # noqa: E402

from pagewarden.engine.llm import LLM  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402
from pagewarden.serve.options import ServeOptions  # noqa: E402

MODEL = "tiny"
PORT = 18231
ENGINE = dict(dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=256, cpu_threads=1)
# Four blocks of shared "system prompt", then a per-request question.
SYSTEM = "Paged attention stores keys and values in blocks. " * 5


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - the only reason to skip
        pytest.skip(f"a local Ray instance cannot start here: {exc}")
    from pagewarden.kernels.cpu import attention as cpu_attention
    from pagewarden.kernels.cpu import fused as cpu_fused
    from pagewarden.serve.ray import build_app

    # Build the C++ extensions here, once, so that no replica compiles them while the
    # tests below wait on its first answers.
    cpu_fused.load()
    cpu_attention.load_extension()
    options = ServeOptions(
        engine=dict(model=str(tiny_llama_dir), **ENGINE),
        served_model_name=MODEL,
        num_replicas=2,
        num_cpus_per_replica=0.5,
        digest_period_s=0.3,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(options), name="pw", route_prefix="/")
    yield f"http://127.0.0.1:{PORT}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """A single engine's greedy answers, in this process."""
    llm = LLM(str(tiny_llama_dir), **ENGINE)

    def output(prompt: str, max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    def answer(prompt: str, max_tokens: int) -> str:
        return output(prompt, max_tokens).text

    def tokens(prompt: str, max_tokens: int) -> list[str]:
        tok = llm.get_tokenizer()
        return [tok.decode([t]) for t in output(prompt, max_tokens).token_ids]

    answer.tokens = tokens  # type: ignore[attr-defined]
    return answer


def _replicas(cluster: str) -> dict[str, dict]:
    body = httpx.get(cluster + "/v1/replicas", timeout=10).json()
    return {r["replica_id"]: r for r in body["data"]}


def _complete(client, prompt: str, max_tokens: int) -> str:
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].text


def _healthy(cluster: str, timeout_s: float = 60.0) -> int:
    """/health's status once some replica has published a live digest (right after
    ``serve.run`` none may have yet: 503 until then), or the last status at the timeout."""
    deadline = time.monotonic() + timeout_s
    status = httpx.get(cluster + "/health", timeout=10).status_code
    while status != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        status = httpx.get(cluster + "/health", timeout=10).status_code
    return status


def test_routes_and_concurrent_answers_equal_a_single_engine(cluster, client, reference):
    assert _healthy(cluster) == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompts = [f"Question {i}: the quick brown fox" for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: _complete(client, p, 8), prompts))
    assert got == [reference(p, 8) for p in prompts]
    chat = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(client.chat.completions.create(stream=True, **chat))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert streamed == client.chat.completions.create(**chat).choices[0].message.content
    metrics = httpx.get(cluster + "/metrics", timeout=10).text
    assert "pagewarden:request_migrations_total" in metrics
    assert "pagewarden:prompt_tokens_total" in metrics


def _settled(cluster: str) -> dict[str, dict]:
    """The replicas once their published counters stop moving: a digest still carrying
    an earlier request's stats would make its replica look like this request's holder."""
    deadline = time.monotonic() + 10
    last = _replicas(cluster)
    while time.monotonic() < deadline:
        time.sleep(0.6)  # longer than the digest period (0.5 s)
        now = _replicas(cluster)
        if all(now[r]["prompt_tokens"] == last.get(r, {}).get("prompt_tokens") for r in now):
            return now
        last = now
    raise AssertionError("the replicas' counters never settled")


def _holder(cluster: str, before: dict[str, dict]) -> str:
    """The one replica whose prompt-token counter moved since ``before``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = _replicas(cluster)
        moved = [
            r for r in now if now[r]["prompt_tokens"] > before.get(r, {}).get("prompt_tokens", 0)
        ]
        if moved:
            return moved[0] if len(moved) == 1 else ",".join(sorted(moved))
        time.sleep(0.2)
    raise AssertionError("no replica served the request")


def _learned(cluster: str, holder: str) -> None:
    """Wait until the holder's digest shows blocks, then a period more for the router."""
    deadline = time.monotonic() + 10
    while _replicas(cluster).get(holder, {}).get("held_blocks", 0) == 0:
        assert time.monotonic() < deadline, "the replica never reported its blocks"
        time.sleep(0.1)
    time.sleep(1.0)


def test_router_sends_a_shared_prefix_to_its_holder(cluster, client):
    before = _settled(cluster)
    _complete(client, SYSTEM + "First tenant question?", 2)
    holder = _holder(cluster, before)
    _learned(cluster, holder)
    for i in range(4):
        before = _settled(cluster)
        _complete(client, SYSTEM + f"Follow-up question number {i}?", 2)
        assert _holder(cluster, before) == holder


def test_stream_survives_the_death_of_its_replica(cluster, client, reference):
    prompt = SYSTEM + "Tell a long story."
    before = _settled(cluster)
    _complete(client, prompt, 1)
    holder = _holder(cluster, before)  # the stream below goes there (test above)
    _learned(cluster, holder)
    max_tokens = 120
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=0,  # one token per entry: the stream's tokens, not only its text
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens, killed = [], False
    for chunk in stream:
        tokens += chunk.choices[0].logprobs.tokens
        if len(tokens) >= 5 and not killed:
            _kill_replica(holder)
            killed = True
    assert killed
    # Every token once, in order: no duplicate, no gap (the text can differ only where
    # the replica died inside a multi-byte character; see docs/scale-out.md).
    assert tokens == reference.tokens(prompt, max_tokens)
    body = httpx.get(cluster + "/v1/replicas", timeout=10).json()
    assert body["request_migrations"] >= 1


def _kill_replica(replica_id: str) -> None:
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith("#" + replica_id)
    ]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
