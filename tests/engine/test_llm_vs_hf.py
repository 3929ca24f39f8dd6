"""End to end: pagewarden's greedy tokens equal transformers' greedy tokens exactly."""

from __future__ import annotations

import random

import pytest
import torch

from pagewarden import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Reference: full-recompute argmax loop in float32 (no EOS stop, no cache)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            out = []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                tok = int(torch.argmax(logits))
                out.append(tok)
                ids.append(tok)
            results.append(out)
    return results


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_pool_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.used_blocks == 0
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks - 1
    assert llm.engine.scheduler.check_invariants() == []


@pytest.fixture(scope="module")
def vocab(tiny_llama_dir) -> int:
    return transformers.AutoConfig.from_pretrained(tiny_llama_dir).vocab_size


def test_single_prompt(tiny_llama_dir, vocab):
    prompts = random_prompts(1, vocab, 12, 12)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, block_size=4)
    assert run_engine(llm, prompts, 16) == hf_greedy(tiny_llama_dir, prompts, 16)
    assert_pool_idle(llm)


def test_sixteen_mixed_prompts_one_batch(tiny_llama_dir, vocab):
    prompts = random_prompts(16, vocab, 1, 40, seed=1)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    assert run_engine(llm, prompts, 12) == hf_greedy(tiny_llama_dir, prompts, 12)
    assert_pool_idle(llm)


def test_chunked_prefill_small_token_budget(tiny_llama_dir, vocab):
    prompts = random_prompts(4, vocab, 20, 45, seed=2)
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=128,
        block_size=4,
        max_num_batched_tokens=7,
    )
    assert run_engine(llm, prompts, 10) == hf_greedy(tiny_llama_dir, prompts, 10)
    assert llm.stats().num_steps > 45 // 7
    assert_pool_idle(llm)


def test_preemption_small_pool(tiny_llama_dir, vocab):
    prompts = random_prompts(8, vocab, 10, 20, seed=3)
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=20,
        block_size=4,
        enable_prefix_caching=False,
    )
    assert run_engine(llm, prompts, 20) == hf_greedy(tiny_llama_dir, prompts, 20)
    assert llm.stats().num_preemptions > 0
    assert_pool_idle(llm)


@pytest.mark.parametrize("integrity", ["off", "strict"])
def test_swap_preemption_small_pool(tiny_llama_dir, vocab, integrity):
    """Preempted requests go to the host tier and resume; tokens still equal HF's."""
    prompts = random_prompts(8, vocab, 10, 20, seed=3)
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=20,
        block_size=4,
        num_swap_blocks=16,
        integrity=integrity,
    )
    assert run_engine(llm, prompts, 20) == hf_greedy(tiny_llama_dir, prompts, 20)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
    assert stats.num_swapped == 0 and stats.free_host_blocks == stats.host_blocks == 16
    assert stats.integrity.failures == {}
    if integrity == "strict":
        assert stats.integrity.block_verifies > 0
    assert_pool_idle(llm)


def test_shared_prefixes_hit_prefix_cache(tiny_llama_dir, vocab):
    rng = random.Random(4)
    prefix = [rng.randrange(3, vocab) for _ in range(24)]
    prompts = [
        prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))] for _ in range(6)
    ]
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, block_size=4)
    expected = hf_greedy(tiny_llama_dir, prompts, 8)
    assert run_engine(llm, prompts[:1], 8) == expected[:1]
    assert run_engine(llm, prompts[1:], 8) == expected[1:]
    assert llm.stats().prefix_cache_hits >= 5 * 24
    assert_pool_idle(llm)


def test_gqa_model(tmp_path, vocab):
    from conftest import make_tiny_llama

    model_dir = make_tiny_llama(
        tmp_path / "gqa", num_attention_heads=6, num_key_value_heads=2, hidden_size=48
    )
    prompts = random_prompts(5, vocab, 3, 30, seed=5)
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=8)
    assert run_engine(llm, prompts, 10) == hf_greedy(model_dir, prompts, 10)
    assert_pool_idle(llm)


def test_seeded_sampling_independent_of_batch(tiny_llama_dir, vocab):
    prompts = random_prompts(6, vocab, 5, 25, seed=6)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    crowd = llm.generate([{"prompt_token_ids": p} for p in prompts[::-1]], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == crowd[-1].outputs[0].token_ids
    assert_pool_idle(llm)


def test_parallel_sampling_n(tiny_llama_dir, vocab):
    prompts = random_prompts(2, vocab, 9, 9, seed=7)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, block_size=4)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = hf_greedy(tiny_llama_dir, prompts, 6)
    for out, exp in zip(outs, expected):
        assert len(out.outputs) == 3
        assert [c.token_ids for c in out.outputs] == [exp] * 3
    assert_pool_idle(llm)


def test_impossible_request_rejected(tiny_llama_dir):
    from pagewarden.engine.core import RequestRejected

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=8, block_size=4)
    with pytest.raises(RequestRejected, match="KV blocks"):
        llm.generate(
            [{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=40), use_tqdm=False
        )
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert_pool_idle(llm)
