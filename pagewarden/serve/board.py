"""``DigestBoard``: the latest digest of every engine replica, for the ingress.

A small named Ray actor (no CPU reserved) per Serve application. Replicas publish their
``ReplicaDigest`` every period; the ingress reads the fresh ones for ``/metrics``,
``/health`` and ``/v1/replicas``. A digest older than ``max_age_s`` belongs to a replica
that died or stalled and is left out. (The router does not read the board: Serve hands
it the same digests through ``record_routing_stats``.)
"""

from __future__ import annotations

import time

import ray

from pagewarden.serve.digest import ReplicaDigest


class DigestBoard:
    def __init__(self) -> None:
        self._latest: dict[str, ReplicaDigest] = {}

    def publish(self, digest: ReplicaDigest) -> None:
        self._latest[digest.replica_id] = digest

    def fresh(self, max_age_s: float) -> list[ReplicaDigest]:
        now = time.time()
        return [d for d in self._latest.values() if now - d.created <= max_age_s]


def board_for(app_name: str):
    """The application's board actor, created by whoever asks first."""
    return (
        ray.remote(DigestBoard)
        .options(
            name=f"pagewarden-digests:{app_name}",
            namespace="pagewarden",
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
        )
        .remote()
    )
