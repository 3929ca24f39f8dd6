"""The engine's hooks into the KV tiers (``kvstore/``, docs/kv-tiers.md).

``attach_kv_tiers`` builds the tiers an ``EngineConfig`` asks for, namespaced by the
model's fingerprint (architecture, config, a hash of the weights as loaded, dtype) and
the KV layout, and connects them: the scheduler extends prefix hits from them and lists
evicted blocks, the runner hands those blocks' bytes to the writer thread. After a step,
``note_landed`` deletes the entries whose bytes failed their check in the pool. On a
clean stop, ``offload_cached`` writes the prefix-cached blocks still in the pool too, so
a restart on the same directory finds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from hashlib import blake2b
from typing import Any

import torch

from pagewarden.kv.block_pool import EvictedBlock
from pagewarden.kvstore.disk import DiskTier
from pagewarden.kvstore.format import (
    BlockIdentity,
    KVLayout,
    ModelFingerprint,
    Namespace,
    RejectReason,
    config_digest,
)
from pagewarden.kvstore.keys import namespace_prefix
from pagewarden.kvstore.redis_tier import RedisTier
from pagewarden.kvstore.store import Offload, TierStore
from pagewarden.kvstore.tier import KVTier, TierError, parse_size
from pagewarden.sched.output import ModelRunnerOutput, SchedulerOutput
from pagewarden.sched.scheduler import Scheduler
from pagewarden.sched.tier_prefix import TierPrefix
from pagewarden.worker.kv_store import KVCacheShape
from pagewarden.worker.runner import ModelRunner

logger = logging.getLogger("pagewarden.kvstore")

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def add_kv_tier_args(parser: argparse.ArgumentParser, defaults: Any) -> None:
    """The KV tier flags of ``pagewarden serve`` and the other engine commands."""
    parser.add_argument(
        "--kv-offload-dir",
        default=None,
        metavar="DIR",
        help="disk KV tier: evicted prefix-cache blocks are kept here and loaded back "
        "(verified) on a later prefix hit; survives restarts, shareable between engines",
    )
    parser.add_argument(
        "--kv-offload-dir-size",
        default=defaults.kv_offload_dir_size,
        metavar="SIZE",
        help="bytes the disk tier may hold, least recently used evicted first (e.g. 20GiB)",
    )
    parser.add_argument(
        "--kv-offload-redis",
        default=None,
        metavar="URL",
        help="Redis KV tier shared by several engines, e.g. redis://127.0.0.1:6379/0",
    )
    parser.add_argument(
        "--kv-offload-redis-size",
        default=defaults.kv_offload_redis_size,
        metavar="SIZE",
        help="bytes this engine may store in Redis (its oldest entries deleted first; bound "
        "the whole server with its maxmemory and allkeys-lru)",
    )
    parser.add_argument(
        "--kv-offload-redis-ttl",
        type=int,
        default=defaults.kv_offload_redis_ttl,
        metavar="SECONDS",
        help="expiry of the entries this engine writes to Redis",
    )
    parser.add_argument(
        "--kv-offload-timeout",
        type=float,
        default=defaults.kv_offload_timeout,
        metavar="SECONDS",
        help="a Redis call slower than this is a miss (the tier is then skipped for a while)",
    )


def model_fingerprint(
    model: torch.nn.Module, model_config: Any, dtype: torch.dtype
) -> ModelFingerprint:
    """Architecture, config, every weight tensor as loaded (names, dtypes, shapes, bytes)."""
    h = blake2b(digest_size=32, person=b"pw-weights1")
    for name, tensor in model.state_dict().items():
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    cfg = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else {}
    return ModelFingerprint(
        type(model).__name__, config_digest(cfg), h.hexdigest(), _DTYPE_NAMES[dtype]
    )


def attach_kv_tiers(
    config: Any,
    model: torch.nn.Module,
    model_config: Any,
    shape: KVCacheShape,
    scheduler: Scheduler,
    runner: ModelRunner,
) -> TierStore | None:
    """Build the configured tiers and connect them; None when none is configured. A tier
    that cannot start (a directory we may not create, Redis unreachable at start) is
    logged and left out: the engine serves without it."""
    if config.kv_offload_dir is None and config.kv_offload_redis is None:
        return None
    layout = KVLayout(
        shape.block_size,
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        _DTYPE_NAMES[shape.dtype],
    )
    ns = Namespace(model_fingerprint(model, model_config, shape.dtype), layout)
    prefix = namespace_prefix(ns)
    tiers: list[KVTier] = []
    try:
        if config.kv_offload_dir is not None:
            tiers.append(
                DiskTier(config.kv_offload_dir, prefix, parse_size(config.kv_offload_dir_size))
            )
        if config.kv_offload_redis is not None:
            tiers.append(
                RedisTier(
                    config.kv_offload_redis,
                    prefix,
                    parse_size(config.kv_offload_redis_size),
                    config.kv_offload_redis_ttl,
                    config.kv_offload_timeout,
                )
            )
    except TierError as e:
        logger.warning("KV tier not started: %s", e)
    if not tiers:
        return None
    # Loads run on the store's loader thread; one that makes no progress for twice the
    # tier timeout gives up (the request computes the rest of its blocks): a backstop for
    # a tier with no timeout of its own (a hung disk); a Redis call times out first.
    store = TierStore(ns, tiers, load_timeout_s=2 * config.kv_offload_timeout)
    scheduler.enable_kv_tiers(TierPrefix(store.loader.start, store.loader.wait))

    def offload(evicted: list[EvictedBlock], payloads: list[bytes], sums: list[int | None]) -> None:
        store.offer(
            [
                Offload(BlockIdentity(e.block_hash, e.parent_hash, e.token_bytes), p, s)
                for e, p, s in zip(evicted, payloads, sums)
            ]
        )

    runner.offload = offload
    logger.info("pagewarden: KV tiers %s, namespace %s", [t.name for t in tiers], prefix)
    return store


def note_landed(store: TierStore, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
    """Delete and count the tier entries whose bytes failed their check in the pool."""
    bad = {b for f in result.faults if f.found_by == "tier_load" for b in f.block_ids}
    for load in out.tier_loads:
        if load.block_id in bad:
            store.reject(
                load.tier, load.key, RejectReason.POOL_CHECKSUM, "checksum differs in the pool"
            )


def offload_cached(
    store: TierStore, scheduler: Scheduler, runner: ModelRunner, timeout_s: float
) -> int:
    """Write every sealed, prefix-cached block still in the pool to the tiers (a clean
    stop), waiting up to ``timeout_s`` in all; returns how many were queued. The writer
    checks each block against its seal as for evictions; what does not fit in time is
    left out (counted as dropped)."""
    pool = scheduler.kv.pool
    blocks = [
        EvictedBlock(b.block_id, h, b.parent_hash, b.token_bytes)
        for h, b in pool.hash_index.items()
        if b.token_bytes is not None and b.block_id not in pool.quarantined
    ]
    deadline = time.monotonic() + timeout_s
    queued = 0
    for i in range(0, len(blocks), 64):  # a chunk's bytes at a time, not the whole pool
        chunk = blocks[i : i + 64]
        ids = [b.block_id for b in chunk]
        payloads, sums = runner.kv_store.read_blocks(ids), runner.guard.seal_sums(ids)
        queued += store.offer(
            [
                Offload(BlockIdentity(e.block_hash, e.parent_hash, e.token_bytes), p, s)
                for e, p, s in zip(chunk, payloads, sums)
            ],
            deadline,
        )
    store.flush(max(0.0, deadline - time.monotonic()))
    logger.info("pagewarden: %d cached KV blocks offered to the tiers at shutdown", queued)
    return queued
