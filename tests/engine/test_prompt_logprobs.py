"""Prompt logprobs from the engine equal a float32 transformers forward on the same weights,
whatever the scheduling: chunked prefill, prefix-cache hits, n > 1, preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagewarden import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

TOLERANCE = 0.02


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """Reference: log_softmax of one float32 forward; entry i is token i+1's logprob row."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()  # (P, V)
    return logits.log_softmax(dim=-1)


def check(out, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for i in range(1, len(prompt)):
        entry, row = lps[i], reference[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - float(row[prompt[i]])) < TOLERANCE, i
        assert (
            entry.rank == int((row > row[prompt[i]]).sum()) + 1
            or abs(float(row.sort(descending=True).values[entry.rank - 1]) - entry.logprob)
            < TOLERANCE
        )
        want = row.topk(k)
        assert [t for t, _ in entry.top] == want.indices.tolist() or k == 0
        assert all(abs(v - float(row[t])) < TOLERANCE for t, v in entry.top)
        assert len(entry.top) == k


@pytest.fixture(scope="module")
def prompt(tiny_llama_dir) -> list[int]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    rng = random.Random(7)
    return [rng.randrange(3, vocab) for _ in range(45)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompt) -> torch.Tensor:
    return hf_prompt_logprobs(tiny_llama_dir, prompt)


def test_chunked_prefill_prefix_hits_and_n(tiny_llama_dir, prompt, reference):
    # 16-token chunks: the prompt is scored over three steps.
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    check(first, prompt, reference, 3)
    # The prompt is cached now: a plain request hits the cache, and one asking for prompt
    # logprobs still gets every position (it computes its prompt instead of reusing it).
    hit = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0 and hit.prompt_logprobs is None
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    check(again, prompt, reference, 3)
    # n > 1: the fork parent scores the prompt once for its children.
    forked = SamplingParams(temperature=1.0, n=3, max_tokens=2, prompt_logprobs=0, seed=1)
    out = llm.generate([{"prompt_token_ids": prompt}], forked, use_tqdm=False)[0]
    check(out, prompt, reference, 0)
    assert len(out.outputs) == 3
    stats = llm.stats()
    assert stats.used_blocks == 0


def test_preempted_prompts_are_scored_completely(tiny_llama_dir, prompt, reference):
    # A pool too small for all at once: requests are preempted and recomputed.
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=40,
        block_size=4,
        max_num_batched_tokens=32,
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    for out in outs:
        check(out, prompt, reference, 1)
