"""Control-plane throughput: scheduler + block pool with a fake runner (no model).

Requests of 64 prompt tokens (a 16-token shared prefix) and 16 output tokens.
Prints sustained requests/s, block ops/s, and median schedule() time at batch 32 and 256.

    python bench/control_plane.py [--runs 5] [--requests 20000] [--batch 32 256]
    python bench/control_plane.py --against /tmp/old   # after: git worktree add /tmp/old REV
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

# --against runs this file on another checkout's package.
sys.path.insert(0, os.environ.get("PAGEWARDEN_ROOT") or str(Path(__file__).resolve().parents[1]))

try:
    from pagewarden.gc_policy import tune_gc_for_serving
except ImportError:  # a checkout from before gc_policy: the same settings, here

    def tune_gc_for_serving() -> tuple[int, int, int]:
        previous = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, previous[1], previous[2])
        return previous


from pagewarden.sampling_params import SamplingParams  # noqa: E402
from pagewarden.sched import Request, Scheduler, SchedulerConfig  # noqa: E402
from pagewarden.sched.fake_runner import FakeModelRunner  # noqa: E402


def _prompts(n: int, rng: random.Random) -> list[tuple[int, ...]]:
    """``n`` prompts of 64 tokens sharing their first 16: tuples of ints, as a tokenizer or
    a JSON body hands them over (the garbage collector stops walking a tuple of ints after
    its first collection; a server holds no prompt before its request arrives)."""
    prefix = [rng.randrange(32000) for _ in range(16)]
    return [tuple(prefix + [rng.randrange(32000) for _ in range(48)]) for _ in range(n)]


def _finished(updates) -> Iterable[object]:
    """One entry per request that finished this step. ``update()`` returns ``StepUpdates``
    (its ``finished`` dict); checkouts from before it (for --against) return a list of
    ``RequestUpdate``."""
    finished = getattr(updates, "finished", None)
    return finished if finished is not None else [u for u in updates if u.finished]


def run(
    num_requests: int, batch: int, tuned_gc: bool = True, output_tokens: tuple[int, int] = (16, 16)
) -> tuple[float, float, float]:
    """Sustained requests/s, block operations/s and median ``schedule()`` seconds.

    Requests arrive as the running ones finish (``batch`` in flight, ``batch`` waiting); each
    is built when it arrives and dropped when it finishes, as a server would. ``tuned_gc``
    runs under ``tune_gc_for_serving`` (what ``pagewarden serve`` uses), else under
    Python's default collector settings.
    """
    cfg = SchedulerConfig(
        num_blocks=batch * 6 + 64,
        block_size=16,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * 64),
        max_model_len=2048,
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(16)
    lo, hi = output_tokens  # each request's output length, uniform in [lo, hi]
    by_len = {n: SamplingParams(max_tokens=n, ignore_eos=True) for n in range(lo, hi + 1)}
    lengths = random.Random(1)
    params = [by_len[lengths.randint(lo, hi)] for _ in range(num_requests)]
    prompts = _prompts(num_requests, random.Random(0))
    previous = tune_gc_for_serving() if tuned_gc else None
    try:
        sched_times = []
        t0 = time.perf_counter()
        arrivals = iter(range(num_requests))
        for i in arrivals:
            s.add_request(Request(f"r{i}", prompts[i], params[i]))
            if len(s.waiting) >= batch:
                break
        while s.has_unfinished_requests():
            a = time.perf_counter()
            out = s.schedule()
            sched_times.append(time.perf_counter() - a)
            for _ in _finished(s.update(out, runner.execute(out))):
                i = next(arrivals, -1)
                if i >= 0:
                    s.add_request(Request(f"r{i}", prompts[i], params[i]))
        elapsed = time.perf_counter() - t0
    finally:
        if previous is not None:
            gc.set_threshold(*previous)
            gc.unfreeze()
    pool = s.kv.pool
    block_ops = pool.num_allocations + pool.num_frees
    return num_requests / elapsed, block_ops / elapsed, statistics.median(sched_times)


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import control_plane
lo, hi = map(int, sys.argv[4].split("-"))
print(json.dumps([control_plane.run(int(sys.argv[2]), int(b), sys.argv[3] == "tuned", (lo, hi))
                  for b in sys.argv[5:]]))
"""


def _run_in(
    root: str, num_requests: int, batches: list[int], gc_mode: str, output_tokens: tuple[int, int]
) -> list[tuple[float, float, float]]:
    """``run`` on the pagewarden package of the checkout at ``root``, in a fresh process."""
    env = dict(os.environ, PAGEWARDEN_ROOT=root)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(Path(__file__).parent),
            str(num_requests),
            gc_mode,
            f"{output_tokens[0]}-{output_tokens[1]}",
            *map(str, batches),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return [tuple(r) for r in json.loads(proc.stdout)]  # type: ignore[misc]


def _report(label: str, runs: list[tuple[float, float, float]]) -> str:
    rps = [r[0] for r in runs]
    ops = statistics.median(r[1] for r in runs)
    med = statistics.median(r[2] for r in runs)
    return (
        f"{label}: {statistics.median(rps):,.0f} requests/s median of {len(rps)} "
        f"(min {min(rps):,.0f}, max {max(rps):,.0f}), {ops:,.0f} block ops/s, "
        f"median schedule() {med * 1e6:.1f} us"
    )


def _token_range(text: str) -> tuple[int, int]:
    """``"16"`` -> (16, 16); ``"1-31"`` -> (1, 31)."""
    try:
        lo, _, hi = text.partition("-")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return bounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument(
        "--runs",
        type=int,
        default=5,
        help="runs per batch size, alternated; the median is reported",
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument(
        "--output-tokens",
        type=_token_range,
        default=(16, 16),
        metavar="N or LO-HI",
        help="each request's output length: 16 (every request finishes "
        "in step with the others) or a range drawn uniformly per "
        "request, e.g. 1-31 (finishes and arrivals every step)",
    )
    parser.add_argument(
        "--gc",
        choices=("tuned", "default", "both"),
        default="both",
        help="garbage collector settings: pagewarden serve's "
        "(gc_policy.tune_gc_for_serving), Python's default, or both",
    )
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="another pagewarden checkout (e.g. a `git worktree add` of an "
        "older commit): its package runs this benchmark, alternated "
        "with this one in fresh processes, and the ratio of the "
        "medians is printed",
    )
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    roots = [here] + ([args.against] if args.against else [])
    modes = ["tuned", "default"] if args.gc == "both" else [args.gc]
    results: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {
        (root, mode, b): [] for root in roots for mode in modes for b in args.batch
    }
    for _ in range(args.runs):  # alternate, so drift on a shared machine hits every side
        for mode in modes:
            for root in roots:
                if args.against:
                    runs = _run_in(root, args.requests, args.batch, mode, args.output_tokens)
                else:
                    runs = [
                        run(args.requests, b, mode == "tuned", args.output_tokens)
                        for b in args.batch
                    ]
                for batch, r in zip(args.batch, runs):
                    results[root, mode, batch].append(r)
    for mode in modes:
        print(
            f"{mode} gc"
            + (" (as pagewarden serve runs)" if mode == "tuned" else " (Python's defaults)")
        )
        for batch in args.batch:
            print(
                "  "
                + _report(f"batch={batch}", results[here, mode, batch])
                + " (target 14,720 requests/s)"
            )
            if args.against:
                print(
                    "    " + _report(f"against {args.against}", results[args.against, mode, batch])
                )
                ratio = statistics.median(
                    r[0] for r in results[here, mode, batch]
                ) / statistics.median(r[0] for r in results[args.against, mode, batch])
                print(f"    ratio of medians {ratio:.2f}")


if __name__ == "__main__":
    main()
