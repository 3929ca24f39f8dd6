"""What the flight recorder costs per engine step, against a real decode step at batch 64.

    python bench/flight_recorder_cost.py                  # default model, batch 64
    python bench/flight_recorder_cost.py --model DIR --num-prompts 64 --decode-steps 10

Two measurements in one run:

1. The recorder's own cost, on the scheduler alone: the same batch-64 decode workload is
   driven by the fake runner with the recorder off and on (``--fake-steps`` steps, so
   its checkpoint every ``--window`` steps is amortised in), in alternating rounds; the
   best round of each is kept. The difference is the recorder's cost per step (journal
   appends, block-table epoch copies, block trace, checkpoints), free of model noise.
2. A real decode step at batch 64 (default GGUF model unless ``--model``), with the
   recorder on and off in alternating rounds, so the ratio of (1) to it is the share of
   step time, and the end-to-end difference is there to compare (it is within noise).

Also prints what writing one record costs (it happens only on a fault or a crash).
Note ``uptime`` beside the figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewarden.engine.flight_recorder import FlightRecorder, integrity_counts  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402
from pagewarden.sched import Request, Scheduler, SchedulerConfig  # noqa: E402
from pagewarden.sched.fake_runner import FakeModelRunner  # noqa: E402


def fake_round(
    cfg: SchedulerConfig, args, record: bool, out_dir: str
) -> tuple[float, tuple[float, int, int]]:
    """CPU seconds per decode step of the fake-runner workload; and one record written
    at the end: (wall seconds, step entries, bytes)."""
    sched = Scheduler(cfg)
    runner = FakeModelRunner(cfg.block_size, 32000)
    rec = FlightRecorder(sched, args.window, out_dir, lambda: (0,) * 8) if record else None
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.fake_steps + 8, ignore_eos=True)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(100, 30000) for _ in range(args.input_len)]
        sched.add_request(Request(str(i), prompt, params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.waiting or sched.running):
        _step(sched, runner, rec)
    # CPU time of this process: other processes on a shared machine do not count.
    start = time.process_time()
    for _ in range(args.fake_steps):
        _step(sched, runner, rec)
    per_step = (time.process_time() - start) / args.fake_steps
    dump = (0.0, 0, 0)
    if rec is not None:
        t0 = time.perf_counter()
        path = rec.dump("benchmark")
        assert path is not None
        with open(path) as f:
            entries = sum(1 for _ in f) - 2
        dump = (time.perf_counter() - t0, entries, path.stat().st_size)
    return per_step, dump


def _step(sched: Scheduler, runner: FakeModelRunner, rec: FlightRecorder | None) -> None:
    if rec is not None:
        rec.begin_step()
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    if rec is not None:
        rec.end_step()


def real_rounds(args, out_dir: str) -> tuple[list[float], list[float], str]:
    """Mean decode-step seconds per round, recorder on and off, alternating."""
    from pagewarden.engine.config import EngineConfig
    from pagewarden.engine.core import EngineCore

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(args.num_prompts * args.input_len, 2048),
        flight_recorder_dir=out_dir,
    )
    engine = EngineCore(config)
    vocab = engine.loaded.config.vocab_size
    rng = random.Random(0)
    total = args.rounds * 2 * args.decode_steps + 8
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
        engine.add_request(str(i), prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    engine.step()
    on: list[float] = []
    off: list[float] = []
    for _ in range(args.rounds):
        for record in (True, False):
            if record:
                engine.recorder = FlightRecorder(
                    engine.scheduler,
                    args.window,
                    out_dir,
                    lambda: integrity_counts(engine.integrity),
                )
            else:
                engine.recorder = None
                engine.scheduler.journal = None
                engine.scheduler.kv.pool.trace = None
            start = time.perf_counter()
            for _ in range(args.decode_steps):
                engine.step()
            (on if record else off).append((time.perf_counter() - start) / args.decode_steps)
    return on, off, f"{engine.loaded.name}, {engine.kv_store.shape.num_blocks} KV blocks"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=8, help="real steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fake-steps", type=int, default=600)
    ap.add_argument("--window", type=int, default=256, help="--flight-recorder-steps")
    ap.add_argument("--num-blocks", type=int, default=2900, help="pool size of the fake run")
    args = ap.parse_args()

    out_dir = tempfile.mkdtemp(prefix="pagewarden-bench-records-")
    cfg = SchedulerConfig(
        num_blocks=args.num_blocks,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=max(args.num_prompts * args.input_len, 2048),
        max_model_len=args.input_len + args.fake_steps + 16,
        enable_prefix_caching=False,
    )
    fake_on, fake_off, dumps = [], [], []
    for _ in range(args.rounds):
        off_s, _ = fake_round(cfg, args, False, out_dir)
        on_s, dump_s = fake_round(cfg, args, True, out_dir)
        fake_off.append(off_s)
        fake_on.append(on_s)
        dumps.append(dump_s)
    cost = min(fake_on) - min(fake_off)
    print(
        f"scheduler + fake runner, batch {args.num_prompts}, {args.fake_steps} decode steps, "
        f"window {args.window}, {args.num_blocks} blocks (best of {args.rounds}):"
    )
    print(
        f"  recorder off {min(fake_off) * 1e6:8.1f} us/step   on {min(fake_on) * 1e6:8.1f} "
        f"us/step   recorder cost {cost * 1e6:6.1f} us/step"
    )
    print(
        f"  writing one record ({dumps[0][1]} step entries, {dumps[0][2] / 1e6:.1f} MB): "
        f"{statistics.median(d[0] for d in dumps) * 1e3:.0f} ms (on a fault, in the background)"
    )
    on, off, name = real_rounds(args, out_dir)
    step = statistics.median(off)
    print(
        f"real decode step, batch {args.num_prompts} ({name}), {args.rounds} rounds x "
        f"{args.decode_steps} steps:"
    )
    print(
        f"  recorder off {step * 1e3:8.1f} ms/step (median)   on {statistics.median(on) * 1e3:8.1f} "
        f"ms/step (median; end-to-end difference is within noise on a shared machine)"
    )
    print(f"  recorder cost / real step: {cost / step:.3%}")


if __name__ == "__main__":
    main()
