"""Integrity work as a share of step time, timed inside the steps, per level.

    python bench/integrity_check_cost.py               # 32 prompts x 128 tokens, 32 out, bf16

Wraps the guard's ``bind``/``check_reads``/``after_write``/``swap_in``, the scheduler's
pre-schedule table check and the monitor's ``after_step`` (audits) with timers, runs one
engine per level and prints the time they took against the engine's total step time.
Unlike ``integrity_overhead.py`` this does not compare two engines, so machine load
scales both sides of the ratio alike.
"""

from __future__ import annotations

import collections
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.models.loader import load_model  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402


def _timed(obj, name: str, acc: collections.Counter) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def main() -> None:
    loaded = load_model(None, EngineConfig(dtype="bfloat16").torch_dtype)
    rng = random.Random(0)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for level in ("audit", "standard", "strict"):
        config = EngineConfig(dtype="bfloat16", integrity=level, kv_cache_memory="1GiB")
        engine = EngineCore(config, loaded)
        acc: collections.Counter = collections.Counter()
        for name in ("bind", "after_write", "check_reads", "swap_in"):
            _timed(engine.runner.guard, name, acc)
        _timed(engine.scheduler, "verify_block_tables", acc)
        _timed(engine.integrity, "after_step", acc)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        total = 0.0
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            total += time.perf_counter() - start
        work = sum(acc.values())
        parts = ", ".join(f"{k} {v * 1e3:.0f}ms" for k, v in acc.items())
        print(
            f"{level:<9} steps {total:6.2f}s  integrity work {work * 1e3:7.1f} ms = "
            f"{100 * work / total:.2f}%  ({parts})",
            flush=True,
        )


if __name__ == "__main__":
    main()
