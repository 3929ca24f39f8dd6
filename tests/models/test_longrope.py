"""Phi-3 longrope past the original context: one factor set for every position, chosen
from max_model_len (as vLLM). Short set up to the original context (test_archs covers it:
the default context), long set beyond it, token-exact against transformers for prompts
longer than the original context, and shorter prompts refused at admission."""

from __future__ import annotations

import pytest
import torch

from pagewarden import LLM, SamplingParams
from pagewarden.models.config import UnsupportedModelError
from pagewarden.models.loader import load_model
from pagewarden.sched.admission import RequestRejected
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
    assert llm.engine.loaded.model.ropes[0].long
    assert run_engine(llm, prompts, MAX_TOKENS) == want
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_long_factors_from_gguf(phi3_long, tmp_path):
    path, prompts, want = phi3_long
    llm = _engine(write_gguf(path, tmp_path / "phi3.gguf"), "torch")
    assert run_engine(llm, prompts, MAX_TOKENS) == want


def test_short_prompt_is_refused_in_long_context(phi3_long):
    """transformers rotates a prompt of <= OLD tokens with the short factors."""
    path, _, _ = phi3_long
    llm = _engine(path, "torch")
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(RequestRejected, match=f"fewer than {OLD + 1} tokens"):
        llm.generate([{"prompt_token_ids": list(range(3, 3 + OLD))}], params, use_tqdm=False)


def test_default_context_is_original_with_short_factors(phi3_long):
    """Without max_model_len the context is OLD and every prompt is exact (short set)."""
    path, _, _ = phi3_long
    llm = _engine(path, "torch", max_model_len=None)
    assert llm.engine.max_model_len == OLD and not llm.engine.loaded.model.ropes[0].long
    prompts = random_prompts(2, 512, 4, OLD - MAX_TOKENS, seed=3)
    assert run_engine(llm, prompts, MAX_TOKENS) == hf_greedy(path, prompts, MAX_TOKENS)


def test_past_extended_context_is_refused(phi3_long):
    path, _, _ = phi3_long
    with pytest.raises(UnsupportedModelError, match="max_position_embeddings"):
        _engine(path, "torch", max_model_len=257)
    lm = load_model(path, torch.float32)
    rope = lm.model.ropes[0]
    with pytest.raises(UnsupportedModelError, match="past the context"):
        rope.lookup(torch.tensor([OLD]), OLD, torch.float32, torch.device("cpu"))
    assert lm.model.select_context(OLD) == 1 and not rope.long
    assert lm.model.select_context(OLD + 1) == OLD + 1 and rope.long
