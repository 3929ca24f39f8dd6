"""pagewarden against llama.cpp on the same GGUF, side by side in alternated rounds.

    python bench/llamacpp.py --llama-cpp-bin LLAMA_CPP/build/bin [--model FILE|gemma3]
        [--threads 2] [--rounds 3] [--reps 5] [--quantization gguf none]
        [--llama-omp inherit PASSIVE] [--batched-fa on] [--one-stream]

Each figure is defined the way llama.cpp's own tool defines it, and pagewarden's is
computed the same way (docs/llamacpp.md):

one stream (llama-bench, ``-r REPS``, the median of its samples; flash attention off and
on in one process)
    pp128        128 prompt tokens / time of the prefill
    tg128        128 / time of 128 one-token decode steps (llama.cpp: from an empty
                 context; pagewarden: after the 128-token prompt, at positions 128-255)
    pp128+tg128  (128 + 128) / time of the prefill plus 128 decode steps (``-pg 128,128``)
pagewarden, in one persistent process per round, REPS repetitions, medians: t1 = one
request of 128 fresh random prompt tokens and max_tokens=1 (the prefill), t129 = the same
with max_tokens=129 (the prefill plus 128 decode steps: llama-bench's pg work); pp =
128 / t1, tg = 128 / (t129 - t1) per repetition, pg = 256 / t129.

64 streams (llama-batched-bench -npp 128 -ntg 128 -npl 64, its jsonl row)
    S_PP  64 * 128 / prefill time      S_TG  64 * 128 / time of 128 batched decode steps
    S     64 * (128 + 128) / total time: prompt tokens included
pagewarden: the same from 64 requests of distinct random prompts at once, max_tokens=1
and max_tokens=129 (``--batch-reps`` repetitions).

``--one-stream`` leaves out both 64-stream runs (llama-batched-bench and pagewarden's).

Prefix caching is off and every prompt is fresh, so nothing is served from a cache. The
llama.cpp side runs under each OpenMP wait policy of ``--llama-omp`` (llama.cpp's CPU
backend uses OpenMP; ``inherit`` is the environment this bench was started with, before
pagewarden's import sets OMP_WAIT_POLICY=PASSIVE for itself) and flash attention off and
on; per round its best of those is its figure (start the bench with OMP_WAIT_POLICY
unset, so that ``inherit`` is llama.cpp's default). pagewarden runs as its users run it (its
own OMP_WAIT_POLICY default, its kernels' thread pool). Each round alternates the order.
Prints per-round figures, medians, pagewarden / llama.cpp ratios and ``uptime``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The environment as the user started the bench: importing pagewarden (model lookup)
# sets OMP_WAIT_POLICY=PASSIVE in os.environ, which must not leak into llama.cpp's runs.
USER_ENV = dict(os.environ)
ROOT = Path(__file__).resolve().parents[1]
N_PROMPT = 128
N_GEN = 128
STREAMS = 64
SUBPROCESS_TIMEOUT_S = 1800


class BenchOutputError(RuntimeError):
    """A llama.cpp tool printed no row this bench can read."""


# ---- parsing and figures (pure; tests/test_bench_llamacpp.py) ----


def llama_bench_test_name(row: dict) -> str:
    """llama-bench's own label for a JSON row: pp128, tg128 or pp128+tg128."""
    p, g = int(row["n_prompt"]), int(row["n_gen"])
    if p and g:
        return f"pp{p}+tg{g}"
    return f"pp{p}" if p else f"tg{g}"


def llama_bench_figures(rows: list[dict]) -> dict[str, float]:
    """{"pp128 fa0": tok/s, ...}: per test and flash-attention setting, the median of
    llama-bench's per-repetition samples (``samples_ts``; tok/s = tokens / sample time)."""
    out = {}
    for row in rows:
        samples = row.get("samples_ts") or [row["avg_ts"]]
        fa = row.get("flash_attn")
        fa_tag = f"fa{int(fa) if isinstance(fa, bool) else fa}"
        out[f"{llama_bench_test_name(row)} {fa_tag}"] = float(statistics.median(samples))
    return out


def batched_bench_figures(output: str, pl: int = STREAMS) -> dict[str, float]:
    """S_PP, S_TG and S (tok/s) of the ``--output-format jsonl`` row with ``pl`` streams."""
    for line in output.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if row.get("pl") == pl:
            return {"S_PP": row["speed_pp"], "S_TG": row["speed_tg"], "S": row["speed"]}
    raise BenchOutputError(f"no pl={pl} jsonl row in llama-batched-bench output:\n{output}")


def pagewarden_figures(
    t1: list[float], t_full: list[float], streams: int, n_prompt: int = N_PROMPT, n_gen: int = N_GEN
) -> dict[str, float]:
    """llama.cpp's figures from pagewarden's timings: ``t1[i]`` the seconds of ``streams``
    requests with max_tokens=1 (the prefill), ``t_full[i]`` with max_tokens=n_gen+1 (the
    prefill plus n_gen decode steps), repetition i of each; medians over repetitions."""
    if len(t1) != len(t_full) or not t1:
        raise ValueError(f"need paired timings, got {len(t1)} and {len(t_full)}")
    decode = [streams * n_gen / (f - p) for p, f in zip(t1, t_full) if f > p]
    if not decode:
        raise ValueError("every max_tokens=1 run took longer than the full run")
    return {
        "pp": streams * n_prompt / statistics.median(t1),
        "tg": statistics.median(decode),
        "pg": streams * (n_prompt + n_gen) / statistics.median(t_full),
    }


def best_of(figures: list[dict[str, float]], prefix: str) -> float:
    """The highest figure whose key starts with ``prefix`` (llama.cpp's best setting)."""
    vals = [v for f in figures for k, v in f.items() if k.split(" ")[0] == prefix]
    if not vals:
        raise BenchOutputError(f"no {prefix} figure in {figures}")
    return max(vals)


# ---- llama.cpp ----


def llama_env(bin_dir: Path, omp: str) -> dict[str, str]:
    """The user's environment with the tools' shared libraries found and ``omp`` applied."""
    env = dict(USER_ENV)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(bin_dir)] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])
    )
    if omp != "inherit":
        env["OMP_WAIT_POLICY"] = omp
    return env


def run_tool(cmd: list[str], env: dict[str, str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S)
    if res.returncode != 0:
        raise BenchOutputError(f"{cmd[0]} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return res.stdout + "\n" + res.stderr


def llama_bench(bin_dir: Path, model: str, threads: int, reps: int, omp: str) -> dict[str, float]:
    cmd = [str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-r", str(reps)]
    cmd += ["-p", str(N_PROMPT), "-n", str(N_GEN), "-pg", f"{N_PROMPT},{N_GEN}"]
    cmd += ["-fa", "0,1", "-o", "json"]
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=llama_env(bin_dir, omp),
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    if res.returncode != 0:
        raise BenchOutputError(f"llama-bench exited {res.returncode}:\n{res.stderr[-3000:]}")
    return llama_bench_figures(json.loads(res.stdout))


def batched_bench(bin_dir: Path, model: str, threads: int, fa: str, omp: str) -> dict[str, float]:
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", model, "-t", str(threads), "-fa", fa]
    cmd += ["-npp", str(N_PROMPT), "-ntg", str(N_GEN), "-npl", str(STREAMS)]
    cmd += ["-c", str(STREAMS * (N_PROMPT + N_GEN)), "--output-format", "jsonl"]
    return batched_bench_figures(run_tool(cmd, llama_env(bin_dir, omp)))


# ---- pagewarden (in a child process: one persistent engine per round and mode) ----


def pagewarden_child(spec: dict) -> dict:
    """Run in the child: time the one-stream and 64-stream requests; returns the timings."""
    import pagewarden
    from pagewarden import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        quantization=spec["quantization"],
        cpu_threads=spec["threads"],
        kv_cache_memory="640MiB",
        max_num_seqs=STREAMS,
        enable_prefix_caching=False,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(spec["seed"])

    def prompts(n: int) -> list[dict]:
        ids = [[rng.randrange(100, vocab) for _ in range(N_PROMPT)] for _ in range(n)]
        return [{"prompt_token_ids": x} for x in ids]

    def timed(n: int, max_tokens: int) -> float:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        batch = prompts(n)
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        got = [len(o.outputs[0].token_ids) for o in outs]
        assert got == [max_tokens] * n, f"expected {max_tokens} tokens per request, got {got}"
        return dt

    timed(1, 8)  # warm-up: kernels built, buffers grown, one and many rows
    if spec["batch_reps"]:  # not with --one-stream
        timed(STREAMS, 4)
    out: dict = {"pagewarden": pagewarden.__file__, "omp": os.environ.get("OMP_WAIT_POLICY")}
    for key, n, reps in (("one", 1, spec["reps"]), ("batch", STREAMS, spec["batch_reps"])):
        t1, t_full = [], []
        for r in range(reps):  # alternate which of the pair runs first
            for first in (1, N_GEN + 1) if r % 2 == 0 else (N_GEN + 1, 1):
                (t1 if first == 1 else t_full).append(timed(n, first))
        out[key] = {"t1": t1, "t_full": t_full}
    return out


def pagewarden(spec: dict, env_extra: dict[str, str]) -> dict[str, dict[str, float]]:
    """Figures of one pagewarden child run: {"one": {pp, tg, pg}, "batch": {...}}."""
    env = dict(USER_ENV, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pw-child", json.dumps(spec)]
    out = run_tool(cmd, env)
    line = [x for x in out.splitlines() if x.startswith('{"pagewarden"')][-1]
    raw = json.loads(line)
    if not raw["pagewarden"].startswith(str(ROOT)):
        raise BenchOutputError(f"the child imported {raw['pagewarden']}, not this tree's")
    one = pagewarden_figures(raw["one"]["t1"], raw["one"]["t_full"], 1)
    if not raw["batch"]["t1"]:  # --one-stream
        return {"one": one}
    batch = pagewarden_figures(raw["batch"]["t1"], raw["batch"]["t_full"], STREAMS)
    return {"one": one, "batch": batch}


# ---- rounds and report ----

ROWS = (  # (label, llama.cpp figure, pagewarden (section, figure))
    ("one stream prefill   pp128", "pp128", ("one", "pp")),
    ("one stream decode    tg128", "tg128", ("one", "tg")),
    ("one stream whole     pp128+tg128", "pp128+tg128", ("one", "pg")),
    ("64 streams prefill   S_PP", "S_PP", ("batch", "pp")),
    ("64 streams decode    S_TG", "S_TG", ("batch", "tg")),
    ("64 streams total     S", "S", ("batch", "pg")),
)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def resolve_model(name: str | None) -> str:
    """A GGUF path; None is the default model, a short name a wheel-packaged GGUF."""
    if name is None:
        from pagewarden.models.loader import default_model_path

        return str(default_model_path())
    if not name.endswith(".gguf") and "/" not in name:
        from pagewarden.models.gguf_wheels import gguf_from_wheels

        return str(gguf_from_wheels(name))
    return name


def round_steps(args: argparse.Namespace, model: str, r: int) -> list[tuple[str, Callable]]:
    """The runs of round ``r``: (label, fn returning a flat {figure: tok/s} dict)."""
    steps: list[tuple[str, Callable]] = []
    b = args.llama_cpp_bin
    for omp in args.llama_omp:
        steps.append(
            (
                f"llama-bench omp={omp}",
                lambda o=omp: llama_bench(b, model, args.threads, args.reps, o),
            )
        )
        for fa in [] if args.one_stream else args.batched_fa:
            steps.append(
                (
                    f"llama-batched-bench omp={omp} fa={fa}",
                    lambda o=omp, f=fa: batched_bench(b, model, args.threads, f, o),
                )
            )
    for q in args.quantization:
        spec = {"model": model, "quantization": q, "threads": args.threads, "reps": args.reps}
        spec.update(
            batch_reps=0 if args.one_stream else args.batch_reps, seed=1000 * r + len(steps)
        )
        steps.append((f"pagewarden {q}", lambda s=spec: pagewarden(s, {})))
    return steps if r % 2 == 0 else steps[::-1]


def llama_round_best(results: dict[str, dict]) -> dict[str, float]:
    """llama.cpp's best per figure over this round's settings (omp policy, flash attention)."""
    lb = [v for k, v in results.items() if k.startswith("llama-bench")]
    bb = [v for k, v in results.items() if k.startswith("llama-batched-bench")]
    best = {f: best_of(lb, f) for f in ("pp128", "tg128", "pp128+tg128")}
    if bb:  # not with --one-stream
        best.update({f: max(x[f] for x in bb) for f in ("S_PP", "S_TG", "S")})
    return best


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items())


def report(lc: list[dict[str, float]], pw: dict[str, list[dict]]) -> None:
    med = {f: statistics.median(r[f] for r in lc) for f in lc[0]}
    print("\nmedians over rounds (tok/s); ratio = pagewarden / llama.cpp's best")
    head = f"{'figure':34s} {'llama.cpp':>10s}"
    for q in pw:
        head += f" {'pw ' + q:>10s} {'ratio':>6s}"
    print(head)
    for label, lf, (sec, pf) in ROWS:
        if lf not in med:  # --one-stream: no 64-stream rows
            continue
        line = f"{label:34s} {med[lf]:10.1f}"
        for rounds in pw.values():
            v = statistics.median(r[sec][pf] for r in rounds)
            line += f" {v:10.1f} {v / med[lf]:5.2f}x"
        print(line)
    if "gguf" in pw and "none" in pw and "S" in med:
        g, n = (statistics.median(r["batch"]["pg"] for r in pw[q]) for q in ("gguf", "none"))
        print(f"64 streams S: gguf / none (pagewarden's own bf16 path) {g / n:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-cpp-bin", type=Path, help="dir with llama-bench, llama-batched-bench")
    ap.add_argument("--model", default=None, help="GGUF path, or gemma3 (default: SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="one-stream repetitions per process")
    ap.add_argument("--batch-reps", type=int, default=1, help="64-stream repetitions per process")
    ap.add_argument(
        "--quantization", nargs="+", default=["gguf", "none"], choices=("auto", "gguf", "none")
    )
    ap.add_argument(
        "--llama-omp", nargs="+", default=["inherit", "PASSIVE"], help="OMP_WAIT_POLICY values"
    )
    ap.add_argument("--batched-fa", nargs="+", default=["on"], choices=("on", "off", "auto"))
    ap.add_argument("--one-stream", action="store_true", help="leave out the 64-stream runs")
    ap.add_argument("--pw-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pw_child:
        print(json.dumps(pagewarden_child(json.loads(args.pw_child))), flush=True)
        return
    if args.llama_cpp_bin is None:
        ap.error("--llama-cpp-bin is required")
    model = resolve_model(args.model)
    print(f"{model}; threads {args.threads}; rounds {args.rounds}; reps {args.reps}")
    print(f"OMP_WAIT_POLICY as started: {USER_ENV.get('OMP_WAIT_POLICY', '(unset)')}")
    if "inherit" in args.llama_omp and USER_ENV.get("OMP_WAIT_POLICY"):
        # Seen here: started under PASSIVE, llama.cpp's one stream ran at ~0.4x of its
        # default (spinning) policy's speed; a comparison needs llama.cpp's best.
        print("WARNING: OMP_WAIT_POLICY is set, so omp=inherit is not llama.cpp's default")
    print(f"uptime: {uptime()}", flush=True)
    lc: list[dict[str, float]] = []
    pw: dict[str, list[dict]] = {q: [] for q in args.quantization}
    for r in range(args.rounds):
        results: dict[str, dict] = {}
        for label, fn in round_steps(args, model, r):
            results[label] = fn()
            shown = (
                results[label]
                if "one" not in results[label]
                else {f"{sec} {k}": v for sec, d in results[label].items() for k, v in d.items()}
            )
            print(f"round {r} {label}: {fmt(shown)}", flush=True)
        lc.append(llama_round_best(results))
        for q in args.quantization:
            pw[q].append(results[f"pagewarden {q}"])
        print(f"round {r} llama.cpp best: {fmt(lc[-1])}; uptime: {uptime()}", flush=True)
    report(lc, pw)
    print(f"uptime: {uptime()}")


if __name__ == "__main__":
    main()
