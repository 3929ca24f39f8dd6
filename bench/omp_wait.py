"""Wait policies of the engine's threads on the real model path, quiet and next to busy
processes: the C++ kernels' own pool (``kernels/cpu/pool``) against OpenMP's policies.

    python bench/omp_wait.py                     # batch 64 and batch 1 decode, 0/1/2 hogs
    python bench/omp_wait.py --hogs 0 --batch 64

Each policy runs in its own process (the OpenMP runtime and the pool read their
environment once, at start): the default GGUF, integrity standard, prefix caching off; it
prefills ``--batch`` prompts of 128 random tokens, then times ``--steps`` decode steps and
prints the median milliseconds per step. A hog is a pure-Python busy loop pinned to no
core, the way any other process on a shared box competes for the cores. Policies:

    pool        the engine's default: the kernels' pool, its idle worker polling 100 us
                (PAGEWARDEN_POOL_SPIN_US), torch's own ops on PASSIVE OpenMP
    pool-sleep  the pool with PAGEWARDEN_POOL_SPIN_US=0: idle workers sleep at once
    passive     no pool (PAGEWARDEN_NO_CPU_POOL=1), OMP_WAIT_POLICY=PASSIVE: a futex
                wake per parallel region (the engine's policy before the pool)
    spin-0.1ms  no pool, PASSIVE with GOMP_SPINCOUNT=10000: spin about 0.1 ms, then sleep
    default     no pool, libgomp's default spin (GOMP_SPINCOUNT 300000, about 3 ms)
    active      no pool, OMP_WAIT_POLICY=ACTIVE: spin (for minutes)

Prints one line per (hogs, batch, policy); note ``uptime`` beside the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_POOL = {"PAGEWARDEN_NO_CPU_POOL": "1"}
POLICIES = {
    "pool": {"OMP_WAIT_POLICY": "PASSIVE"},
    "pool-sleep": {"OMP_WAIT_POLICY": "PASSIVE", "PAGEWARDEN_POOL_SPIN_US": "0"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", **NO_POOL},
    "spin-0.1ms": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", **NO_POOL},
    "default": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000", **NO_POOL},
    "active": {"OMP_WAIT_POLICY": "ACTIVE", **NO_POOL},
}

WORKER = """
import json, random, statistics, sys, time
sys.path.insert(0, {root!r})
from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core import EngineCore
from pagewarden.sampling_params import SamplingParams
batch, steps = {batch}, {steps}
engine = EngineCore(EngineConfig(enable_prefix_caching=False))
rng = random.Random(0)
for i in range(batch):
    prompt = [rng.randrange(1000, 40000) for _ in range(128)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request(f"r{{i}}", prompt, params)
while any(r.num_computed_tokens < 128 for r in engine.scheduler.running) or engine.scheduler.waiting:
    engine.step()
for _ in range(3):
    engine.step()
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - t0)
print(json.dumps(statistics.median(times) * 1e3))
"""


def _hog() -> None:
    while True:
        pass


def run(policy: str, batch: int, steps: int) -> float:
    env = dict(os.environ)
    for name in ("GOMP_SPINCOUNT", "PAGEWARDEN_NO_CPU_POOL", "PAGEWARDEN_POOL_SPIN_US"):
        env.pop(name, None)
    env.update(POLICIES[policy])
    code = WORKER.format(root=str(ROOT), batch=batch, steps=steps)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--policies", nargs="+", default=["pool", "pool-sleep", "passive"], choices=list(POLICIES)
    )
    args = ap.parse_args()
    print(f"uptime: {os.getloadavg()}")
    for hogs in args.hogs:
        procs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(hogs)]
        for p in procs:
            p.start()
        time.sleep(0.5)
        try:
            for batch in args.batch:
                row = {}
                for policy in args.policies:
                    row[policy] = run(policy, batch, args.steps)
                    print(
                        f"hogs {hogs}  batch {batch:3d}  {policy:11s} {row[policy]:8.1f} ms/step",
                        flush=True,
                    )
                base = row.get("passive")
                if base:
                    ratios = ", ".join(f"{k} {base / v:.2f}x" for k, v in row.items())
                    print(f"   speed vs passive: {ratios}")
        finally:
            for p in procs:
                p.terminate()


if __name__ == "__main__":
    main()
