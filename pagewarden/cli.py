"""Command line: ``pagewarden generate``, ``pagewarden chat`` and ``pagewarden serve``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from pagewarden.engine.args import add_engine_args, engine_config
from pagewarden.engine.config import EngineConfig


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request seed")


def _sampling(args: argparse.Namespace):
    from pagewarden.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
    )


def _llm(args: argparse.Namespace):
    from pagewarden.engine.llm import LLM

    # LLM takes exactly EngineConfig's fields as keyword arguments.
    return LLM(**asdict(engine_config(args)))


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _sampling(args)
    if args.chat_template:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate([args.prompt], params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _sampling(args)
    history: list[dict[str, str]] = []
    print("pagewarden chat: type a message, Ctrl-D or /exit to quit.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        history.append({"role": "assistant", "content": reply})


def cmd_chaos(args: argparse.Namespace) -> int:
    from pagewarden.faults.chaos import run_chaos

    report = run_chaos(
        model=args.model,
        num_faults=args.faults,
        integrity=args.integrity,
        num_requests=args.requests,
        max_tokens=args.max_tokens,
        seed=args.seed,
        dtype=args.dtype,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        num_swap_blocks=args.num_swap_blocks,
        flight_recorder_steps=args.flight_recorder_steps,
        flight_recorder_dir=args.flight_recorder_dir,
    )
    print(report.table())
    return 0


def _add_chaos_parser(sub) -> None:
    chaos = sub.add_parser(
        "chaos",
        help="inject KV faults into a mixed workload and report "
        "detection, recovery and output equality",
    )
    chaos.add_argument("--model", default=None, help="HF model directory or .gguf file")
    chaos.add_argument("--faults", type=int, default=20, help="faults to inject")
    chaos.add_argument(
        "--integrity", default="strict", choices=("off", "audit", "standard", "strict")
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
    chaos.add_argument(
        "--flight-recorder-steps",
        type=int,
        default=EngineConfig.flight_recorder_steps,
        help="steps the faulty run's flight recorder keeps (0: off)",
    )
    chaos.add_argument(
        "--flight-recorder-dir",
        default=EngineConfig.flight_recorder_dir,
        help="where the faulty run writes its flight records",
    )
    chaos.set_defaults(func=cmd_chaos)


def cmd_replay(args: argparse.Namespace) -> int:
    from pagewarden.faults.metadata_faults import METADATA_FAULTS
    from pagewarden.sched.replay import load_record, replay

    record = load_record(args.file)
    h = record.header
    print(f"flight record {args.file}: {h['reason']} ({h['created']}, pid {h['pid']})")
    result = replay(record, METADATA_FAULTS)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagewarden")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap the prompt as a user message with the model's chat template",
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    _add_chaos_parser(sub)
    _add_replay_parser(sub)
    try:
        from pagewarden.server.cli import add_serve_parser
    except ImportError:  # the server's dependencies (fastapi, uvicorn) are optional
        pass
    else:
        add_serve_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagewarden: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
