"""The fused CPU elementwise ops (``kernels/cpu/fused.py``) against the torch path, per op.

    OMP_WAIT_POLICY=PASSIVE python bench/fused_elementwise.py           # SmolLM2-135M shapes
    python bench/fused_elementwise.py --tokens 1 64 512 --reps 400
    python bench/fused_elementwise.py --model-batch 64                  # + the real model

Shapes of one decoder layer of the default model (hidden 576, 9 + 3 heads of 64 rotated,
intermediate 1536) at ``--tokens`` rows, in float32 and bfloat16. Each op runs
``--reps`` times per round; rounds alternate fused and torch (so a load change hits
both alike) and the medians of the per-call times are printed with their ratio. The
engine sets OMP_WAIT_POLICY=PASSIVE (importing pagewarden does, unless set already), so
every parallel region wakes sleeping threads; the fused ops run a call estimated under
``serial_us`` on the calling thread (``--serial-us 0`` splits every call).

``--model-batch N``: then the default model (bf16 where the CPU has it) decodes a batch of
N prompts in one process, rounds of ``--model-steps`` decode steps alternating the fused
ops and the torch path (``bench/profile_step.py``'s phase clocks), and prints the medians
per step: total, elementwise (the rest of the forward), GEMMs, attention. Note ``uptime``
beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn: Callable[[], object], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def ops(t: int, dtype: Any, args: argparse.Namespace, ext: Any) -> dict[str, tuple]:
    """name -> (fused call, torch call) on fresh inputs of `t` rows."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default, before torch loads

    import torch

    from pagewarden.kernels.cpu import fused as cpu_fused

    h, heads, d, i = args.hidden, args.heads, args.head_dim, args.intermediate
    x = torch.randn(t, h).to(dtype)
    w = (torch.rand(h) + 0.5).to(dtype)
    qkv = torch.randn(t, (heads + 2) * d).to(dtype)  # rotated heads + a v head's columns
    qk = qkv[:, : heads * d].view(t, heads, d)
    cos, sin = torch.randn(t, 1, d).to(dtype), torch.randn(t, 1, d).to(dtype)
    gate_up = torch.randn(t, 2 * i).to(dtype)
    return {
        "rms_norm": (
            lambda: ext.rms_norm(x, w, 1e-5),
            lambda: cpu_fused.rms_norm_reference(x, w, 1e-5),
        ),
        "rope": (lambda: ext.rope_(qk, cos, sin), lambda: cpu_fused.rope_reference(qk, cos, sin)),
        "silu_mul": (lambda: ext.silu_mul(gate_up), lambda: cpu_fused.silu_mul_reference(gate_up)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=12, help="q + k heads rotated together")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--serial-us", type=float, default=None, help="the fused ops' threshold")
    ap.add_argument("--model-batch", type=int, default=0, help="also decode the real model")
    ap.add_argument("--model-steps", type=int, default=4, help="decode steps per round")
    args = ap.parse_args()
    # pagewarden first: it sets OMP_WAIT_POLICY (unless set already) before torch loads.
    from pagewarden.kernels.cpu import fused as cpu_fused  # isort: skip

    import torch

    ext = cpu_fused.load()
    if ext is None:
        raise SystemExit("the fused CPU extension did not build (see the log line above)")
    if args.serial_us is not None:
        ext.set_serial_us(args.serial_us)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, {torch.get_num_threads()} threads, "
        f"fused ops serial under an estimated {ext.serial_us():.0f} us"
    )
    print(f"{'op':9} {'dtype':9} {'T':>5} {'fused us':>9} {'torch us':>9} {'torch/fused':>11}")
    layer = {"rms_norm": 2, "rope": 1, "silu_mul": 1}  # calls per decoder layer
    totals: dict[tuple[str, int], list[float]] = {}
    for dtype in (torch.bfloat16, torch.float32):
        for t in args.tokens:
            for name, (fused, plain) in ops(t, dtype, args, ext).items():
                fused(), plain()  # warm up
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(args.rounds):
                    times[True].append(per_call_us(fused, args.reps))
                    times[False].append(per_call_us(plain, args.reps))
                f, p = statistics.median(times[True]), statistics.median(times[False])
                key = (str(dtype).removeprefix("torch."), t)
                totals.setdefault(key, [0.0, 0.0])
                totals[key][0] += layer[name] * f
                totals[key][1] += layer[name] * p
                print(f"{name:9} {key[0]:9} {t:>5} {f:>9.1f} {p:>9.1f} {p / f:>10.2f}x")
    print("per layer (2 RMSNorms + RoPE + SiLU*mul):")
    for (dt, t), (f, p) in totals.items():
        print(f"  {dt:9} T={t:<5} fused {f:8.1f} us  torch {p:8.1f} us  {p / f:5.2f}x")
    print(f"uptime: {os.popen('uptime').read().strip()}")
    if args.model_batch:
        model_steps(args, ext)


def model_steps(args: argparse.Namespace, ext: Any) -> None:
    """Decode steps of the real model, alternating the fused ops and the torch path."""
    import random

    from bench.profile_step import PhaseClock, instrument, make_engine, timed_step
    from pagewarden.kernels.cpu import fused as cpu_fused
    from pagewarden.sampling_params import SamplingParams

    opts = argparse.Namespace(
        model=None,
        dtype="bfloat16",
        integrity="standard",
        num_prompts=args.model_batch,
        input_len=128,
    )
    engine = make_engine(opts)
    clock = PhaseClock()
    instrument(engine, clock)
    rng = random.Random(0)
    vocab = engine.loaded.config.vocab_size
    steps = 2 * args.rounds * args.model_steps
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(args.model_batch):
        engine.add_request(str(i), [rng.randrange(100, vocab - 100) for _ in range(128)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
        engine.step()
    engine.step()
    cols = ("step", "elementwise", "GEMMs", "attention")
    ms: dict[bool, dict[str, list[float]]] = {f: {c: [] for c in cols} for f in (True, False)}
    for _ in range(args.rounds):
        for fused in (True, False):
            cpu_fused._ext = ext if fused else None  # None: the wrappers take the torch path
            for _ in range(args.model_steps):
                total, phases = timed_step(engine, clock)
                ms[fused]["step"].append(total * 1e3)
                for c in cols[1:]:
                    ms[fused][c].append(phases.get(c, 0.0) * 1e3)
    cpu_fused._ext = ext
    name = engine.loaded.name
    print(f"{name}, {engine.loaded.model.lm_head.weight.dtype}, decode batch {args.model_batch}:")
    print(f"  {'median ms':12} {'fused':>8} {'torch':>8} {'saved':>8}")
    for c in cols:
        f, p = statistics.median(ms[True][c]), statistics.median(ms[False][c])
        print(f"  {c:12} {f:8.2f} {p:8.2f} {p - f:8.2f}")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
