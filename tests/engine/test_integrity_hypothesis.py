"""Property: in ``strict``, no token is ever released from KV that a fault altered.

Hypothesis interleaves random engine operations (add requests with shared prefixes and
n > 1, abort, step) with random faults of every kind on a small pool that forces
preemption (to a host tier too small for every victim, so both swap and recompute). The injector knows what each fault altered and counts tokens released from
a step that read altered KV before anyone detected it: that count must be 0. Every
fault that stayed readable must have been detected, and every request that was not
aborted must produce exactly what a fault-free engine produces for it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kv_echo_model import echo_engine, run_to_completion

from pagewarden.faults.injector import FAULT_KINDS, FaultInjector
from pagewarden.sampling_params import SamplingParams

EXAMPLES = int(os.environ.get("PAGEWARDEN_HYPOTHESIS_EXAMPLES_ENGINE", "30"))
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]

_add = st.tuples(
    st.just("add"),
    st.booleans(),
    st.lists(st.integers(3, 500), min_size=1, max_size=9),
    st.integers(1, 14),
    st.sampled_from([1, 1, 2]),
)
_op = st.one_of(
    _add,
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("fault"), st.sampled_from(FAULT_KINDS)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


def _params(max_tokens: int, n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(_op, min_size=4, max_size=30))
# Found by hypothesis: two use-after-free faults on one request; the rollback for the
# first dropped the second stale ref, which the injector still counted as read.
@example(
    ops=[
        ("step", 1),
        ("step", 1),
        ("step", 1),
        ("fault", "open_bitflip"),
        ("add", False, [3, 3], 4, 1),
        ("step", 3),
        ("add", True, [3], 2, 1),
        ("step", 1),
        ("fault", "use_after_free"),
        ("fault", "use_after_free"),
    ]
)
# Found by hypothesis: a write redirected away from a fresh block's slot that still held
# an earlier owner's tag for the same tokens; the read there passed the tag check. Fresh
# blocks now start with zeroed tags. The second example: the same, with that slot's K/V
# also corrupted by a use-after-free, so a wrong token was released.
@example(
    ops=[("step", 1)] * 13
    + [
        ("add", False, [3], 3, 2),
        ("step", 1),
        ("step", 1),
        ("add", False, [3], 1, 1),
        ("fault", "slot_redirect"),
        ("fault", "use_after_free"),
    ]
)
@example(
    ops=[
        ("add", False, [3], 1, 1),
        ("add", False, [3], 3, 1),
        ("step", 1),
        ("step", 1),
        ("add", False, [3], 1, 1),
        ("fault", "slot_redirect"),
    ]
)
# Found by hypothesis: a held block pushed on the free queue, then its request aborted
# before the next step's table check: the free linked the block a second time.
@example(
    ops=[
        ("add", False, [3], 2, 1),
        ("add", False, [3], 1, 1),
        ("step", 1),
        ("fault", "free_list_push"),
        ("abort", 0),
    ]
)
@example(
    ops=[
        ("add", True, [3], 2, 1),
        ("add", False, [3], 1, 1),
        ("fault", "sealed_bitflip"),
        ("step", 1),
        ("fault", "free_list_push"),
        ("abort", 0),
    ]
)
# The same window for a table entry rewritten to another request's block: the abort
# freed that block instead of its own (checked against the tables after the abort).
@example(
    ops=[
        ("add", False, [3, 4, 5, 6, 7], 3, 1),
        ("add", False, [8, 9, 10, 11, 12], 3, 1),
        ("step", 1),
        ("fault", "coherent_wrong_ref"),
        ("abort", 0),
    ]
)
# Found by hypothesis: two requests with the same tokens; one's block index redirected
# to the other's block (same tags, so no tag fault) in the step a bit flip there was
# found: the reader through the index must roll back too, not only the table's holder.
@example(
    ops=[
        ("add", False, [5, 3, 3], 3, 1),
        ("add", False, [5, 3, 3], 3, 1),
        ("fault", "sealed_bitflip"),
        ("fault", "index_redirect"),
    ]
)
# Found by hypothesis: a block index redirected back to the block a table redirect had
# moved the entry from, in the same step: the two undid each other (one mapping fault
# per request and step now).
@example(
    ops=[("step", 1)] * 9
    + [
        ("fault", "table_redirect"),
        ("fault", "index_redirect"),
        ("add", True, [3], 1, 2),
        ("add", True, [3], 2, 1),
    ]
)
# Found by hypothesis: a coherent wrong ref to a block of the same token chain that its
# owner was still filling (the same K/V after the step's write): no fault at all.
@example(
    ops=[
        ("add", False, [3], 5, 1),
        ("step", 1),
        ("add", False, [3], 4, 1),
        ("step", 1),
        ("add", False, [3], 1, 1),
        ("step", 1),
        ("step", 1),
        ("fault", "coherent_wrong_ref"),
    ]
)
# Found by hypothesis: a wrong ref to a sibling's block that a use after free then
# freed: the table check rolled both back but left the wrong ref's own block counted.
@example(
    ops=[("step", 1)] * 7
    + [
        ("add", True, [3], 2, 2),
        ("step", 1),
        ("step", 1),
        ("fault", "coherent_wrong_ref"),
        ("fault", "use_after_free"),
    ]
)
# Found by hypothesis: a second wrong ref pointed the entry back at its own block.
@example(
    ops=[("step", 1)] * 5
    + [
        ("add", True, [3], 2, 2),
        ("step", 1),
        ("step", 1),
        ("fault", "open_bitflip"),
        ("fault", "coherent_wrong_ref"),
        ("fault", "coherent_wrong_ref"),
    ]
)
# Found by hypothesis: two redirects armed for the same step.
@example(
    ops=[("add", False, [3], 1, 1)] * 3
    + [
        ("add", True, [3], 2, 1),
        ("fault", "slot_mapping_redirect"),
        ("fault", "slot_mapping_redirect"),
        ("add", False, [3], 2, 1),
    ]
)
@example(
    ops=[
        ("add", False, [3], 1, 1),
        ("add", False, [3], 2, 1),
        ("add", False, [3, 3], 2, 1),
        ("fault", "slot_redirect"),
        ("fault", "slot_mapping_redirect"),
        ("add", False, [3], 2, 1),
    ]
)
# Found by hypothesis: a table redirect onto a sibling's block with the bytes of the block
# a coherent wrong ref had displaced from that entry: it undid the wrong ref for the step
# (correct K/V read), yet the ground truth counted the token. Such redirects are not
# faults now; the wrong ref is found by the slot tags of its first read. The second: the
# same with the forward call's block index redirected.
@example(
    ops=[
        ("add", False, [3, 3, 3], 4, 2),
        ("step", 4),
        ("fault", "table_redirect"),
        ("fault", "coherent_wrong_ref"),
    ]
)
@example(
    ops=[
        ("add", False, [3, 3, 3], 4, 2),
        ("step", 4),
        ("fault", "index_redirect"),
        ("fault", "coherent_wrong_ref"),
    ]
)
def test_strict_never_releases_a_token_computed_from_altered_kv(tiny_llama_dir, ops) -> None:
    engine = echo_engine(
        tiny_llama_dir,
        block_size=4,
        num_kv_blocks=24,
        integrity="strict",
        max_num_batched_tokens=32,
        audit_interval=5,
        num_swap_blocks=8,
    )
    injector = FaultInjector(engine, seed=len(ops))
    added: dict[str, tuple[list[int], int, int]] = {}
    aborted: set[str] = set()
    outputs: dict[str, list[list[int]]] = {}

    def step(n: int) -> None:
        for _ in range(n):
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]

    for op in ops:
        if op[0] == "add":
            _, shared, tail, max_tokens, n = op
            rid = f"r{len(added)}"
            prompt = (PREFIX if shared else []) + tail
            added[rid] = (prompt, max_tokens, n)
            engine.add_request(rid, prompt, _params(max_tokens, n))
        elif op[0] == "step":
            step(op[1])
        elif op[0] == "fault":
            injector.inject(op[1])
        elif added:
            rid = f"r{op[1] % len(added)}"
            if rid not in outputs:
                aborted.add(rid)
            engine.abort_request(rid)
    step(1)
    outputs.update(run_to_completion(engine))
    injector.settle()

    assert injector.corrupted_tokens == 0
    for f in injector.faults:
        if f not in injector.pending_faults and f.kind != "foreign_thread":
            assert f.detected or not f.live_blocks, f
    s = engine.stats()
    assert s.integrity.failed_requests == 0
    assert s.integrity.invariant_violations == 0
    assert s.used_blocks == 0 and engine.scheduler.check_invariants() == []

    clean = echo_engine(
        tiny_llama_dir, block_size=4, num_kv_blocks=24, integrity="off", max_num_batched_tokens=32
    )
    for rid, (prompt, max_tokens, n) in added.items():
        if rid not in aborted:
            clean.add_request(rid, prompt, _params(max_tokens, n))
    expected = run_to_completion(clean)
    for rid, tokens in expected.items():
        assert outputs[rid] == tokens, rid
