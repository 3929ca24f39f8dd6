"""Request migration in ``MigratingStream``, against fake replicas (no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagewarden.engine.async_engine import AdmissionRejected, EngineDeadError
from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.admission import AdmissionLimits
from pagewarden.serve.digest import ClusterView
from pagewarden.serve.remote_engine import RemoteEngine, RemoteErrors


class Lost(Exception):
    """Stands for Ray's ActorDiedError."""


class Shed(Exception):
    """Stands for Ray Serve's BackPressureError."""


def next_token(ids: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of all tokens."""
    return (sum(ids) * 31 + len(ids)) % 97


class Tok:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{t}>" for t in ids)


class FakeReplicas:
    """Each call streams greedy tokens; the replica dies after ``die_after[i]`` outputs."""

    def __init__(self, die_after: list[int | None], first_error: Exception | None = None):
        self.die_after, self.calls, self.first_error = die_after, [], first_error

    def options(self, stream: bool):
        return SimpleNamespace(generate=SimpleNamespace(remote=self._remote))

    def _remote(self, call):
        self.calls.append(call)
        limit = self.die_after[len(self.calls) - 1]
        first_error = self.first_error

        async def gen():
            if first_error is not None:
                raise first_error
            ids: list[int] = []
            for i in range(call.params.max_tokens):
                if limit is not None and i == limit:
                    raise Lost("replica died")
                ids.append(next_token(call.prompt_token_ids + ids))
                done = len(ids) == call.params.max_tokens
                c = CompletionOutput(0, Tok().decode(ids), list(ids), "length" if done else None)
                yield RequestOutput(call.request_id, call.prompt, call.prompt_token_ids, [c], done)
                await asyncio.sleep(0)

        return _Response(gen())


class _Response:
    """The shape of Serve's DeploymentResponseGenerator: async iterable + cancel()."""

    def __init__(self, it) -> None:
        self.it, self.cancelled = it, False

    def __aiter__(self):
        return self.it

    def cancel(self) -> None:
        self.cancelled = True


def engine(replicas: FakeReplicas) -> RemoteEngine:
    info = SimpleNamespace(
        tokenizer=Tok(), max_model_len=1000, limits=AdmissionLimits(1000, 16, 100, 8)
    )
    errors = RemoteErrors(
        cause=lambda e: e,
        lost=lambda e: isinstance(e, Lost),
        overloaded=lambda e: AdmissionRejected("shed") if isinstance(e, Shed) else None,
    )
    return RemoteEngine(replicas, info, errors, lambda: ClusterView(None, True, 0, ()))


async def collect(eng: RemoteEngine, params: SamplingParams) -> list[RequestOutput]:
    stream = await eng.add_request("r", [5, 6, 7], params, prompt="p")
    return [out async for out in stream]


def greedy(max_tokens: int) -> list[int]:
    ids: list[int] = []
    for _ in range(max_tokens):
        ids.append(next_token([5, 6, 7] + ids))
    return ids


def test_stream_continues_on_another_replica_without_gap_or_duplicate():
    reps = FakeReplicas([3, 2, None])
    eng = engine(reps)
    outs = asyncio.run(collect(eng, SamplingParams(temperature=0.0, max_tokens=10)))
    ids = [o.outputs[0].token_ids for o in outs]
    assert ids == [greedy(10)[:k] for k in range(1, 11)]  # each output extends the last
    assert outs[-1].outputs[0].text == Tok().decode(greedy(10))
    assert outs[-1].finished and outs[-1].prompt_token_ids == [5, 6, 7]
    assert eng.migrations == 2
    stats = eng.stats()
    assert (stats.request_success, stats.request_migrations) == ({"length": 1}, 2)
    second = reps.calls[1]
    assert second.prompt_token_ids == [5, 6, 7] + greedy(3)
    assert second.params.max_tokens == 7 and second.request_id == "r#m1"


def test_non_migratable_requests_fail_as_on_one_engine():
    eng = engine(FakeReplicas([2, None]))
    params = SamplingParams(temperature=0.0, max_tokens=5, n=2)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(eng, params))
    assert eng.migrations == 0


def test_load_shedding_is_an_admission_rejection_at_submit():
    eng = engine(FakeReplicas([None], first_error=Shed("full")))
    with pytest.raises(AdmissionRejected):
        asyncio.run(collect(eng, SamplingParams(max_tokens=5)))
