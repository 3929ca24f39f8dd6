"""Offline API, compatible with vLLM's ``LLM`` so that users can switch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagewarden.engine.config import DEFAULT_FLIGHT_RECORDER_DIR, EngineConfig
from pagewarden.engine.core import EngineCore, EngineStats
from pagewarden.engine.outputs import RequestOutput
from pagewarden.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class PromptError(ValueError):
    """A prompt is neither a string, a token-id list nor ``{"prompt_token_ids": [...]}``."""


class LLM:
    """Generate completions for batches of prompts with continuous batching.

    ``LLM(model=None)`` loads the default model (SmolLM2-135M-Instruct, GGUF).
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "bfloat16",
        block_size: int = 16,
        kv_cache_memory: int | str | None = None,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        integrity: str = "standard",
        audit_interval: int = 64,
        scrub_blocks_per_step: int = 4,
        swap_space: float = 0.0,
        num_swap_blocks: int | None = None,
        preemption_mode: str | None = None,
        cpu_threads: int | None = None,
        cpu_bind: str | None = None,
        serial_step_tokens: int | None = EngineConfig.serial_step_tokens,
        adaptive_batch: bool = True,
        target_itl_ms: float | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_topic: str = "",
        kv_events_encoding: str = "array",
        kv_events_token_ids: bool = True,
        profile: str = "normal",
        profiles_file: str | None = None,
        auto_safe_mode: bool = True,
        safe_mode_faults: int = 3,
        safe_mode_window: float = 10.0,
        safe_mode_clean_period: float = 30.0,
        flight_recorder_steps: int = 256,
        flight_recorder_dir: str = DEFAULT_FLIGHT_RECORDER_DIR,
        device: str | None = None,
        attention_backend: str | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_offload_dir: str | None = None,
        kv_offload_dir_size: int | str = EngineConfig.kv_offload_dir_size,
        kv_offload_redis: str | None = None,
        kv_offload_redis_size: int | str = EngineConfig.kv_offload_redis_size,
        kv_offload_redis_ttl: int = EngineConfig.kv_offload_redis_ttl,
        kv_offload_timeout: float = EngineConfig.kv_offload_timeout,
        chat_template: str | None = None,
        quantization: str = EngineConfig.quantization,
    ) -> None:
        # Every argument is an EngineConfig field of the same name (a test keeps it so).
        fields = {name: value for name, value in locals().items() if name != "self"}
        self.config = EngineConfig(**fields)
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise PromptError(
            f"a prompt must be a str, a list of token ids or {{'prompt_token_ids': [...]}}, "
            f"got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, (list, tuple))
            else [sampling_params] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        encoded = [self._to_token_ids(p) for p in prompts]
        for (_, ids), params in zip(encoded, params_list):
            self.engine.validate(ids, params)  # reject before anything is queued
        order: dict[str, int] = {}
        for (text, ids), params in zip(encoded, params_list):
            request_id = str(next(self._ids))
            order[request_id] = len(order)
            self.engine.add_request(request_id, ids, params, prompt=text)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(results) < len(order):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in order:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            self.engine.step()  # apply the aborts so no KV block is left held
            raise
        finally:
            bar.close()
        return sorted(results.values(), key=lambda o: order[o.request_id])

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.engine.tokenizer
        prompts = [
            {
                "prompt": (
                    text := tokenizer.apply_chat_template(
                        conv, add_generation_prompt=add_generation_prompt
                    )
                ),
                "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> EngineStats:
        """Block counts, prefix-cache counters, preemptions, steps and integrity counters."""
        return self.engine.stats()
