"""One-stream decode step with the weights in huge pages and without, alternated.

    python bench/hugepages.py [--model FILE] [--quantization gguf none] [--rounds 3]

Each round runs ``bench/profile_step.py --num-prompts 1`` once per mode and setting, in
alternated order, with ``PAGEWARDEN_HUGEPAGES=1`` (the default: the streamed weights moved
into one MADV_HUGEPAGE map, kernels/cpu/hugepages.py) and ``=0`` (where the loader put
them: a GGUF's quantized blocks as views of the file's map, bf16 tiles from the
allocator). Prints each decode step's mean, the medians, the ratio off / on, the
kernel's THP setting and ``uptime``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEP = re.compile(r"decode step \(batch 1\): ([0-9.]+) ms")


def step_ms(model: str | None, quantization: str, huge: bool, steps: int) -> float:
    argv = [sys.executable, str(HERE / "profile_step.py"), "--num-prompts", "1"]
    argv += ["--decode-steps", str(steps), "--quantization", quantization]
    if model:
        argv += ["--model", model]
    env = dict(os.environ, PAGEWARDEN_HUGEPAGES="1" if huge else "0")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    m = STEP.search(out)
    if m is None:
        raise RuntimeError(f"no decode step line in profile_step's output:\n{out}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 Q4_1)")
    ap.add_argument("--quantization", nargs="+", default=["gguf", "none"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=80)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from pagewarden.kernels.cpu import hugepages

    print(f"THP setting: {hugepages.thp_mode()}; uptime: {os.popen('uptime').read().strip()}")
    runs: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        for q in args.quantization:
            for huge in order:
                ms = step_ms(args.model, q, huge, args.decode_steps)
                runs.setdefault((q, huge), []).append(ms)
                print(f"round {r} {q:<5} hugepages {'on ' if huge else 'off'} {ms:6.2f} ms/step")
    print("\nmedians (ms per decode step, batch 1); ratio = off / on (above 1: huge pages faster)")
    for q in args.quantization:
        on, off = statistics.median(runs[(q, True)]), statistics.median(runs[(q, False)])
        print(f"{q:<5} on {on:6.2f}  off {off:6.2f}  ratio {off / on:5.2f}x")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
