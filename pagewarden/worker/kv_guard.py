"""The worker's integrity checks around each step, by integrity level.

``KVGuard`` owns the integrity state of the physical cache and runs the checks of
``worker/integrity.py`` at the points of a step where they matter::

    execute(out):
        guard.swap_out(out.swap_out)             # swap copies carry tags, sums and seals;
        faults = guard.swap_in(out, ...)         # a swapped-in block is verified on arrival
        guard.copy_blocks(out.copy_blocks)       # COW copies carry tags, sums and seals
        faults += guard.check_reads(out)         # before the forward pass: contents it reads
        meta = AttentionMetadata.build(...)
        guard.bind(out, meta)                    # the step's tags, to scatter with the K/V
        model forward: write_kv(cache, k, v, meta) scatters K, V and tags through
                       meta.slot_mapping; attention gathers through meta.block_index
        faults += guard.after_write(out, meta)   # tags read through meta.block_index,
                                                 # slot_mapping checked against block_index,
                                                 # write-time sums at meta.slot_mapping, seal
        drop the sampled tokens of every request a fault names

One index source, by construction: the tags are written by the same call and index tensor
as the K/V (``meta.slot_mapping``) and read through the same index tensor as attention
(``meta.block_index``) of that forward call; no other copy of the mapping (the scheduler's
tables, the runner's lists) takes part in a placement check. A kernel that reads and
writes the cache only through the metadata's two indices is covered without change.

Fused reads (``fused_reads``, the Triton and cpu backends): ``bind`` also hands the kernel each
request's expected tags (``meta.read_checks``); the attention kernel compares every slot
it reads through ``meta.block_index`` and, in ``strict``, sums each block's checksum as
it reads it. ``after_write`` turns its per-block verdicts into the same ``KVFault``s
(found by "read"), and ``check_reads`` leaves sealed context blocks to it instead of
re-reading them before the forward pass (``worker/fused_checks.py``).

What each level checks (each includes the one before):

========  ==================================================================================
off       nothing
audit     slot tags: after the step's writes, every position ``[0, stop)`` of every
          scheduled request, read through ``meta.block_index``, must hold the tag of that
          request's token chain at that position; and every new token's
          ``meta.slot_mapping`` entry must be the slot ``meta.block_index`` reads its
          position from (catches a wrong block-index entry, a wrong slot, a table entry
          pointing at another request's block, in the step they happen, before its tokens
          are released)
standard  write-time slot checksums (from the bytes at ``meta.slot_mapping``); block
          checksums at seal (from slots that still verify: a block whose slots earlier
          steps wrote is re-read first); verification of a request's context blocks the
          first time it reads them (prefix-cache reuse, return after preemption or
          rollback); verification of every block swapped in from the host tier (sealed
          blocks by block checksum, a partly filled one by its used slots' write-time
          sums); a scrubber re-verifying ``scrub_blocks_per_step`` sealed blocks per step,
          round robin
strict    every block a step reads is verified before the forward pass (sealed blocks by
          block checksum, the open block by its slots' write-time sums)
========  ==================================================================================

A failed check never raises: it becomes a ``KVFault`` naming the blocks and, for every
scheduled request that reads one of them, the position to recompute from. The scheduler
quarantines the blocks and rolls those requests back; no token is sampled from them in
this step, so nothing computed from bad KV is released by a check that caught it.

State per physical block: ``sealed[b]`` and ``block_sums[b]`` (valid while sealed);
per slot: ``slot_sums`` (write-time checksum) and the slot tag. A write at offset 0 of a
block starts that block's new life: ``bind`` unseals it and clears its tags before the
forward pass. Host (swap) blocks carry the same state, copied along with their bytes:
what a block held when it left the device is what it must hold when it comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kv.swap_space import BlockSwap
from pagewarden.sched.output import FailureKey, KVFault, ScheduledRequest, SchedulerOutput
from pagewarden.worker.fused_checks import allocate_read_checks
from pagewarden.worker.integrity import (
    MASK64,
    ROOT_TAG,
    SlotTags,
    block_checksums,
    combine_slot_checksums,
    mix64,
    slot_checksums,
    to_signed64,
    verify_blocks,
    verify_slots,
)

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


class KVGuard:
    """Integrity state and checks for one ``KVStore``; used only by the model runner."""

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
        self.counters = GuardCounters()
        device = caches[0].device
        self.tags = SlotTags(self.num_blocks, block_size, device)
        n_slots = self.num_blocks * block_size
        self.slot_sums = torch.zeros(n_slots, dtype=torch.int64, device=device)
        self.block_sums = torch.zeros(self.num_blocks, dtype=torch.int64, device=device)
        self.sealed = torch.zeros(self.num_blocks, dtype=torch.bool, device=device)
        self._chains: dict[str, list[int]] = {}  # req_id -> tag of each position
        self._chain_tensors: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()  # requests whose context was verified
        self._scrub_cursor = 1
        self._swapped_in: set[int] = set()  # blocks verified on arrival this step
        # The host tier's copy of the same state (tags, slot sums, seals, block sums).
        self.host = _TierState(num_host_blocks, block_size)
        if self.sums_on:
            # Compile (or load from cache) the checksum kernels now, at engine start,
            # not inside the first request's step. Block 0 is reserved padding.
            reserved = torch.zeros(1, dtype=torch.int64)
            block_checksums(caches, reserved)
            slot_checksums(caches, reserved)

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

    # ------------------------------------------------------------ request state
    def forget(self, req_ids) -> None:
        """Drop per-request state (finished, preempted or rolled back requests)."""
        for rid in req_ids:
            self._chains.pop(rid, None)
            self._chain_tensors.pop(rid, None)
            self._seen.discard(rid)

    def _chain_tensor(self, req: ScheduledRequest, upto: int) -> torch.Tensor:
        """``_chain`` as an int64 tensor, (upto,); converted once per position."""
        chain = self._chain(req, upto)
        cached = self._chain_tensors.get(req.req_id)
        if cached is None or cached.numel() < upto:
            have = 0 if cached is None else cached.numel()
            extra = torch.tensor(chain[have:], dtype=torch.int64)
            cached = extra if cached is None else torch.cat([cached, extra])
            self._chain_tensors[req.req_id] = cached
        return cached[:upto]

    def _chain(self, req: ScheduledRequest, upto: int) -> list[int]:
        """Tags of ``req``'s token chain for positions ``[0, upto)`` (cached, extended)."""
        chain = self._chains.get(req.req_id)
        if chain is None:
            chain = self._chains[req.req_id] = []
        if len(chain) < upto:
            prompt, output = req.prompt_token_ids, req.output_token_ids
            n_prompt = len(prompt)
            tag = chain[-1] if chain else self.root_tag
            for p in range(len(chain), upto):
                token = prompt[p] if p < n_prompt else output[p - n_prompt]
                tag = mix64(tag, token, p)
                chain.append(tag)
        return chain

    # ------------------------------------------------------------ copy-on-write
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Mirror ``KVStore.copy_blocks``: the copy carries tags, slot sums and seal."""
        if not pairs or not self.tags_on:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        device = self._device_state()
        _copy_state(device, src, device, dst)

    # ------------------------------------------------------------ swapping
    def swap_out(self, swaps: list[BlockSwap]) -> None:
        """Mirror ``KVStore.swap_out``: host blocks take the device blocks' tags, sums and
        seals (metadata only; nothing is read)."""
        if swaps and self.tags_on:
            src = torch.tensor([w.src for w in swaps], dtype=torch.long)
            dst = torch.tensor([w.dst for w in swaps], dtype=torch.long)
            _copy_state(self._device_state(), src, self.host, dst)

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
        _copy_state(self.host, src, self._device_state(), dst)
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
        if not bad:
            return []
        fault = KVFault(
            "checksum",
            tuple(sorted(set(bad))),
            {},
            "swap_in",
            "a block swapped in from the host tier does not hold what was swapped out",
        )
        return self._attach_readers([fault], out.requests)

    # ------------------------------------------------------------ KV tiers
    def seal_sums(self, block_ids: list[int]) -> list[int | None]:
        """Each block's sealed checksum (unsigned 64-bit), None where none is kept."""
        if not self.sums_on or not block_ids:
            return [None] * len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long)
        sealed = self.sealed[ids].tolist()
        sums = self.block_sums[ids].tolist()
        return [s & MASK64 if ok else None for s, ok in zip(sums, sealed)]

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
        bad = ids[got != want].tolist()
        if not bad:
            return []
        fault = KVFault(
            "checksum",
            tuple(sorted(set(bad))),
            {},
            "tier_load",
            "a block loaded from a KV tier does not checksum in the pool to its entry's sum",
        )
        return self._attach_readers([fault], out.requests)

    def _device_state(self) -> _TierState:
        return _TierState.of(self.tags.tags, self.slot_sums, self.sealed, self.block_sums)

    # ------------------------------------------------------------ before forward
    def check_reads(self, out: SchedulerOutput) -> list[KVFault]:
        """Verify the contents this step's attention will read; returns the faults found.

        Tags are checked after the write (``after_write``), where they also cover the
        positions written in this step.
        """
        if not self.sums_on:
            return []
        reqs = [r for r in out.requests if r.positions.start > 0]
        faults = self._check_contents(reqs)
        found = {b for f in faults for b in f.block_ids}
        faults += [f for f in self._scrub() if not found.issuperset(f.block_ids)]
        # From now on a request's context grows only by blocks it wrote and sealed itself.
        self._seen.update(r.req_id for r in out.requests)
        return self._attach_readers(faults, out.requests)

    def _check_tags(self, reqs: list[ScheduledRequest], meta: AttentionMetadata) -> list[KVFault]:
        """Every position ``[0, stop)`` of each request, read through ``meta.block_index``
        (the index attention gathered K/V with), must hold the tag of that request's
        token chain at that position."""
        assert meta.num_seqs == len(reqs), "metadata rows are the step's requests, in order"
        bs = self.block_size
        lens = [r.positions.stop for r in reqs]
        expected = self._expected_tags(reqs)
        tables = meta.block_index.view(meta.num_seqs, meta.max_blocks)  # (S, max_blocks)
        self.counters.tag_checks += sum(lens)
        bad = self.tags.verify(tables, lens, expected)
        if not bad:
            return []
        rollback: dict[str, int] = {}
        blocks: set[int] = set()
        for m in bad:
            rid = reqs[m.seq_index].req_id
            start = (m.position // bs) * bs
            rollback[rid] = min(rollback.get(rid, start), start)
            blocks.add(m.block_id)
        first = bad[0]
        detail = (
            f"{len(bad)} position(s) read a slot holding another token's K/V; first: "
            f"request {reqs[first.seq_index].req_id} position {first.position} in "
            f"block {first.block_id}"
        )
        return [KVFault("slot_tag", tuple(sorted(blocks)), rollback, "read", detail)]

    def _fused_tag_faults(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata
    ) -> list[KVFault]:
        """The attention kernel's tag verdicts: a nonzero ``tag_faults[i, lb]`` means a
        slot of sequence i's logical block lb, read through ``meta.block_index``, held
        another token's tag."""
        checks = meta.read_checks
        assert checks is not None and meta.num_seqs == len(reqs)
        self.counters.tag_checks += sum(r.positions.stop for r in reqs)
        bad = checks.tag_faults.nonzero().cpu()  # (n, 2): sequence, logical block
        if not bad.numel():
            return []
        bs = self.block_size
        tables = meta.block_index.view(meta.num_seqs, meta.max_blocks).cpu()
        rollback: dict[str, int] = {}
        blocks: set[int] = set()
        for i, lb in bad.tolist():
            rid = reqs[i].req_id
            rollback[rid] = min(rollback.get(rid, lb * bs), lb * bs)
            blocks.add(int(tables[i, lb]))
        i0, lb0 = bad[0].tolist()
        detail = (
            f"{bad.shape[0]} block read(s) found a slot holding another token's K/V; first: "
            f"request {reqs[i0].req_id} positions {lb0 * bs}..{lb0 * bs + bs - 1} in block "
            f"{int(tables[i0, lb0])} (checked by the attention kernel)"
        )
        return [KVFault("slot_tag", tuple(sorted(blocks)), rollback, "read", detail)]

    def _fused_sum_faults(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata
    ) -> list[KVFault]:
        """Strict: every sealed context block the kernel read must checksum to its seal
        (``check_reads`` left these to the kernel)."""
        checks = meta.read_checks
        assert checks is not None
        if checks.read_sums is None:
            return []
        bs, device = self.block_size, checks.read_sums.device
        tables = meta.block_index.view(meta.num_seqs, meta.max_blocks)  # (S, max_blocks)
        full = torch.tensor([r.positions.start // bs for r in reqs], device=device)  # (S,)
        logical = torch.arange(meta.max_blocks, device=device)  # (max_blocks,)
        # Full context blocks, sealed before this step and not verified on arrival.
        verify = (logical < full.unsqueeze(1)) & (tables != 0) & self.sealed[tables]
        if self._swapped_in:
            arrived = torch.tensor(sorted(self._swapped_in), device=device)
            verify &= ~torch.isin(tables, arrived)
        wrong = verify & (checks.block_sums() != self.block_sums[tables])
        n_verified, n_wrong = (int(x) for x in torch.stack([verify.sum(), wrong.sum()]).tolist())
        self.counters.block_verifies += n_verified
        if not n_wrong:
            return []
        bad = sorted(set(tables[wrong].tolist()))
        detail = (
            "context block content changed since it was sealed (checked by the attention kernel)"
        )
        return [KVFault("checksum", tuple(bad), {}, "read", detail)]

    def _check_contents(self, reqs: list[ScheduledRequest]) -> list[KVFault]:
        """Reuse verification (standard) or every read (strict) of context blocks."""
        bs = self.block_size
        full: set[int] = set()
        open_slots: list[int] = []
        for r in reqs:
            if not self.strict and r.req_id in self._seen:
                continue
            n = r.positions.start
            n_full = n // bs
            full.update(r.block_table[:n_full])
            if self.strict and n % bs and r.block_table[n_full] not in self._swapped_in:
                base = r.block_table[n_full] * bs
                open_slots.extend(range(base, base + n % bs))
        faults: list[KVFault] = []
        full.discard(0)
        full -= self._swapped_in  # verified on arrival in this very step
        if full:
            ids = torch.tensor(sorted(full), dtype=torch.int64)
            sealed = self.sealed[ids].cpu()
            sealed_ids, unsealed_ids = ids[sealed], ids[~sealed]
            if self.strict and self.fused_reads:
                # The attention kernel checksums these as it reads them (_fused_sum_faults).
                sealed_ids = sealed_ids[:0]
            bad = self._verify_sealed(sealed_ids)
            # A full block the guard never sealed (sealing failed or was skipped): check
            # its slots against their write-time sums instead.
            if unsealed_ids.numel():
                slots = (unsealed_ids.unsqueeze(1) * bs + torch.arange(bs)).reshape(-1)
                bad += self._verify_slots(slots)
            found_by = "read" if self.strict else "reuse"
            if bad:
                faults.append(
                    KVFault(
                        "checksum",
                        tuple(sorted(set(bad))),
                        {},
                        found_by,
                        "context block content changed since it was sealed",
                    )
                )
        if open_slots:
            bad = self._verify_slots(torch.tensor(open_slots, dtype=torch.int64))
            if bad:
                faults.append(
                    KVFault(
                        "checksum",
                        tuple(sorted(set(bad))),
                        {},
                        "read",
                        "an open block's slot changed since it was written",
                    )
                )
        return faults

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

    def scrub(self, num_blocks: int) -> list[KVFault]:
        """Re-verify the next ``num_blocks`` sealed blocks now, outside a step (idle time)."""
        if not self.sums_on:
            return []
        saved, self.scrub_blocks_per_step = self.scrub_blocks_per_step, num_blocks
        try:
            return self._attach_readers(self._scrub(), [])
        finally:
            self.scrub_blocks_per_step = saved

    @property
    def num_sealed(self) -> int:
        return int(self.sealed.sum())

    def _scrub(self) -> list[KVFault]:
        """Re-verify the next ``scrub_blocks_per_step`` sealed blocks (round robin)."""
        if self.scrub_blocks_per_step <= 0:
            return []
        sealed_ids = self.sealed.nonzero().view(-1)
        if not sealed_ids.numel():
            return []
        after = sealed_ids[sealed_ids >= self._scrub_cursor]
        picked = torch.cat([after, sealed_ids])[
            : min(self.scrub_blocks_per_step, sealed_ids.numel())
        ]
        self._scrub_cursor = int(picked[-1]) + 1
        self.counters.scrubbed_blocks += picked.numel()
        bad = self._verify_sealed(picked)
        if not bad:
            return []
        return [
            KVFault(
                "checksum",
                tuple(bad),
                {},
                "scrub",
                "the scrubber found a sealed block whose content changed",
            )
        ]

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

    # ------------------------------------------------------------ around forward
    def bind(self, out: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Give the forward pass this step's slot tags, to scatter with the K/V.

        ``write_kv`` writes ``meta.new_tags`` through ``meta.slot_mapping`` in the same
        call that writes K and V, so a tag lands wherever its token's K/V lands. Blocks
        that start a new life in this step forget their old tags first, so a slot this
        step was meant to write but did not cannot pass on an earlier owner's tag, and
        they are unsealed (their content is about to change).
        """
        if not self.tags_on or out.is_empty:
            return
        bs = self.block_size
        tags: list[torch.Tensor] = []
        new_blocks: list[int] = []
        for r in out.requests:
            start, stop = r.positions.start, r.positions.stop
            tags.append(self._chain_tensor(r, stop)[start:stop])
            first = (start + bs - 1) // bs  # blocks that start inside this step
            new_blocks.extend(r.block_table[first : (stop + bs - 1) // bs])
        if new_blocks:
            fresh_ids = torch.tensor(new_blocks, dtype=torch.int64)
            self.sealed[fresh_ids] = False
            self.tags.tags[fresh_ids] = 0
        meta.slot_tags = self.tags.tags.view(-1)
        meta.new_tags = torch.cat(tags).to(self.tags.tags.device)  # (T,)
        if self.fused_reads:
            expected = self._expected_tags(list(out.requests))
            n_kv = self.caches[0].shape[3]
            meta.read_checks = allocate_read_checks(
                expected.to(self.tags.tags.device), meta.max_blocks, n_kv, self.strict
            )

    def _expected_tags(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """(S, max stop) int64: the tag of each request's token chain at each position."""
        lens = [r.positions.stop for r in reqs]
        expected = torch.zeros(len(reqs), max(lens), dtype=torch.int64)
        for i, r in enumerate(reqs):
            expected[i, : lens[i]] = self._chain_tensor(r, lens[i])
        return expected

    def after_write(
        self, out: SchedulerOutput, meta: AttentionMetadata, skip: set[str]
    ) -> list[KVFault]:
        """Check every read through the kernel's own indices; write-time sums; seal.

        ``meta`` is the ``AttentionMetadata`` the forward pass used (``bind`` gave it the
        tags). Requests in ``skip`` (already faulted this step) are not sealed (their
        tags are still checked). Tags are checked after the write, through
        ``meta.block_index``, so they cover the positions written in this step too; and
        ``meta.slot_mapping`` must agree with ``meta.block_index`` position by position,
        so K/V scattered anywhere but where attention will look for it is caught at once,
        naming both the block it should have gone to and the block it went to.
        """
        if not self.tags_on or out.is_empty:
            return []
        bs = self.block_size
        reqs = list(out.requests)
        to_seal: list[int] = []
        fresh: list[int] = []
        for r in reqs:
            if r.req_id not in skip:
                start, stop = r.positions.start, r.positions.stop
                first = (start + bs - 1) // bs
                # Blocks this step filled: [start // bs, first) had slots written by
                # earlier steps and are re-read at seal; [first, stop // bs) were written
                # whole by this step, from which the sums were just taken.
                to_seal.extend(r.block_table[start // bs : min(first, stop // bs)])
                fresh.extend(r.block_table[first : stop // bs])
        # Tags of every request, faulted ones too: a bad tag in a block that a rollback
        # is about to drop would otherwise go unseen, and the block stays in the prefix
        # cache.
        if meta.read_checks is not None:
            faults = self._fused_tag_faults(reqs, meta)
            faults += self._fused_sum_faults(reqs, meta)
        else:
            faults = self._check_tags(reqs, meta)
        faults += self._check_slot_mapping(reqs, meta)
        if self.sums_on:
            # From the bytes at the slots the model actually wrote.
            slots = meta.slot_mapping
            self.slot_sums[slots] = slot_checksums(self.caches, slots)
            bad_blocks = {b for f in faults for b in f.block_ids} | {0}
            to_seal = sorted(set(to_seal) - bad_blocks)
            if to_seal:
                faults += self._seal(to_seal)
            fresh = sorted(set(fresh) - bad_blocks)
            if fresh:
                self._seal_written(fresh)
        return self._attach_readers(faults, reqs)

    def _check_slot_mapping(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata
    ) -> list[KVFault]:
        """Each new token's write slot must be where ``block_index`` reads its position::

        token t of sequence i at position p:
        slot_mapping[t] == block_index[i * max_blocks + p // bs] * bs + p % bs
        """
        bs = self.block_size
        device = meta.slot_mapping.device
        q_lens = torch.tensor([len(r.positions) for r in reqs], dtype=torch.int64)  # (S,)
        starts = torch.tensor([r.positions.start for r in reqs], dtype=torch.int64)  # (S,)
        seq = torch.repeat_interleave(torch.arange(len(reqs)), q_lens)  # (T,)
        first_token = torch.cumsum(q_lens, 0) - q_lens  # (S,)
        pos = starts[seq] + torch.arange(seq.numel()) - first_token[seq]  # (T,)
        row = (seq * meta.max_blocks + pos // bs).to(device)  # (T,)
        expected = meta.block_index[row] * bs + (pos % bs).to(device)  # (T,)
        wrong = (expected != meta.slot_mapping).nonzero().view(-1)
        if not wrong.numel():
            return []
        wrong_cpu = wrong.cpu()
        meant = (expected[wrong] // bs).tolist()
        went = (meta.slot_mapping[wrong] // bs).tolist()
        rollback: dict[str, int] = {}
        for t in wrong_cpu.tolist():
            rid, p = reqs[int(seq[t])].req_id, int(pos[t])
            rollback[rid] = min(rollback.get(rid, p), (p // bs) * bs)
        t0 = int(wrong_cpu[0])
        detail = (
            f"{wrong.numel()} token(s) written to a slot attention does not read them from; "
            f"first: request {reqs[int(seq[t0])].req_id} position {int(pos[t0])} went to "
            f"block {went[0]} instead of block {meant[0]}"
        )
        blocks = tuple(sorted(set(meant) | set(went)))
        return [KVFault("slot_mapping", blocks, rollback, "write", detail)]

    def _seal_written(self, block_ids: list[int]) -> None:
        """Seal blocks written whole by this step: their slot sums were just taken from
        the same bytes, so reading the blocks again would verify nothing new."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        self.block_sums[ids] = combine_slot_checksums(
            self.slot_sums.view(self.num_blocks, self.block_size)[ids]
        )
        self.sealed[ids] = True
        self.counters.seals += ids.numel()

    def _seal(self, block_ids: list[int]) -> list[KVFault]:
        """Seal full blocks from their write-time slot sums, after re-reading them."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        recorded = combine_slot_checksums(
            self.slot_sums.view(self.num_blocks, self.block_size)[ids]
        )
        actual = block_checksums(self.caches, ids)
        ok = actual == recorded
        self.counters.seals += int(ok.sum())
        self.counters.slot_verifies += ids.numel() * self.block_size
        self.block_sums[ids[ok]] = recorded[ok]
        self.sealed[ids[ok]] = True
        if bool(ok.all()):
            return []
        bad = ids[~ok].tolist()
        return [
            KVFault(
                "checksum",
                tuple(bad),
                {},
                "seal",
                "a slot changed between its write and the block's seal",
            )
        ]

    # ------------------------------------------------------------ quarantine
    def unseal(self, block_ids) -> None:
        """Forget the seals of quarantined blocks: their content is no longer trusted, and
        the scrubber must not keep re-finding a block that is already out of service."""
        if block_ids:
            self.sealed[torch.tensor(list(block_ids), dtype=torch.int64)] = False

    def scrub_quarantined(self, block_ids: list[int]) -> list[int]:
        """Zero quarantined blocks and read them back; returns the ids that verified.

        A block that reads back as written can return to service; one that does not
        stays quarantined (the pool retires a block after repeated failures).
        """
        if not block_ids:
            return []
        ids = torch.tensor(block_ids, dtype=torch.int64)
        for cache in self.caches:
            cache[:, ids] = 0
        self.tags.tags[ids] = 0
        self.sealed[ids] = False
        # All-zero content has checksum 0 (a sum of key * 0 terms).
        actual = block_checksums(self.caches, ids)
        self.counters.block_verifies += ids.numel()
        return ids[actual == 0].tolist()


class _TierState:
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
    ) -> _TierState:
        state = cls.__new__(cls)
        state.tags, state.slot_sums, state.sealed, state.block_sums = (
            tags,
            slot_sums,
            sealed,
            block_sums,
        )
        return state


def _copy_state(
    source: _TierState, src: torch.Tensor, target: _TierState, dst: torch.Tensor
) -> None:
    """Block ``src[i]`` of ``source`` -> block ``dst[i]`` of ``target`` (all state)."""
    bs = source.tags.shape[1]
    device = target.tags.device
    target.tags[dst] = source.tags[src].to(device)
    target.slot_sums.view(-1, bs)[dst] = source.slot_sums.view(-1, bs)[src].to(device)
    target.sealed[dst] = source.sealed[src].to(device)
    target.block_sums[dst] = source.block_sums[src].to(device)
