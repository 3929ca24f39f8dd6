"""Adaptive batch size: lower the batch under stress, raise it back after calm.

The controller sits in the engine core and sees one ``StepSignals`` per step: how many
integrity faults the step detected, how many requests were preempted, and the
inter-token latencies of the tokens it released. It answers with the batch limits the
scheduler should use from the next step on, between a floor and the configured maximum:

- multiplicative decrease (``decrease_factor``) at once when a step detects an integrity
  fault, when preemptions within the last window reach ``preemption_storm``, or when the
  p90 inter-token latency over the window exceeds the target;
- additive increase (``increase_step`` sequences) after ``window_steps`` steps in a row
  with none of those, back toward the configured maximum.

After any change the window starts afresh, so one slow stretch lowers the batch once,
not once per step. The token budget follows the sequence limit in proportion and never
drops below its own floor. Running requests are never dropped by a decrease: the
scheduler only admits fewer until the running batch fits under the new limit.

A latency decrease happens only where it would bind: when the window's largest decode
batch exceeds the lowered sequence limit. Below that, the lower limit would not shorten
a single decode step; its only effect would be the smaller token budget, which slices
arriving prompts into more mixed steps that stall every running stream (measured with
vLLM's serving client at concurrency 32 under a 256-sequence limit: a target derived
from the warm-up's single-stream steps cut the budget to 1,024 and then 512 tokens, and
the client's ITL p99 went from about 140 ms to 350-520 ms). Such steps count as calm:
they neither lower the limits nor keep them from climbing back.

The latency target is ``target_itl_s`` when given; otherwise it is derived per batch
size class (the window's largest decode batch, rounded up to a power of two): the first
full window of a class sets that class's target, ``baseline_factor`` times the window's
median inter-token latency, and a class with no target yet is never judged slow. A step's
time grows with its batch, so one target for all sizes either never fires at one stream or
fires on every healthy full batch (measured: a target derived from a first window of
one-stream and small-batch steps, 110 ms, halved an offline 64-stream batch whose steps
take 90-120 ms, and the 64-stream throughput swung by 10-15% between runs).
The engine feeds the latencies of all-decode steps only: those grow with the batch,
which is what this controller sets. A step that also prefills is as slow as the token
budget lets it be; cutting the batch for it only spread new prompts over more mixed
steps (measured with vLLM's serving client at concurrency 32: ITL p99 186-248 ms with
those samples, 147 ms without the controller).

No torch, no engine imports: the engine feeds it plain numbers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

ChangeReason = Literal[
    "integrity_fault", "latency", "preemption_storm", "recovery", "operator", "profile"
]


@dataclass(frozen=True)
class BatchLimits:
    """The per-step limits the scheduler enforces."""

    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class BatchControllerConfig:
    """Bounds and rates of the controller; validated on construction."""

    max_num_seqs: int
    max_num_batched_tokens: int
    min_num_seqs: int = 0  # 0: a quarter of max_num_seqs, at least 1
    min_num_batched_tokens: int = 0  # 0: a quarter of max_num_batched_tokens, at least 1
    decrease_factor: float = 0.5
    increase_step: int = 0  # 0: an eighth of max_num_seqs, at least 1
    window_steps: int = 32
    target_itl_s: float | None = None
    baseline_factor: float = 4.0
    preemption_storm: int = 8  # preemptions within one window that count as a storm
    min_latency_samples: int = 16  # fewer samples in a window say nothing about p90

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 < self.decrease_factor < 1.0:
            raise ValueError(f"decrease_factor must be in (0, 1), got {self.decrease_factor}")
        if self.window_steps < 1 or self.preemption_storm < 1:
            raise ValueError("window_steps and preemption_storm must be >= 1")
        if self.target_itl_s is not None and self.target_itl_s <= 0:
            raise ValueError(f"target_itl_s must be > 0, got {self.target_itl_s}")
        if self.min_num_seqs > self.max_num_seqs:
            raise ValueError(
                f"min_num_seqs ({self.min_num_seqs}) exceeds max_num_seqs ({self.max_num_seqs})"
            )
        if self.min_num_batched_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"min_num_batched_tokens ({self.min_num_batched_tokens}) exceeds "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )

    @property
    def floor(self) -> BatchLimits:
        seqs = self.min_num_seqs or max(1, self.max_num_seqs // 4)
        tokens = self.min_num_batched_tokens or max(1, self.max_num_batched_tokens // 4)
        return BatchLimits(seqs, tokens)

    @property
    def ceiling(self) -> BatchLimits:
        return BatchLimits(self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def step_up(self) -> int:
        return self.increase_step or max(1, self.max_num_seqs // 8)


@dataclass(frozen=True)
class StepSignals:
    """What one engine step reports to the controller."""

    integrity_faults: int = 0
    preemptions: int = 0
    # One latency per decoded token: as many as the step's decode batch.
    inter_token_latencies_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class BatchLimitChange:
    """One change of the limits, with the figures that caused it."""

    old: BatchLimits
    new: BatchLimits
    reason: ChangeReason
    detail: str


class AdaptiveBatchController:
    """Turns per-step stress signals into batch limits (module docstring)."""

    def __init__(self, config: BatchControllerConfig) -> None:
        self.config = config
        self.limits = config.ceiling
        # Below the configured maximum while a profile caps the batch (engine/profiles.py).
        self.ceiling_seqs = config.max_num_seqs
        # Derived targets (target_itl_s not configured): batch size class -> seconds.
        self._targets: dict[int, float] = {}
        self._last_batch = 0  # the last decode batch seen (the class of an empty window)
        self._latencies: deque[float] = deque()
        self._largest_batch = 0  # the window's largest decode batch
        self._preemptions = 0
        self._clean_steps = 0
        self.changes: dict[ChangeReason, int] = {}

    def observe(self, signals: StepSignals) -> BatchLimitChange | None:
        """Feed one step; returns the change of limits it caused, if any."""
        self._latencies.extend(signals.inter_token_latencies_s)
        self._largest_batch = max(self._largest_batch, len(signals.inter_token_latencies_s))
        self._last_batch = len(signals.inter_token_latencies_s) or self._last_batch
        self._preemptions += signals.preemptions
        if signals.integrity_faults:
            return self._decrease("integrity_fault", f"{signals.integrity_faults} fault(s)")
        if self._preemptions >= self.config.preemption_storm:
            return self._decrease(
                "preemption_storm", f"{self._preemptions} preemptions in the window"
            )
        p90 = self._window_p90()
        target = self.target_itl_s
        slow = p90 is not None and target is not None and p90 > target
        if slow and self._largest_batch > self._decreased_seqs():
            assert p90 is not None and target is not None
            return self._decrease(
                "latency", f"inter-token p90 {p90 * 1e3:.1f} ms > target {target * 1e3:.1f} ms"
            )
        # Slow tokens that a lower limit could not speed up count as calm here.
        self._clean_steps += 1
        if self._clean_steps < self.config.window_steps:
            return None
        if self.config.target_itl_s is None and p90 is not None:
            median = _quantile(sorted(self._latencies), 0.5)
            self._targets.setdefault(self._size_class, self.config.baseline_factor * median)
        if self.limits.max_num_seqs >= self.ceiling_seqs:
            self._reset_window()
            return None
        seqs = min(self.ceiling_seqs, self.limits.max_num_seqs + self.config.step_up)
        return self._set(seqs, "recovery", f"clean for {self._clean_steps} steps")

    def force(self, max_num_seqs: int) -> BatchLimitChange | None:
        """Set the sequence limit by hand (an operator, or a profile switch)."""
        seqs = min(max(max_num_seqs, self.config.floor.max_num_seqs), self.ceiling_seqs)
        return self._set(seqs, "operator", f"set to {seqs}")

    def set_ceiling(self, max_num_seqs: int) -> BatchLimitChange | None:
        """Cap the sequence limit (a profile's cap; the configured maximum lifts it).

        Lowering the cap lowers the limit at once; raising it changes nothing now: the
        limit climbs to it by additive increase, one clean window at a time.
        """
        cfg = self.config
        self.ceiling_seqs = min(max(max_num_seqs, cfg.floor.max_num_seqs), cfg.max_num_seqs)
        if self.limits.max_num_seqs <= self.ceiling_seqs:
            return None
        return self._set(self.ceiling_seqs, "profile", f"capped at {self.ceiling_seqs}")

    @property
    def target_itl_s(self) -> float | None:
        """The latency target the current window is judged by: the configured one, or
        the one derived for its batch size class (None: not derived yet)."""
        if self.config.target_itl_s is not None:
            return self.config.target_itl_s
        return self._targets.get(self._size_class)

    @property
    def _size_class(self) -> int:
        """The window's largest decode batch (an empty window: the last one seen) rounded
        up to a power of two."""
        return 1 << max(0, (self._largest_batch or self._last_batch) - 1).bit_length()

    def _window_p90(self) -> float | None:
        if len(self._latencies) < self.config.min_latency_samples:
            return None
        return _quantile(sorted(self._latencies), 0.9)

    def _decreased_seqs(self) -> int:
        seqs = math.floor(self.limits.max_num_seqs * self.config.decrease_factor)
        return max(seqs, self.config.floor.max_num_seqs)

    def _decrease(self, reason: ChangeReason, detail: str) -> BatchLimitChange | None:
        return self._set(self._decreased_seqs(), reason, detail)

    def _set(self, seqs: int, reason: ChangeReason, detail: str) -> BatchLimitChange | None:
        self._reset_window()
        cfg = self.config
        tokens = math.ceil(cfg.max_num_batched_tokens * seqs / cfg.max_num_seqs)
        new = BatchLimits(seqs, max(tokens, cfg.floor.max_num_batched_tokens))
        if new == self.limits:
            return None
        change = BatchLimitChange(self.limits, new, reason, detail)
        self.limits = new
        self.changes[reason] = self.changes.get(reason, 0) + 1
        return change

    def _reset_window(self) -> None:
        self._latencies.clear()
        self._largest_batch = 0
        self._preemptions = 0
        self._clean_steps = 0


def _quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank)."""
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]
