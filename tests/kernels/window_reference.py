"""The plain-torch reference of sliding-window and soft-capped attention: full attention
per sequence, every key gathered position by position through the python block tables,
only the keys each query may see (p - window < j <= p), the cap, in float64. Every backend is compared with it."""

from __future__ import annotations

import random

import torch

from tests.kernels.kernel_step import Step, make_step


def reference_attention(
    step: Step, scale: float, window: int | None, softcap: float | None, layer: int = 0
) -> torch.Tensor:
    """(T, n_heads, D) float64: query at position p sees keys j with p - window < j <= p
    (all j <= p without a window), logits softcap * tanh(logits / softcap)."""
    cache = step.caches[layer].cpu().double()  # (2, num_blocks, bs, n_kv, D)
    bs, n_kv = cache.shape[2], cache.shape[3]
    q = step.q.cpu().double()  # (T, n_heads, D)
    group = q.shape[1] // n_kv
    out = torch.zeros_like(q)
    start = 0
    for table, qn, ctx in zip(step.tables, step.meta.query_lens, step.meta.context_lens):
        n = ctx + qn
        slots = [(table[p // bs], p % bs) for p in range(n)]
        k = torch.stack([cache[0, b, o] for b, o in slots])  # (n, n_kv, D)
        v = torch.stack([cache[1, b, o] for b, o in slots])
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (n, H, D)
        for t in range(qn):
            p = ctx + t
            lo = 0 if window is None else max(0, p - window + 1)
            kw, vw = k[lo : p + 1], v[lo : p + 1]  # (keys it may see, H, D): no others
            logits = torch.einsum("hd,nhd->hn", q[start + t], kw) * scale  # (H, keys)
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            out[start + t] = torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), vw)
        start += qn
    return out


def random_step(seed: int, **kwargs) -> tuple[Step, int | None, float | None]:
    """A random mix of decodes, fresh prompts and chunks over cached prefixes, with a
    random window (smaller or larger than the contexts, rarely a block multiple) and cap."""
    rng = random.Random(seed)
    num_seqs = rng.randint(1, 5)
    q_lens, ctx = [], []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "fresh", "chunk"])
        q_lens.append(1 if kind == "decode" else rng.randint(2, 24))
        ctx.append(0 if kind == "fresh" else rng.randint(0 if kind == "decode" else 1, 60))
    window = rng.choice([None, 1, rng.randint(2, 12), rng.randint(13, 40), 200])
    softcap = rng.choice([None, 0.5, 2.0, 30.0])
    step = make_step(q_lens, ctx, seed=seed, **kwargs)
    return step, window, softcap
