"""Scheduler and pool counters, each declared once with what the metrics exporter needs.

A field made with ``metric(kind, doc)`` is exported as ``pagewarden:<name>`` (the field
name, or ``name=``) by ``metrics/prometheus.py``, which walks ``exported_fields``; a
plain field is reported by ``stats()`` only. Adding a counter is one field here, its
value in ``Scheduler.stats()``, and its line in the metrics reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal

MetricKind = Literal["gauge", "counter"]


def metric(kind: MetricKind, doc: str, name: str | None = None) -> Any:
    """A stats field exported as a prometheus ``kind`` (default 0)."""
    return field(default=0, metadata={"metric": kind, "doc": doc, "name": name})


@dataclass(frozen=True)
class ExportedField:
    """One field of a stats snapshot as the exporter sees it."""

    name: str  # without the ``pagewarden:`` prefix
    kind: MetricKind
    doc: str
    value: float


def exported_fields(stats: object) -> Iterator[ExportedField]:
    """The fields of a stats dataclass instance made with ``metric(...)``, in order."""
    for f in fields(stats):  # type: ignore[arg-type]
        kind = f.metadata.get("metric")
        if kind is not None:
            name = f.metadata["name"] or f.name
            yield ExportedField(name, kind, f.metadata["doc"], getattr(stats, f.name))


@dataclass(frozen=True, kw_only=True)
class SchedulerStats:
    """A snapshot of scheduler and pool counters (token counts for the prefix cache)."""

    num_steps: int = 0
    num_running: int = metric("gauge", "Requests in the running batch.", "num_requests_running")
    num_waiting: int = metric("gauge", "Requests waiting to be scheduled.", "num_requests_waiting")
    num_swapped: int = metric(
        "gauge", "Requests whose KV is in the host (swap) tier.", "num_requests_swapped"
    )
    num_preemptions: int = metric("counter", "Requests preempted.")
    effective_max_num_seqs: int = metric(
        "gauge", "Sequences per step the scheduler allows now (the batch controller's limit)."
    )
    effective_max_num_batched_tokens: int = metric(
        "gauge", "Tokens per step the scheduler allows now (the batch controller's limit)."
    )
    prefix_cache_queries: int = metric("counter", "Prompt tokens looked up in the prefix cache.")
    prefix_cache_hits: int = metric("counter", "Prompt tokens served from the prefix cache.")
    total_blocks: int = 0
    free_blocks: int = metric("gauge", "Free KV blocks.", "kv_blocks_free")
    cached_blocks: int = metric(
        "gauge", "Free KV blocks still holding prefix-cache entries.", "kv_blocks_cached"
    )
    used_blocks: int = metric("gauge", "KV blocks referenced by requests.", "kv_blocks_used")
    quarantined_blocks: int = metric(
        "gauge", "KV blocks quarantined after a fault.", "kv_blocks_quarantined"
    )
    block_allocations: int = metric(
        "counter", "KV blocks taken into use (new, or cached-free reused by a prefix hit)."
    )
    block_frees: int = metric("counter", "KV block frees.")
    retired_blocks: int = 0
    ownership_violations: int = 0
    host_blocks: int = 0
    free_host_blocks: int = metric(
        "gauge", "Free blocks of the host (swap) tier.", "kv_host_blocks_free"
    )
    swapped_out_blocks: int = metric(
        "counter", "KV blocks copied to the host tier.", "kv_swapped_out_blocks"
    )
    swapped_in_blocks: int = metric(
        "counter", "KV blocks copied back from the host tier.", "kv_swapped_in_blocks"
    )
