"""Offline throughput: pagewarden vs transformers ``generate`` on the same weights, one run.

    python bench/throughput.py --num-prompts 64 --input-len 128 --output-len 128

Random prompt tokens, greedy, ignore EOS. Each engine: a warm-up, then ``--runs`` timed
runs interleaved; prints median output tok/s of each and the ratio. These machines are
noisy: read the ratio, not the absolute figure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run_pagewarden(llm, prompts, output_len: int) -> float:
    from pagewarden import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def load_hf(model_path, dtype):
    from pathlib import Path

    import transformers

    p = Path(model_path)
    if p.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=dtype
        )
    return transformers.AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype)


def run_hf(model, prompts, output_len: int, cache: str | None) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = {"cache_implementation": cache} if cache else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
            **kwargs,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    return len(prompts) * output_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hf-cache", default="static", help="transformers cache_implementation")
    ap.add_argument(
        "--hf-dtype",
        default=None,
        help="dtype of the transformers run (default: --dtype); on CPUs without bf16 "
        "GEMM kernels float32 is transformers' fastest setting",
    )
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()

    from pagewarden import LLM
    from pagewarden.models.loader import default_model_path

    model_path = args.model or str(default_model_path())
    llm = LLM(model=model_path, dtype=args.dtype)
    vocab = llm.engine.loaded.config.vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len, vocab)
    hf_dtype = args.hf_dtype or args.dtype
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[hf_dtype]
    hf = None if args.no_hf else load_hf(model_path, dtype)

    run_pagewarden(llm, prompts[:8], 8)  # warm-up
    if hf is not None:
        run_hf(hf, prompts[:8], 8, args.hf_cache)
    pw, ref = [], []
    for i in range(args.runs):
        pw.append(run_pagewarden(llm, prompts, args.output_len))
        if hf is not None:
            ref.append(run_hf(hf, prompts, args.output_len, args.hf_cache))
        print(
            f"run {i}: pagewarden {pw[-1]:.1f} tok/s"
            + (f", transformers {ref[-1]:.1f} tok/s" if ref else ""),
            flush=True,
        )
    pw_med = statistics.median(pw)
    gemm = llm.engine.loaded.model.lm_head.weight.dtype
    print(f"pagewarden   GEMMs in {str(gemm).removeprefix('torch.')}")
    print(
        f"pagewarden   median {pw_med:.1f} output tok/s  ({args.num_prompts}x"
        f"{args.input_len}/{args.output_len}, {args.dtype})"
    )
    if ref:
        ref_med = statistics.median(ref)
        print(f"transformers median {ref_med:.1f} output tok/s (cache={args.hf_cache}, {hf_dtype})")
        print(f"ratio pagewarden / transformers = {pw_med / ref_med:.2f}")


if __name__ == "__main__":
    main()
