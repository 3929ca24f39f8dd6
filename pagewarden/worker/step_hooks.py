"""The points inside an engine step where fault injection may act.

Fault injection (``pagewarden.faults``, tests, ``pagewarden chaos``) never replaces
methods on live objects: it subclasses ``StepHooks`` and installs it with
``EngineCore.install_hooks``. The engine and the runner call the hooks at fixed points::

    EngineCore.step():
        integrity.before_schedule()          -> hooks.on_detection(...) per event found
        out = scheduler.schedule()
        out = hooks.before_execute(out)      # may alter the worker's view of the step
        runner.execute(out):
            meta = AttentionMetadata.build(...); guard.bind(out, meta)
            hooks.on_attention_metadata(out, meta)   # may alter the kernel's indices
            model forward, integrity checks, sampling
        recovery, scheduler.update(...)
        hooks.after_step(out, result, updates)
        integrity.after_step()               -> hooks.on_detection(...) per repair

With no hooks installed (``None``, the default) none of this costs anything.
"""

from __future__ import annotations

from typing import Any

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.sched.output import FailureKey, ModelRunnerOutput, SchedulerOutput


class StepHooks:
    """No-op hooks; override the ones a fault injector needs."""

    def before_execute(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step's output as the worker will see it (return ``out`` to keep it)."""
        return out

    def on_attention_metadata(self, out: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Called with the metadata the forward pass is about to use, tags bound."""

    def on_detection(self, block_ids: set[int], key: FailureKey, req_id: str | None) -> None:
        """The engine found a fault outside the worker's step checks (before scheduling,
        or by an invariant audit): ``key`` says what was found and by which check."""

    def after_step(self, out: SchedulerOutput, result: ModelRunnerOutput, updates: Any) -> None:
        """The step is done: ``out`` without the rolled-back requests, ``updates`` the
        sampled tokens appended."""
