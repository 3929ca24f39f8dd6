"""The guard's checksum checks: seal, verify on reuse and on every read, on swap-in, scrub.

A block is sealed when it is full: its block checksum is combined from its slots'
write-time sums, after the slots are re-read (``_seal``), or straight away when this step
wrote it whole (``_seal_written``). Reads are verified against those seals: a request's
context blocks the first time it reads them (``standard``: prefix-cache reuse, return
after preemption or rollback), every block a step reads (``strict``; a fused kernel sums
sealed blocks as it reads them, ``_fused_sum_faults``), every block swapped in, and a
budgeted round-robin scrubber. Quarantined blocks are zeroed and read back before they
may return to service. See ``kv_guard.py`` for when each runs.
"""

from __future__ import annotations

import bisect

import numpy
import torch

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.sched.output import KVFault, ScheduledRequest, SchedulerOutput
from pagewarden.worker import integrity_cpu
from pagewarden.worker.guard_arrivals import ArrivalChecks
from pagewarden.worker.integrity import (
    MASK64,
    block_checksums,
    combine_slot_checksums,
)

#: The most blocks a step may read for its scrub picks to be checksummed by the
#: attention kernel (``ChecksumChecks._fuse_scrub``); larger steps scrub from the cache.
FUSED_SCRUB_MAX_BLOCKS = 64


class ChecksumChecks(ArrivalChecks):
    """Seals, checksum verification and the scrubber (a base of ``KVGuard``); the
    checks of blocks arriving from the host tier or a KV tier are ``ArrivalChecks``'."""

    def check_reads(self, out: SchedulerOutput) -> list[KVFault]:
        """Verify the contents this step's attention will read; returns the faults found.

        Tags are checked after the write (``after_write``), where they also cover the
        positions written in this step.
        """
        if not self.sums_on:
            return []
        seen = self._seen
        reqs = out.requests
        if (
            reqs
            and not self.strict
            and self._decode_path(reqs)
            and all(r.req_id in seen for r in reqs)
        ):
            # A decode step of requests whose context was verified (standard): nothing
            # to re-read; the kernel sums the scrub picks (_fuse_scrub, _close_decode).
            self._deferred_scrub = self._scrub_picks() or None
            return []
        reqs = [r for r in out.requests if r.positions.start > 0]
        faults = self._check_contents(reqs)
        found = {b for f in faults for b in f.block_ids}
        self._deferred_scrub = None
        if self._fuse_scrub(out):
            # The kernel checksums the picks it reads (after_write, _fused_scrub_faults).
            self._deferred_scrub = self._scrub_picks() or None
        else:
            faults += [
                f for f in self._scrub(self._verified_by_kernel(reqs))
                if not found.issuperset(f.block_ids)
            ]  # fmt: skip
        # From now on a request's context grows only by blocks it wrote and sealed itself.
        self._seen.update(r.req_id for r in out.requests)
        return self._attach_readers(faults, out.requests)

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
            # An open block: the kernel sums it as it reads it, or it is re-read here.
            open_block = r.block_table[n_full] if n % bs and not self._open_by_kernel else 0
            if self.strict and open_block and open_block not in self._swapped_in:
                base = open_block * bs
                open_slots.extend(range(base, base + n % bs))
        faults: list[KVFault] = []
        full.discard(0)
        full -= self._swapped_in  # verified on arrival in this very step
        if full:
            ids = sorted(full)
            flags = _gather(self.sealed, torch.tensor(ids, dtype=torch.int64)).tolist()
            # The attention kernel checksums sealed ones as it reads them (strict with a
            # checking kernel: _fused_sum_faults).
            by_kernel = self.strict and self.fused_reads
            sealed_ids = [b for b, f in zip(ids, flags) if f and not by_kernel]
            bad = self._verify_sealed(torch.tensor(sealed_ids)) if sealed_ids else []
            # A full block the guard never sealed (sealing failed or was skipped): check
            # its slots against their write-time sums instead.
            slots = [b * bs + o for b, f in zip(ids, flags) if not f for o in range(bs)]
            if slots:
                bad += self._verify_slots(torch.tensor(slots, dtype=torch.int64))
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

    def _fused_sum_faults(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata, named: set[int]
    ) -> list[KVFault]:
        """Strict: every sealed context block the kernel read must checksum to its seal
        (``check_reads`` left these to the kernel), and with the cpu kernel each open
        context block to its slots' write-time sums (``_open_block_faults``; a block in
        ``named``, which another fault of the step names, is left to that fault)."""
        checks = meta.read_checks
        assert checks is not None
        if checks.read_sums is None or not self.strict:  # standard: only the scrub picks
            return []
        # numpy on the host (views of CPU tensors): a decode step's few dozen entries,
        # where each torch op costs more than the whole comparison.
        bs, n_layers = self.block_size, len(self.caches)
        tables_t = meta.block_index.view(meta.num_seqs, meta.max_blocks)  # (S, max_blocks)
        tables = _host(tables_t)
        full = numpy.array([r.positions.start // bs for r in reqs])  # (S,)
        logical = numpy.arange(meta.max_blocks)  # (max_blocks,)
        # Full context blocks, sealed before this step and not verified on arrival.
        verify = (logical < full[:, None]) & (tables != 0) & _gather(self.sealed, tables_t)
        if self._swapped_in:
            verify &= ~numpy.isin(tables, sorted(self._swapped_in))
        # A sliding-window layer skips the blocks before its window: only a block every
        # layer read sums to its seal; one that some layers read is verified from the
        # cache instead; one that no layer read was not read in this step.
        partial: list[int] = []
        if checks.read_layers is not None:
            layers = _host(checks.read_layers)  # (S, max_blocks)
            some = verify & (layers > 0) & (layers < n_layers)
            partial = sorted(set(tables[some].tolist()))
            verify &= layers == n_layers
        # (S, max_blocks): each read block's checksum, summed over kv heads mod 2^64
        read = _host(checks.read_sums).sum(axis=1, dtype=numpy.int64)
        wrong = verify & (read != _gather(self.block_sums, tables_t))
        self.counters.block_verifies += int(verify.sum())
        bad_partial = self._verify_sealed(torch.tensor(partial)) if partial else []
        bad_open = self._open_block_faults(reqs, meta, read, named) if self._open_by_kernel else []
        if not wrong.any() and not bad_partial and not bad_open:
            return []
        bad = sorted(set(tables[wrong].tolist()) | set(bad_partial) | set(bad_open))
        detail = (
            "context block content changed since it was sealed (checked by the attention kernel)"
        )
        return [KVFault("checksum", tuple(bad), {}, "read", detail)]

    @property
    def _open_by_kernel(self) -> bool:
        """Strict with the cpu checking kernel: each context's open (partly filled) block
        is verified after the forward pass by the sum the kernel took of it as it read it
        (``_open_block_faults``), not re-read from the cache before the pass."""
        return self.strict and self.fused_reads and self.open_block_sums

    def _open_block_faults(
        self,
        reqs: list[ScheduledRequest],
        meta: AttentionMetadata,
        read: numpy.ndarray,
        named: set[int],
    ) -> list[int]:
        """Ids of open context blocks whose slots changed since they were written.

        The kernel sums each block it reads over the slots it reads: a decode row
        (one new token) its context and the new token, ``[0, stop)``; any other row its
        context, ``[0, start)``. The open block's share of that sum must equal the
        write-time slot sums (``after_write`` took the new token's first) combined with
        the offset keys over the same slots, the block checksum's own formula. A block
        that not every layer read is verified from the cache instead, by its slots::

            block  |o0 o1 o2 .. o(m-1)| .. bs-1      m = (stop or start) - lb * bs
            read[i, lb] == sum_o offset_key[o] * slot_sums[block * bs + o]  (mod 2^64)
        """
        checks = meta.read_checks
        assert checks is not None and checks.read_layers is not None
        bs, width, n_layers = self.block_size, meta.max_blocks, len(self.caches)
        # numpy views of the CPU tensors (_open_by_kernel): one block per row at most.
        tables = meta.block_index.numpy()  # (S * max_blocks,)
        layers = checks.read_layers.numpy().reshape(-1)
        sums = read.reshape(-1)  # (S * max_blocks,) the kernel's block sums
        slot_sums, keys = self.slot_sums.numpy(), self._offset_keys_np
        bad: list[int] = []
        rest: list[int] = []  # slots to verify from the cache
        for i, r in enumerate(reqs):
            start = r.positions.start
            if not start % bs:
                continue  # no open context block: the step starts a block or reads none
            lb = start // bs
            block = int(tables[i * width + lb])
            if block == 0 or block in self._swapped_in or block in named:
                continue  # padding, verified on arrival, or another fault's
            end = r.positions.stop if len(r.positions) == 1 else start
            m = end - lb * bs
            if layers[i * width + lb] != n_layers:
                rest.extend(range(block * bs, block * bs + start - lb * bs))
                continue
            self.counters.slot_verifies += m
            want = (slot_sums[block * bs : block * bs + m] * keys[:m]).sum(dtype=numpy.int64)
            if sums[i * width + lb] != want:
                bad.append(block)
        if rest:
            bad += self._verify_slots(torch.tensor(rest, dtype=torch.int64))
        return bad

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

    def _verified_by_kernel(self, reqs: list[ScheduledRequest]) -> set[int]:
        """Strict with a checking kernel: the full context blocks this step reads, which
        the kernel checksums against their seals as it reads them (``_fused_sum_faults``);
        empty otherwise."""
        if not (self.strict and self.fused_reads):
            return set()
        bs = self.block_size
        return {b for r in reqs for b in r.block_table[: r.positions.start // bs]}

    def _scrub(self, verified: set[int] | None = None) -> list[KVFault]:
        """Re-verify the next ``scrub_blocks_per_step`` sealed blocks (round robin); a
        pick in ``verified`` (checked against its seal in this step anyway) is not read
        a second time."""
        picked = self._scrub_picks()
        if verified:
            picked = [b for b in picked if b not in verified]
        if not picked:
            return []
        return _scrub_fault(self._verify_sealed(torch.tensor(picked, dtype=torch.int64)))

    def _scrub_picks(self) -> list[int]:
        """The next ``scrub_blocks_per_step`` sealed block ids from the cursor on, round
        robin (the cursor moves past them and they count as scrubbed)."""
        if self.scrub_blocks_per_step <= 0:
            return []
        if self.decode_guard is not None and integrity_cpu.enabled:
            # The C++ walk over the seal flags from the cursor: the same picks, without
            # listing every sealed id in Python each step.
            picked = self.decode_guard.scrub_picks(self._scrub_cursor, self.scrub_blocks_per_step)
            if picked:
                self._scrub_cursor = picked[-1] + 1
                self.counters.scrubbed_blocks += len(picked)
            return picked
        # Plain lists (numpy's nonzero on the CPU): torch's nonzero and a handful of torch
        # ops on a few ids cost more than the bisect, at one stream a good part of a step.
        if self.sealed.device.type == "cpu":
            sealed_ids = numpy.flatnonzero(self.sealed.numpy()).tolist()  # ascending
        else:
            sealed_ids = self.sealed.nonzero().view(-1).tolist()
        k = min(self.scrub_blocks_per_step, len(sealed_ids))
        if not k:
            return []
        i = bisect.bisect_left(sealed_ids, self._scrub_cursor)
        picked = sealed_ids[i : i + k]
        picked += sealed_ids[: k - len(picked)]  # wrap around to the start
        self._scrub_cursor = picked[-1] + 1
        self.counters.scrubbed_blocks += k
        return picked

    def _decode_path(self, reqs) -> bool:
        """Whether this step's checks run as ``DecodeGuard``'s two C++ calls: a decode
        step (one new token per request) with the cpu checking kernel, at ``standard``
        or at ``strict`` (where the kernel also sums each open block and no block of the
        step arrived by swap-in)."""
        return (
            self.decode_guard is not None
            and self.fused_reads
            and (not self.strict or (self._open_by_kernel and not self._swapped_in))
            and integrity_cpu.enabled
            and all(len(r.positions) == 1 for r in reqs)
        )

    def _fuse_scrub(self, out: SchedulerOutput) -> bool:
        """Whether this step's scrub picks are checksummed by the attention kernel as it
        reads them (``standard`` on the CPU with a checking kernel; a decode step that
        ``DecodeGuard`` checks, or another step reading at most
        ``FUSED_SCRUB_MAX_BLOCKS`` blocks): the scrubber's separate pass re-reads its
        picks from memory (at 64 streams ~0.45 ms of a 40 ms step), while the kernel
        sums a pick as it reads it anyway, and ``DecodeGuard.open`` flags the picks in
        C++; the general path flags them in Python, a walk of the whole table."""
        if self.strict or not self.fused_reads or self.scrub_blocks_per_step <= 0:
            return False
        if out.is_empty or self.caches[0].device.type != "cpu":
            return False
        if self._decode_path(out.requests):
            return True
        bs = self.block_size
        read = sum((r.positions.stop + bs - 1) // bs for r in out.requests)
        return read <= FUSED_SCRUB_MAX_BLOCKS

    def _fused_scrub_faults(
        self, reqs: list[ScheduledRequest], meta: AttentionMetadata
    ) -> list[KVFault]:
        """The deferred scrub picks (``check_reads``), verified after the forward pass:
        a pick that some sequence read, as a full context block, in every layer, by the
        kernel's sum of it; any other pick from the cache, as ``_scrub`` does. Picks
        that stopped being sealed in this step (a new life started in ``bind``, a
        quarantine) are skipped, as the next pick round would."""
        picked, self._deferred_scrub = self._deferred_scrub, None
        if not picked:
            return []
        # numpy views of the CPU tensors (_fuse_scrub): a few ids, where torch's indexing
        # ops cost tens of microseconds each.
        sealed, block_sums = self.sealed.numpy(), self.block_sums.numpy()
        want = {b: int(block_sums[b]) for b in picked if sealed[b]}
        self.counters.scrubbed_blocks -= len(picked) - len(want)  # skipped: not scrubbed
        checks = meta.read_checks
        bad: set[int] = set()
        covered: set[int] = set()
        width, n_layers, bs = meta.max_blocks, len(self.caches), self.block_size
        if checks is None or checks.read_sums is None or checks.read_layers is None:
            reqs = []  # no kernel sums (a hook swapped the checks): all from the cache
        else:
            tables = meta.block_index.numpy().tolist()  # (S * max_blocks,)
            layers = checks.read_layers.numpy().reshape(-1).tolist()
            # (S, n_kv, max_blocks) summed over kv heads, wrapping mod 2^64 as torch's sum
            sums = checks.read_sums.numpy().sum(axis=1, dtype=numpy.int64).reshape(-1).tolist()
        for i, r in enumerate(reqs):
            for lb in range(r.positions.start // bs):  # full context blocks
                b = tables[i * width + lb]
                if b in want and layers[i * width + lb] == n_layers:
                    covered.add(b)
                    if sums[i * width + lb] != want[b]:
                        bad.add(b)
        self.counters.block_verifies += len(covered)
        rest = [b for b in want if b not in covered]
        if rest:
            bad.update(self._verify_sealed(torch.tensor(rest, dtype=torch.int64)))
        return _scrub_fault(sorted(bad))

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

    def unseal(self, block_ids) -> None:
        """Forget the seals of quarantined blocks (their content is no longer trusted, and
        the scrubber must not keep re-finding a block that is already out of service) and
        of dead ones (``SchedulerOutput.dead_blocks``: nothing reads them before a new
        life rewrites them, so scrubbing them would only delay the live blocks' turn)."""
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

    # ------------------------------------------------------------ KV tiers
    def seal_sums(self, block_ids: list[int]) -> list[int | None]:
        """Each block's sealed checksum (unsigned 64-bit), None where none is kept."""
        if not self.sums_on or not block_ids:
            return [None] * len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.long)
        sealed = self.sealed[ids].tolist()
        sums = self.block_sums[ids].tolist()
        return [s & MASK64 if ok else None for s, ok in zip(sums, sealed)]


def _host(t: torch.Tensor) -> numpy.ndarray:
    """A numpy array of ``t``: a view in host memory, else a copy from the device."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _gather(state: torch.Tensor, index: torch.Tensor) -> numpy.ndarray:
    """``state[index]`` as a numpy array (numpy's gather for a host tensor: a few ids,
    where torch's indexing costs tens of microseconds)."""
    if state.device.type == "cpu":
        return state.numpy()[index.numpy()]
    return state[index].cpu().numpy()


def _scrub_fault(bad: list[int]) -> list[KVFault]:
    """The scrubber's fault for the blocks in ``bad`` (none when empty)."""
    if not bad:
        return []
    detail = "the scrubber found a sealed block whose content changed"
    return [KVFault("checksum", tuple(bad), {}, "scrub", detail)]
