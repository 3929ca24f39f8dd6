"""What crosses between the ingress, the router and the engine replicas.

Plain dataclasses, no Ray: ``GenerateCall`` is the one argument of a replica's
``generate`` (the router reads it to hash the prompt), ``ReplicaDigest`` is what a
replica reports every period (the block hashes it holds, its load, its engine stats).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

from pagewarden.kv.block import BlockHash
from pagewarden.kv.prefix_hash import encode_extra_keys, hash_block_chain
from pagewarden.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateCall:
    """One request as the ingress sends it to a replica."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class ReplicaDigest:
    """A replica's periodic report: identity, prefix holdings, load and stats.

    ``hashes`` are chained block hashes (``kv.prefix_hash``) of the blocks the replica's
    prefix cache most likely holds; ``model_id`` and ``block_size`` are what the router
    needs to hash a prompt exactly as this replica's engine does.
    """

    replica_id: str
    model_id: str
    block_size: int
    hashes: frozenset[BlockHash]
    num_in_flight: int
    engine_stats: object | None  # EngineStats of the replica's engine core
    alive: bool  # the engine's heartbeat is fresh
    engine_restarts: int
    created: float = 0.0


@dataclass(frozen=True)
class ClusterView:
    """The replicas as the ingress last saw them: summed stats, liveness, restarts."""

    engine_stats: object | None
    alive: bool
    engine_restarts: int
    replicas: tuple[ReplicaDigest, ...]

    @classmethod
    def of(cls, digests: list[ReplicaDigest], fallback_stats: object | None) -> ClusterView:
        stats = sum_stats([d.engine_stats for d in digests if d.engine_stats is not None])
        return cls(
            stats if stats is not None else fallback_stats,
            any(d.alive for d in digests),
            sum(d.engine_restarts for d in digests),
            tuple(sorted(digests, key=lambda d: d.replica_id)),
        )


def prompt_hashes(
    token_ids: list[int], block_size: int, model_id: str, cache_salt: str | None
) -> list[BlockHash]:
    """The engine's chained hashes of a prompt's full blocks (tenant salt included)."""
    return hash_block_chain(token_ids, block_size, encode_extra_keys(model_id, cache_salt))


@dataclass
class HeldBlocks:
    """An LRU model of the engine's prefix cache, fed with what the replica served.

    The engine core (another process) evicts cached-free blocks least recently used;
    recording each request's full-block hashes here, most recent last, and keeping at
    most ``capacity`` of them approximates the set it holds without asking it.
    """

    capacity: int
    _lru: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)

    def touch(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def snapshot(self) -> frozenset[BlockHash]:
        return frozenset(self._lru)


def sum_stats(snapshots: list[object]) -> object | None:
    """Field-wise sum of stats dataclasses (counters and gauges add, dicts merge, text
    fields keep the first replica's value): the cluster's totals for ``/metrics``."""
    if not snapshots:
        return None
    first = snapshots[0]
    values = {}
    for f in dataclasses.fields(first):  # type: ignore[arg-type]
        items = [getattr(s, f.name) for s in snapshots]
        if dataclasses.is_dataclass(items[0]):
            values[f.name] = sum_stats(items)
        elif isinstance(items[0], dict):
            merged: dict = {}
            for d in items:
                for k, v in d.items():
                    merged[k] = merged.get(k, 0) + v
            values[f.name] = merged
        elif isinstance(items[0], (int, float)) and not isinstance(items[0], bool):
            values[f.name] = sum(items)
        else:
            values[f.name] = items[0]
    return type(first)(**values)
