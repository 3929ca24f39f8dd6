"""End to end with the Triton backend: greedy tokens equal transformers' exactly (float32).

Same approach as ``tests/engine/test_llm_vs_hf.py``; under the interpreter every kernel
call is slow, so the prompts are few and short, but they cover fresh prompts, chunked
prefill over a cached prefix, decodes in one batch and a prefix-cache hit.
"""

from __future__ import annotations

import pytest

from pagewarden import LLM
from pagewarden.engine.config import EngineConfigError
from tests.engine.test_llm_vs_hf import hf_greedy, random_prompts, run_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def vocab(tiny_llama_dir) -> int:
    return transformers.AutoConfig.from_pretrained(tiny_llama_dir).vocab_size


def test_triton_tokens_equal_transformers(tiny_llama_dir, vocab, device):
    """Strict: the kernel checks every tag it reads and re-checksums every sealed block."""
    prompts = random_prompts(3, vocab, 5, 21, seed=3)
    prompts.append(prompts[0][:16] + [5, 6])  # shares a full block with prompt 0
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=32,
        block_size=16,
        max_num_batched_tokens=24,  # chunks prompt tokens over several steps
        integrity="strict",
        device=device,
        attention_backend="triton",
    )
    assert llm.engine.runner.guard.fused_reads
    assert run_engine(llm, prompts, 6) == hf_greedy(tiny_llama_dir, prompts, 6)
    counters = llm.engine.runner.guard.counters
    assert counters.tag_checks > 0 and not counters.failures
    assert counters.block_verifies > 0  # the shared sealed block, checked by the kernel


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineConfigError, match="TRITON_INTERPRET=1"):
        LLM(model="unused", device="cpu", attention_backend="triton")


def test_backend_defaults_and_errors():
    from pagewarden.kernels.backend import AttentionBackendError, check_backend, default_backend

    assert default_backend("cuda") == "triton"  # Triton is installed here
    assert default_backend("mps") == "torch"
    with pytest.raises(AttentionBackendError, match="not one of"):
        check_backend("flash", "cuda")
    with pytest.raises(AttentionBackendError, match="runs on cuda"):
        check_backend("triton", "mps")
