"""One stream's decode speed alone (prefill taken out), ``--quantization none`` against
``gguf`` side by side in one process, alternated rounds, medians:

    python -m bench.quant_one_stream [--model FILE] [--input-len 128] [--output-len 128]
                                     [--rounds 5] [--int8-row 0]

Each round times ``generate`` of 1 token and of output-len + 1 tokens after the same
prompt (greedy, ignore_eos); decode tok/s = output-len / (t_long - t_one), which is what
llama-bench's tg reports. ``--int8-row 0`` also times ``gguf`` with the int8 kernel's
one-row GEMV switched off (PAGEWARDEN_INT8_ROW=0: its multi-row loop, the kernel before).
Noisy on a shared machine: ``uptime`` is printed beside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from pagewarden import LLM
from pagewarden.sampling_params import SamplingParams


def decode_tok_s(llm: LLM, input_len: int, output_len: int) -> float:
    prompt = [{"prompt_token_ids": [(13 * j) % 5000 + 100 for j in range(input_len)]}]

    def timed(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t0

    return output_len / (timed(output_len + 1) - timed(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--int8-row", default="1", choices=["0", "1"])
    args = ap.parse_args()
    print(f"uptime: {os.popen('uptime').read().strip()}")
    engines = {
        q: LLM(model=args.model, quantization=q, kv_cache_memory="512MiB") for q in ("none", "gguf")
    }
    variants = ["none", "gguf"] + (["gguf-loop"] if args.int8_row == "0" else [])
    results: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            if v == "gguf-loop":
                os.environ["PAGEWARDEN_INT8_ROW"] = "0"
            try:
                results[v].append(decode_tok_s(engines[v[:4]], args.input_len, args.output_len))
            finally:
                os.environ.pop("PAGEWARDEN_INT8_ROW", None)
    base = statistics.median(results["none"])
    for v, r in results.items():
        med = statistics.median(r)
        print(
            f"1 stream {args.input_len}+{args.output_len} decode {v:9s} median {med:7.1f} tok/s "
            f"({1e3 / med:5.2f} ms/token)  {med / base:.2f}x none  rounds {[round(x, 1) for x in r]}"
        )
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
