"""KV tiers on a prefix-heavy workload: TTFT and output tok/s with no tier, the disk tier,
the Redis tier, and a restarted engine on a warm disk tier.

    python bench/kv_tiers.py                                    # the issue's workload
    python bench/kv_tiers.py --num-prefixes 8 --prefix-len 512 --uses 3   # a quick run

Workload: ``--num-prefixes`` distinct system prompts of ``--prefix-len`` tokens, each
reused by ``--uses`` requests (a short distinct question each), in shuffled order, one
request at a time (TTFT is then the request's own prefill, not queueing), greedy,
``--output-len`` tokens. The device pool holds about a quarter of the prefixes, so most
reuses find their prefix evicted: recomputed without a tier, loaded (verified) with one.
One model load; every engine gets the same requests; every configuration's tokens must
equal the no-tier run's. Redis runs when ``redis-server`` is installed (started here on a
free loopback port, stopped at the end). Also printed: the mean verified load time per
block against the time to recompute one (no-tier prefill time per block).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.models.loader import load_model  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
        for _ in range(args.num_prefixes)
    ]
    reqs = [
        p + [rng.randrange(100, vocab) for _ in range(16)]
        for p in prefixes
        for _ in range(args.uses)
    ]
    rng.shuffle(reqs)
    return reqs


def run(
    engine: EngineCore, reqs: list[list[int]], output_len: int
) -> tuple[list[float], float, list[list[int]]]:
    """TTFT of each request, output tok/s over the run, the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttfts, outputs = [], []
    start_all = time.perf_counter()
    for i, ids in enumerate(reqs):
        start = time.perf_counter()
        engine.add_request(str(i), ids, params)
        first = None
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
        ttfts.append((first or time.perf_counter()) - start)
        outputs.append(tokens)
    elapsed = time.perf_counter() - start_all
    return ttfts, len(reqs) * output_len / elapsed, outputs


def start_redis(directory: Path) -> tuple[subprocess.Popen, str] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prefixes", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1500)
    ap.add_argument("--uses", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    loaded = load_model(args.model, EngineConfig(dtype=args.dtype).torch_dtype)
    reqs = workload(args, loaded.config.vocab_size)
    per_prefix = (args.prefix_len + 16 + args.output_len) // args.block_size + 2
    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=max(per_prefix * args.num_prefixes // 4, 2 * per_prefix) + 1,
        max_num_seqs=1,
        max_num_batched_tokens=2048,
        flight_recorder_steps=0,
    )
    tmp = Path(tempfile.mkdtemp(prefix="pagewarden-bench-kv-tiers-"))
    redis = start_redis(tmp)
    results: dict[str, tuple[list[float], float, list[list[int]], EngineCore]] = {}
    try:
        configs = [
            ("no tier", base),
            ("disk", dataclasses.replace(base, kv_offload_dir=str(tmp / "disk"))),
        ]
        if redis is not None:
            configs.append(("redis", dataclasses.replace(base, kv_offload_redis=redis[1])))
        configs.append(
            ("disk, restarted", dataclasses.replace(base, kv_offload_dir=str(tmp / "disk")))
        )
        for name, cfg in configs:
            engine = EngineCore(cfg, loaded)
            ttfts, tps, outs = run(engine, reqs, args.output_len)
            if engine.kv_tiers is not None:
                engine.kv_tiers.flush()
            results[name] = (ttfts, tps, outs, engine)
            print(
                f"{name:<16} TTFT p50 {statistics.median(ttfts) * 1e3:8.1f} ms  "
                f"output {tps:6.2f} tok/s  tokens equal: {outs == results['no tier'][2]}",
                flush=True,
            )
            if engine.kv_tiers is not None:  # a clean stop: the pool's prefixes go too
                engine.shutdown()
    finally:
        if redis is not None:
            redis[0].terminate()
            redis[0].wait()
        shutil.rmtree(tmp, ignore_errors=True)
    ref_ttft = statistics.median(results["no tier"][0])
    ref_tps = results["no tier"][1]
    print(
        f"\n{args.num_prefixes} prefixes x {args.prefix_len} tokens, {args.uses} uses each, "
        f"{args.output_len} out, {args.dtype}, pool {base.num_kv_blocks} blocks of {args.block_size}"
    )
    # Recompute cost of a block: the no-tier prefill time of a request over its blocks.
    per_block_recompute = ref_ttft / ((args.prefix_len + 16) // args.block_size)
    for name, (ttfts, tps, _, engine) in results.items():
        line = (
            f"{name:<16} TTFT p50 ratio {statistics.median(ttfts) / ref_ttft:5.2f}   "
            f"tok/s ratio {tps / ref_tps:5.2f}"
        )
        s = engine.kv_tiers.stats() if engine.kv_tiers is not None else None
        if s is not None and s.load_latency.count:
            mean = s.load_latency.total / s.load_latency.count
            line += (
                f"   hits {sum(s.hits.values())} stores {sum(s.stores.values())} "
                f"dropped {s.offload_dropped}   load/block {mean * 1e3:.2f} ms = "
                f"{mean / per_block_recompute:.2f} x recompute"
            )
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
