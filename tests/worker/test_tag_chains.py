"""TagChains: per-request tag chains as lists and as rows of one table."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy
import torch

from pagewarden.worker.integrity import ROOT_TAG, mix64, token_chain_tags
from pagewarden.worker.tag_chains import TagChains, mix64_many


def _req(rid: str, tokens: list[int], start: int, stop: int, n_prompt: int) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=rid,
        prompt_token_ids=tokens[:n_prompt],
        output_token_ids=tokens[n_prompt:],
        positions=range(start, stop),
    )


def _want(tokens: list[int], stop: int, width: int) -> list[int]:
    return token_chain_tags(ROOT_TAG, tokens[:stop], 0) + [0] * (width - stop)


def test_expected_and_new_tags_follow_each_chain_as_requests_grow_and_leave() -> None:
    chains = TagChains(ROOT_TAG)
    a, b = list(range(100, 190)), list(range(500, 503))
    # Step 1: a prefills 70 of its 90 tokens, b all 3 of its own.
    step = [_req("a", a, 0, 70, 80), _req("b", b, 0, 3, 3)]
    assert chains.new_tags(step).tolist() == _want(a, 70, 70) + _want(b, 3, 3)
    assert chains.expected(step).tolist() == [_want(a, 70, 70), _want(b, 3, 70)]
    # Step 2: a's next 20 (past the table's first 64 columns), b decodes one.
    step = [_req("b", b + [7], 3, 4, 3), _req("a", a, 70, 90, 80)]
    assert chains.new_tags(step).tolist() == [_want(b + [7], 4, 4)[3]] + _want(a, 90, 90)[70:]
    assert chains.expected(step).tolist() == [_want(b + [7], 4, 90), _want(a, 90, 90)]
    # the same new tags out of the expected table, for several requests and for one
    assert torch.equal(TagChains.written(chains.expected(step), step), chains.new_tags(step))
    assert torch.equal(
        TagChains.written(chains.expected(step[:1]), step[:1]), chains.new_tags(step[:1])
    )
    # a leaves; c takes its row and must not see a's tags past its own stop.
    chains.forget("a")
    c = [9, 8]
    step = [_req("c", c, 0, 2, 2), _req("b", b + [7, 6], 4, 5, 3)]
    got = chains.expected(step)
    assert got.tolist() == [_want(c, 2, 5), _want(b + [7, 6], 5, 5)]
    assert got.dtype == torch.int64
    # A rolled-back request (forgotten) starts its chain again from its tokens.
    chains.forget("b")
    other = [1, 2, 3, 4, 5]
    assert chains.expected([_req("b", other, 0, 5, 5)]).tolist() == [_want(other, 5, 5)]


def test_rows_grow_past_the_first_table() -> None:
    chains = TagChains(ROOT_TAG)
    step = [_req(str(i), [i, i + 1], 0, 2, 2) for i in range(20)]  # 20 rows > 8
    got = chains.expected(step)
    assert got.tolist() == [_want([i, i + 1], 2, 2) for i in range(20)]
    assert chains.table.shape[0] >= 20


def test_one_stream_decoding_equals_a_fresh_chain_and_its_list_catches_up() -> None:
    """One request decoding past the table's first 64 columns: ``expected`` equals a
    fresh ``TagChains``'s at every step, though the decode steps write the new tags to
    the table only; ``chain`` then copies them back into the list."""
    fast = TagChains(ROOT_TAG)
    tokens = list(range(300, 400))
    fast.expected([_req("a", tokens, 0, 9, 9)])
    for stop in range(10, 80):
        step = [_req("a", tokens, stop - 1, stop, 9)]
        want = [_want(tokens, stop, stop)]
        assert fast.expected(step).tolist() == TagChains(ROOT_TAG).expected(step).tolist() == want
    assert len(fast._lists["a"]) == 9  # the prompt's; the decode steps wrote the table
    assert fast.chain(_req("a", tokens, 79, 80, 9), 80) == _want(tokens, 80, 80)
    # A prompt step after decode steps syncs from the caught-up list.
    step = [_req("a", tokens, 80, 90, 9)]
    assert fast.expected(step).tolist() == [_want(tokens, 90, 90)]


def test_decode_plan_syncs_a_request_not_in_state() -> None:
    """``decode_plan`` of a request whose chain is behind (never synced, or forgotten)
    syncs it up to the position it writes and widens the table; the caller's new tag
    then makes ``expected`` whole."""
    chains = TagChains(ROOT_TAG)
    tokens = list(range(10, 90))
    step = [_req("a", tokens, 70, 71, 9)]  # position 70, never synced, past 64 columns
    rows, starts, toks = chains.decode_plan(step)
    assert starts == [70] and toks == [tokens[70]] and chains.table.shape[1] > 70
    assert chains.table[rows[0], :70].tolist() == _want(tokens, 70, 70)
    assert chains.expected(step).tolist() == [_want(tokens, 71, 71)]


def test_mix64_many_equals_mix64() -> None:
    rng = random.Random(3)
    prev = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(200)] + [ROOT_TAG, -1, 0]
    tokens = [rng.randrange(0, 1 << 20) for _ in prev]
    positions = [rng.randrange(0, 1 << 40) for _ in prev]
    got = mix64_many(*(numpy.array(v, dtype=numpy.int64) for v in (prev, tokens, positions)))
    assert got.tolist() == [mix64(*t) for t in zip(prev, tokens, positions)]


def test_a_decode_step_of_several_streams_equals_expected_from_scratch() -> None:
    """Requests each writing the position past their synced chains take the numpy path
    (``_decode``); a step with a request in another state (a new prompt) takes the
    general one. Either way ``expected`` equals a fresh ``TagChains``'s."""
    fast = TagChains(ROOT_TAG)
    took: list[str] = []  # the paths of the current step
    decode, sync = fast._decode, fast._sync

    def spy(reqs):
        took.append("decode")
        return decode(reqs)

    def spy_sync(reqs, stops):
        took.append("sync")
        return sync(reqs, stops)

    fast._decode = spy  # type: ignore[method-assign]
    fast._sync = spy_sync  # type: ignore[method-assign]
    toks = {n: list(range(100 * i, 100 * i + 99)) for i, n in enumerate("abcde")}
    n_prompt = {"a": 9, "b": 20, "c": 33, "d": 5, "e": 12}
    done = {n: 0 for n in "abcd"}
    paths: list[list[str]] = []
    for k in range(45):  # "c" passes the table's first 64 columns
        if k == 17:
            done["e"] = 0  # a new prompt joins: this step goes the general way
        step = [
            _req(n, toks[n], d, d + (n_prompt[n] if d == 0 else 1), n_prompt[n])
            for n, d in done.items()
        ]
        want = TagChains(ROOT_TAG).expected(step).tolist()
        took.clear()
        assert fast.expected(step).tolist() == want
        paths.append(list(took))
        for r in step:
            done[r.req_id] = r.positions.stop
    assert paths[0] == paths[17] == ["sync"]
    # the rest decode; where the table grew, after syncing to the written position
    assert all(p[0] == "decode" for k, p in enumerate(paths) if k not in (0, 17))
    assert sum(p == ["decode"] for p in paths) >= 40
