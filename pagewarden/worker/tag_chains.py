"""The slot tag of every position of each live request's token chain (``KVGuard``'s).

Each request's chain is a Python list, extended as the request grows (``chain``; one
``mix64`` per new position), and mirrored in one int64 table with a row per live
request, so that a step's expected tags come out of it in one gather (``expected``)
instead of one copy per request::

    rows:  {"a": 0, "b": 1}            table (rows, cols) int64, grown by doubling
    table[0, :synced["a"]] == chain("a")[:synced["a"]]
    expected([b, a]) -> [[chain b, 0 ...], [chain a, 0 ...]]   (S, max stop), 0 past stop

Invariant: ``table[rows[r], p]`` is the tag of r's chain at p for every
``p < synced[r]``; entries at or past ``synced[r]`` hold whatever an earlier owner of the
row left and are never read (``expected`` zeroes every entry at or past a request's stop,
and ``stop <= synced`` after it syncs). The list of a request is a prefix of its chain
that may end before ``synced[r]``: a decode step writes the one new tag of each request
to the table only (``decode_plan``, then ``DecodeGuard.bind`` or ``expected``, then
``decoded``), and ``chain`` copies what the list lacks back from the table.
"""

from __future__ import annotations

import numpy
import torch

from pagewarden.sched.output import ScheduledRequest
from pagewarden.worker.integrity import _GOLDEN, _MIX1, _MIX2, mix64


class TagChains:
    """Per-request tag chains, as lists and as rows of one table."""

    def __init__(self, root_tag: int) -> None:
        self.root_tag = root_tag
        self._lists: dict[str, list[int]] = {}  # req_id -> tag of each position
        self._rows: dict[str, int] = {}  # req_id -> its row of the table
        self._synced: dict[str, int] = {}  # req_id -> positions copied into the table
        self._free: list[int] = []
        self._next_row = 0
        self.table = torch.zeros(0, 0, dtype=torch.int64)

    def forget(self, req_id: str) -> None:
        """Drop a request's chain (finished, preempted, rolled back) and free its row."""
        self._lists.pop(req_id, None)
        self._synced.pop(req_id, None)
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def chain(self, req: ScheduledRequest, upto: int) -> list[int]:
        """Tags of ``req``'s token chain for positions ``[0, upto)`` (cached, extended;
        may be longer than ``upto``)."""
        chain = self._lists.get(req.req_id)
        if chain is None:
            chain = self._lists[req.req_id] = []
        synced = self._synced.get(req.req_id, 0)
        if len(chain) < min(synced, upto):  # decode steps wrote the table only
            row = self._rows[req.req_id]
            chain.extend(self.table.numpy()[row, len(chain) : synced].tolist())
        if len(chain) < upto:
            prompt, output = req.prompt_token_ids, req.output_token_ids
            n_prompt = len(prompt)
            tag = chain[-1] if chain else self.root_tag
            for p in range(len(chain), upto):
                token = prompt[p] if p < n_prompt else output[p - n_prompt]
                tag = mix64(tag, token, p)
                chain.append(tag)
        return chain

    def new_tags(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """(T,) int64: the tags of the positions each request writes in this step, in
        order (positions ``[start, stop)`` of each)."""
        tags: list[int] = []
        for r in reqs:
            start, stop = r.positions.start, r.positions.stop
            tags.extend(self.chain(r, stop)[start:stop])
        return torch.tensor(tags, dtype=torch.int64)

    @staticmethod
    def written(expected: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """``new_tags(reqs)`` taken from ``expected(reqs)``: each row's positions
        ``[start, stop)``, in order (a step that needs both computes the chains once)."""
        rows = expected.numpy()
        if len(reqs) == 1:  # one stream: no list, no concatenation
            p = reqs[0].positions
            return torch.from_numpy(rows[0, p.start : p.stop].copy())
        starts = [r.positions.start for r in reqs]
        if all(r.positions.stop == s + 1 for r, s in zip(reqs, starts)):  # a decode step
            return torch.from_numpy(rows[numpy.arange(len(reqs)), starts])
        parts = [rows[i, r.positions.start : r.positions.stop] for i, r in enumerate(reqs)]
        return torch.from_numpy(numpy.concatenate(parts))

    def expected(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """(S, max stop) int64: the tag of each request's token chain at each position,
        0 at and past the request's stop. Read only: for one request it is a view of the
        table's row (no copy, nothing past its stop)."""
        stops = [r.positions.stop for r in reqs]
        # A decode step (one position per request) computes only the new tags; anything
        # else syncs every chain up to its stop.
        if all(r.positions.stop == r.positions.start + 1 for r in reqs):
            rows = self._decode(reqs)
        else:
            rows = self._sync(reqs, stops)
        if len(rows) == 1:  # one stream: its row of the table, read only (a view)
            return self.table[rows[0] : rows[0] + 1, : stops[0]]
        return self._gather(rows, stops)

    def _gather(self, rows: list[int], stops: list[int]) -> torch.Tensor:
        """(S, max stop): table row ``rows[i]`` up to ``stops[i]``, zeros past it."""
        width = max(stops)
        # numpy's gather on the table (always in host memory), not torch's: torch's
        # advanced indexing measured ~100x slower at these sizes in the engine's process
        # (3 ms for 64 x 256), and each torch op costs tens of microseconds at one stream.
        expected = self.table.numpy()[rows, :width]  # (S, width), a new array
        if min(stops) < width:
            past = numpy.arange(width) >= numpy.asarray(stops)[:, None]
            expected[past] = 0
        return torch.from_numpy(expected)

    def decode_plan(self, reqs: list[ScheduledRequest]) -> tuple[list[int], list[int], list[int]]:
        """For a decode step (each request writes one position): (rows, starts, tokens),
        each request's table row, the position it writes and the token there, with its
        chain in the table up to that position and the table wide enough for it (synced
        here where a request is not yet). The caller writes the new tags to the table
        (``DecodeGuard.bind``; ``_decode``), then calls ``decoded``."""
        rows: list[int] = []
        starts: list[int] = []
        tokens: list[int] = []
        cols = self.table.shape[1]
        table_rows, synced = self._rows, self._synced
        for r in reqs:
            start = r.positions.start
            row = table_rows.get(r.req_id)
            if row is None or synced.get(r.req_id) != start or start >= cols:
                row = -1  # not in state: the step syncs below
            rows.append(row)
            starts.append(start)
            prompt = r.prompt_token_ids
            n_prompt = len(prompt)
            tokens.append(
                prompt[start] if start < n_prompt else r.output_token_ids[start - n_prompt]
            )
        if -1 in rows:
            rows = self._sync(reqs, starts)
            self._grow(self._next_row, max(starts) + 1)
        return rows, starts, tokens

    def decoded(self, reqs: list[ScheduledRequest]) -> None:
        """The new tags of a ``decode_plan``'s step are in the table: each chain is synced
        one position further."""
        synced = self._synced
        for r in reqs:
            synced[r.req_id] = r.positions.start + 1

    def _decode(self, reqs: list[ScheduledRequest]) -> list[int]:
        """A decode step's new tags written to the table (``mix64`` for one stream,
        ``mix64_many``, one numpy call, for several); returns the rows."""
        rows, starts, tokens = self.decode_plan(reqs)
        table = self.table.numpy()
        prev = [
            table[row, start - 1] if start else self.root_tag for row, start in zip(rows, starts)
        ]
        if len(reqs) == 1:  # one stream: numpy's per-call cost is more than one mix64
            table[rows[0], starts[0]] = mix64(int(prev[0]), tokens[0], starts[0])
        else:
            at = numpy.array(starts, dtype=numpy.int64)
            table[rows, at] = mix64_many(
                numpy.array(prev, dtype=numpy.int64), numpy.array(tokens, dtype=numpy.int64), at
            )
        self.decoded(reqs)
        return rows

    def _sync(self, reqs: list[ScheduledRequest], stops: list[int]) -> list[int]:
        """Each request's row, its chain copied into it up to its stop (one scatter)."""
        rows: list[int] = []
        for r in reqs:
            row = self._rows.get(r.req_id)
            if row is None:
                row = self._free.pop() if self._free else self._take_row()
                self._rows[r.req_id] = row
            rows.append(row)
        self._grow(self._next_row, max(stops))
        cols = self.table.shape[1]
        at: list[int] = []  # flat table positions
        values: list[int] = []
        for r, row, stop in zip(reqs, rows, stops):
            have = self._synced.get(r.req_id, 0)
            if have < stop:
                values.extend(self.chain(r, stop)[have:stop])
                at.extend(range(row * cols + have, row * cols + stop))
                self._synced[r.req_id] = stop
        if len(values) == 1:  # a decode step of one stream: one entry, no index array
            self.table.numpy().reshape(-1)[at[0]] = values[0]
        elif values:
            self.table.numpy().reshape(-1)[at] = values  # a view of the table: in place
        return rows

    def _take_row(self) -> int:
        self._next_row += 1
        return self._next_row - 1

    def _grow(self, rows: int, cols: int) -> None:
        """Make the table at least (rows, cols), doubling what is short."""
        have_rows, have_cols = self.table.shape
        if rows <= have_rows and cols <= have_cols:
            return
        new_rows = max(have_rows, 8)
        while new_rows < rows:
            new_rows *= 2
        new_cols = max(have_cols, 64)
        while new_cols < cols:
            new_cols *= 2
        table = torch.zeros(new_rows, new_cols, dtype=torch.int64)
        table[:have_rows, :have_cols] = self.table
        self.table = table


def mix64_many(prev_tags: numpy.ndarray, token_ids: numpy.ndarray, positions: numpy.ndarray):
    """``mix64`` of each (prev_tag, token_id, position), elementwise: int64 arrays in,
    int64 array out (numpy's uint64 arithmetic wraps as ``mix64``'s masks do)."""
    with numpy.errstate(over="ignore"):
        x = _splitmix64_numpy(prev_tags.astype(numpy.uint64) ^ numpy.uint64(_MIX1))
        x = _splitmix64_numpy(x ^ token_ids.astype(numpy.uint64))
        x = _splitmix64_numpy(x ^ (positions.astype(numpy.uint64) * numpy.uint64(_GOLDEN)))
    return x.view(numpy.int64)


def _splitmix64_numpy(z: numpy.ndarray) -> numpy.ndarray:
    """``splitmix64`` of each uint64 (wrapping; the caller silences overflow)."""
    z = z + numpy.uint64(_GOLDEN)
    z = (z ^ (z >> numpy.uint64(30))) * numpy.uint64(_MIX1)
    z = (z ^ (z >> numpy.uint64(27))) * numpy.uint64(_MIX2)
    return z ^ (z >> numpy.uint64(31))
