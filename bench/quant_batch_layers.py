"""Per-layer cost of a decode batch's GEMMs under ``--quantization gguf`` against ``none``,
on a GGUF file's own weights, through the engine's own layer calls: both models loaded in
one process (``EngineCore``), every call inside ``quant.decode_batch(True)`` as the worker
makes a decode step's, the two modes alternated per round.

    python -m bench.quant_batch_layers [--model FILE] [--rows 64] [--rounds 5]

Per layer kind (qkv, o_proj + residual, gate_up + act, down + residual, lm_head) and the
weight type(s) its layers hold (a ``QuantRows`` qkv shows as "Q5_0+Q8_0"): ms per step
(summed over the layers of that kind; median of ``--rounds``, each round cycling through
every layer ``--sweeps`` times so the weights come from memory as in a step), gguf / none.
Wall clock with torch's threads, or ``--process-time``: note ``uptime`` (printed); on a
shared machine only the ratios, taken back to back, mean something.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine's default, before torch loads

import torch  # noqa: E402

from pagewarden.engine.config import EngineConfig  # noqa: E402
from pagewarden.engine.core import EngineCore  # noqa: E402
from pagewarden.kernels.cpu import linear as cpu_linear  # noqa: E402
from pagewarden.kernels.cpu import quant as cpu_quant  # noqa: E402

DEFAULT = "/root/.cache/pagewarden/gguf/gemma-3-270m-q4_k_m.gguf"
Call = Callable[[], torch.Tensor]


def type_of(layer: torch.nn.Module) -> str:
    q = cpu_linear.quant_weight(layer)
    return "bf16" if q is None else q.type_name


def calls(model: torch.nn.Module, rows: int) -> dict[str, list[tuple[str, Call]]]:
    """Layer kind -> [(weight type, a call of that layer on ``rows`` random rows)]."""
    torch.manual_seed(0)
    out: dict[str, list[tuple[str, Call]]] = collections.defaultdict(list)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = attn.qkv_proj.in_features
        x = torch.randn(rows, h, dtype=torch.bfloat16)
        a = torch.randn(rows, attn.o_proj.in_features, dtype=torch.bfloat16)
        d = torch.randn(rows, mlp.down_proj.in_features, dtype=torch.bfloat16) * 0.1
        res = torch.randn(rows, h, dtype=torch.bfloat16)
        act = mlp.activation
        qkv, o, gu, dn = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        out["qkv"].append((type_of(qkv), lambda q=qkv, x=x: cpu_linear.linear(q, x)))
        out["o_proj"].append((type_of(o), lambda o=o, a=a, r=res: cpu_linear.linear_add(o, a, r)))
        out["gate_up"].append(
            (type_of(gu), lambda g=gu, x=x, act=act: cpu_linear.linear_gated(g, x, act))
        )
        out["down"].append((type_of(dn), lambda n=dn, d=d, r=res: cpu_linear.linear_add(n, d, r)))
    x = torch.randn(rows, model.lm_head.in_features, dtype=torch.bfloat16)
    # compute_logits as the runner calls it (dtype=None: bf16 logits under none, float32
    # from a quantized lm_head)
    out["lm_head"].append((type_of(model.lm_head), lambda: model.compute_logits(x, dtype=None)))
    return out


#: The clock: wall time, or (``--process-time``) the process's CPU time, all threads.
CLOCK = time.perf_counter


def sweep(group: list[Call], sweeps: int) -> float:
    """Seconds for one pass over ``group`` (each call once), averaged over ``sweeps``."""
    t0 = CLOCK()
    for _ in range(sweeps):
        for c in group:
            c()
    return (CLOCK() - t0) / sweeps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweeps", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", help="only these layer kinds (default: all)")
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="the calls outside a decode batch, as a prompt's prefill makes them (bf16-decode "
        "tiles; --rows 2048: a full chunk of the default max_num_batched_tokens)",
    )
    ap.add_argument(
        "--process-time",
        action="store_true",
        help="the process's CPU time (all threads, the pool's spin off): less disturbed "
        "by other processes on a shared machine than wall time",
    )
    args = ap.parse_args()
    if args.process_time:
        global CLOCK
        CLOCK = time.process_time
    print(f"uptime: {os.popen('uptime').read().strip()}; torch threads {torch.get_num_threads()}")
    modes = ("gguf", "none")
    built = {}
    for mode in modes:
        cfg = EngineConfig(model=args.model, quantization=mode, kv_cache_memory="16MiB")
        built[mode] = calls(EngineCore(cfg).loaded.model, args.rows)
    if args.process_time:
        from pagewarden.kernels.cpu import pool as cpu_pool

        cpu_pool.load().set_spin_us(0)
    kinds = [k for k in built["gguf"] if not args.kinds or k in args.kinds]
    times: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    with cpu_quant.decode_batch(not args.prefill), torch.inference_mode():
        for _ in range(args.rounds):
            for kind in kinds:
                for mode in modes:
                    by_type: dict[str, list[Call]] = collections.defaultdict(list)
                    for i, (_, c) in enumerate(built[mode][kind]):
                        # group by the gguf side's types so the two rows compare like with like
                        by_type[built["gguf"][kind][i][0]].append(c)
                    for t, group in by_type.items():
                        sweep(group, 1)  # warm
                        times[(kind, t, mode)].append(sweep(group, args.sweeps))
    what = "prefill" if args.prefill else "decode batch"
    print(f"{args.rows} rows ({what}), ms per step (median of {args.rounds} rounds)")
    print(f"{'kind':8} {'gguf type':12} {'layers':>6} {'gguf':>9} {'none':>9} {'gguf/none':>9}")
    tot = dict.fromkeys(modes, 0.0)
    for kind in kinds:
        types = collections.Counter(t for t, _ in built["gguf"][kind])
        for t, n in types.items():
            g = statistics.median(times[(kind, t, "gguf")]) * 1e3
            b = statistics.median(times[(kind, t, "none")]) * 1e3
            tot["gguf"] += g
            tot["none"] += b
            print(f"{kind:8} {t:12} {n:6d} {g:9.2f} {b:9.2f} {g / b:9.2f}")
    print(
        f"{'total':8} {'':12} {'':6} {tot['gguf']:9.2f} {tot['none']:9.2f} "
        f"{tot['gguf'] / tot['none']:9.2f}"
    )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
