"""Greedy decoding straight through a model's forward over a paged KV cache (no engine),
and transformers' greedy on the same prompt: the pair the real-GGUF tests compare."""

from __future__ import annotations

import torch

from pagewarden.kernels.attention import AttentionMetadata

BS = 16


def paged_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Prefill in one chunk, then one token per step, through a scattered block table
    (blocks in reverse order, so block order != position order)."""
    cfg = model.config
    n_blocks = -(-(len(prompt) + steps) // BS)
    table = list(range(n_blocks, 0, -1))
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


def hf_generate_greedy(ref, prompt: list[int], steps: int) -> list[int]:
    """transformers' ``generate`` without sampling: the `steps` tokens after `prompt`."""
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()
