"""Hypothesis state machine: random allocate/append/fork/prefix-hit/free/preempt/abort/
quarantine/swap out/swap in over a tiny pool and host tier, with invariants and a
simulated physical cache (both tiers) checked after every operation."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagewarden.kv import BlockRef, KVCacheManager, StaleBlockError
from pagewarden.kv.block import BlockState
from pagewarden.kv.errors import BlockStateError
from pagewarden.kv.prefix_hash import encode_extra_keys

BS = 2
NUM_BLOCKS = 9
NUM_HOST_BLOCKS = 5
EXTRAS = [encode_extra_keys("m", None), encode_extra_keys("m", "tenant")]
MAX_EXAMPLES = int(os.environ.get("PAGEWARDEN_HYPOTHESIS_EXAMPLES", "2000"))


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, num_host_blocks=NUM_HOST_BLOCKS)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.extra: dict[str, bytes] = {}
        self.slots: dict[int, int] = {}  # physical slot -> token id
        self.host_slots: dict[int, int] = {}  # host tier slot -> token id
        # Swapped-out requests: req id -> (tokens, computed, extra keys)
        self.swapped: dict[str, tuple[list[int], int, bytes]] = {}
        self.stale: list[BlockRef] = []
        self.next_id = 0

    # ------------------------------------------------------------ helpers
    def _write(self, rid: str, start: int, end: int) -> None:
        ids = self.kv.tables[rid].ids
        for p in range(start, end):
            self.slots[ids[p // BS] * BS + p % BS] = self.tokens[rid][p]

    def _advance(self, rid: str, k: int) -> bool:
        start = self.computed[rid]
        k = min(k, len(self.tokens[rid]) - start)
        if k <= 0:
            return True
        copies = self.kv.allocate_slots(rid, start, k)
        if copies is None:
            return False
        for src, dst in copies:
            for off in range(BS):
                if src * BS + off in self.slots:
                    self.slots[dst * BS + off] = self.slots[src * BS + off]
        self._write(rid, start, start + k)
        self.computed[rid] = start + k
        self.kv.seal_full_blocks(rid, self.tokens[rid], start + k)
        return True

    def _drop(self, rid: str) -> None:
        self.stale.extend(self.kv.tables[rid].refs)
        self.kv.free(rid)
        del self.tokens[rid], self.computed[rid], self.extra[rid]

    # --------------------------------------------------------------- rules
    @rule(
        prefix=st.sampled_from([[], [1, 2], [1, 2, 3, 4], [5, 6, 7]]),
        tail=st.lists(st.integers(0, 3), max_size=6),
        salt=st.integers(0, 1),
        k=st.integers(1, 8),
    )
    def start(self, prefix: list[int], tail: list[int], salt: int, k: int) -> None:
        tokens = prefix + tail
        if not tokens or len(self.tokens) >= 6:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        cached = self.kv.lookup_prefix(rid, tokens, EXTRAS[salt], len(tokens) - 1)
        assert cached % BS == 0 and cached <= len(tokens) - 1
        # Exact content check: a hit must hold this request's tokens.
        ids = self.kv.tables[rid].ids
        for p in range(cached):
            assert self.slots[ids[p // BS] * BS + p % BS] == tokens[p]
        self.tokens[rid], self.computed[rid], self.extra[rid] = tokens, cached, EXTRAS[salt]
        if not self._advance(rid, k):
            self._drop(rid)  # could not fit: unpin, as the scheduler does

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 6))
    def compute(self, data: st.DataObject, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._advance(rid, k)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tok=st.integers(0, 3))
    def append_and_decode(self, data: st.DataObject, tok: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.computed[rid] == len(self.tokens[rid]) and len(self.tokens[rid]) < 14:
            self.tokens[rid] = self.tokens[rid] + [tok]
        self._advance(rid, 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data: st.DataObject, n: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if len(self.tokens) + n > 8:
            return
        children = [f"{rid}#{i}" for i in range(n)]
        self.kv.fork(rid, children)
        for c in children:
            self.tokens[c] = list(self.tokens[rid])
            self.computed[c] = self.computed[rid]
            self.extra[c] = self.extra[rid]
        del self.tokens[rid], self.computed[rid], self.extra[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), twice=st.booleans())
    def finish_or_abort(self, data: st.DataObject, twice: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._drop(rid)
        if twice:
            self.kv.free(rid)  # idempotent

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt_and_resume(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, extra = self.tokens[rid], self.extra[rid]
        self._drop(rid)
        cached = self.kv.lookup_prefix(rid, tokens, extra, len(tokens) - 1)
        self.tokens[rid], self.computed[rid], self.extra[rid] = tokens, cached, extra
        if not self._advance(rid, len(tokens)):
            self._drop(rid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        computed = self.computed[rid]
        refs = self.kv.tables[rid].refs
        if len(refs) != (computed + BS - 1) // BS:
            return  # allocated ahead of what it computed: the scheduler never swaps that
        swaps = self.kv.swap_out(rid, computed)
        if swaps is None:
            assert self.kv.swap.num_free_blocks < len(refs)
            assert self.kv.has_table(rid)
            return
        assert [(w.src, w.num_slots) for w in swaps] == [
            (r.block_id, min(BS, computed - i * BS)) for i, r in enumerate(refs)
        ]
        for w in swaps:
            for off in range(w.num_slots):
                self.host_slots[w.dst * BS + off] = self.slots[w.src * BS + off]
        self.stale.extend(refs)
        self.swapped[rid] = (self.tokens.pop(rid), self.computed.pop(rid), self.extra.pop(rid))
        assert not self.kv.has_table(rid) and self.kv.is_swapped(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), abort=st.booleans())
    def swap_in_or_abort(self, data: st.DataObject, abort: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        if abort:
            self.kv.free(rid)
            del self.swapped[rid]
            return
        swaps = self.kv.swap_in(rid)
        if swaps is None:
            assert self.kv.is_swapped(rid)
            return
        for w in swaps:
            for off in range(w.num_slots):
                self.slots[w.dst * BS + off] = self.host_slots[w.src * BS + off]
        tokens, computed, extra = self.swapped.pop(rid)
        self.tokens[rid], self.computed[rid], self.extra[rid] = tokens, computed, extra
        assert self.kv.tables[rid].ids == [w.dst for w in swaps]
        self.kv.seal_full_blocks(rid, tokens, computed)  # full blocks indexed again

    @rule(block_id=st.integers(1, NUM_BLOCKS - 1))
    def quarantine_toggle(self, block_id: int) -> None:
        pool = self.kv.pool
        if pool.blocks[block_id].state is BlockState.QUARANTINED:
            if block_id in pool.retired:  # failed MAX_BLOCK_FAILURES times: out for good
                try:
                    pool.release_quarantine(block_id)
                except BlockStateError:
                    return
                raise AssertionError(f"retired block {block_id} was released")
            pool.release_quarantine(block_id)
        elif len(pool.quarantined) < 2:
            pool.quarantine(block_id)

    # ---------------------------------------------------------- invariants
    @invariant()
    def sound(self) -> None:
        assert self.kv.check_invariants() == []

    @invariant()
    def tables_read_back_own_tokens(self) -> None:
        for rid, tokens in self.tokens.items():
            ids = self.kv.tables[rid].ids
            for p in range(self.computed[rid]):
                assert self.slots[ids[p // BS] * BS + p % BS] == tokens[p], (rid, p)

    @invariant()
    def host_tier_reads_back_swapped_tokens(self) -> None:
        for rid, (tokens, computed, _) in self.swapped.items():
            host_ids = self.kv.swap.tables[rid].host_ids
            assert len(host_ids) == (computed + BS - 1) // BS
            for p in range(computed):
                assert self.host_slots[host_ids[p // BS] * BS + p % BS] == tokens[p], (rid, p)

    @invariant()
    def stale_refs_fail_loudly(self) -> None:
        for ref in self.stale[-4:]:
            block = self.kv.pool.blocks[ref.block_id]
            if block.epoch != ref.epoch:
                try:
                    self.kv.resolve(ref)
                except StaleBlockError:
                    pass
                else:
                    raise AssertionError(f"stale {ref} resolved")


KVMachine.TestCase.settings = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase
