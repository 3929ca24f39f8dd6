"""Replay a flight record: re-drive a scheduler through the recorded calls and compare.

A record (``docs/flight-recorder.md``) is a checkpoint of scheduler and KV metadata at
the start of its window, then one entry per engine step with the scheduler's journal
(``journal.py``) and the blocks the pool handed out and freed. Replay restores the
checkpoint into a fresh ``Scheduler`` and makes the same calls in the same order, with
the recorded inputs: the requests that arrived, the tokens the model sampled, the faults
the worker found, the batch limits, the quarantined blocks released. Everything else is
recomputed by the scheduler and KV code under test, and compared with the record:

    what a step scheduled    request ids, first position, token count, block table
                             (block ids and epochs), copy-on-write pairs, swaps,
                             preemptions
    pool traffic             blocks allocated and freed, in order
    integrity outcomes       table faults found before scheduling, recovery reports

KV tier loads finish when the tiers answer; the record holds each answer the scheduler
got (``tier`` entries) and replay gives it the same ones (``ReplayTierPrefix``), placing
the loaded blocks as the recorded run did (no bytes: no model runs). The first
difference is reported (step, field, expected, got). No model runs: the
sampled tokens are the record's, so a replay takes milliseconds per step and needs no
weights. Metadata changed behind the scheduler's back is replayed only when it was
journaled (``external`` entries: fault injection); an unjournaled change (a real bug)
shows up as the divergence it caused.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagewarden.kv.block_pool import BlockTrace
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.sched import snapshot
from pagewarden.sched.journal import (
    RECORD_FORMAT,
    RECORD_VERSION,
    decode_arrival,
    decode_fault,
    encode,
    encode_report,
    schedule_entry,
)
from pagewarden.sched.output import ModelRunnerOutput, SchedulerOutput, TierLoad
from pagewarden.sched.request import Request, RequestStatus
from pagewarden.sched.scheduler import Scheduler
from pagewarden.sched.tier_prefix import TierPrefix

#: An ``external`` journal entry's function: (scheduler, *args).
ExternalOps = Mapping[str, Callable[..., None]]


class FlightRecordError(ValueError):
    """The file is not a flight record this version of pagewarden can read."""


@dataclass(frozen=True)
class FlightRecord:
    """A parsed flight record: header, checkpoint state, step entries (oldest first)."""

    header: dict[str, Any]
    checkpoint: dict[str, Any]
    steps: list[dict[str, Any]]


@dataclass(frozen=True)
class Divergence:
    """The first place where replay and record disagree."""

    step: int
    field: str
    expected: Any
    got: Any

    def __str__(self) -> str:
        return (
            f"step {self.step}, {self.field}:\n  expected (recorded): {_short(self.expected)}"
            f"\n  got (replayed):      {_short(self.got)}"
        )


@dataclass(frozen=True)
class ReplayResult:
    first_step: int
    last_step: int
    num_steps: int
    num_ops: int
    divergence: Divergence | None


#: A record larger than this is refused before it is read (the engine's own records are
#: capped far below it: engine/flight_recorder.py).
MAX_RECORD_FILE_BYTES = 1 << 30
#: Sizes a checkpoint may claim; the scheduler it restores allocates one object per block.
MAX_REPLAY_BLOCKS = 1 << 20
MAX_REPLAY_HOST_BLOCKS = 1 << 20


def load_record(path: str | Path) -> FlightRecord:
    """Read a flight record file; raises ``FlightRecordError`` on anything that is not a
    well-formed record of this version, before allocating what it describes."""
    size = Path(path).stat().st_size
    if size > MAX_RECORD_FILE_BYTES:
        raise FlightRecordError(
            f"{path} is {size} bytes; flight records are at most {MAX_RECORD_FILE_BYTES}"
        )
    try:
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (UnicodeDecodeError, ValueError) as exc:
        raise FlightRecordError(f"{path} is not a pagewarden flight record ({exc})") from None
    if not lines or not all(isinstance(line, dict) for line in lines):
        raise FlightRecordError(f"{path} is not a pagewarden flight record")
    if lines[0].get("format") != RECORD_FORMAT:
        raise FlightRecordError(f"{path} is not a pagewarden flight record")
    header = lines[0]
    if header.get("version") != RECORD_VERSION:
        raise FlightRecordError(
            f"{path} is flight record version {header.get('version')}; this pagewarden "
            f"reads version {RECORD_VERSION}"
        )
    if len(lines) < 2 or lines[1].get("type") != "checkpoint":
        raise FlightRecordError(f"{path}: the second line must be the checkpoint")
    _check_sizes(path, lines[1].get("state"))
    steps = [line for line in lines[2:] if line.get("type") == "step"]
    if not all(isinstance(s.get("ops"), list) and isinstance(s.get("step"), int) for s in steps):
        raise FlightRecordError(f"{path}: a step entry lacks its step number or ops")
    return FlightRecord(header, lines[1]["state"], steps)


def _check_sizes(path: str | Path, state: Any) -> None:
    """The checkpoint's claimed pool sizes are within limits and match what it holds."""
    try:
        config, blocks = state["config"], state["kv"]["blocks"]
        num_blocks = config["num_blocks"]
        num_host = config.get("num_host_blocks", 0)
    except (KeyError, TypeError):
        raise FlightRecordError(f"{path}: the checkpoint lacks its config or blocks") from None
    for name, value, limit in (
        ("num_blocks", num_blocks, MAX_REPLAY_BLOCKS),
        ("num_host_blocks", num_host, MAX_REPLAY_HOST_BLOCKS),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise FlightRecordError(f"{path}: checkpoint {name} {value!r} is not in 0..{limit}")
    if not isinstance(blocks, list) or len(blocks) != num_blocks:
        raise FlightRecordError(
            f"{path}: the checkpoint claims {num_blocks} blocks and holds "
            f"{len(blocks) if isinstance(blocks, list) else 'no list of'} blocks"
        )


def replay(record: FlightRecord, external: ExternalOps | None = None) -> ReplayResult:
    """Replay ``record`` from its checkpoint; the result names the first divergence.
    A record whose contents do not fit together raises ``FlightRecordError``."""
    try:
        sched = snapshot.restore(record.checkpoint)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise FlightRecordError(f"the checkpoint cannot be restored: {exc!r}") from None
    player = _Player(sched, external or {})
    if any(op.get("op") == "tier" for entry in record.steps for op in entry["ops"]):
        player.tiers = ReplayTierPrefix()
        sched.enable_kv_tiers(player.tiers)
    divergence = None
    num_ops = 0
    for entry in record.steps:
        divergence = player.play_step(entry)  # an op that raises is a divergence
        num_ops += len(entry["ops"])
        if divergence is not None:
            break
    steps = [e["step"] for e in record.steps]
    return ReplayResult(
        steps[0] if steps else 0, steps[-1] if steps else 0, len(steps), num_ops, divergence
    )


class _Player:
    """Applies journal entries to one scheduler, remembering the last scheduled step."""

    def __init__(self, sched: Scheduler, external: ExternalOps) -> None:
        self.sched = sched
        self.external = external
        self.last_out: SchedulerOutput | None = None
        self.tiers: ReplayTierPrefix | None = None  # a record of an engine with KV tiers

    def play_step(self, entry: dict[str, Any]) -> Divergence | None:
        step = entry["step"]
        trace = BlockTrace()
        self.sched.kv.pool.trace = trace
        for i, op in enumerate(entry["ops"]):
            try:
                found = getattr(self, f"_{op['op']}")(op)
            except Exception as exc:  # noqa: BLE001 - the replayed call failed: report it
                return Divergence(step, f"ops[{i}] {op['op']}", "the call to succeed", f"{exc!r}")
            if found is not None:
                name, expected, got = found
                return Divergence(step, f"ops[{i}] {op['op']}: {name}", expected, got)
        if self.tiers is not None and self.tiers.answers:
            left = [[c, *a] for c, a in self.tiers.answers]
            return Divergence(step, "tier answers", left, "not asked for by the scheduler")
        for name, got in (("allocated", trace.allocated), ("freed", trace.freed)):
            if got != entry[name]:
                return Divergence(step, f"{name} blocks", entry[name], got)
        return None

    # One method per journal entry kind; each returns (field, expected, got) or None.
    def _add(self, op: dict[str, Any]) -> None:
        self.sched.add_request(decode_arrival(op))

    def _finish(self, op: dict[str, Any]) -> None:
        self.sched.finish_requests_as(
            op["req_ids"], RequestStatus(op["status"]), op["reason"], op["stop_reason"]
        )

    def _limits(self, op: dict[str, Any]) -> None:
        self.sched.set_batch_limits(op["max_num_seqs"], op["max_num_batched_tokens"])

    def _verify(self, op: dict[str, Any]) -> tuple[str, Any, Any] | None:
        events = self.sched.verify_block_tables()
        got = [[e.kind, e.req_id, e.block_id, e.position] for e in events]
        return _compare("events", op["events"], got)

    def _schedule(self, op: dict[str, Any]) -> tuple[str, Any, Any] | None:
        out = self.sched.schedule()
        self.last_out = out
        got = _json(encode(schedule_entry(out, self.sched.kv.tables, {})))
        for key, expected in op.items():
            if key == "op":
                continue
            if key == "requests":
                found = _compare_requests(expected, got["requests"])
            else:
                found = _compare(key, expected, got[key])
            if found is not None:
                return found
        return None

    def _update(self, op: dict[str, Any]) -> tuple[str, Any, Any] | None:
        if self.last_out is None:
            return ("scheduled step", "a step scheduled before this update", None)
        by_id = {r.req_id: r for r in self.last_out.requests}
        missing = [rid for rid in op["req_ids"] if rid not in by_id]
        if missing:
            return ("req_ids", op["req_ids"], sorted(by_id))
        out = dataclasses.replace(self.last_out, requests=[by_id[rid] for rid in op["req_ids"]])
        self.sched.update(out, ModelRunnerOutput(dict(op["sampled"])))
        return None

    def _recover(self, op: dict[str, Any]) -> tuple[str, Any, Any] | None:
        report = self.sched.recover([decode_fault(f) for f in op["faults"]])
        return _compare("report", op["report"], _json(encode_report(report)))

    def _repair(self, op: dict[str, Any]) -> tuple[str, Any, Any] | None:
        report = self.sched.repair()
        return _compare("report", op["report"], _json(encode_report(report)))

    def _release(self, op: dict[str, Any]) -> None:
        self.sched.release_quarantined(op["block_ids"])

    def _mode(self, op: dict[str, Any]) -> None:
        self.sched.set_preemption_mode(op["mode"])

    def _drop_cached(self, op: dict[str, Any]) -> tuple[str, Any, Any] | None:
        return _compare("dropped", op["dropped"], self.sched.drop_cached_prefixes())

    def _tier(self, op: dict[str, Any]) -> None:
        if self.tiers is None:  # pragma: no cover - replay() installs it for any tier op
            raise FlightRecordError("a tier entry in a record without KV tiers")
        self.tiers.answers.append((op["call"], list(op["args"])))

    def _external(self, op: dict[str, Any]) -> None:
        fn = self.external.get(op["name"])
        if fn is None:
            raise FlightRecordError(
                f"the record applies {op['name']!r} outside the scheduler and this replay "
                f"does not know how (known: {sorted(self.external)})"
            )
        fn(self.sched, *op["args"])


class ReplayTierPrefix(TierPrefix):
    """The KV tiers as a record saw them: each call the scheduler makes gets the answer
    recorded for it (``tier`` entries, queued in ``answers`` before the step's schedule).
    A call the record did not make raises ``FlightRecordError`` (a divergence). Loaded
    blocks are placed in the pool metadata as in the recorded run, without bytes."""

    def __init__(self) -> None:
        super().__init__(self._no_start, lambda jobs, timeout_s: None)
        self.answers: deque[tuple[str, list[Any]]] = deque()

    @staticmethod
    def _no_start(chain: Sequence[Any]) -> Any:
        raise FlightRecordError("replay does not load from a tier")

    def _answer(self, call: str, *key: Any) -> Any:
        if not self.answers:
            raise FlightRecordError(f"the scheduler asked the tiers {call}{key}; none recorded")
        got, args = self.answers.popleft()
        if got != call or args[: len(key)] != list(key):
            raise FlightRecordError(
                f"the scheduler asked the tiers {call}{key}; the record answers {got}{args}"
            )
        return args[len(key)]

    def is_loading(self, req_id: str) -> bool:
        return bool(self._answer("loading", req_id))

    def wait(self, timeout_s: float) -> bool:
        return bool(self._answer("wait"))

    def forget(self, req_id: str) -> None:
        pass

    def extend(
        self, kv: KVCacheManager, req: Request, cached: int, max_tokens: int
    ) -> tuple[int, list[TierLoad]] | None:
        n = self._answer("extend", req.req_id)
        if n is None:
            return None
        bs = kv.block_size
        if not n or kv.allocate_slots(req.req_id, cached, n * bs) is None:
            return cached, []
        ids, first = kv.tables[req.req_id].ids, cached // bs
        loads = [
            TierLoad(ids[first + j], b"", 0, req.req_id, first + j, "replay", "") for j in range(n)
        ]
        return cached + n * bs, loads


def _json(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def _compare(name: str, expected: Any, got: Any) -> tuple[str, Any, Any] | None:
    return None if _json(expected) == _json(got) else (name, expected, got)


def _compare_requests(expected: list, got: list) -> tuple[str, Any, Any] | None:
    """Scheduled requests, one field at a time, so a divergence names what differs."""
    names = ("req_id", "first position", "num_tokens", "block_table ids", "block_table epochs")
    for i, (e, g) in enumerate(zip(expected, got)):
        for name, ev, gv in zip(names, e, g):
            if ev != gv:
                return (f"requests[{i}] ({e[0]}) {name}", ev, gv)
    if len(expected) != len(got):
        return ("requests (ids)", [e[0] for e in expected], [g[0] for g in got])
    return None


def _short(value: Any, limit: int = 400) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
