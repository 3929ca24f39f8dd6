"""The engine core: owns the scheduler, the KV cache and the model runner.

Only the thread that runs ``step()`` mutates scheduler and KV state. Other threads talk
to the core through ``add_request`` / ``abort_request``, which only enqueue; the queues
are drained at the start of the next step, never in the middle of one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from pagewarden.engine.batch_controller import (
    AdaptiveBatchController,
    BatchControllerConfig,
    StepSignals,
)
from pagewarden.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from pagewarden.engine.flight_recorder import FlightRecorder, integrity_counts
from pagewarden.engine.grammar import (
    DEFAULT_BACKEND,
    GRAMMAR_BACKENDS,
    GrammarError,
    GrammarTable,
    check_spec,
)
from pagewarden.engine.integrity import IntegrityMonitor, IntegrityStats
from pagewarden.engine.kv_events import KVEventPublisher
from pagewarden.engine.kv_tiers import attach_kv_tiers, note_landed, offload_cached
from pagewarden.engine.output_processor import OutputProcessor
from pagewarden.engine.outputs import RequestOutput
from pagewarden.engine.profiles import ProfileState, ProfileSwitch
from pagewarden.engine.safe_mode import SafeMode
from pagewarden.kernels.cpu.warm import build_all
from pagewarden.metrics.stats import KVTierStats
from pagewarden.models.chat_template import read_chat_template
from pagewarden.models.loader import LoadedModel, load_model
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.admission import RequestRejected, check_request
from pagewarden.sched.config import SchedulerConfig
from pagewarden.sched.request import Request
from pagewarden.sched.scheduler import Scheduler
from pagewarden.sched.stats import SchedulerStats, metric
from pagewarden.worker.cpu_threads import apply_cpu_threads
from pagewarden.worker.device import activation_reserve, gpu_kv_budget
from pagewarden.worker.kv_store import KVCacheShape, KVStore
from pagewarden.worker.runner import ModelRunner
from pagewarden.worker.step_hooks import StepHooks

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("pagewarden.engine")


__all__ = ["EngineCore", "EngineStats", "RequestRejected"]


@dataclass(frozen=True, kw_only=True)
class EngineStats(SchedulerStats):
    """A snapshot of the engine's counters: the scheduler's, plus the engine's own."""

    prompt_tokens: int = metric("counter", "Prompt tokens admitted.")
    generation_tokens: int = metric("counter", "Tokens generated.")
    integrity: IntegrityStats
    # Changes of the effective batch limits by reason (engine/batch_controller.py).
    batch_limit_changes: dict[str, int] = field(default_factory=dict)
    # The active engine profile and the switches so far (engine/profiles.py).
    profile: ProfileState = field(default_factory=ProfileState)
    # The KV tiers' counters (engine/kv_tiers.py); None without tiers.
    kv_tiers: KVTierStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        usable = max(self.total_blocks - 1, 1)
        return self.used_blocks / usable


class EngineCore:
    """Schedules, executes and updates requests one step at a time."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        apply_cpu_threads(config.cpu_threads, config.cpu_bind)
        self.loaded = _place_model(
            loaded
            if loaded is not None
            else load_model(config.model, config.torch_dtype, config.resolved_quantization),
            config.resolved_device,
        )
        if config.resolved_device.type == "cpu":
            build_all()  # every CPU extension now, not inside a step (kernels/cpu/warm.py)
        self.tokenizer = self.loaded.tokenizer
        if config.chat_template is not None:
            template = read_chat_template(config.chat_template)
            self.tokenizer = self.tokenizer.with_chat_template(template)
        self.kv_store = _build_kv_store(config, self.loaded)
        self.max_model_len = config.max_model_len or self.loaded.config.max_position_embeddings
        # A model with length-dependent RoPE (Phi-3 longrope) says past which sequence
        # length it rotates with its long factors; models without the hook (test doubles,
        # custom modules) need nothing.
        select_context = getattr(self.loaded.model, "select_context", None)
        self.rope_switch_tokens = select_context(self.max_model_len) if select_context else None
        self.scheduler = self._build_scheduler()
        self.runner = self._build_runner()
        # KV tiers (engine/kv_tiers.py): None unless --kv-offload-dir / --kv-offload-redis.
        self.kv_tiers = attach_kv_tiers(
            config,
            self.loaded.model,
            self.loaded.config,
            self.kv_store.shape,
            self.scheduler,
            self.runner,
        )
        self.integrity = IntegrityMonitor(
            self.scheduler, self.runner.guard, config.integrity, config.audit_interval
        )
        self.grammars = self._start_grammars()
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
        self.kv_events = self._start_kv_events()
        self.batch = _batch_controller(config)
        self.safe_mode = SafeMode(
            config, self.scheduler, self.runner.guard, self.integrity, self.batch
        )
        self.recorder = self._start_flight_recorder()

    # ---- construction steps, in the order __init__ takes them --------------------
    def _build_scheduler(self) -> Scheduler:
        """The scheduler over as many device blocks as the KV store holds."""
        config = self.config
        num_host_blocks = self.kv_store.num_host_blocks
        return Scheduler(
            SchedulerConfig(
                num_blocks=self.kv_store.shape.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                rope_switch_tokens=self.rope_switch_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
                model_id=self.loaded.name,
                preemption_mode=(
                    config.resolved_preemption_mode if num_host_blocks else "recompute"
                ),
                num_host_blocks=num_host_blocks,
            )
        )

    def _build_runner(self) -> ModelRunner:
        """The model runner, with the integrity level's guard over the KV store."""
        config = self.config
        return ModelRunner(
            self.loaded.model,
            self.kv_store,
            self.loaded.config.vocab_size,
            seed=config.seed,
            integrity=config.integrity,
            scrub_blocks_per_step=config.scrub_blocks_per_step,
            attention_backend=config.resolved_attention_backend,
            serial_step_tokens=config.serial_step_tokens,
        )

    def _start_grammars(self) -> GrammarTable:
        """Structured outputs: grammars compiled per spec (cached), one matcher per
        request, whose token masks the runner applies when it samples."""
        make_backend = GRAMMAR_BACKENDS[DEFAULT_BACKEND][0]
        eos_ids = self.tokenizer.eos_token_ids
        vocab_size = self.loaded.config.vocab_size
        grammars = GrammarTable(
            lambda: make_backend(self.tokenizer, vocab_size, sorted(eos_ids)),
            vocab_size,
            eos_ids,
        )
        self.runner.grammar = grammars
        return grammars

    def _start_kv_events(self) -> KVEventPublisher | None:
        """The KV events publisher when an endpoint is configured; the pool starts
        recording cache events for it."""
        config = self.config
        if not config.kv_events_endpoint:
            return None
        publisher = KVEventPublisher(
            config.kv_events_endpoint,
            config.block_size,
            config.kv_events_topic,
            config.kv_events_encoding,
            token_ids=config.kv_events_token_ids,
        )
        self.scheduler.kv.pool.take_cache_events()  # start recording
        logger.info(
            "pagewarden: KV events on %s (%s encoding)",
            config.kv_events_endpoint,
            config.kv_events_encoding,
        )
        return publisher

    def _start_flight_recorder(self) -> FlightRecorder | None:
        """The flight recorder when it keeps any steps; it follows profile switches."""
        config = self.config
        if not config.flight_recorder_steps:
            return None
        recorder = FlightRecorder(
            self.scheduler,
            config.flight_recorder_steps,
            config.flight_recorder_dir,
            lambda: integrity_counts(self.integrity),
            {"model_name": self.loaded.name, **asdict(config)},
        )
        recorder.profile = config.profile
        self.safe_mode.on_switch = self._record_profile_switch
        return recorder

    def _record_profile_switch(self, switch: ProfileSwitch) -> None:
        assert self.recorder is not None
        self.recorder.profile = switch.new
        self.recorder.trigger(f"profile {switch.old} -> {switch.new} ({switch.reason})")

    def install_hooks(self, hooks: StepHooks | None) -> None:
        """Let ``hooks`` act at fixed points of every step (fault injection; None
        removes them)."""
        self.hooks = hooks
        self.runner.step_hooks = hooks
        self.integrity.hooks = hooks

    # ---- called from any thread -------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestRejected`` if the request can never run."""
        limits = self.scheduler.admission_limits(vocab_size=self.loaded.config.vocab_size)
        check_request(prompt_token_ids, params, limits)
        if params.structured_outputs is not None:  # cached; the server checked it too
            try:
                check_spec(params.structured_outputs)
            except GrammarError as exc:
                raise RequestRejected(str(exc), "structured_outputs") from None

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
        if params.structured_outputs is not None:  # compiles beside the prefill
            self.grammars.prepare(params.structured_outputs)
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

    def request_profile(self, name: str) -> None:
        """Switch to profile ``name`` at the start of the next step (an operator's
        choice; ``ProfileError`` if unknown). Safe from any thread."""
        self.safe_mode.request(name)

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
            except RequestRejected as exc:
                # Valid when submitted, but the pool shrank since (retired blocks).
                logger.warning("request %s rejected at admission: %s", request.req_id, exc)
                out = self.outputs.abort(request.req_id, reason="error")
                if out is not None:
                    aborted.append(out)
                continue
            self.prompt_tokens += len(request.prompt_token_ids)
        if aborts:
            fixed = self.scheduler.kv.refcounts_fixed_at_free
            self.scheduler.abort_requests(aborts)
            if self.scheduler.kv.refcounts_fixed_at_free != fixed:
                logger.warning(
                    "integrity: ref counts disagreed with the block tables after aborting "
                    "%s (a table altered since the last check); set from the tables",
                    aborts,
                )
        for request_id in aborts:
            out = self.outputs.abort(request_id)
            if out is not None:
                aborted.append(out)
        return aborted

    def has_unfinished(self) -> bool:
        with self._lock:
            if self._pending_adds or self._pending_aborts:
                return True
        return self.scheduler.has_unfinished_requests() or self.safe_mode.has_pending()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs that changed. With KV events on, the
        prefix-cache changes of the step are published after it."""
        outputs = self._step()
        if self.kv_events is not None:
            events = self.scheduler.kv.pool.take_cache_events()
            if self.kv_tiers is not None:  # the tiers' stores and drops, medium DISK/REDIS
                events += self.kv_tiers.take_events()
            self.kv_events.publish(events)
        return outputs

    def _step(self) -> list[RequestOutput]:
        if not self._owned:
            self.claim_ownership()
        if self.recorder is not None:
            self.recorder.begin_step()
        finished = self._apply_pending()
        self.safe_mode.before_step()
        self.integrity.before_schedule()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and not sched_out.copy_blocks:
            return finished
        if self.hooks is not None:
            sched_out = self.hooks.before_execute(sched_out)
        start = (time.perf_counter(), self.integrity.recoveries, self.scheduler.num_preemptions)
        result = self.runner.execute(sched_out)
        if sched_out.tier_loads and self.kv_tiers is not None:
            note_landed(self.kv_tiers, sched_out, result)
        if result.faults:
            sched_out, report = self.integrity.recover(sched_out, result)
            for request_id in report.failed:
                out = self.outputs.abort(request_id, reason="error")
                if out is not None:
                    finished.append(out)
        if result.prompt_logprobs:
            self._collect_prompt_logprobs(sched_out, result)
        updates = self.scheduler.update(sched_out, result)
        if self.hooks is not None:
            self.hooks.after_step(sched_out, result, updates)
        self.integrity.after_step()
        if self.batch is not None:
            decodes = sum(len(r.positions) == 1 for r in sched_out.requests)
            # Only all-decode steps say how the batch size sets inter-token latency; a
            # step that also prefills is as slow as the token budget lets it be.
            self._adapt_batch(start, decodes if decodes == len(sched_out.requests) else 0)
        self.safe_mode.after_step()
        self.generation_tokens += len(updates)  # one entry per sampled token
        changed, stopped = self.outputs.process(updates)
        if stopped:
            self.scheduler.finish_requests(stopped, None)
        if self.recorder is not None:
            self.recorder.end_step()
        return finished + changed

    def _collect_prompt_logprobs(self, sched_out, result) -> None:
        """Hand the step's prompt logprobs to their requests' outputs: only those of
        requests still in the step after recovery (as for sampled tokens)."""
        kept = {r.req_id for r in sched_out.requests}
        for rid, chunk in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if rid in kept and req is not None:
                self.outputs.add_prompt_logprobs(req.parent_id or rid, chunk)

    def _adapt_batch(self, start: tuple[float, int, int], num_decodes: int) -> None:
        """Feed the step to the batch controller; apply and log the change it makes."""
        assert self.batch is not None
        t0, recoveries, preemptions = start
        step_s = time.perf_counter() - t0  # each decoded token waited this long
        change = self.batch.observe(
            StepSignals(
                integrity_faults=self.integrity.recoveries - recoveries,
                preemptions=self.scheduler.num_preemptions - preemptions,
                inter_token_latencies_s=(step_s,) * num_decodes,
            )
        )
        if change is None:
            return
        new = change.new
        self.scheduler.set_batch_limits(new.max_num_seqs, new.max_num_batched_tokens)
        logger.warning(
            "batch limit %s: max_num_seqs %d -> %d, max_num_batched_tokens %d -> %d (%s)",
            change.reason,
            change.old.max_num_seqs,
            new.max_num_seqs,
            change.old.max_num_batched_tokens,
            new.max_num_batched_tokens,
            change.detail,
        )

    def shutdown(self, offload_timeout_s: float = 5.0) -> None:
        """A clean stop: the KV tiers get the prefix-cached blocks still in the pool (up
        to ``offload_timeout_s``) and what is queued, then close. Engine thread only."""
        if self.kv_tiers is not None:
            offload_cached(self.kv_tiers, self.scheduler, self.runner, offload_timeout_s)
            self.kv_tiers.close(1.0)

    def stats(self) -> EngineStats:
        scheduler = self.scheduler.stats()
        return EngineStats(
            **{f.name: getattr(scheduler, f.name) for f in fields(scheduler)},
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            integrity=self.integrity.stats(),
            batch_limit_changes=dict(self.batch.changes) if self.batch is not None else {},
            profile=self.safe_mode.state(),
            kv_tiers=self.kv_tiers.stats() if self.kv_tiers is not None else None,
        )


def _place_model(loaded: LoadedModel, device: torch.device) -> LoadedModel:
    """Move the weights to ``device``; off the CPU they compute in their storage dtype."""
    if device.type != "cpu":
        loaded.model.to(device)
        loaded.model.use_compute_dtype()
    return loaded


def _build_kv_store(config: EngineConfig, loaded: LoadedModel) -> KVStore:
    """The KV store: device blocks from ``num_kv_blocks``, ``kv_cache_memory`` or (on
    CUDA) what the GPU has left, and the host tier ``swap_space`` asks for."""
    mcfg = loaded.config
    device = config.resolved_device
    shape_args = dict(
        num_layers=mcfg.num_hidden_layers,
        block_size=config.block_size,
        num_kv_heads=mcfg.num_key_value_heads,
        head_dim=mcfg.head_dim,
        dtype=config.torch_dtype,
    )
    if config.num_kv_blocks is not None:
        shape = KVCacheShape(num_blocks=config.num_kv_blocks, **shape_args)
    elif config.kv_cache_memory is None and device.type == "cuda":
        reserve = activation_reserve(
            config.max_num_batched_tokens, mcfg.hidden_size, mcfg.vocab_size
        )
        budget = gpu_kv_budget(device, config.gpu_memory_utilization, reserve)
        shape = KVCacheShape.from_budget(budget, **shape_args)
    else:
        shape = KVCacheShape.from_budget(
            config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, **shape_args
        )
    if config.num_swap_blocks is not None:
        num_host_blocks = config.num_swap_blocks
    else:
        num_host_blocks = int(config.swap_space * 2**30) // shape.bytes_per_block
    return KVStore(shape, device=device, num_host_blocks=num_host_blocks)


def _batch_controller(config: EngineConfig) -> AdaptiveBatchController | None:
    """The adaptive batch controller, unless ``adaptive_batch`` is off."""
    if not config.adaptive_batch:
        return None
    return AdaptiveBatchController(
        BatchControllerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            target_itl_s=(config.target_itl_ms / 1e3 if config.target_itl_ms is not None else None),
        )
    )
