"""A stand-in model for fast integrity tests: real KV writes and reads, no network.

``KVEchoModel`` writes, for each new token, K/V that are a fixed function of
(token, position) into the cache slots of ``meta.slot_mapping`` (``write_kv``, the real
model's scatter, slot tags included), then reads every position of the request's context
back through ``meta.block_index`` (the index attention gathers with) and derives the next token from a digest of what it read. So a step
that reads corrupted or misplaced KV produces a different token, exactly like a real
model, at a few microseconds a step instead of milliseconds.

The runner passes the flat batch; the model learns the per-request split from the
``SchedulerOutput`` the harness stashes on it (``attach_echo_model``
wraps ``runner.execute``), i.e. the worker's view of the step, faults included.
"""

from __future__ import annotations

import hashlib

import torch

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.kernels.attention import write_kv
from pagewarden.models.llama import LlamaConfig
from pagewarden.models.loader import LoadedModel
from pagewarden.models.tokenizer import Tokenizer

VOCAB = 512
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 8


def kv_values(token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """K/V row of each token: (T,) x (T,) -> (T, KV_HEADS, HEAD_DIM) float32."""
    j = torch.arange(KV_HEADS * HEAD_DIM, dtype=torch.float32)
    x = token_ids.float().unsqueeze(1) * 0.37 + positions.float().unsqueeze(1) * 0.11 + j
    return torch.sin(x).view(-1, KV_HEADS, HEAD_DIM)


class KVEchoModel:
    """Writes K/V through ``slot_mapping``, reads contexts through block tables."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.current = None  # the SchedulerOutput being executed (set by the harness)

    def __call__(self, input_ids, positions, caches, meta) -> torch.Tensor:
        values = kv_values(input_ids, positions)
        for cache in caches:  # the real model's scatter: K/V and slot tags, one index
            write_kv(cache, values, -values, meta)
        bs = self.block_size
        # Read through the kernel's index, as attention does: (S, max_blocks).
        block_index = meta.block_index.view(meta.num_seqs, meta.max_blocks)
        digests = torch.zeros(input_ids.numel(), dtype=torch.float64)
        row = 0
        for i, req in enumerate(self.current.requests):
            n = len(req.token_ids)
            stop = req.positions.stop
            pos = torch.arange(stop)
            table = block_index[i, : (stop + bs - 1) // bs]
            read = table[pos // bs] * bs + pos % bs
            total = torch.zeros((), dtype=torch.float64)
            for cache in caches:
                k = cache[0].view(-1, KV_HEADS * HEAD_DIM)[read].double()
                v = cache[1].view(-1, KV_HEADS * HEAD_DIM)[read].double()
                total = total + (k * (pos.double().unsqueeze(1) + 1)).sum() - v.sum()
            digests[row + n - 1] = total
            row += n
        return digests.unsqueeze(1)  # (T, 1)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """One-hot logits at a token picked by hashing the digest's exact bits."""
        logits = torch.zeros(hidden.shape[0], VOCAB, dtype=torch.float32)
        for i, d in enumerate(hidden[:, 0].tolist()):
            h = hashlib.blake2b(repr(d).encode(), digest_size=8).digest()
            logits[i, 3 + int.from_bytes(h, "little") % (VOCAB - 3)] = 1.0
        return logits


def echo_engine(tokenizer_dir, **config) -> EngineCore:
    """An ``EngineCore`` over ``KVEchoModel`` (float32 cache, real scheduler and guard)."""
    block_size = config.get("block_size", 4)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=config.pop("max_model_len", 512),
        eos_token_id=2,
    )
    model = KVEchoModel(block_size)
    loaded = LoadedModel(
        model=model,
        config=cfg,
        tokenizer=Tokenizer.from_hf_dir(tokenizer_dir),
        name="kv-echo",
        path=tokenizer_dir,
    )
    # The echo model reads the cache itself (through meta.block_index, as the torch
    # backend does); the guard checks its reads after the forward pass.
    config.setdefault("attention_backend", "torch")
    engine = EngineCore(EngineConfig(dtype="float32", **config), loaded)
    execute = engine.runner.execute

    def stash_and_execute(out):
        model.current = out
        return execute(out)

    engine.runner.execute = stash_and_execute
    return engine


def run_to_completion(engine: EngineCore, max_steps: int = 100_000) -> dict[str, list[list[int]]]:
    """Step until done; returns each finished request's token ids per completion."""
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
    raise AssertionError(f"engine did not finish within {max_steps} steps")
