"""Two real engines sharing one real redis-server; a Redis that dies is a miss."""

from __future__ import annotations

import pytest

from pagewarden import LLM, SamplingParams

pytest.importorskip("redis")

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = [[3 + (7 * i + j) % 400 for j in range(41)] for i in range(6)]


def _llm(model_dir, url: str | None) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_model_len=128,
        max_num_seqs=1,
        kv_offload_redis=url,
        kv_offload_timeout=0.3,
    )


def _run(llm: LLM, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        (res,) = llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)
        out.append(list(res.outputs[0].token_ids))
        if llm.engine.kv_tiers is not None:
            llm.engine.kv_tiers.flush()
    return out


def test_two_engines_share_one_redis_and_a_dead_redis_is_a_miss(tiny_llama_dir, redis_server):
    baseline = _run(_llm(tiny_llama_dir, None), PROMPTS + PROMPTS[:1])
    writer = _llm(tiny_llama_dir, redis_server.url)
    assert _run(writer, PROMPTS) == baseline[:-1]
    assert writer.engine.kv_tiers.counters.stores["redis"] > 0
    reader = _llm(tiny_llama_dir, redis_server.url)  # another engine (replica), cold pool
    assert _run(reader, PROMPTS[:1]) == baseline[:1]
    assert reader.engine.kv_tiers.counters.hits["redis"] >= 9
    assert not reader.engine.kv_tiers.counters.rejected
    redis_server.stop()  # the tier disappears: serving goes on, errors are counted
    assert _run(reader, PROMPTS[1:] + PROMPTS[:1]) == baseline[1:]
    assert reader.engine.kv_tiers.counters.errors["redis"] >= 1
