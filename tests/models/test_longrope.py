"""Phi-3 longrope past the original context (OLD): as transformers, a request is rotated
with the short factors while it is at most OLD tokens long and with the long ones past
it (recomputed from position 0 when it grows past OLD), under one max_model_len:
token-exact against transformers for short, crossing and long prompts, and KV computed
with one set never served to a request using the other."""

from __future__ import annotations

import pytest
import torch

from pagewarden import LLM
from pagewarden.models.config import UnsupportedModelError
from pagewarden.models.loader import load_model
from tests.engine.test_llm_vs_hf import hf_greedy, random_prompts, run_engine
from tests.models.tiny_models import _configs, make_tiny, write_gguf

OLD = 16  # original context of the tiny model; its max_position_embeddings is 256
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory):
    """(HF dir, prompts longer than OLD, transformers' greedy tokens for them)."""
    rope = {**_configs()["phi3"][1]["rope_parameters"], "original_max_position_embeddings": OLD}
    path = make_tiny(
        "phi3",
        tmp_path_factory.mktemp("phi3long"),
        rope_parameters=rope,
        original_max_position_embeddings=OLD,
    )
    prompts = random_prompts(3, 512, OLD + 1, 2 * OLD + 5, seed=11)
    prompts.append(list(prompts[0]))  # a prefix-cache hit
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def _engine(model, backend: str, max_model_len: int | None = 64) -> LLM:
    return LLM(
        model=str(model),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=16,  # 4 prompts of up to 37 + 6 tokens: preemption
        max_num_batched_tokens=7,  # chunked prefill: the first chunk is within OLD
        max_model_len=max_model_len,
        attention_backend=backend,
    )


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_long_factors_match_transformers(phi3_long, backend):
    path, prompts, want = phi3_long
    llm = _engine(path, backend)
    assert llm.engine.rope_switch_tokens == OLD
    assert run_engine(llm, prompts, MAX_TOKENS) == want
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_long_factors_from_gguf(phi3_long, tmp_path):
    path, prompts, want = phi3_long
    llm = _engine(write_gguf(path, tmp_path / "phi3.gguf"), "torch")
    assert run_engine(llm, prompts, MAX_TOKENS) == want


@pytest.fixture(scope="module")
def phi3_mixed(phi3_long):
    """Prompts of every kind under one max_model_len: short throughout, crossing OLD
    while generating (transformers then recomputes the sequence with the long set), and
    longer than OLD; with transformers' greedy tokens for them."""
    path, _, _ = phi3_long
    prompts = random_prompts(2, 512, 4, OLD - MAX_TOKENS, seed=3)  # short throughout
    prompts += random_prompts(3, 512, OLD - 4, OLD, seed=5)  # crossing OLD
    prompts += random_prompts(2, 512, OLD + 1, OLD + 9, seed=9)  # long
    prompts.append(list(prompts[2]))  # a prefix-cache hit (short blocks)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_short_and_long_requests_under_one_context(phi3_mixed, backend):
    """Each request uses the factor set transformers uses for its length, switching
    (and recomputing) when it grows past OLD; chunked prefill and preemption on."""
    path, prompts, want = phi3_mixed
    llm = _engine(path, backend)
    assert llm.engine.rope_switch_tokens == OLD
    assert run_engine(llm, prompts, MAX_TOKENS) == want


def test_hf_greedy_is_transformers_generate(phi3_mixed):
    """The reference loop (full recompute per token) is what transformers' generate
    gives with its KV cache, which it drops when a sequence grows past OLD."""
    from transformers import AutoModelForCausalLM

    path, prompts, want = phi3_mixed
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, tokens in list(zip(prompts, want))[2:5]:  # the crossing ones
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            min_new_tokens=MAX_TOKENS,
        )
        assert out[0, len(prompt) :].tolist() == tokens


def test_long_request_reuses_no_short_block(phi3_long):
    """A long prompt that opens with a short one's blocks computes them again (with the
    long set); the same long prompt again hits; greedy tokens equal transformers'."""
    path, _, _ = phi3_long
    llm = _engine(path, "torch")
    short = random_prompts(1, 512, 10, 10, seed=21)[0]  # at most 15 tokens: short set
    long = short + random_prompts(1, 512, 10, 10, seed=22)[0]
    want = hf_greedy(path, [short, long], MAX_TOKENS)
    assert run_engine(llm, [short], MAX_TOKENS) == want[:1]
    hits = llm.stats().prefix_cache_hits
    assert run_engine(llm, [long], MAX_TOKENS) == want[1:]
    assert llm.stats().prefix_cache_hits == hits  # no short-set block served
    assert run_engine(llm, [long], MAX_TOKENS) == want[1:]
    assert llm.stats().prefix_cache_hits > hits


def test_past_extended_context_is_refused(phi3_long):
    path, _, _ = phi3_long
    with pytest.raises(UnsupportedModelError, match="max_position_embeddings"):
        _engine(path, "torch", max_model_len=257)
    lm = load_model(path, torch.float32)
    rope = lm.model.ropes[0]
    with pytest.raises(UnsupportedModelError, match="past the context"):
        rope.lookup(torch.tensor([OLD]), OLD, torch.float32, torch.device("cpu"))
    assert lm.model.select_context(OLD) is None
    assert lm.model.select_context(OLD + 1) == OLD
