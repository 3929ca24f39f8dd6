"""The engine-core process loop: a failed step fails its culprit alone, or ends the loop."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pagewarden.engine.core_proc import _Inbox, _loop
from pagewarden.sampling_params import SamplingParams


class _Conn:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, msg: tuple) -> None:
        self.sent.append(msg)


class _Outputs:
    def __init__(self) -> None:
        self.aborted: list[tuple[str, str]] = []

    def abort(self, rid: str, reason: str = "abort"):
        self.aborted.append((rid, reason))


class _Recorder:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def dump(self, reason: str) -> None:
        self.reasons.append(reason)


class _FakeCore:
    """Steps ``steps`` times; the steps listed in ``fail_at`` raise."""

    scheduler = SimpleNamespace(max_num_batched_tokens=2048)

    def __init__(self, steps: int, fail_at: set[int], inbox_ref: list) -> None:
        self.left, self.fail_at, self.n, self.inbox_ref = steps, fail_at, 0, inbox_ref
        self.outputs = _Outputs()
        self.aborts: list[str] = []
        self.recorder: _Recorder | None = None

    def has_unfinished(self) -> bool:
        if self.left == 0:
            self.inbox_ref[0].stop = True
        return self.left > 0

    def step(self):
        self.n += 1
        self.left -= 1
        if self.n in self.fail_at:
            raise RuntimeError("boom")
        return []

    def abort_request(self, rid: str) -> None:
        self.aborts.append(rid)

    def stats(self) -> str:
        return "stats"


def _setup(steps: int, fail_at: set[int], culprits: set[str]):
    ref: list = [None]
    core = _FakeCore(steps, fail_at, ref)
    probe = lambda ids, params: "bad params" if ids == [666] else None  # noqa: E731
    inbox = _Inbox(core, None, probe)
    ref[0] = inbox
    for rid in ("good", *culprits):
        inbox.params[rid] = ([666] if rid in culprits else [1], SamplingParams())
    return core, inbox


def test_failed_step_fails_only_the_request_whose_params_fail():
    core, inbox = _setup(steps=3, fail_at={2}, culprits={"bad"})
    out = _Conn()
    _loop(core, inbox, out)
    assert core.outputs.aborted == [("bad", "error")] and core.aborts == ["bad"]
    failed = [f for msg in out.sent if msg[0] == "step" for f in msg[3]]
    assert [rid for rid, _ in failed] == ["bad"] and "bad params" in failed[0][1]
    assert set(inbox.params) == {"good"}  # the others go on


def test_unattributable_step_failure_ends_the_loop():
    core, inbox = _setup(steps=3, fail_at={2}, culprits=set())
    with pytest.raises(RuntimeError, match="no request explains it"):
        _loop(core, inbox, _Conn())


def test_two_failed_steps_in_a_row_end_the_loop():
    core, inbox = _setup(steps=4, fail_at={2, 3}, culprits={"bad", "worse"})
    with pytest.raises(RuntimeError, match="boom"):
        _loop(core, inbox, _Conn())


def test_a_failed_step_writes_the_flight_record_before_anything_else():
    core, inbox = _setup(steps=4, fail_at={2, 3}, culprits={"bad", "worse"})
    core.recorder = _Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        _loop(core, inbox, _Conn())
    # The isolated failure and the one that ends the loop each leave a record.
    assert core.recorder.reasons == ["engine step raised RuntimeError('boom')"] * 2


def test_an_idle_core_waits_for_the_rest_of_a_burst_before_its_first_step():
    # Requests of one burst arrive 1 ms apart (as a client opening many streams reaches
    # the core); the first step must not start on the first of them.
    core, inbox = _setup(steps=1, fail_at=set(), culprits=set())
    arrived: list[int] = []
    seen_at_first_step: list[int] = []
    step = core.step
    core.step = lambda: (seen_at_first_step.append(len(arrived)), step())[1]

    def burst() -> None:
        for i in range(10):
            arrived.append(i)
            inbox.wake.set()
            time.sleep(0.001)

    feeder = threading.Thread(target=burst)
    feeder.start()
    _loop(core, inbox, _Conn())
    feeder.join()
    assert seen_at_first_step == [10]


class _BurstCore:
    """An idle core that takes one step, as soon as it has work, and records what came."""

    def __init__(self, budget: int) -> None:
        self.scheduler = SimpleNamespace(max_num_batched_tokens=budget)
        self.added: list[str] = []
        self.seen_at_step: list[str] = []
        self.recorder = None
        self.inbox: _Inbox | None = None

    def add_request(self, rid, ids, params, prompt=None, cache_salt=None) -> None:
        self.added.append(rid)

    def has_unfinished(self) -> bool:
        return bool(self.added)

    def step(self):
        self.seen_at_step = list(self.added)
        self.inbox.stop = True
        return []

    def stats(self) -> str:
        return "stats"


def _run_burst(core: _BurstCore, arrivals: list[tuple[float, int]]) -> None:
    """Drive ``_loop`` while a feeder delivers "add" messages: (delay before, tokens)."""
    inbox = _Inbox(core, None, lambda ids, params: None)
    core.inbox = inbox

    def feed() -> None:
        for i, (delay, n) in enumerate(arrivals):
            time.sleep(delay)
            inbox._apply(("add", f"r{i}", [1] * n, SamplingParams(), None, None))
            inbox.wake.set()

    feeder = threading.Thread(target=feed)
    feeder.start()
    _loop(core, inbox, _Conn())
    feeder.join()


def test_an_idle_core_waits_out_a_gap_in_a_burst(monkeypatch):
    # Once a second request came, the gather waits for BURST_QUIET_S of quiet, not
    # GATHER_QUIET_S: a burst with a gap (new connections) starts in one step.
    import pagewarden.engine.core_proc as cp

    monkeypatch.setattr(cp, "GATHER_QUIET_S", 0.05)
    monkeypatch.setattr(cp, "BURST_QUIET_S", 1.0)
    monkeypatch.setattr(cp, "GATHER_MAX_S", 3.0)
    core = _BurstCore(budget=2048)
    _run_burst(core, [(0.0, 8), (0.0, 8), (0.3, 8), (0.0, 8)])
    assert core.seen_at_step == ["r0", "r1", "r2", "r3"]


def test_an_idle_gather_ends_when_the_burst_fills_a_step(monkeypatch):
    import pagewarden.engine.core_proc as cp

    monkeypatch.setattr(cp, "BURST_QUIET_S", 5.0)
    monkeypatch.setattr(cp, "GATHER_MAX_S", 10.0)
    core = _BurstCore(budget=24)
    # 24 tokens fill the step: it starts then, not after the quiet that would take r3.
    _run_burst(core, [(0.0, 8), (0.0, 8), (0.0, 8), (1.0, 8)])
    assert core.seen_at_step == ["r0", "r1", "r2"]


def test_held_requests_reach_an_idle_core_at_once_and_a_busy_one_after_the_burst():
    from pagewarden.engine.core_proc import BUSY_MAX_S, BUSY_QUIET_S, release_due

    assert release_due(now=0.0, first=0.0, last=0.0, busy=False)  # idle: the gather waits
    # Busy: held while the burst is still arriving and its first request is young.
    assert not release_due(now=1.0, first=1.0 - BUSY_MAX_S / 2, last=1.0, busy=True)
    quiet = 1.0 - BUSY_QUIET_S * 1.01
    assert release_due(now=1.0, first=quiet, last=quiet, busy=True)
    # A burst that never goes quiet is released once its first request waited BUSY_MAX_S.
    assert release_due(now=1.0, first=1.0 - BUSY_MAX_S * 1.01, last=1.0, busy=True)


class _AddingCore:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, rid, ids, params, prompt=None, cache_salt=None) -> None:
        if ids == [999]:
            from pagewarden.engine.core import RequestRejected

            raise RequestRejected("too long")
        self.added.append(rid)

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)


def test_the_inbox_holds_adds_until_released_and_drops_a_held_abort():
    core = _AddingCore()
    inbox = _Inbox(core, None, lambda ids, params: None)
    for rid, ids in (("a", [1]), ("b", [2]), ("c", [999])):
        inbox._apply(("add", rid, ids, SamplingParams(), None, None))
    assert core.added == [] and inbox.has_held()
    inbox._apply(("abort", "b"))  # never reached the core: nothing to abort there
    assert core.aborted == []
    inbox.first_held = inbox.last_held = 1e18  # a burst still arriving (far future)
    inbox.release(busy=True)
    assert core.added == [] and inbox.has_held()
    inbox.release(busy=False)
    assert core.added == ["a"] and not inbox.has_held()
    assert set(inbox.params) == {"a"}
    assert inbox.take_failed() == [("c", "too long")]  # rejected at release, failed alone
    inbox._apply(("abort", "a"))  # in the core now
    assert core.aborted == ["a"]
