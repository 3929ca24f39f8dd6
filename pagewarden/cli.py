"""Command line: ``pagewarden generate``, ``pagewarden chat`` and ``pagewarden serve``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from pagewarden.engine.args import DefaultsHelpFormatter, add_engine_args, engine_config
from pagewarden.engine.config import EngineConfig

#: Where ``pagewarden chaos --scenario storm`` draws its plot unless ``--plot`` says.
DEFAULT_STORM_PLOT = "pagewarden-storm.png"


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 samples greedily")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest (0 = off)"
    )
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1 = off)"
    )
    parser.add_argument(
        "--sample-seed",
        type=int,
        default=None,
        help="per-request seed (default: none, the engine's generator seeded by --seed)",
    )


def _add_chat_sampling_args(parser: argparse.ArgumentParser) -> None:
    from pagewarden.terminal import CHAT_FALLBACK

    def recommended(name: str, what: str) -> str:
        fallback = CHAT_FALLBACK.get(name, "off")
        return f"{what} (default: the model's generation config, else {fallback})"

    parser.add_argument("--system", default=None, help="system prompt (default: none)")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    parser.add_argument(
        "--temperature", type=float, default=None, help=recommended("temperature", "0 is greedy")
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help=recommended("top_p", "nucleus sampling mass")
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help=recommended("top_k", "the k likeliest; 0 = off")
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help=recommended("repetition_penalty", "> 1 discourages repeats"),
    )
    parser.add_argument(
        "--sample-seed", type=int, default=None, help="per-reply seed (default: none)"
    )


def _sampling(args: argparse.Namespace, settings: dict | None = None):
    from pagewarden.sampling_params import SamplingParams

    if settings is None:
        names = ("temperature", "top_p", "top_k", "repetition_penalty")
        settings = {k: getattr(args, k) for k in names}
    return SamplingParams(max_tokens=args.max_tokens, seed=args.sample_seed, **settings)


def _llm(args: argparse.Namespace):
    from pagewarden.engine.llm import LLM
    from pagewarden.terminal import load_progress

    # LLM takes exactly EngineConfig's fields as keyword arguments.
    with load_progress(f"pagewarden: loading {args.model or 'the default model'}", sys.stderr):
        return LLM(**asdict(engine_config(args)))


def cmd_generate(args: argparse.Namespace) -> int:
    from pagewarden.terminal import chat_prompt, stream_completion

    llm = _llm(args)
    params = _sampling(args)
    if args.chat_template is not None:  # --chat-template [TEMPLATE]
        text, ids = chat_prompt(llm, [{"role": "user", "content": args.prompt}])
    else:
        text, ids = args.prompt, llm.engine.tokenizer.encode(args.prompt)

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    stream_completion(llm, text, ids, params, write)
    print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagewarden.terminal import chat_sampling, run_chat

    llm = _llm(args)
    overrides = {
        k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")
    }
    settings = chat_sampling(llm.engine.loaded.path, overrides)
    params = _sampling(args, settings)
    shown = ", ".join(f"{k} {v}" for k, v in settings.items())
    print(f"sampling: {shown}", file=sys.stderr)
    return run_chat(llm, params, args.system, input, sys.stdout)


def cmd_chaos(args: argparse.Namespace) -> int:
    if args.scenario == "storm":
        return _cmd_storm(args)
    if args.scenario == "tiers":
        from pagewarden.chaos.tiers import run_tier_chaos

        tier_report = run_tier_chaos(
            model=args.model,
            integrity=args.integrity or "strict",
            redis_url=args.kv_offload_redis,
            dtype=args.dtype,
            seed=args.seed,
        )
        print(tier_report.table())
        return 0 if tier_report.corrupted_tokens == 0 else 1
    from pagewarden.chaos.campaign import run_chaos

    report = run_chaos(
        model=args.model,
        num_faults=args.faults or 20,
        integrity=args.integrity or "strict",
        num_requests=args.requests,
        max_tokens=args.max_tokens,
        seed=args.seed,
        dtype=args.dtype,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        num_swap_blocks=args.num_swap_blocks,
        flight_recorder_steps=args.flight_recorder_steps,
        flight_recorder_dir=args.flight_recorder_dir or EngineConfig.flight_recorder_dir,
    )
    print(report.table())
    return 0


def _cmd_storm(args: argparse.Namespace) -> int:
    """``pagewarden chaos --scenario storm``: the report, then the plot where it can be drawn.

    Without matplotlib the default plot is skipped with one line saying what to install;
    a ``--plot PATH`` asked for explicitly fails instead (exit status 2, after the report).
    """
    import tempfile
    from pathlib import Path

    from pagewarden.chaos.storm import run_storm, storm_config
    from pagewarden.chaos.storm_plot import PlotUnavailable, write_storm_plot

    overrides = dict(
        dtype=args.dtype,
        block_size=args.block_size,
        integrity=args.integrity or "standard",
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        safe_mode_clean_period=args.clean_period,
    )
    if args.num_kv_blocks is not None:
        overrides["num_kv_blocks"] = args.num_kv_blocks
    if args.num_swap_blocks is not None:
        overrides["num_swap_blocks"] = args.num_swap_blocks
    config = storm_config(args.model, **overrides)
    recorder_dir = Path(args.flight_recorder_dir or tempfile.mkdtemp(prefix="pagewarden-storm-"))
    recorder_dir.mkdir(parents=True, exist_ok=True)
    report = run_storm(
        config,
        num_faults=args.faults or 12,
        burst_s=args.burst_seconds,
        max_tokens=args.max_tokens,
        seed=args.seed,
        recorder_dir=recorder_dir,
    )
    plot_error = None
    plot = DEFAULT_STORM_PLOT if args.plot is None else args.plot
    if plot:
        try:
            report.plot = write_storm_plot(report, plot)
        except PlotUnavailable as exc:
            plot_error = str(exc)
    print(report.table())
    if plot_error is not None:
        if args.plot is not None:  # asked for by name: not drawing it is a failure
            print(f"error: {plot_error}", file=sys.stderr)
            return 2
        print("plot skipped: the storm plot needs matplotlib (pip install 'pagewarden[chaos]')")
    facts = (
        report.limit_recovered,
        report.came_back,
        report.all_recovered,
        report.outputs_equal,
    )
    return 0 if all(facts) else 1


def _add_chaos_parser(sub) -> None:
    chaos = sub.add_parser(
        "chaos",
        help="inject KV faults into a mixed workload and report "
        "detection, recovery and output equality",
    )
    chaos.add_argument("--model", default=None, help="HF model directory or .gguf file")
    chaos.add_argument(
        "--scenario",
        default="mixed",
        choices=("mixed", "storm", "tiers"),
        help="mixed: faults at random steps of a mixed workload; storm: a burst of faults "
        "on a busy engine, then calm (batch limit, safe mode and recovery over time); "
        "tiers: damaged KV tier entries and failing tiers (docs/kv-tiers.md)",
    )
    chaos.add_argument(
        "--kv-offload-redis",
        default=None,
        metavar="URL",
        help="tiers scenario: also fault a Redis tier here (a scratch server: this model's "
        "entries on it are deleted)",
    )
    chaos.add_argument(
        "--faults", type=int, default=None, help="faults to inject (default 20; storm 12)"
    )
    chaos.add_argument(
        "--integrity",
        default=None,
        choices=("off", "audit", "standard", "strict"),
        help="default strict; storm: standard (safe mode makes it strict)",
    )
    chaos.add_argument("--requests", type=int, default=16)
    chaos.add_argument("--max-tokens", type=int, default=24)
    chaos.add_argument(
        "--dtype", default="float32", help="float32 by default so recomputed KV is bit-identical"
    )
    chaos.add_argument("--block-size", type=int, default=8)
    chaos.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="default: about a third of what the workload needs (preemption)",
    )
    chaos.add_argument(
        "--num-swap-blocks",
        type=int,
        default=None,
        help="host (swap) tier blocks; default half the KV blocks (too few "
        "for every victim, so preemption both swaps and recomputes); "
        "0: recompute only",
    )
    chaos.add_argument("--seed", type=int, default=0)
    storm = chaos.add_argument_group("storm scenario")
    storm.add_argument("--burst-seconds", type=float, default=3.0)
    storm.add_argument("--max-num-seqs", type=int, default=16)
    storm.add_argument(
        "--clean-period", type=float, default=2.0, help="seconds clean before safe mode ends"
    )
    storm.add_argument(
        "--plot",
        default=None,
        help=f"PNG to write ('' for none; default {DEFAULT_STORM_PLOT}, skipped with a note "
        "when matplotlib is not installed)",
    )
    chaos.add_argument(
        "--flight-recorder-steps",
        type=int,
        default=EngineConfig.flight_recorder_steps,
        help="steps the faulty run's flight recorder keeps (0: off)",
    )
    chaos.add_argument(
        "--flight-recorder-dir",
        default=None,
        help=f"where the faulty run writes its flight records (default: "
        f"{EngineConfig.flight_recorder_dir}; storm: a new temporary directory)",
    )
    chaos.set_defaults(func=cmd_chaos)


def cmd_replay(args: argparse.Namespace) -> int:
    from pagewarden.faults.metadata_faults import METADATA_FAULTS
    from pagewarden.sched.replay import FlightRecordError, load_record, replay

    try:
        record = load_record(args.file)
        h = record.header
        print(
            f"flight record {args.file}: {h.get('reason')} ({h.get('created')}, pid {h.get('pid')})"
        )
        result = replay(record, METADATA_FAULTS)
    except (FlightRecordError, OSError) as exc:
        print(f"pagewarden replay: {exc}", file=sys.stderr)
        return 2
    ops = f"{result.num_steps} step entries, {result.num_ops} scheduler calls"
    if result.divergence is None:
        print(f"replayed steps {result.first_step}..{result.last_step} ({ops}): no divergence")
        return 0
    print(f"DIVERGENCE at {result.divergence}")
    return 1


def _add_replay_parser(sub) -> None:
    replay = sub.add_parser(
        "replay",
        help="re-run the scheduler and KV-metadata operations of a flight record and "
        "report the first divergence from what was recorded (exit 1)",
    )
    replay.add_argument("file", help="a flight record (.jsonl) the engine wrote")
    replay.set_defaults(func=cmd_replay)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagewarden`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="pagewarden")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="complete one prompt, printing tokens as they are generated",
        formatter_class=DefaultsHelpFormatter,
    )
    gen.add_argument("prompt", help="the text to complete")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser(
        "chat",
        help="interactive chat in the terminal (/reset clears it)",
        formatter_class=DefaultsHelpFormatter,
    )
    add_engine_args(chat)
    _add_chat_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    _add_chaos_parser(sub)
    _add_replay_parser(sub)
    try:
        from pagewarden.serve.cli import add_serve_parser
    except ImportError:  # the server's dependencies (fastapi, uvicorn) are optional
        pass
    else:
        add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagewarden: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
