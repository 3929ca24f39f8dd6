"""Engine command-line flags, beside ``EngineConfig`` (named as vLLM names them).

``pagewarden generate``, ``chat``, ``serve`` and ``chaos`` all build their engine from
these; the CLIs import them from here, so neither CLI module imports the other.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from pagewarden.engine.config import EngineConfig
from pagewarden.engine.kv_tiers import add_kv_tier_args
from pagewarden.kernels.backend import ATTENTION_BACKENDS
from pagewarden.models.gguf_weights import QUANTIZATION_MODES


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if (
            "default" in help_text
            or action.default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return help_text
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them, in the order ``--help`` lists them."""
    d = EngineConfig()
    _add_model_args(parser, d)
    _add_scheduler_args(parser, d)
    _add_integrity_args(parser, d)
    _add_preemption_args(parser, d)
    _add_kv_events_args(parser, d)
    _add_safe_mode_args(parser, d)
    _add_flight_recorder_args(parser, d)
    _add_device_args(parser, d)


def _add_model_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The model, its dtype and the KV cache's size."""
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--dtype", default=d.dtype, help="bfloat16 | float32 | float16")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB (default 1GiB)")
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="exact KV block count (default: as many as --kv-cache-memory holds)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_MODES,
        default=d.quantization,
        help="GGUF weights (docs/quantization.md): auto (default) keeps Q4_0/Q4_1/Q5_0/"
        "Q5_1/Q8_0/Q4_K/Q5_K/Q6_K tensors quantized for the CPU kernels where they apply "
        "(bfloat16 on the CPU) and their AVX512-BF16/VNNI paths build, else dequantizes; "
        "gguf keeps them quantized (the portable path without AVX-512; an error where "
        "nothing builds); none dequantizes every tensor at load",
    )


def _add_scheduler_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """How much one step may schedule, prefix caching and the sampler's seed."""
    parser.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="most tokens in one step (chunked prefill splits longer prompts)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's context length)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV of shared prompt prefixes",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the sampler")


def _add_integrity_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """KV integrity checks: the level, the audit and the scrubber."""
    parser.add_argument(
        "--integrity",
        default=d.integrity,
        choices=("off", "audit", "standard", "strict"),
        help="KV integrity checks (default standard; see README)",
    )
    parser.add_argument(
        "--audit-interval",
        type=int,
        default=d.audit_interval,
        help="steps between metadata invariant audits",
    )
    parser.add_argument(
        "--scrub-blocks-per-step",
        type=int,
        default=d.scrub_blocks_per_step,
        help="sealed blocks the scrubber re-verifies each step",
    )


def _add_preemption_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The host tier, preemption and the adaptive batch size."""
    parser.add_argument(
        "--swap-space",
        type=float,
        default=d.swap_space,
        help="GiB of host memory for swapped-out KV (default 0: no host tier)",
    )
    parser.add_argument(
        "--preemption-mode",
        default=None,
        choices=("recompute", "swap"),
        help="default: swap when --swap-space > 0, else recompute",
    )
    parser.add_argument(
        "--adaptive-batch",
        action=argparse.BooleanOptionalAction,
        default=d.adaptive_batch,
        help="lower the batch on integrity faults, preemption storms or slow tokens and "
        "raise it back after a clean window (default on)",
    )
    parser.add_argument(
        "--target-itl-ms",
        type=float,
        default=None,
        help="inter-token latency p90 above which the batch shrinks (default: 4x the median "
        "of the first clean window of each batch size class, powers of two)",
    )


def _add_kv_events_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """KV cache events in vLLM's format over ZeroMQ."""
    parser.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="URL",
        help="publish KV cache events in vLLM's format on a ZeroMQ PUB socket: "
        "tcp://*:5557 binds, tcp://host:5557 connects to a subscriber that binds "
        "(default: off; see docs/kv-events.md)",
    )
    parser.add_argument(
        "--kv-events-topic",
        default=d.kv_events_topic,
        help="ZeroMQ topic of the KV events (default: empty, as vLLM's)",
    )
    parser.add_argument(
        "--kv-events-encoding",
        default=d.kv_events_encoding,
        choices=("array", "map"),
        help="each event as a tagged array (vLLM up to 0.23, every consumer reads it) or a "
        "tagged map (newer vLLM)",
    )
    parser.add_argument(
        "--kv-events-no-token-ids",
        dest="kv_events_token_ids",
        action="store_false",
        help="send BlockStored events without their token ids (block hashes only, all a "
        "prefix-aware router needs): a subscriber can then not read prompts",
    )
    add_kv_tier_args(parser, d)


def _add_safe_mode_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """Engine profiles and the automatic switch to the safe one."""
    parser.add_argument(
        "--profile",
        default=d.profile,
        help="engine profile to start in: normal (as configured), safe, or one of "
        "--profiles-file (default normal)",
    )
    parser.add_argument(
        "--profiles-file",
        default=None,
        metavar="PATH",
        help="YAML, JSON or TOML file defining engine profiles (see docs/integrity.md)",
    )
    parser.add_argument(
        "--auto-safe-mode",
        action=argparse.BooleanOptionalAction,
        default=d.auto_safe_mode,
        help="switch to the safe profile on repeated or unrecoverable faults or a failed "
        "audit, and back after a clean period (default on)",
    )
    parser.add_argument(
        "--safe-mode-faults",
        type=int,
        default=d.safe_mode_faults,
        metavar="K",
        help=f"detected faults within --safe-mode-window that trigger safe mode "
        f"(default {d.safe_mode_faults})",
    )
    parser.add_argument(
        "--safe-mode-window",
        type=float,
        default=d.safe_mode_window,
        metavar="S",
        help=f"seconds over which faults are counted (default {d.safe_mode_window:g})",
    )
    parser.add_argument(
        "--safe-mode-clean-period",
        type=float,
        default=d.safe_mode_clean_period,
        metavar="S",
        help=f"seconds without a fault before safe mode ends (default "
        f"{d.safe_mode_clean_period:g})",
    )


def _add_flight_recorder_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The flight recorder of the last engine steps."""
    parser.add_argument(
        "--flight-recorder-steps",
        type=int,
        default=d.flight_recorder_steps,
        metavar="N",
        help="keep the last N..2N engine steps for `pagewarden replay` and write them out on "
        f"a fault, a failed audit or a crash (default {d.flight_recorder_steps}; 0: off)",
    )
    parser.add_argument(
        "--flight-recorder-dir",
        default=d.flight_recorder_dir,
        metavar="DIR",
        help=f"where flight records are written (default {d.flight_recorder_dir}, created on "
        "the first write)",
    )


def _add_device_args(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The device, the attention kernels and the CPU threads."""
    parser.add_argument(
        "--device",
        default=None,
        help="cuda | cuda:N | cpu (default: cuda when a GPU is present, else cpu)",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        choices=ATTENTION_BACKENDS,
        help="attention kernels (default: triton on cuda, torch on cpu; cpu: the C++ "
        "decode kernel, compiled on first use; triton on cpu needs TRITON_INTERPRET=1 and "
        "is for tests only)",
    )
    parser.add_argument(
        "--chat-template",
        nargs="?",
        const="",
        default=None,
        metavar="TEMPLATE",
        help="a Jinja chat template file, or the template itself, used instead of the "
        "model's (generate: given alone, wrap the prompt in the model's chat template)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="on cuda, the share of GPU memory the engine may use; the KV cache gets what "
        "the weights and activations leave (default 0.9)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads of the engine (default: torch's choice, one per core)",
    )
    parser.add_argument(
        "--cpu-bind",
        default=None,
        metavar="LIST",
        help="bind the engine to these cores, a Linux cpu list such as 0-3,8 (default: unbound)",
    )
    parser.add_argument(
        "--serial-step-tokens",
        type=int,
        default=EngineConfig.serial_step_tokens,
        metavar="N",
        help="CPU steps of at most N tokens run on one thread: with OpenMP threads asleep "
        "between parallel regions, waking them costs a tiny step more than a second core "
        "gains (0: always all threads; default: 0 where the GEMMs run on pagewarden's "
        "own kernel pool, else 2)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if values.get("chat_template") == "":  # a bare --chat-template: the model's own
        values["chat_template"] = None
    return EngineConfig(**values)
