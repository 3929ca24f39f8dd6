"""pagewarden against llama.cpp on the same GGUF, side by side in alternated rounds.

    python bench/llamacpp.py --llama-cpp-bin /work/llamacpp/build/bin [--model FILE]
        [--threads 2] [--rounds 3] [--quantization gguf]

Per round (the order alternates): llama.cpp's ``llama-bench -p 128 -n 128`` with flash
attention off and on (its best of the two is llama.cpp's figure: pp128 and tg128 tok/s),
``llama-batched-bench -npp 128 -ntg 128 -npl 64`` (its total tok/s), and pagewarden on the
same file and thread count: one stream of 128 prompt tokens decoding 128 (``ignore_eos``),
and 64 such streams at once. Prints the medians and pagewarden / llama.cpp ratios; note
``uptime`` (printed) beside the figures. Building llama.cpp: docs/llamacpp.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PW_CHILD = r"""
import json, sys, time
from pagewarden import LLM
from pagewarden.sampling_params import SamplingParams
model, threads, quant, streams = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
llm = LLM(model=model, kv_cache_memory="512MiB", cpu_threads=threads, quantization=quant)
prompt = list(range(1000, 1128))  # 128 prompt tokens
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, ignore_eos=True))
t0 = time.perf_counter()
out = llm.generate([{"prompt_token_ids": prompt}] * streams, sp, use_tqdm=False)
dt = time.perf_counter() - t0
print(json.dumps({"tok_s": streams * 128 / dt, "seconds": dt}))
"""


def llama_bench(bin_dir: Path, model: str, threads: int) -> float:
    best = 0.0
    for fa in ("0", "1"):
        cmd = [
            str(bin_dir / "llama-bench"),
            "-m",
            model,
            "-p",
            "128",
            "-n",
            "128",
            "-t",
            str(threads),
            "-fa",
            fa,
            "-o",
            "json",
        ]
        rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        for r in rows:
            if r.get("n_gen") == 128:
                best = max(best, float(r["avg_ts"]))
    return best


def batched_bench(bin_dir: Path, model: str, threads: int) -> float:
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        "-m",
        model,
        "-npp",
        "128",
        "-ntg",
        "128",
        "-npl",
        "64",
        "-t",
        str(threads),
        "-c",
        str(64 * 256 + 256),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():  # |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | ... | S t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[2] == "64":
            return float(cells[-1])
    raise RuntimeError(f"no B=64 row in llama-batched-bench output:\n{out}")


def pagewarden(model: str, threads: int, quant: str, streams: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PW_CHILD, model, str(threads), quant, str(streams)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-cpp-bin", type=Path, required=True, help="dir with llama-bench")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="gguf", choices=("auto", "gguf", "none"))
    args = ap.parse_args()
    model = args.model
    if model is None:
        from pagewarden.models.loader import default_model_path

        model = str(default_model_path())
    print(f"uptime: {os.popen('uptime').read().strip()}; threads {args.threads}; {model}")
    res: dict[str, list[float]] = {"lc_tg": [], "lc_b64": [], "pw_1": [], "pw_64": []}
    for r in range(args.rounds):
        steps = [
            ("lc_tg", lambda: llama_bench(args.llama_cpp_bin, model, args.threads)),
            ("lc_b64", lambda: batched_bench(args.llama_cpp_bin, model, args.threads)),
            ("pw_1", lambda: pagewarden(model, args.threads, args.quantization, 1)),
            ("pw_64", lambda: pagewarden(model, args.threads, args.quantization, 64)),
        ]
        for key, fn in steps if r % 2 == 0 else steps[::-1]:
            res[key].append(fn())
            print(f"round {r} {key}: {res[key][-1]:.1f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"single stream 128/128: pagewarden {med['pw_1']:.1f} tok/s (whole request), "
        f"llama.cpp tg128 best {med['lc_tg']:.1f}: {med['pw_1'] / med['lc_tg']:.2f}x"
    )
    print(
        f"batch 64 x 128/128: pagewarden {med['pw_64']:.1f} tok/s, llama-batched-bench "
        f"{med['lc_b64']:.1f}: {med['pw_64'] / med['lc_b64']:.2f}x"
    )


if __name__ == "__main__":
    main()
