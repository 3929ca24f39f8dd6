"""Control-plane throughput: scheduler + block pool with a fake runner (no model).

Requests of 64 prompt tokens (a 16-token shared prefix) and 16 output tokens.
Prints sustained requests/s, block ops/s, and median schedule() time at batch 32 and 256.

    python bench/control_plane.py [--runs 5] [--requests 20000] [--batch 32 256]
    python bench/control_plane.py --against /tmp/old   # after: git worktree add /tmp/old REV
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewarden.sampling_params import SamplingParams  # noqa: E402
from pagewarden.sched import Request, Scheduler, SchedulerConfig  # noqa: E402
from pagewarden.sched.fake_runner import FakeModelRunner  # noqa: E402


def _requests(n: int, rng: random.Random) -> list[Request]:
    prefix = [rng.randrange(32000) for _ in range(16)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return [
        Request(f"r{i}", prefix + [rng.randrange(32000) for _ in range(48)], params)
        for i in range(n)
    ]


def run(num_requests: int, batch: int) -> tuple[float, float, float]:
    cfg = SchedulerConfig(num_blocks=batch * 6 + 64, block_size=16, max_num_seqs=batch,
                          max_num_batched_tokens=max(2048, batch * 64), max_model_len=2048)
    s = Scheduler(cfg)
    runner = FakeModelRunner(16)
    reqs = _requests(num_requests, random.Random(0))
    sched_times = []
    t0 = time.perf_counter()
    it = iter(reqs)
    for r in it:
        s.add_request(r)
        if len(s.waiting) >= batch:
            break
    while s.has_unfinished_requests():
        a = time.perf_counter()
        out = s.schedule()
        sched_times.append(time.perf_counter() - a)
        for _ in s.update(out, runner.execute(out)).finished:
            nxt = next(it, None)
            if nxt is not None:
                s.add_request(nxt)
    elapsed = time.perf_counter() - t0
    pool = s.kv.pool
    block_ops = pool.num_allocations + pool.num_frees
    return num_requests / elapsed, block_ops / elapsed, statistics.median(sched_times)


_CHILD = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
import control_plane
print(json.dumps([control_plane.run(int(sys.argv[2]), int(b)) for b in sys.argv[3:]]))
"""


def _run_in(root: str, num_requests: int, batches: list[int]) -> list[tuple[float, float, float]]:
    """``run`` of the checkout at ``root``, in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, root, str(num_requests),
                           *map(str, batches)], capture_output=True, text=True, check=True)
    return [tuple(r) for r in json.loads(proc.stdout)]  # type: ignore[misc]


def _report(label: str, runs: list[tuple[float, float, float]]) -> str:
    rps = [r[0] for r in runs]
    ops = statistics.median(r[1] for r in runs)
    med = statistics.median(r[2] for r in runs)
    return (f"{label}: {statistics.median(rps):,.0f} requests/s median of {len(rps)} "
            f"(min {min(rps):,.0f}, max {max(rps):,.0f}), {ops:,.0f} block ops/s, "
            f"median schedule() {med * 1e6:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=5,
                        help="runs per batch size, alternated; the median is reported")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--against", metavar="DIR",
                        help="another pagewarden checkout (e.g. a `git worktree add` of an "
                             "older commit): both run alternated in fresh processes and "
                             "the ratio of their medians is printed")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    roots = [here] + ([args.against] if args.against else [])
    results = {(root, b): [] for root in roots for b in args.batch}
    for _ in range(args.runs):  # alternate, so drift on a shared machine hits every side
        for root in roots:
            if args.against:
                runs = _run_in(root, args.requests, args.batch)
            else:
                runs = [run(args.requests, b) for b in args.batch]
            for batch, r in zip(args.batch, runs):
                results[root, batch].append(r)
    for batch in args.batch:
        print(_report(f"batch={batch}", results[here, batch]) + " (target 14,720 requests/s)")
        if args.against:
            print("  " + _report(f"against {args.against}", results[args.against, batch]))
            ratio = (statistics.median(r[0] for r in results[here, batch])
                     / statistics.median(r[0] for r in results[args.against, batch]))
            print(f"  ratio of medians {ratio:.2f}")


if __name__ == "__main__":
    main()
