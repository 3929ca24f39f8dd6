"""Where one engine step spends its time: a per-phase breakdown of prefill and decode.

    python bench/profile_step.py                       # 64 prompts x 128 tokens, standard
    python bench/profile_step.py --integrity strict --num-prompts 16 --decode-steps 10
    python bench/profile_step.py --quantization gguf --num-prompts 1 --decode-steps 60

Runs the real engine (default GGUF unless ``--model``), prefix caching off. The first
step (fresh prompts only, no cached context) is the prefill step; once every request
decodes, ``--decode-steps`` decode steps are timed. Phases are timed by wrapping the
functions that implement them with wall clocks (CPU torch ops are synchronous):

    attention     paged_attention (reads K/V, SDPA or the kernel); on the cpu backend's
                  decode steps, RoPE, the K/V write and attention in one call
    kv write      write_kv (the K/V scatter; a part of attention where fused with it)
    GEMMs         every nn.Linear of the decoder (qkv, o, gate_up, down; o and down
                  with their residual add folded in, gate_up with SiLU*mul where the
                  bf16 kernel fuses it)
    lm_head       compute_logits
    elementwise   the rest of the forward: embedding, RMSNorm, RoPE, SiLU*mul, residuals,
                  Python between ops
    sampler       Sampler.__call__
    integrity     every KVGuard and IntegrityMonitor call
    bookkeeping   the rest of the step: scheduler, metadata build, output processing

With ``--ops`` it also counts the aten ops of one decode step with torch.profiler.
Prints milliseconds per step and the share of each phase; note ``uptime`` beside figures.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default, before torch loads

import torch  # noqa: E402

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.models import gemma, layers  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402

PHASES = (
    "attention",
    "kv write",
    "GEMMs",
    "lm_head",
    "elementwise",
    "sampler",
    "integrity",
    "bookkeeping",
)


class PhaseClock:
    """Accumulates wall time per phase; nested phases are subtracted from their parent."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = collections.defaultdict(float)
        self._stack: list[list[float]] = []  # [start, time spent in nested phases]

    def wrap(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.totals[phase] += spent - nested
                if self._stack:
                    self._stack[-1][1] += spent

        return timed

    def reset(self) -> None:
        self.totals.clear()


def instrument(engine: EngineCore, clock: PhaseClock) -> None:
    """Wrap the engine's phase functions with `clock` (in place, for this process only)."""
    model = engine.loaded.model
    # The per-layer path, whose GEMMs, norms and attention are calls of their own: a GGUF
    # kept quantized otherwise decodes one stream through models/decode_chain.py, where
    # a layer's GEMMs and norms are one C++ call (this profile is of the per-layer path).
    model._decode_chain = None
    # Every layer's GEMM goes through kernels/cpu/linear.py as imported by the model
    # blocks (models/layers.py, and gemma.py's sandwich layer); the lm_head's call
    # (models/causal_lm.py) stays in its own phase.
    gemm = clock.wrap("GEMMs", layers.linear)
    layers.linear = gemma.linear = gemm
    layers.linear_add = clock.wrap("GEMMs", layers.linear_add)
    layers.linear_gated = clock.wrap("GEMMs", layers.linear_gated)
    # The attention backend's ops (torch or triton), wrapped once per distinct object.
    ops = {id(m.ops): m.ops for m in model.modules() if isinstance(m, layers.Attention)}
    for op in ops.values():
        op.attend = clock.wrap("attention", op.attend)
        op.write_kv = clock.wrap("kv write", op.write_kv)
        if hasattr(op, "rope_write_decode"):  # RoPE, K/V write and attention in one call
            op.rope_write_decode = clock.wrap("attention", op.rope_write_decode)
    model.forward = clock.wrap("elementwise", model.forward)
    model.compute_logits = clock.wrap("lm_head", model.compute_logits)
    runner = engine.runner
    runner.sampler = clock.wrap("sampler", runner.sampler)
    for owner in (runner.guard, engine.integrity):
        for name in dir(owner):
            attr = getattr(owner, name)
            if not name.startswith("_") and inspect.ismethod(attr):  # not its callable state
                setattr(owner, name, clock.wrap("integrity", attr))


def make_engine(args: argparse.Namespace) -> EngineCore:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        integrity=args.integrity,
        quantization=args.quantization,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(args.num_prompts * args.input_len, 2048),
    )
    return EngineCore(config)


def timed_step(engine: EngineCore, clock: PhaseClock) -> tuple[float, dict[str, float]]:
    clock.reset()
    start = time.perf_counter()
    engine.step()
    total = time.perf_counter() - start
    phases = dict(clock.totals)
    phases["bookkeeping"] = total - sum(phases.values())
    return total, phases


def report(title: str, steps: list[tuple[float, dict[str, float]]]) -> None:
    n = len(steps)
    total = sum(t for t, _ in steps) / n
    print(f"{title}: {total * 1e3:.1f} ms per step (mean of {n})")
    for phase in PHASES:
        ms = sum(p.get(phase, 0.0) for _, p in steps) / n * 1e3
        print(f"  {phase:<12} {ms:8.2f} ms  {ms / (total * 1e3):6.1%}")


def count_ops(engine: EngineCore, top: int = 0) -> int:
    """Aten ops dispatched by one engine step (top-level and nested); ``top`` > 0 also
    prints the ops (and C++ extension calls) that took the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--integrity", default="standard")
    ap.add_argument(
        "--quantization",
        choices=("auto", "gguf", "none"),
        default=EngineConfig.quantization,
        help="GGUF weights: keep quantized (gguf), where kernels exist (auto), or bf16 (none)",
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--ops", action="store_true", help="count aten ops of one decode step")
    ap.add_argument("--top-ops", type=int, default=0, help="with --ops: print the N costliest")
    args = ap.parse_args()

    engine = make_engine(args)
    clock = PhaseClock()
    instrument(engine, clock)
    vocab = engine.loaded.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.decode_steps + 4 + args.ops, ignore_eos=True
    )
    # Warm-up request on its own, so one-time costs stay out of the timed steps.
    engine.add_request("warm", [rng.randrange(100, vocab - 100) for _ in range(16)], params)
    while engine.has_unfinished():
        engine.step()
    for i in range(args.num_prompts):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
        engine.add_request(str(i), prompt, params)
    prefill = [timed_step(engine, clock)]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in _running(engine)):
        engine.step()
    engine.step()  # first all-decode step pays any one-time growth
    decode = [timed_step(engine, clock) for _ in range(args.decode_steps)]
    torch_threads = torch.get_num_threads()
    print(
        f"{engine.loaded.name}, GEMMs in {engine.loaded.model.lm_head.weight.dtype}, "
        f"KV in {engine.kv_store.caches[0].dtype}, integrity {args.integrity}, "
        f"{torch_threads} threads"
    )
    report(f"prefill step ({args.num_prompts} x {args.input_len} fresh tokens)", prefill)
    report(f"decode step (batch {args.num_prompts})", decode)
    if args.ops:
        print(f"aten ops in one decode step: {count_ops(engine, args.top_ops)}")


def _running(engine: EngineCore) -> list:
    return list(engine.scheduler.running)


if __name__ == "__main__":
    main()
