"""The guard's checks of blocks that arrive in the pool from outside it: swapped in from
the host tier (``swap_in``) or loaded from a KV tier (``tier_in``), each verified before
anything reads it, and the two verifications every check uses (``_verify_sealed``,
``_verify_slots``). A base of ``ChecksumChecks`` (``guard_checksums.py``).
"""

from __future__ import annotations

import torch

from pagewarden.sched.output import Finder, KVFault, SchedulerOutput
from pagewarden.worker.guard_state import GuardState, copy_state
from pagewarden.worker.integrity import (
    combine_slot_checksums,
    slot_checksums,
    to_signed64,
    verify_blocks,
    verify_slots,
)


class ArrivalChecks(GuardState):
    """Verification on arrival from the host tier and the KV tiers."""

    def swap_in(self, out: SchedulerOutput) -> list[KVFault]:
        """Mirror ``KVStore.swap_in`` and verify every block that arrived.

        A sealed block must match its block checksum; a partly filled one its used
        slots' write-time sums. Corruption in the host tier (or in the copy) becomes a
        "checksum" fault found by "swap_in", before anything reads the block.
        """
        swaps = out.swap_in
        self._swapped_in = set()
        if not swaps or not self.tags_on:
            return []
        src = torch.tensor([w.src for w in swaps], dtype=torch.long)
        dst = torch.tensor([w.dst for w in swaps], dtype=torch.long)
        copy_state(self.host, src, self._device_state(), dst)
        if not self.sums_on:
            return []
        bs = self.block_size
        whole = [w.dst for w in swaps if w.num_slots == bs and bool(self.sealed[w.dst])]
        slots = [
            w.dst * bs + o
            for w in swaps
            if not (w.num_slots == bs and bool(self.sealed[w.dst]))
            for o in range(w.num_slots)
        ]
        bad = self._verify_sealed(torch.tensor(whole, dtype=torch.int64))
        bad += self._verify_slots(torch.tensor(slots, dtype=torch.int64))
        # Checked on arrival, good or bad: this step's read checks skip them (a bad one
        # is already a fault; its readers are rolled back).
        self._swapped_in = {w.dst for w in swaps}
        return self._arrival_fault(
            bad,
            "swap_in",
            "a block swapped in from the host tier does not hold what was swapped out",
            out,
        )

    def _verify_sealed(self, ids: torch.Tensor) -> list[int]:
        """Ids of sealed blocks whose content no longer matches their seal."""
        if not ids.numel():
            return []
        self.counters.block_verifies += ids.numel()
        return verify_blocks(self.caches, ids, self.block_sums[ids])

    def _verify_slots(self, slots: torch.Tensor) -> list[int]:
        """Ids of blocks with a slot that changed since it was written."""
        if not slots.numel():
            return []
        self.counters.slot_verifies += slots.numel()
        bad = verify_slots(self.caches, slots, self.slot_sums[slots])
        return sorted({m.block_id for m in bad})

    def tier_in(self, out: SchedulerOutput) -> list[KVFault]:
        """Verify blocks copied into the pool from a KV tier (``out.tier_loads``).

        At every level but ``off``: the block checksum is recomputed over the bytes in
        the pool and compared with the entry's; the slots take the requesting chain's
        tags and write-time sums, and the block is sealed with the entry's checksum. A
        mismatch is a "checksum" fault found by "tier_load", before anything reads it.
        """
        loads = out.tier_loads
        if not loads or not self.tags_on:
            return []
        bs = self.block_size
        reqs = {r.req_id: r for r in out.requests}
        for load in loads:
            req = reqs.get(load.req_id)
            if req is None:  # not in this step (a hook took it out): its tags stay 0
                continue
            chain = self._chain(req, (load.index + 1) * bs)[load.index * bs :]
            self.tags.tags[load.block_id] = torch.tensor(chain, dtype=torch.int64)
        ids = torch.tensor([load.block_id for load in loads], dtype=torch.int64)
        slots = (ids.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)
        sums = slot_checksums(self.caches, slots)
        self.slot_sums[slots.to(self.slot_sums.device)] = sums
        got = combine_slot_checksums(sums.view(len(loads), bs)).cpu()
        want = torch.tensor([to_signed64(load.checksum) for load in loads], dtype=torch.int64)
        self.block_sums[ids] = want.to(self.block_sums.device)
        self.sealed[ids] = True
        self.counters.block_verifies += len(loads)
        self._swapped_in |= set(ids.tolist())  # verified on arrival: skip the read checks
        return self._arrival_fault(
            ids[got != want].tolist(),
            "tier_load",
            "a block loaded from a KV tier does not checksum in the pool to its entry's sum",
            out,
        )

    def _arrival_fault(
        self, bad: list[int], found_by: Finder, detail: str, out: SchedulerOutput
    ) -> list[KVFault]:
        """The "checksum" fault of the arrived blocks ``bad`` (none if empty), with the
        step's requests that read them."""
        if not bad:
            return []
        fault = KVFault("checksum", tuple(sorted(set(bad))), {}, found_by, detail)
        return self._attach_readers([fault], out.requests)
