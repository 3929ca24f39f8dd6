"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewarden.engine.profiles import ProfileError, SafeModePolicy
from pagewarden.kernels.backend import AttentionBackendError, check_backend, default_backend
from pagewarden.kvstore.tier import check_tier_options
from pagewarden.models.chat_template import ChatTemplateError, read_chat_template
from pagewarden.models.gguf_weights import QUANTIZATION_MODES
from pagewarden.private_dir import user_state_dir
from pagewarden.sched.config import MIN_MAX_MODEL_LEN
from pagewarden.worker.cpu_threads import CpuBindError, parse_cpu_list
from pagewarden.worker.device import DeviceError, resolve_device
from pagewarden.worker.kv_guard import INTEGRITY_LEVELS

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "auto": torch.bfloat16,
}

#: Where flight records go unless told (logged with every write).
DEFAULT_FLIGHT_RECORDER_DIR = str(user_state_dir() / "flight-records")  # created 0700

#: KV budget when neither ``kv_cache_memory`` nor ``num_kv_blocks`` is given.
DEFAULT_KV_CACHE_MEMORY = "1GiB"


class EngineConfigError(ValueError):
    """An engine argument is out of range; the message names it."""


@dataclass(frozen=True)
class EngineConfig:
    """Arguments of ``LLM(...)`` and of the CLI's engine flags (named as vLLM names them)."""

    model: str | None = None
    dtype: str = "bfloat16"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # off | audit | standard | strict (see README, "Integrity levels")
    integrity: str = "standard"
    audit_interval: int = 64  # steps between check_invariants() runs
    scrub_blocks_per_step: int = 4  # sealed blocks the scrubber re-verifies each step
    # Host (swap) tier: GiB of host memory (as vLLM's --swap-space) or an exact block count.
    swap_space: float = 0.0
    num_swap_blocks: int | None = None
    # "recompute" | "swap"; None: swap when a host tier is configured, else recompute.
    preemption_mode: str | None = None
    # torch threads (None: torch's default) and the cores they may run on, a Linux cpu
    # list such as "0-3" (None: no binding); see worker/cpu_threads.py.
    cpu_threads: int | None = None
    cpu_bind: str | None = None
    # CPU steps of at most this many tokens run on one thread (0: never; None: 0 where
    # the GEMMs run on the kernels' pool, else 2); see worker/cpu_threads.py.
    serial_step_tokens: int | None = None
    # Adaptive batch size (engine/batch_controller.py): lower the batch on integrity
    # faults, preemption storms or slow tokens; raise it back after a clean window.
    adaptive_batch: bool = True
    target_itl_ms: float | None = None  # None: derived per batch size class
    # KV cache events in vLLM's format on a ZeroMQ PUB socket (engine/kv_events.py);
    # None: off. "array" or "map": how each event is encoded (vLLM's old and new way).
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_encoding: str = "array"
    kv_events_token_ids: bool = True  # False: hashes only (what routers need)
    # Engine profiles (engine/profiles.py): the one to start in, user-defined ones, and
    # automatic rollback to "safe" after safe_mode_faults faults within safe_mode_window
    # seconds (or an unrecoverable fault, or a failed audit), back after
    # safe_mode_clean_period seconds without a fault.
    profile: str = "normal"
    profiles_file: str | None = None
    auto_safe_mode: bool = True
    safe_mode_faults: int = 3
    safe_mode_window: float = 10.0
    safe_mode_clean_period: float = 30.0
    # Flight recorder (engine/flight_recorder.py): keep the last N steps (0: off) and
    # write them to this directory on a fault, a failed audit or a crash. The temp dir:
    # writable where the working directory is not (read-only container root); point it
    # at a persistent volume in production.
    flight_recorder_steps: int = 256
    flight_recorder_dir: str = DEFAULT_FLIGHT_RECORDER_DIR
    # Device and attention kernels (docs/gpu.md). None: cuda when present, else cpu;
    # triton on cuda, torch on cpu.
    device: str | None = None
    attention_backend: str | None = None
    gpu_memory_utilization: float = 0.9  # on CUDA, share of the GPU the engine may fill
    # A Jinja chat template (a file's path, or the template itself) that replaces the
    # model's own; None: the model's.
    chat_template: str | None = None
    # KV tiers (kvstore/, docs/kv-tiers.md): evicted prefix-cache blocks kept in a disk
    # directory and/or a Redis server, loaded back verified on a later prefix hit.
    kv_offload_dir: str | None = None
    kv_offload_dir_size: int | str = "10GiB"
    kv_offload_redis: str | None = None
    kv_offload_redis_size: int | str = "4GiB"
    kv_offload_redis_ttl: int = 86400
    kv_offload_timeout: float = 0.5
    # GGUF weights kept block-quantized for the CPU kernels (kernels/cpu/quant.py,
    # docs/quantization.md): auto (default) keeps them quantized where that applies
    # (bfloat16 on the CPU) and the fast kernels build (AVX512-BF16 and VNNI), else
    # dequantizes; gguf keeps them quantized or fails; none dequantizes at load.
    quantization: str = "auto"

    def __post_init__(self) -> None:
        self._check_model_and_cache()
        self._check_integrity()
        self._check_host_tier()
        self._check_cpu()
        self._check_recorder_and_events()
        self._check_batch_and_profiles()
        self._check_device()
        self._check_chat_template()
        self._check_kv_tiers()
        self._check_quantization()

    def _check_quantization(self) -> None:
        """A known mode; ``gguf`` only where the quantized kernels apply (bf16 on the CPU)."""
        if self.quantization not in QUANTIZATION_MODES:
            raise EngineConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, "
                f"got {self.quantization!r}"
            )
        blocker = self._quantization_blocker()
        if self.quantization == "gguf" and blocker:
            raise EngineConfigError(f"quantization 'gguf': {blocker}")

    def _quantization_blocker(self) -> str | None:
        """Why GGUF weights cannot stay quantized with this config (None: they can)."""
        if self.torch_dtype != torch.bfloat16:
            return f"the quantized kernels compute in bfloat16, not {self.dtype}"
        if self.resolved_device.type != "cpu":
            return f"the quantized kernels run on the CPU, not {self.resolved_device}"
        return None

    def _check_kv_tiers(self) -> None:
        """The KV tiers' directory, server, sizes and timeout (kvstore/tier.py)."""
        try:
            check_tier_options(
                self.kv_offload_dir,
                self.kv_offload_dir_size,
                self.kv_offload_redis,
                self.kv_offload_redis_size,
                self.kv_offload_redis_ttl,
                self.kv_offload_timeout,
                self.enable_prefix_caching,
            )
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None

    def _check_chat_template(self) -> None:
        """A template given by path or inline must parse."""
        if self.chat_template is not None:
            try:
                read_chat_template(self.chat_template)
            except ChatTemplateError as exc:
                raise EngineConfigError(str(exc)) from None

    def _check_model_and_cache(self) -> None:
        """The dtype, the KV cache's size and what one step may hold."""
        if self.dtype not in _DTYPES:
            raise EngineConfigError(
                f"dtype {self.dtype!r} is not supported; use one of {sorted(_DTYPES)}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise EngineConfigError(
                f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}"
            )
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise EngineConfigError("give kv_cache_memory or num_kv_blocks, not both")
        if self.max_model_len is not None and self.max_model_len < MIN_MAX_MODEL_LEN:
            raise EngineConfigError(
                f"max_model_len must be >= {MIN_MAX_MODEL_LEN}, got {self.max_model_len}"
            )

    def _check_integrity(self) -> None:
        """The integrity level, the audit interval and the scrubber's budget."""
        if self.integrity not in INTEGRITY_LEVELS:
            raise EngineConfigError(
                f"integrity {self.integrity!r} is not one of {', '.join(INTEGRITY_LEVELS)}"
            )
        if not isinstance(self.audit_interval, int) or self.audit_interval < 1:
            raise EngineConfigError(
                f"audit_interval must be a positive integer, got {self.audit_interval!r}"
            )
        if not isinstance(self.scrub_blocks_per_step, int) or self.scrub_blocks_per_step < 0:
            raise EngineConfigError(
                f"scrub_blocks_per_step must be an integer >= 0, got {self.scrub_blocks_per_step!r}"
            )

    def _check_host_tier(self) -> None:
        """The swap tier and the preemption mode it allows."""
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise EngineConfigError(
                f"swap_space is GiB of host memory, >= 0; got {self.swap_space!r}"
            )
        if self.num_swap_blocks is not None and (
            not isinstance(self.num_swap_blocks, int) or self.num_swap_blocks < 0
        ):
            raise EngineConfigError(
                f"num_swap_blocks must be an integer >= 0, got {self.num_swap_blocks!r}"
            )
        if self.num_swap_blocks is not None and self.swap_space:
            raise EngineConfigError("give swap_space or num_swap_blocks, not both")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise EngineConfigError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and not (self.swap_space or self.num_swap_blocks):
            raise EngineConfigError(
                "preemption_mode 'swap' needs a host tier: set swap_space (GiB) or num_swap_blocks"
            )

    def _check_cpu(self) -> None:
        """CPU threads, the cores they are bound to and the serial-step size."""
        if self.cpu_threads is not None and (
            not isinstance(self.cpu_threads, int) or self.cpu_threads < 1
        ):
            raise EngineConfigError(
                f"cpu_threads must be a positive integer, got {self.cpu_threads!r}"
            )
        if self.serial_step_tokens is not None and (
            not isinstance(self.serial_step_tokens, int) or self.serial_step_tokens < 0
        ):
            raise EngineConfigError(
                f"serial_step_tokens must be a non-negative integer, got "
                f"{self.serial_step_tokens!r}"
            )
        if self.cpu_bind is not None:
            try:
                parse_cpu_list(self.cpu_bind)
            except CpuBindError as exc:
                raise EngineConfigError(str(exc)) from None

    def _check_recorder_and_events(self) -> None:
        """The flight recorder and the KV events socket."""
        if (
            not isinstance(self.flight_recorder_steps, int)
            or isinstance(self.flight_recorder_steps, bool)
            or self.flight_recorder_steps < 0
        ):
            raise EngineConfigError(
                f"flight_recorder_steps must be an integer >= 0 (0: off), "
                f"got {self.flight_recorder_steps!r}"
            )
        endpoint = self.kv_events_endpoint
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise EngineConfigError(
                f"kv_events_endpoint must be a ZeroMQ tcp://, ipc:// or inproc:// address "
                f"(tcp://*:5557 binds), got {endpoint!r}"
            )
        if self.kv_events_encoding not in ("array", "map"):
            raise EngineConfigError(
                f"kv_events_encoding must be 'array' or 'map', got {self.kv_events_encoding!r}"
            )

    def _check_batch_and_profiles(self) -> None:
        """The adaptive batch's latency target and the safe-mode thresholds."""
        if self.target_itl_ms is not None and not self.target_itl_ms > 0:
            raise EngineConfigError(f"target_itl_ms must be > 0, got {self.target_itl_ms}")
        try:
            self.safe_mode_policy  # noqa: B018 - validates the thresholds
        except ProfileError as exc:
            raise EngineConfigError(str(exc)) from None

    def _check_device(self) -> None:
        """The device, the attention backend it can run and the GPU memory share."""
        try:
            device_type = self.resolved_device.type
            if self.attention_backend is not None:  # asked for: it must run here
                check_backend(self.attention_backend, device_type)
        except (DeviceError, AttentionBackendError) as exc:
            raise EngineConfigError(str(exc)) from None
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError(
                f"gpu_memory_utilization is a fraction in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def resolved_preemption_mode(self) -> str:
        """The preemption mode in force ("swap" when a host tier exists, unless told)."""
        if self.preemption_mode is not None:
            return self.preemption_mode
        return "swap" if (self.swap_space or self.num_swap_blocks) else "recompute"

    @property
    def safe_mode_policy(self) -> SafeModePolicy:
        return SafeModePolicy(
            faults=self.safe_mode_faults,
            window_s=self.safe_mode_window,
            clean_period_s=self.safe_mode_clean_period,
            auto=self.auto_safe_mode,
        )

    @property
    def resolved_device(self) -> torch.device:
        """The device the engine runs on (cuda when present unless told)."""
        return resolve_device(self.device)

    @property
    def resolved_attention_backend(self) -> str:
        """The attention backend asked for, else the device's default (``default_backend``:
        triton on cuda, cpu on a CPU with a C++ toolchain, else torch)."""
        return self.attention_backend or default_backend(self.resolved_device.type)

    @property
    def resolved_quantization(self) -> str:
        """The mode the loader gets: ``auto`` is ``none`` where the kernels do not apply
        (float32 or float16 runs, a GPU); whether they build is the loader's to find."""
        if self.quantization == "auto" and self._quantization_blocker():
            return "none"
        return self.quantization

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
