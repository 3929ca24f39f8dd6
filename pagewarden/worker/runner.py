"""Model runner: turns a ``SchedulerOutput`` into sampled tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.kv.block_pool import EvictedBlock
from pagewarden.models.llama import LlamaForCausalLM
from pagewarden.sched.output import (
    KVFault,
    ModelRunnerOutput,
    PromptLogprobs,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pagewarden.worker.cpu_threads import StepThreads, default_serial_step_tokens
from pagewarden.worker.fused_checks import element_keys, limb_keys, offset_keys
from pagewarden.worker.kv_guard import KVGuard
from pagewarden.worker.kv_store import KVStore
from pagewarden.worker.prompt_logprobs import score_prompts
from pagewarden.worker.sampler import Sampler, SamplingRow, TokenBitmask
from pagewarden.worker.step_hooks import StepHooks

#: Takes evicted blocks, their bytes (``KVStore.read_blocks``) and sealed sums.
OffloadSink = Callable[[list[EvictedBlock], list[bytes], list["int | None"]], None]

logger = logging.getLogger("pagewarden.worker")


class GrammarMasks(Protocol):
    """Structured outputs' per-request grammars (``engine/grammar.py``, the layer above,
    hands one in): the batch's token bitmask, and forgetting requests that left."""

    def bitmask(self, requests: list[ScheduledRequest]) -> TokenBitmask | None: ...
    def forget(self, req_ids: Iterable[str]) -> None: ...


class ModelRunner:
    """Runs one step: swap and copy-on-write copies, integrity checks, the forward pass,
    sampling.

    Requests named by a fault of ``KVGuard`` get no sampled token: they read KV that failed
    a check, and the scheduler recomputes them.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_store: KVStore,
        vocab_size: int,
        seed: int = 0,
        integrity: str = "standard",
        scrub_blocks_per_step: int = 4,
        attention_backend: str = "torch",
        serial_step_tokens: int | None = 0,
    ) -> None:
        self.model = model
        self.kv_store = kv_store
        self.guard = KVGuard(
            kv_store.caches,
            kv_store.shape.block_size,
            integrity,
            scrub_blocks_per_step,
            num_host_blocks=kv_store.num_host_blocks,
        )
        self.device = kv_store.caches[0].device
        # One thread for tiny CPU steps (worker/cpu_threads.py); None: leave threads alone.
        if serial_step_tokens is None:  # the KV cache has the model's compute dtype
            dtype = kv_store.caches[0].dtype
            serial_step_tokens = default_serial_step_tokens(dtype, self.device)
        self.threads = (
            StepThreads(serial_step_tokens)
            if self.device.type == "cpu" and serial_step_tokens > 0
            else None
        )
        if attention_backend == "triton":
            self._use_triton()
        elif attention_backend == "cpu":
            self._use_cpu()
        # Fault injection's hook into the step (``pagewarden.faults``); None in service.
        self.step_hooks: StepHooks | None = None
        # KV tiers: takes evicted blocks' bytes and sealed sums (kvstore.TierStore via
        # engine/kv_tiers.py); None: no tier.
        self.offload: OffloadSink | None = None
        # Sampling runs where the logits are; only the sampled token ids come back.
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampler = Sampler(vocab_size, generator)
        # Structured outputs: set by the engine; None samples every row unconstrained.
        self.grammar: GrammarMasks | None = None
        self.vocab = vocab_size

    def _use_triton(self) -> None:
        """Attention and KV writes through the Triton kernels, which check their reads."""
        from pagewarden.kernels.triton.ops import TritonAttention  # imports triton: only if asked

        self._use_checking_ops(TritonAttention, element_keys)

    def _use_cpu(self) -> None:
        """Decode attention through the C++ kernel, which checks tags (and, strict,
        checksums) as it reads; the other rows' reads are checked by the backend too.
        Where it cannot run (no build, a float16 cache) the torch path stays, logged: a
        backend asked for explicitly was checked by the config already."""
        from pagewarden.kernels.backend import AttentionBackendError
        from pagewarden.kernels.cpu import attention as cpu_attention  # compiles on first use

        try:
            self._use_checking_ops(cpu_attention.CpuAttention, limb_keys)
        except AttentionBackendError as exc:
            logger.warning("attention backend cpu unavailable (%s); using torch", exc)

    def _use_checking_ops(self, make_ops, sum_keys) -> None:
        """Install ops that check what they read (``fused_reads``); strict's checksum keys
        come from ``sum_keys(caches)``."""
        caches = self.kv_store.caches
        keys = (None, None)
        if self.guard.sums_on:
            keys = (sum_keys(caches), offset_keys(self.kv_store.shape.block_size, self.device))
        self.model.set_attention_ops(make_ops(caches, *keys))
        self.guard.fused_reads = self.guard.tags_on
        self.guard.open_block_sums = self.guard.tags_on and getattr(
            make_ops, "sums_open_blocks", False
        )

    def _offload(self, out: SchedulerOutput) -> None:
        """Hand the step's evicted blocks, as they are before this step writes anything,
        with their seals, to the KV tiers' writer."""
        assert self.offload is not None
        ids = [e.block_id for e in out.offload]
        self.offload(out.offload, self.kv_store.read_blocks(ids), self.guard.seal_sums(ids))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the step's tokens' K/V and sample for the requests that ask for it."""
        # A decode batch's quantized GEMMs may round activations to int8 per row, as one
        # stream's do; a prompt's prefill stays bf16 (kernels/cpu/quant.pick_kernel).
        decode = bool(out.requests) and all(len(r.token_ids) == 1 for r in out.requests)
        with cpu_quant.decode_batch(decode):
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        guard = self.guard
        if self.threads is not None:
            self.threads.before_step(sum(len(r.token_ids) for r in out.requests))
        faults = self._move_blocks(out)
        if out.is_empty:
            return ModelRunnerOutput(sampled_token_ids={}, faults=faults)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []  # flat index of each sampled request's last token
        sampled = []
        scored: list[tuple[ScheduledRequest, int]] = []  # (chunk, flat index of its start)
        for req in out.requests:
            if req.score_prompt:
                scored.append((req, len(input_ids)))
            input_ids.extend(req.token_ids)
            positions.extend(req.positions)
            slot_mapping.extend(req.slot_mapping)
            query_lens.append(len(req.token_ids))
            context_lens.append(req.num_context_tokens)
            block_tables.append(req.block_table)
            if req.sample:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(req)
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            block_size=self.kv_store.shape.block_size,
            device=self.kv_store.caches[0].device,
        )
        guard.bind(out, meta)  # the tags ride with the K/V through meta.slot_mapping
        if self.step_hooks is not None:
            self.step_hooks.on_attention_metadata(out, meta)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),  # (T,)
            torch.tensor(positions, dtype=torch.long, device=self.device),  # (T,)
            self.kv_store.caches,
            meta,
            **self._rope_kwargs(out),
        )  # (T, hidden)
        faulted: set[str] = set()
        if guard.tags_on:
            faults = guard.attach_index_readers(faults, out, meta)
            faulted = _faulted(faults)
            faults = faults + guard.after_write(out, meta, faulted)
            if faults:
                faulted = _faulted(faults)
                keep = [i for i, r in enumerate(sampled) if r.req_id not in faulted]
                sample_rows = [sample_rows[i] for i in keep]
                sampled = [sampled[i] for i in keep]
        # Like sampled tokens, no prompt logprob computed from bad KV is reported.
        prompt = score_prompts(
            self.model, hidden, [(r, s) for r, s in scored if r.req_id not in faulted], self.vocab
        )
        return self._sample(hidden, sample_rows, sampled, faults, prompt)

    def _rope_kwargs(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """``rope_long`` (T,) bool for a step with tokens on the long RoPE factors (only
        models with longrope get them; the others are never asked)."""
        if not any(r.rope_long for r in out.requests):
            return {}
        flags = [r.rope_long for r in out.requests for _ in r.token_ids]
        return {"rope_long": torch.tensor(flags, dtype=torch.bool, device=self.device)}

    def _move_blocks(self, out: SchedulerOutput) -> list[KVFault]:
        """The step's swaps and copy-on-write copies, with their integrity state; then
        the checks of what this step will read. Returns the faults found."""
        store, guard = self.kv_store, self.guard
        # Order matters (see SchedulerOutput): evicted blocks leave for the KV tiers before
        # anything writes the pool; swap-outs read device blocks that this step may hand
        # to others; then swap-ins and tier loads; then copy-on-write.
        if out.offload and self.offload is not None:
            self._offload(out)
        store.swap_out(out.swap_out)
        guard.swap_out(out.swap_out)
        guard.unseal(out.dead_blocks)  # after swap_out, which carried their seals out
        store.swap_in(out.swap_in)
        faults = guard.swap_in(out)
        if out.tier_loads:
            store.write_blocks(
                [t.block_id for t in out.tier_loads], [t.payload for t in out.tier_loads]
            )
            faults += guard.tier_in(out)
        store.copy_blocks(out.copy_blocks)
        guard.copy_blocks(out.copy_blocks)
        guard.forget(out.finished_req_ids)
        guard.forget(out.preempted_req_ids)
        if self.grammar is not None:
            self.grammar.forget(out.finished_req_ids)
            self.grammar.forget(out.preempted_req_ids)
        faults += guard.check_reads(out)
        return faults

    def _sample(
        self,
        hidden: torch.Tensor,
        sample_rows: list[int],
        sampled: list[ScheduledRequest],
        faults: list[KVFault],
        prompt: dict[str, PromptLogprobs],
    ) -> ModelRunnerOutput:
        """Sample the next token of each request in ``sampled`` from its row of
        ``hidden`` (T, hidden); ``prompt`` is the step's prompt logprobs, by request."""
        if not sampled:
            return ModelRunnerOutput(sampled_token_ids={}, faults=faults, prompt_logprobs=prompt)
        # One row per sequence, its next token's, as a decode step's rows are (int8 rows
        # for a quantized lm_head from INT8_DECODE_MIN_ROWS), whatever the step: a
        # prefill step's few rows otherwise decode the whole quantized table into bf16
        # tiles (Gemma 3: 262,144 x 640 weights per prefill step).
        with cpu_quant.decode_batch(True):
            logits = self.model.compute_logits(hidden[sample_rows], dtype=None)  # (S, vocab)
        rows = [
            SamplingRow(
                params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                seed=r.seed,
                sample_index=r.sample_index,
            )
            for r in sampled
        ]
        bitmask = self.grammar.bitmask(sampled) if self.grammar is not None else None
        result = self.sampler(logits, rows, bitmask)
        tokens = {r.req_id: t for r, t in zip(sampled, result.token_ids)}
        logprobs: dict[str, TokenLogprobs] = {
            r.req_id: lp for r, lp in zip(sampled, result.logprobs) if lp is not None
        }
        return ModelRunnerOutput(
            sampled_token_ids=tokens, logprobs=logprobs, faults=faults, prompt_logprobs=prompt
        )


def _faulted(faults: list[KVFault]) -> set[str]:
    """Requests whose reads went through a failed block this step."""
    return {rid for f in faults for rid in f.rollback}
