"""A model runner stand-in for scheduler tests and benchmarks (pure Python).

It samples a deterministic token per request and position, and, with ``verify=True``,
simulates the physical KV cache (one token id per slot) to check that every block table
reads back exactly the request's own tokens: a wrong table entry, a missing copy-on-write
or a bad prefix hit shows up as a ``FakeKVMismatch``.
"""

from __future__ import annotations

import zlib

from pagewarden.sched.output import ModelRunnerOutput, SchedulerOutput


class FakeKVMismatch(AssertionError):
    """The simulated KV cache does not hold the tokens a block table claims."""


class FakeModelRunner:
    """``execute(out)`` returns one token per request scheduled with ``sample=True``."""

    def __init__(self, block_size: int, vocab_size: int = 32000, verify: bool = False) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.verify = verify
        self.slots: dict[int, int] = {}
        self.host_slots: dict[int, int] = {}  # the host (swap) tier, same layout
        self._seeds: dict[str, int] = {}  # req_id -> its token seed
        self.num_steps = 0

    def _seed(self, req_id: str) -> int:
        seed = self._seeds.get(req_id)
        if seed is None:
            seed = self._seeds[req_id] = zlib.crc32(req_id.encode()) % self.vocab_size
        return seed

    def token_for(self, req_id: str, position: int) -> int:
        """The token sampled for ``req_id`` after ``position`` context tokens."""
        return (self._seed(req_id) + position) % self.vocab_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        seeds = self._seeds
        for rid in out.finished_req_ids:
            seeds.pop(rid, None)
        if self.verify:
            self._apply(out)
        sampled = {
            sr.req_id: self.token_for(sr.req_id, sr.positions.stop)
            for sr in out.requests
            if sr.sample
        }
        return ModelRunnerOutput(sampled)

    def _apply(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        requests = out.requests
        slots = self.slots
        host = self.host_slots
        assert not (out.swap_out and out.swap_in), "a step swaps one way only"
        for tier_from, tier_to, swaps in ((slots, host, out.swap_out), (host, slots, out.swap_in)):
            for w in swaps:
                for off in range(bs):
                    tier_to.pop(w.dst * bs + off, None)
                for off in range(w.num_slots):
                    tier_to[w.dst * bs + off] = tier_from[w.src * bs + off]
        for src, dst in out.copy_blocks:
            for off in range(bs):
                s = src * bs + off
                if s in slots:
                    slots[dst * bs + off] = slots[s]
                else:
                    slots.pop(dst * bs + off, None)
        for sr in requests:
            for slot, tok in zip(sr.slot_mapping, sr.token_ids):
                if slot < bs:
                    raise FakeKVMismatch(f"{sr.req_id} wrote to reserved block 0")
                slots[slot] = tok
        for sr in requests:
            expected = sr.prompt_token_ids + sr.output_token_ids
            table = sr.block_table
            for p in range(sr.positions.stop):
                got = slots.get(table[p // bs] * bs + p % bs)
                if got != expected[p]:
                    raise FakeKVMismatch(
                        f"step {out.step_id}: {sr.req_id} position {p} reads {got}, "
                        f"expected {expected[p]} (table {table})"
                    )
