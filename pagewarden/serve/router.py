"""``PrefixAwareRouter``: a Ray Serve request router that follows the prompt's prefix.

For a ``GenerateCall`` it hashes the prompt's full blocks with the engine's own chained
hash (``kv.prefix_hash``: same block size, model id and tenant salt as the replica's
engine, so tenants never match each other's blocks) and ranks the replicas by how many
leading blocks each holds, from the digests replicas report through Serve's
``record_routing_stats``. When the replicas' loads differ by more than
``imbalanced_threshold`` requests, it ranks them all together and Serve picks the least
loaded (``prefix_rank.rank_replicas``). Other calls (``engine_info``, ...) go to any
replica, least loaded first.

Use it with::

    RequestRouterConfig(
        request_router_class="pagewarden.serve.router:PrefixAwareRouter",
        request_router_kwargs={"imbalanced_threshold": 8},
        request_routing_stats_period_s=0.5,
    )
"""

from __future__ import annotations

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from pagewarden.serve.digest import GenerateCall, ReplicaDigest, prompt_hashes
from pagewarden.serve.prefix_rank import rank_replicas

DEFAULT_IMBALANCED_THRESHOLD = 8


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """Longest held prefix first; least loaded when loads are unbalanced."""

    def initialize_state(self, imbalanced_threshold: int = DEFAULT_IMBALANCED_THRESHOLD) -> None:
        self.imbalanced_threshold = imbalanced_threshold

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        call = _generate_call(pending_request)
        digests = {r.replica_id: _digest(r) for r in candidate_replicas}
        known = [d for d in digests.values() if d is not None]
        if call is None or not known:
            return [candidate_replicas]
        chain = prompt_hashes(
            call.prompt_token_ids, known[0].block_size, known[0].model_id, call.cache_salt
        )
        held = {
            r.replica_id: (d.hashes if (d := digests[r.replica_id]) else ())
            for r in candidate_replicas
        }
        ranks = rank_replicas(
            chain, held, self._loads(candidate_replicas), self.imbalanced_threshold
        )
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[i] for i in rank] for rank in ranks]

    def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests per replica: Serve's probed queue length, else the digest's."""
        loads = {}
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                d = _digest(r)
                n = d.num_in_flight if d is not None else 0
            loads[r.replica_id] = n
        return loads


def _generate_call(pending: PendingRequest | None) -> GenerateCall | None:
    if pending is None or not pending.args:
        return None
    call = pending.args[0]
    return call if isinstance(call, GenerateCall) else None


def _digest(replica: RunningReplica) -> ReplicaDigest | None:
    stats = replica.routing_stats or {}
    digest = stats.get("digest")
    return digest if isinstance(digest, ReplicaDigest) else None
