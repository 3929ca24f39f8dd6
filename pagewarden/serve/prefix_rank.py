"""Ranking replicas for a prompt: longest held prefix first, unless loads are unbalanced.

Pure logic (no Ray) so that it is tested in milliseconds. Chained block hashes have the
prefix property (``h_i`` covers every token before it), so the length of the prompt
prefix a replica holds is the number of leading hashes of the chain in its set::

    prompt chain:   h0 h1 h2 h3
    replica A set:  h0 h1           -> 2 blocks
    replica B set:  h0              -> 1 block
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TypeVar

from pagewarden.kv.block import BlockHash

R = TypeVar("R", bound=Hashable)


def matched_blocks(chain: Sequence[BlockHash], held: Collection[BlockHash]) -> int:
    """How many leading blocks of ``chain`` are in ``held``."""
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


def rank_replicas(
    chain: Sequence[BlockHash],
    held: Mapping[R, Collection[BlockHash]],
    loads: Mapping[R, int],
    imbalance_threshold: int,
) -> list[list[R]]:
    """Replicas in ranks, most preferred first (Ray picks the least loaded within a rank).

    - loads unbalanced (max - min > ``imbalance_threshold``): one rank, all replicas,
      so the request goes to the least loaded one;
    - otherwise: replicas by the number of prompt blocks they hold, longest first; those
      holding none share the last rank (a new prefix goes to the least loaded).
    """
    replicas = list(held)
    if not replicas:
        return []
    counts = [loads.get(r, 0) for r in replicas]
    if max(counts) - min(counts) > imbalance_threshold:
        return [replicas]
    by_match: dict[int, list[R]] = {}
    for r in replicas:
        by_match.setdefault(matched_blocks(chain, held[r]), []).append(r)
    return [by_match[m] for m in sorted(by_match, reverse=True)]
