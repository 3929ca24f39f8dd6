"""Scheduler configuration: frozen, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

#: The shortest context that can serve anything: one prompt token and one output token.
MIN_MAX_MODEL_LEN = 2


@dataclass(frozen=True)
class SchedulerConfig:
    """Pool geometry and per-step budgets (names as vLLM's CLI flags)."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    model_id: str = ""
    # Preemption when the pool runs dry: "recompute" (free the victim's blocks, redo its
    # prefill later) or "swap" (copy its KV to ``num_host_blocks`` host blocks and back;
    # falls back to recompute when the host tier is full).
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    # A request longer than this many tokens is rotated with the model's second RoPE
    # factor set (Phi-3 longrope past its original context, as transformers does; see
    # DecoderForCausalLM.select_context): it restarts when it grows past it, and its
    # blocks are hashed apart. None for every other model.
    rope_switch_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < MIN_MAX_MODEL_LEN:
            raise ValueError(
                f"max_model_len must be >= {MIN_MAX_MODEL_LEN}, got {self.max_model_len}"
            )
        switch = self.rope_switch_tokens
        if switch is not None and not (
            isinstance(switch, int) and 1 <= switch < self.max_model_len
        ):
            raise ValueError(
                f"rope_switch_tokens must be None or an int in [1, max_model_len), got {switch!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0, got {self.num_host_blocks!r}")
        if self.preemption_mode == "swap" and self.num_host_blocks == 0:
            raise ValueError(
                "preemption_mode='swap' needs host blocks: set num_host_blocks "
                "(--swap-space) above 0"
            )
        if not isinstance(self.model_id, str):
            raise ValueError(f"model_id must be a str, got {self.model_id!r}")
