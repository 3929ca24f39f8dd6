"""The disk tier in a real engine: same greedy tokens, hits after a restart, bad entries
become misses."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagewarden import LLM, SamplingParams
from pagewarden.metrics.prometheus import build_registry, render
from pagewarden.metrics.stats import FrontendStatsRecorder

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
# Six 41-token prompts (10 full blocks of 4 each) through a 24-block pool: each evicts
# the previous ones' cached blocks, so the first prompt's prefix is gone from the pool
# when it comes back at the end.
PROMPTS = [[3 + (7 * i + j) % 400 for j in range(41)] for i in range(6)]


def _llm(model_dir: Path, offload_dir: Path | None, max_num_seqs: int = 1, **kw) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_model_len=128,
        max_num_seqs=max_num_seqs,
        kv_offload_dir=None if offload_dir is None else str(offload_dir),
        **kw,
    )


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:  # one at a time: each one's blocks are evicted by the next ones
        (res,) = llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)
        out.append(list(res.outputs[0].token_ids))
        if llm.engine.kv_tiers is not None:
            assert llm.engine.kv_tiers.flush()
    return out


def _entries(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir) -> list[list[int]]:
    return _run(_llm(tiny_llama_dir, None), PROMPTS + PROMPTS[:1])


def test_greedy_outputs_equal_and_the_tier_serves_the_evicted_prefix(
    tiny_llama_dir, tmp_path, baseline
):
    llm = _llm(tiny_llama_dir, tmp_path)
    assert _run(llm, PROMPTS + PROMPTS[:1]) == baseline
    c = llm.engine.kv_tiers.counters
    assert c.stores["disk"] > 0 and _entries(tmp_path)
    assert c.hits["disk"] >= 5  # the first prompt's evicted blocks came back
    assert not c.rejected
    text = render(build_registry(llm.engine.stats, FrontendStatsRecorder().snapshot, "m"))[0]
    lines = text.decode().splitlines()
    hits = f'pagewarden:kv_tier_hits_total{{model_name="m",tier="disk"}} {float(c.hits["disk"])}'
    assert hits in lines
    assert any(x.startswith("pagewarden:kv_tier_stores_total{") for x in lines)
    assert any(x.startswith('pagewarden:kv_tier_bytes{model_name="m",tier="disk"}') for x in lines)
    assert any(x.startswith("pagewarden:kv_tier_load_seconds_count") for x in lines)


def test_a_new_engine_on_the_same_directory_sees_tier_hits(tiny_llama_dir, tmp_path, baseline):
    first = _llm(tiny_llama_dir, tmp_path)
    _run(first, PROMPTS)
    first.engine.kv_tiers.close()
    assert _entries(tmp_path)
    second = _llm(tiny_llama_dir, tmp_path)  # a restart: an empty pool, a warm directory
    assert _run(second, PROMPTS[:1]) == baseline[:1]
    assert second.engine.kv_tiers.counters.hits["disk"] >= 9  # 40 tokens = 10 blocks, minus one


@pytest.mark.parametrize("damage", ["bitflip", "truncate"])
def test_corrupted_entries_become_misses_and_are_deleted(
    tiny_llama_dir, tmp_path, baseline, damage
):
    first = _llm(tiny_llama_dir, tmp_path)
    _run(first, PROMPTS)
    first.engine.kv_tiers.close()
    entries = _entries(tmp_path)
    assert entries
    for path in entries:
        data = bytearray(path.read_bytes())
        if damage == "bitflip":
            data[-100] ^= 0x10  # a payload bit
        else:
            data = data[: len(data) // 2]
        path.write_bytes(bytes(data))
    second = _llm(tiny_llama_dir, tmp_path)
    assert _run(second, PROMPTS[:1]) == baseline[:1]
    c = second.engine.kv_tiers.counters
    assert c.hits["disk"] == 0
    reason = "checksum" if damage == "bitflip" else "size"
    assert c.rejected.get(("disk", reason), 0) >= 1
    text = render(build_registry(second.engine.stats, FrontendStatsRecorder().snapshot, "m"))[0]
    metric = f'pagewarden:kv_tier_rejected_total{{model_name="m",reason="{reason}",tier="disk"}}'
    assert metric.encode() in text
    # The first block's entry was rejected and deleted (the chain stops at a miss).
    assert len(_entries(tmp_path)) < len(entries) + 10


def test_integrity_off_and_strict_serve_the_same_tokens(tiny_llama_dir, tmp_path, baseline):
    for level in ("strict", "audit"):
        d = tmp_path / level
        llm = _llm(tiny_llama_dir, d, integrity=level)
        assert _run(llm, PROMPTS + PROMPTS[:1]) == baseline, level
        assert llm.engine.kv_tiers.counters.hits["disk"] >= 5, level


def test_a_block_that_lands_wrong_in_the_pool_is_recomputed(tiny_llama_dir, tmp_path, baseline):
    """The entry verified, but the bytes in the pool do not (a bad copy): the worker's
    checksum over the pool catches it before the forward pass; the request recomputes."""
    llm = _llm(tiny_llama_dir, tmp_path)
    store = llm.engine.kv_store
    write = store.write_blocks

    def bad_copy(block_ids, payloads):
        write(block_ids, payloads)
        store.caches[0][0, block_ids[0], 1, 0, 3] += 1.0  # one value of the first block

    store.write_blocks = bad_copy
    assert _run(llm, PROMPTS + PROMPTS[:1]) == baseline
    c = llm.engine.kv_tiers.counters
    assert c.rejected.get(("disk", "pool_checksum"), 0) == 1
    integrity = llm.engine.stats().integrity
    assert any(k.found_by == "tier_load" for k in integrity.failures), integrity.failures


def test_a_clean_shutdown_writes_the_cached_prefix_for_the_next_engine(
    tiny_llama_dir, tmp_path, baseline
):
    first = _llm(tiny_llama_dir, tmp_path)
    _run(first, PROMPTS[:1])  # nothing evicted: the prefix is only in the pool
    assert first.engine.kv_tiers.counters.stores["disk"] == 0
    first.engine.shutdown()
    assert first.engine.kv_tiers.counters.stores["disk"] >= 10  # 41 tokens: 10 sealed blocks
    second = _llm(tiny_llama_dir, tmp_path)
    assert _run(second, PROMPTS[:1]) == baseline[:1]
    assert second.engine.kv_tiers.counters.hits["disk"] >= 9
