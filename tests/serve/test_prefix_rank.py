"""Replica ranking on chained block hashes (no Ray)."""

from __future__ import annotations

from pagewarden.serve.digest import ClusterView, HeldBlocks, ReplicaDigest, prompt_hashes, sum_stats
from pagewarden.serve.prefix_rank import matched_blocks, rank_replicas

BS = 4
TOKENS = list(range(1, 17))  # four full blocks


def chain(salt: str | None = None, tokens: list[int] = TOKENS) -> list[bytes]:
    return prompt_hashes(tokens, BS, "m", salt)


def test_matched_blocks_counts_leading_hashes_only():
    c = chain()
    assert matched_blocks(c, set(c[:2])) == 2
    assert matched_blocks(c, {c[1], c[2]}) == 0  # no h0: the chain breaks at once


def test_longest_prefix_first_then_the_rest_together():
    c = chain()
    held = {"a": set(c[:1]), "b": set(c[:3]), "c": set(), "d": set()}
    assert rank_replicas(c, held, {}, 8) == [["b"], ["a"], ["c", "d"]]


def test_unbalanced_loads_fall_back_to_least_loaded():
    c = chain()
    held = {"a": set(c), "b": set()}
    assert rank_replicas(c, held, {"a": 10, "b": 1}, 8) == [["a", "b"]]
    assert rank_replicas(c, held, {"a": 9, "b": 1}, 8) == [["a"], ["b"]]


def test_tenants_never_match_each_other():
    held = {"a": set(chain("tenant-1")), "b": set()}
    assert rank_replicas(chain("tenant-2"), held, {}, 8) == [["a", "b"]]
    assert rank_replicas(chain("tenant-1"), held, {}, 8) == [["a"], ["b"]]


def test_held_blocks_keep_the_most_recent():
    held = HeldBlocks(capacity=3)
    c = chain()
    held.touch(c[:2])
    held.touch(c[2:])
    assert held.snapshot() == frozenset(c[1:])


def test_cluster_view_sums_stats_and_restarts():
    from pagewarden.engine.core import EngineStats
    from pagewarden.engine.integrity import IntegrityStats

    def stats(n: int) -> EngineStats:
        return EngineStats(
            prompt_tokens=n,
            prefix_cache_hits=2 * n,
            integrity=IntegrityStats("standard", n, 0, 0, 0, 0, 0, 0),
            batch_limit_changes={"latency": n},
        )

    digests = [
        ReplicaDigest(r, "m", BS, frozenset(), 0, stats(n), alive, n, 0.0)
        for r, n, alive in (("x", 1, False), ("y", 3, True))
    ]
    view = ClusterView.of(digests, None)
    assert view.alive and view.engine_restarts == 4
    s = view.engine_stats
    assert (s.prompt_tokens, s.prefix_cache_hits, s.batch_limit_changes) == (4, 8, {"latency": 4})
    assert (s.integrity.level, s.integrity.tag_checks) == ("standard", 4)
    assert sum_stats([]) is None
