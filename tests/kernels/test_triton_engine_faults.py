"""Faults injected under the engine with the Triton backend: the attention kernel's own
checks find them (found_by "read"), and recovery still serves transformers' tokens."""

from __future__ import annotations

import random

import pytest

from pagewarden import LLM
from pagewarden.faults.kv_faults import corrupt_tag, flip_bit
from tests.engine.test_llm_vs_hf import hf_greedy, random_prompts, run_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def prefix(tiny_llama_dir) -> list[int]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    return random_prompts(1, vocab, 32, 32, seed=5)[0]  # two full blocks of 16


def _llm_with_cached_prefix(tiny_llama_dir, prefix, device) -> tuple[LLM, list[int]]:
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=16,
        block_size=16,
        integrity="strict",
        scrub_blocks_per_step=0,  # leave the finding to the kernel
        device=device,
        attention_backend="triton",
    )
    run_engine(llm, [prefix + [7]], 1)
    pool = llm.engine.scheduler.kv.pool
    cached = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert len(cached) == 2
    return llm, cached


def test_flipped_bit_in_a_reused_block_is_caught_by_the_kernels_checksum(
    tiny_llama_dir, prefix, device
):
    llm, cached = _llm_with_cached_prefix(tiny_llama_dir, prefix, device)
    flip_bit(llm.engine.kv_store.caches, cached[1], 1, random.Random(0))
    prompt = prefix + [9, 10]
    assert run_engine(llm, [prompt], 3) == hf_greedy(tiny_llama_dir, [prompt], 3)
    failures = llm.stats().integrity.failures
    assert failures == {("checksum", "read"): 1}


def test_wrong_slot_tag_in_a_reused_block_is_caught_by_the_kernels_tag_check(
    tiny_llama_dir, prefix, device
):
    llm, cached = _llm_with_cached_prefix(tiny_llama_dir, prefix, device)
    corrupt_tag(llm.engine.runner.guard.tags, cached[0], 5)
    prompt = prefix + [9, 10]
    assert run_engine(llm, [prompt], 3) == hf_greedy(tiny_llama_dir, [prompt], 3)
    failures = llm.stats().integrity.failures
    assert failures == {("slot_tag", "read"): 1}
