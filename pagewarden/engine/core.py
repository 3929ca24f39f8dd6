"""The engine core: owns the scheduler, the KV cache and the model runner.

Only the thread that runs ``step()`` mutates scheduler and KV state. Other threads talk
to the core through ``add_request`` / ``abort_request``, which only enqueue; the queues
are drained at the start of the next step, never in the middle of one.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass

from pagewarden.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagewarden.engine.integrity import IntegrityMonitor, IntegrityStats
from pagewarden.engine.output_processor import OutputProcessor
from pagewarden.engine.outputs import RequestOutput
from pagewarden.models.loader import LoadedModel, load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.request import Request
from pagewarden.sched.scheduler import RequestRejectedError, Scheduler
from pagewarden.worker.kv_store import KVCacheShape, KVStore
from pagewarden.worker.runner import ModelRunner
from pagewarden.worker.step_hooks import StepHooks

logger = logging.getLogger("pagewarden.engine")


class RequestRejected(ValueError):
    """A request can never run (too long for the context or the KV pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters."""

    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    quarantined_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens served from the cache
    num_preemptions: int
    num_steps: int
    num_running: int
    num_waiting: int
    block_allocations: int
    block_frees: int
    prompt_tokens: int
    generation_tokens: int
    integrity: IntegrityStats
    num_swapped: int = 0  # requests whose KV is in the host tier
    host_blocks: int = 0
    free_host_blocks: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0

    @property
    def kv_cache_usage(self) -> float:
        usable = max(self.total_blocks - 1, 1)
        return self.used_blocks / usable


class EngineCore:
    """Schedules, executes and updates requests one step at a time."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded if loaded is not None else load_model(config.model, config.torch_dtype)
        mcfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        shape_args = dict(
            num_layers=mcfg.num_hidden_layers,
            block_size=config.block_size,
            num_kv_heads=mcfg.num_key_value_heads,
            head_dim=mcfg.head_dim,
            dtype=config.torch_dtype,
        )
        if config.num_kv_blocks is not None:
            shape = KVCacheShape(num_blocks=config.num_kv_blocks, **shape_args)
        else:
            shape = KVCacheShape.from_budget(
                config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, **shape_args
            )
        if config.num_swap_blocks is not None:
            num_host_blocks = config.num_swap_blocks
        else:
            num_host_blocks = int(config.swap_space * 2**30) // shape.bytes_per_block
        self.kv_store = KVStore(shape, num_host_blocks=num_host_blocks)
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=shape.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                model_id=self.loaded.name,
                preemption_mode=(
                    config.resolved_preemption_mode if num_host_blocks else "recompute"
                ),
                num_host_blocks=num_host_blocks,
            )
        )
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv_store,
            mcfg.vocab_size,
            seed=config.seed,
            integrity=config.integrity,
            scrub_blocks_per_step=config.scrub_blocks_per_step,
        )
        self.integrity = IntegrityMonitor(
            self.scheduler, self.runner.guard, config.integrity, config.audit_interval
        )
        # Scheduler and KV state belong to the thread that claims them: the async front
        # end's engine thread does before its first step; otherwise the first ``step()``.
        self._owned = False
        self.outputs = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()
        self._pending_adds: deque[tuple[Request, str | None]] = deque()
        self._pending_aborts: deque[str] = deque()
        self._children: dict[str, list[str]] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.hooks: StepHooks | None = None  # fault injection only (see install_hooks)

    def install_hooks(self, hooks: StepHooks | None) -> None:
        """Let ``hooks`` act at fixed points of every step (fault injection; None
        removes them)."""
        self.hooks = hooks
        self.runner.step_hooks = hooks
        self.integrity.hooks = hooks

    # ---- called from any thread -------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestRejected`` if the request can never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty; give at least one token", "prompt")
        vocab = self.loaded.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len} "
                "tokens, which leaves no room for output",
                "prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"the context length {self.max_model_len}; lower max_tokens",
                "max_tokens",
            )
        blocks = math.ceil((n + max_tokens) / self.config.block_size)
        # Block 0 is reserved; retired blocks (failed checks repeatedly) never return.
        usable = self.kv_store.shape.num_blocks - 1 - len(self.scheduler.kv.pool.retired)
        if blocks > usable:
            raise RequestRejected(
                f"the request needs up to {blocks} KV blocks but the pool has {usable}; "
                "raise kv_cache_memory or lower max_tokens",
                "max_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and enqueue a request; it joins at the start of the next step."""
        self.validate(prompt_token_ids, params)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            cache_salt=cache_salt,
        )
        with self._lock:
            self._pending_adds.append((request, prompt))

    def abort_request(self, request_id: str) -> None:
        """Enqueue an abort; applied at the start of the next step."""
        with self._lock:
            self._pending_aborts.append(request_id)

    def claim_ownership(self) -> None:
        """Make the calling thread the engine-core thread: from now on a mutation of
        scheduler or KV state from any other thread raises ``KVOwnershipError`` (a claim
        included, once owned)."""
        self.scheduler.claim_ownership()
        self._owned = True

    # ---- engine-core thread only ------------------------------------------------
    def _apply_pending(self) -> list[RequestOutput]:
        with self._lock:
            adds = list(self._pending_adds)
            aborts = list(self._pending_aborts)
            self._pending_adds.clear()
            self._pending_aborts.clear()
        aborted = []
        for request, prompt in adds:
            self.outputs.add(
                request.req_id, prompt, request.prompt_token_ids, request.sampling_params
            )
            try:
                self.scheduler.add_request(request)
            except RequestRejectedError as exc:
                # Valid when submitted, but the pool shrank since (retired blocks).
                logger.warning("request %s rejected at admission: %s", request.req_id, exc)
                out = self.outputs.abort(request.req_id, reason="error")
                if out is not None:
                    aborted.append(out)
                continue
            self.prompt_tokens += len(request.prompt_token_ids)
        for request_id in aborts:
            self.scheduler.abort_requests([request_id])
            out = self.outputs.abort(request_id)
            if out is not None:
                aborted.append(out)
        return aborted

    def has_unfinished(self) -> bool:
        with self._lock:
            if self._pending_adds or self._pending_aborts:
                return True
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs that changed."""
        if not self._owned:
            self.claim_ownership()
        finished = self._apply_pending()
        self.integrity.before_schedule()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.copy_blocks:
            return finished
        # The worker side (runner, guard, fault injection, recovery) works one
        # ScheduledRequest at a time: fold the columnar decode batch in once.
        sched_out = sched_out.materialized()
        if self.hooks is not None:
            sched_out = self.hooks.before_execute(sched_out)
        result = self.runner.execute(sched_out)
        if result.faults:
            sched_out, report = self.integrity.recover(sched_out, result)
            for request_id in report.failed:
                out = self.outputs.abort(request_id, reason="error")
                if out is not None:
                    finished.append(out)
        # The output side wants one RequestUpdate per token: build them now, while every
        # request they describe is still in the scheduler.
        updates = self.scheduler.update(sched_out, result).updates()
        if self.hooks is not None:
            self.hooks.after_step(sched_out, result, updates)
        self.integrity.after_step()
        self.generation_tokens += len(updates)  # one entry per sampled token
        changed, stopped = self.outputs.process(updates)
        if stopped:
            self.scheduler.finish_requests(stopped, None)
        return finished + changed

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            total_blocks=s.total_blocks,
            free_blocks=s.free_blocks,
            cached_blocks=s.cached_blocks,
            used_blocks=s.used_blocks,
            quarantined_blocks=s.quarantined_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_steps=s.num_steps,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            block_allocations=s.block_allocations,
            block_frees=s.block_frees,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            integrity=self.integrity.stats(),
            num_swapped=s.num_swapped,
            host_blocks=s.host_blocks,
            free_host_blocks=s.free_host_blocks,
            swapped_out_blocks=s.swapped_out_blocks,
            swapped_in_blocks=s.swapped_in_blocks,
        )
