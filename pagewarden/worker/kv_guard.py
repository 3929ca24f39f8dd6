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
re-reading them before the forward pass (``worker/fused_checks.py``); with the cpu
kernel also each open context block, whose partial sum must equal its written slots'
write-time sums combined (``_open_block_faults``). Either way a failed read is found in
the step that reads it, before that step's tokens are released.

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
strict    every block a step reads is verified before its tokens are released (sealed
          blocks by block checksum, the open block by its slots' write-time sums): before
          the forward pass, or from a checking kernel's sums after it (fused reads)
========  ==================================================================================

Decode steps with the cpu kernel (one new token per request, every step of a stream
after its prompt), at ``standard`` and at ``strict`` (where no block of the step arrived by
swap-in), run the same ``bind`` and ``after_write`` work as two C++ calls over the
guard's state (``DecodeGuard`` in ``kernels/cpu/checksum.cpp``: ``_bind_decode``,
``_close_decode``; at ``strict`` the second also holds every context block to the
kernel's sum of it). Only a clean step finishes there; a step in which
any check fails is handed, unchanged but for its write-time sums, to the general path
below, which finds and names the fault. ``tests/worker/test_decode_guard.py`` holds the
two paths to the same tokens, faults, counters and state.

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

import torch

from pagewarden.kernels.attention import AttentionMetadata, ReadChecks
from pagewarden.sched.output import KVFault, ScheduledRequest, SchedulerOutput
from pagewarden.worker.fused_checks import allocate_read_checks, sum_only
from pagewarden.worker.guard_checksums import ChecksumChecks
from pagewarden.worker.guard_state import INTEGRITY_LEVELS, GuardCounters, IntegrityLevel

__all__ = ["INTEGRITY_LEVELS", "GuardCounters", "IntegrityLevel", "KVGuard"]


class KVGuard(ChecksumChecks):
    """Integrity state and checks for one ``KVStore``; used only by the model runner.

    The state and the request chains are ``GuardState``'s (``guard_state.py``), the
    checksum checks ``ChecksumChecks``' (``guard_checksums.py``); this class adds what
    happens around the forward pass: the step's tags handed to the kernel (``bind``) and
    the checks through the kernel's own indices after it wrote (``after_write``).
    """

    def bind(self, out: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Give the forward pass this step's slot tags, to scatter with the K/V.

        ``write_kv`` writes ``meta.new_tags`` through ``meta.slot_mapping`` in the same
        call that writes K and V, so a tag lands wherever its token's K/V lands. Blocks
        that start a new life in this step forget their old tags first, so a slot this
        step was meant to write but did not cannot pass on an earlier owner's tag, and
        they are unsealed (their content is about to change).
        """
        self._decode_step = None
        if not self.tags_on or out.is_empty:
            return
        if self._decode_path(out.requests):
            self._bind_decode(list(out.requests), meta)
            return
        bs = self.block_size
        new_blocks: list[int] = []
        for r in out.requests:
            start, stop = r.positions.start, r.positions.stop
            first = (start + bs - 1) // bs  # blocks that start inside this step
            new_blocks.extend(r.block_table[first : (stop + bs - 1) // bs])
        if new_blocks:
            fresh_ids = torch.tensor(new_blocks, dtype=torch.int64)
            self.sealed[fresh_ids] = False
            self.tags.tags[fresh_ids] = 0
        meta.slot_tags = self.tags.tags.view(-1)
        reqs = list(out.requests)
        if not self.fused_reads:
            meta.new_tags = self.chains.new_tags(reqs).to(self.tags.tags.device)  # (T,)
        else:
            expected = self._expected_tags(reqs)  # (S, max stop); the new tags are in it
            meta.new_tags = self.chains.written(expected, reqs).to(self.tags.tags.device)
            n_kv = self.caches[0].shape[3]
            sums = self.strict or self._deferred_scrub is not None
            checks = allocate_read_checks(
                expected.to(self.tags.tags.device), meta.max_blocks, n_kv, sums
            )
            if sums and not self.strict:  # only the scrub picks (_fuse_scrub), where read
                assert self._deferred_scrub is not None
                if not sum_only(checks, meta.block_index, self._deferred_scrub):
                    checks.read_sums = checks.read_layers = None  # all from the cache
            meta.read_checks = checks

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
        step, self._decode_step = self._decode_step, None
        reqs = list(out.requests)
        if step is not None and not skip and meta.read_checks is step[0]:
            if self._close_decode(reqs, meta, step[1]):
                return []  # clean; anything else is found and named by the path below
        bs = self.block_size
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
        if self.sums_on:
            # From the bytes at the slots the model actually wrote; first, as strict's
            # open-block check combines the new tokens' sums with the older slots'.
            assert self.slot_checksums is not None  # built where sums_on
            self.slot_checksums.store(meta.slot_mapping, self.slot_sums)
        # Tags of every request, faulted ones too: a bad tag in a block that a rollback
        # is about to drop would otherwise go unseen, and the block stays in the prefix
        # cache.
        fused = meta.read_checks is not None
        tags = self._fused_tag_faults(reqs, meta) if fused else self._check_tags(reqs, meta)
        scrub = self._fused_scrub_faults(reqs, meta)  # the picks check_reads deferred
        mapping = self._check_slot_mapping(reqs, meta)
        # A block a tag or write-slot fault names was read or written through a wrong
        # index: its sum says nothing more, and the fault already recomputes it.
        named = {b for f in tags + mapping for b in f.block_ids}
        sums = self._fused_sum_faults(reqs, meta, named) if fused else []
        faults = tags + sums + scrub + mapping
        if self.sums_on:
            bad_blocks = {b for f in faults for b in f.block_ids} | {0}
            to_seal = sorted(set(to_seal) - bad_blocks)
            if to_seal:
                faults += self._seal(to_seal)
            fresh = sorted(set(fresh) - bad_blocks)
            if fresh:
                self._seal_written(fresh)
        return self._attach_readers(faults, reqs)

    def _bind_decode(self, reqs: list[ScheduledRequest], meta: AttentionMetadata) -> None:
        """``bind`` for a decode step, the same state and kernel inputs with one C++ call
        (``DecodeGuard.bind``): each request's new tag into the chain table, the expected
        tags and the kernel's zeroed outputs, blocks written at offset 0 starting a new
        life, and the kernel's sums limited to the scrub picks."""
        assert self.decode_guard is not None
        chains = self.chains
        rows, starts, tokens = chains.decode_plan(reqs)
        picks = self._deferred_scrub or []
        expected, meta.new_tags, tag_faults, read_sums, read_layers = self.decode_guard.bind(
            meta.block_index,
            chains.table,
            rows,
            starts,
            tokens,
            chains.root_tag,
            picks,
            self.caches[0].shape[3],
            self.strict,
        )
        chains.decoded(reqs)
        meta.slot_tags = self.tags.tags.view(-1)
        checks = ReadChecks(expected, tag_faults, read_sums, read_layers)
        meta.read_checks = checks
        self._decode_step = (checks, picks)

    def _close_decode(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata, picks: list[int]
    ) -> bool:
        """``after_write`` for a decode step that ``_bind_decode`` opened: write-time sums,
        the kernel's tag verdicts, the slot mapping, the scrub picks and the seals of
        filled blocks in one C++ call (``DecodeGuard.close``). True: every check passed
        and the state moved on as the general path would have moved it. False: something
        failed, nothing but the write-time sums was recorded, and the general path runs
        the same checks again to name the fault."""
        checks = meta.read_checks
        assert self.decode_guard is not None and checks is not None
        clean, by_kernel, reread, live, sealed_read, sealed_written, blocks, slots = (
            self.decode_guard.close(
                meta.block_index,
                meta.slot_mapping,
                picks,
                checks.tag_faults,
                checks.read_sums,
                checks.read_layers,
            )
        )
        if not clean:
            return False
        self._deferred_scrub = None
        counters = self.counters
        counters.tag_checks += sum(r.positions.stop for r in reqs)
        counters.scrubbed_blocks -= len(picks) - live  # unsealed since picked: not scrubbed
        counters.block_verifies += by_kernel + reread + blocks  # blocks, slots: strict's
        counters.seals += sealed_read + sealed_written
        counters.slot_verifies += sealed_read * self.block_size + slots
        return True

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
        if checks.tag_faults.device.type == "cpu" and not checks.tag_faults.numpy().any():
            return []  # numpy's any on the CPU: torch's nonzero costs more, every step
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

    def _check_slot_mapping(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata
    ) -> list[KVFault]:
        """Each new token's write slot must be where ``block_index`` reads its position::

        token t of sequence i at position p:
        slot_mapping[t] == block_index[i * max_blocks + p // bs] * bs + p % bs
        """
        bs, width = self.block_size, meta.max_blocks
        # Plain lists: a decode step has one token per request, and a handful of torch
        # ops over 64 tokens cost more than the comparisons.
        index = meta.block_index.tolist()  # (S * max_blocks,)
        written = meta.slot_mapping.tolist()  # (T,)
        wrong: list[tuple[int, int, int, int]] = []  # (request, position, token, expected)
        t = 0
        for i, r in enumerate(reqs):
            for p in r.positions:
                expected = index[i * width + p // bs] * bs + p % bs
                if written[t] != expected:
                    wrong.append((i, p, t, expected))
                t += 1
        assert t == len(written), f"slot_mapping has {len(written)} entries for {t} tokens"
        if not wrong:
            return []
        meant = [e // bs for *_, e in wrong]
        went = [written[t] // bs for _, _, t, _ in wrong]
        rollback: dict[str, int] = {}
        for i, p, _, _ in wrong:
            rid = reqs[i].req_id
            rollback[rid] = min(rollback.get(rid, p), (p // bs) * bs)
        i0, p0, _, _ = wrong[0]
        detail = (
            f"{len(wrong)} token(s) written to a slot attention does not read them from; "
            f"first: request {reqs[i0].req_id} position {p0} went to "
            f"block {went[0]} instead of block {meant[0]}"
        )
        blocks = tuple(sorted(set(meant) | set(went)))
        return [KVFault("slot_mapping", blocks, rollback, "write", detail)]
