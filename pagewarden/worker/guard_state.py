"""The integrity state ``KVGuard`` keeps for the physical cache, and what every check shares.

Per device block: ``sealed[b]`` and ``block_sums[b]`` (valid while sealed); per slot:
``slot_sums`` (write-time checksum) and the slot tag (``SlotTags``). The host (swap) tier
keeps the same state in a ``TierState``, copied along with the bytes (copy-on-write,
swap-out, swap-in): what a block held when it left is what it must hold when it returns.
Per request: the tag of its token chain at each position, and whether its context was
verified once. A fault found by any check names the scheduled requests that read its
blocks (``_attach_readers``) and forgets their per-request state.

``GuardState`` is the base of ``ArrivalChecks`` (``guard_arrivals.py``), ``ChecksumChecks``
(``guard_checksums.py``) and ``KVGuard`` (``kv_guard.py``, whose docstring says what each
level checks and when).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from pagewarden.kernels.attention import AttentionMetadata, ReadChecks
from pagewarden.kv.swap_space import BlockSwap
from pagewarden.sched.output import FailureKey, KVFault, ScheduledRequest, SchedulerOutput
from pagewarden.worker.fused_checks import offset_keys
from pagewarden.worker.integrity import (
    ROOT_TAG,
    SlotChecksums,
    SlotTags,
    block_checksums,
    decode_guard,
    slot_checksums,
)
from pagewarden.worker.tag_chains import TagChains

IntegrityLevel = Literal["off", "audit", "standard", "strict"]
INTEGRITY_LEVELS: tuple[str, ...] = ("off", "audit", "standard", "strict")
_RANK = {name: i for i, name in enumerate(INTEGRITY_LEVELS)}


@dataclass
class GuardCounters:
    """Checks run and failures found, by kind. Monotonic."""

    tag_checks: int = 0  # context positions whose tag was compared
    block_verifies: int = 0  # block checksums recomputed and compared
    slot_verifies: int = 0  # slot checksums recomputed and compared (open blocks, seal)
    seals: int = 0
    scrubbed_blocks: int = 0
    failures: dict[FailureKey, int] = field(default_factory=dict)


class GuardState:
    """Integrity state of one ``KVStore``'s blocks and its scheduled requests."""

    def __init__(
        self,
        caches: list[torch.Tensor],
        block_size: int,
        level: str = "standard",
        scrub_blocks_per_step: int = 4,
        root_tag: int = ROOT_TAG,
        num_host_blocks: int = 0,
    ) -> None:
        if level not in _RANK:
            raise ValueError(f"integrity level {level!r} is not one of {INTEGRITY_LEVELS}")
        self.caches = caches
        self.level = level
        self.block_size = block_size
        self.num_blocks = caches[0].shape[1]
        self.scrub_blocks_per_step = scrub_blocks_per_step
        self.root_tag = root_tag
        self.tags_on = _RANK[level] >= _RANK["audit"]
        self.sums_on = _RANK[level] >= _RANK["standard"]
        self.strict = level == "strict"
        # True when the attention backend checks tags (and, strict, checksums) as it
        # reads: bind() hands it the expected tags, after_write() reads its verdicts.
        self.fused_reads = False
        # True when that backend's read sums also cover each open context block over the
        # slots a row reads (the cpu kernel): strict verifies the open block by them.
        self.open_block_sums = False
        self.counters = GuardCounters()
        device = caches[0].device
        self.tags = SlotTags(self.num_blocks, block_size, device)
        n_slots = self.num_blocks * block_size
        self.slot_sums = torch.zeros(n_slots, dtype=torch.int64, device=device)
        self.block_sums = torch.zeros(self.num_blocks, dtype=torch.int64, device=device)
        self.sealed = torch.zeros(self.num_blocks, dtype=torch.bool, device=device)
        self.chains = TagChains(root_tag)  # req_id -> tag of each position
        self._seen: set[str] = set()  # requests whose context was verified
        self._scrub_cursor = 1
        self._swapped_in: set[int] = set()  # blocks verified on arrival this step
        # Scrub picks this step's attention kernel checksums as it reads them, verified
        # after the forward pass (``guard_checksums._fuse_scrub``); None: scrubbed at once.
        self._deferred_scrub: list[int] | None = None
        # What bind gave a decode step's kernel and checks on the C++ path (KVGuard's
        # _bind_decode), for after_write: the read checks and the scrub picks.
        self._decode_step: tuple[ReadChecks, list[int]] | None = None
        # The offset keys as a numpy array, for checks that combine a few slot sums.
        self._offset_keys_np = offset_keys(block_size, torch.device("cpu")).numpy()
        # The host tier's copy of the same state (tags, slot sums, seals, block sums).
        self.host = TierState(num_host_blocks, block_size)
        if self.sums_on:
            # Compile (or load from cache) the checksum kernels now, at engine start,
            # not inside the first request's step. Block 0 is reserved padding.
            reserved = torch.zeros(1, dtype=torch.int64)
            block_checksums(caches, reserved)
            slot_checksums(caches, reserved)
        # after_write's sums of the slots each step wrote (levels with sums only: off
        # builds no checksum kernel)
        self.slot_checksums = SlotChecksums(caches) if self.sums_on else None
        # A decode step's checks at standard in two C++ calls (KVGuard._bind_decode);
        # None where the C++ kernels do not run (the general path serves every step).
        self.decode_guard = (
            decode_guard(caches, self.sealed, self.tags.tags, self.slot_sums, self.block_sums)
            if self.sums_on
            else None
        )

    def set_level(self, level: str) -> None:
        """Switch between ``standard`` and ``strict`` between two steps (a profile switch).

        Both keep the same tags, write-time sums and seals; ``strict`` only verifies more
        reads. Any other switch would start checking state that was not kept, or stop
        keeping state a later switch back would check, so it raises ``ValueError``.
        """
        if level == self.level:
            return
        runtime = ("standard", "strict")
        if level not in runtime or self.level not in runtime:
            raise ValueError(
                f"integrity cannot switch from {self.level!r} to {level!r} at runtime; "
                f"only between {' and '.join(runtime)}"
            )
        self.level = level
        self.strict = level == "strict"

    def forget(self, req_ids) -> None:
        """Drop per-request state (finished, preempted or rolled back requests)."""
        for rid in req_ids:
            self.chains.forget(rid)
            self._seen.discard(rid)

    def _chain(self, req: ScheduledRequest, upto: int) -> list[int]:
        """Tags of ``req``'s token chain for positions ``[0, upto)`` (cached, extended)."""
        return self.chains.chain(req, upto)

    def _expected_tags(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """(S, max stop) int64: the tag of each request's token chain at each position."""
        return self.chains.expected(reqs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Mirror ``KVStore.copy_blocks``: the copy carries tags, slot sums and seal."""
        if not pairs or not self.tags_on:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        device = self._device_state()
        copy_state(device, src, device, dst)

    def swap_out(self, swaps: list[BlockSwap]) -> None:
        """Mirror ``KVStore.swap_out``: host blocks take the device blocks' tags, sums and
        seals (metadata only; nothing is read)."""
        if swaps and self.tags_on:
            src = torch.tensor([w.src for w in swaps], dtype=torch.long)
            dst = torch.tensor([w.dst for w in swaps], dtype=torch.long)
            copy_state(self._device_state(), src, self.host, dst)

    def _device_state(self) -> TierState:
        return TierState.of(self.tags.tags, self.slot_sums, self.sealed, self.block_sums)

    def _attach_readers(self, faults: list[KVFault], reqs: list[ScheduledRequest]) -> list[KVFault]:
        """Add every scheduled request that reads a failed block to its fault's rollback."""
        if not faults:
            return faults
        bs = self.block_size
        result = []
        for f in faults:
            bad = set(f.block_ids)
            rollback = dict(f.rollback)
            for r in reqs:
                n_read = (r.positions.stop + bs - 1) // bs
                for i, b in enumerate(r.block_table[:n_read]):
                    if b in bad:
                        rollback[r.req_id] = min(rollback.get(r.req_id, i * bs), i * bs)
                        break
            result.append(KVFault(f.kind, f.block_ids, rollback, f.found_by, f.detail))
            self._count(f)
        self.forget({rid for f in result for rid in f.rollback})
        return result

    def attach_index_readers(
        self, faults: list[KVFault], out: SchedulerOutput, meta: AttentionMetadata
    ) -> list[KVFault]:
        """Add to each fault's rollback every request whose row of ``meta.block_index``
        (what attention actually read, after the forward pass) names a failed block.

        The faults found before the forward pass named their readers by block table; a
        request that read a failed block through an index that disagreed with its table
        (a redirect the tag check cannot see, since the redirected slots held the same
        tokens) read it all the same.
        """
        if not faults or out.is_empty:
            return faults
        bs = self.block_size
        tables = meta.block_index.view(meta.num_seqs, meta.max_blocks).tolist()
        result = []
        for f in faults:
            bad = set(f.block_ids) - {0}
            rollback = dict(f.rollback)
            for r, row in zip(out.requests, tables):
                n_read = (r.positions.stop + bs - 1) // bs
                for i, b in enumerate(row[:n_read]):
                    if b in bad:
                        rollback[r.req_id] = min(rollback.get(r.req_id, i * bs), i * bs)
                        break
            if rollback != f.rollback:
                f = KVFault(f.kind, f.block_ids, rollback, f.found_by, f.detail)
                self.forget(rollback)
            result.append(f)
        return result

    def _count(self, fault: KVFault) -> None:
        key = FailureKey(fault.kind, fault.found_by)
        self.counters.failures[key] = self.counters.failures.get(key, 0) + 1


class TierState:
    """Integrity state of one tier's blocks: tags (num_blocks, block_size), slot sums
    (num_blocks * block_size,), seals and block sums (num_blocks,)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.tags = torch.zeros(num_blocks, block_size, dtype=torch.int64)
        self.slot_sums = torch.zeros(num_blocks * block_size, dtype=torch.int64)
        self.sealed = torch.zeros(num_blocks, dtype=torch.bool)
        self.block_sums = torch.zeros(num_blocks, dtype=torch.int64)

    @classmethod
    def of(
        cls,
        tags: torch.Tensor,
        slot_sums: torch.Tensor,
        sealed: torch.Tensor,
        block_sums: torch.Tensor,
    ) -> TierState:
        state = cls.__new__(cls)
        state.tags, state.slot_sums, state.sealed, state.block_sums = (
            tags,
            slot_sums,
            sealed,
            block_sums,
        )
        return state


def copy_state(source: TierState, src: torch.Tensor, target: TierState, dst: torch.Tensor) -> None:
    """Block ``src[i]`` of ``source`` -> block ``dst[i]`` of ``target`` (all state)."""
    bs = source.tags.shape[1]
    device = target.tags.device
    target.tags[dst] = source.tags[src].to(device)
    target.slot_sums.view(-1, bs)[dst] = source.slot_sums.view(-1, bs)[src].to(device)
    target.sealed[dst] = source.sealed[src].to(device)
    target.block_sums[dst] = source.block_sums[src].to(device)
