"""Greedy-token agreement of --quantization gguf (each quantized GEMM kernel) with none on
20 prompts, 32 tokens each:

    python -m bench.quant_tokens
"""

# ruff: noqa: E501

from pagewarden import LLM
from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.sampling_params import SamplingParams

P = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1492, Christopher Columbus",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "My favourite food is",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "Machine learning is",
    "The French word for cat is",
    "Shakespeare wrote",
    "A triangle has",
    "The speed of light is",
    "Python is a programming language that",
    "The Great Wall of China",
    "On Monday morning I",
    "The human heart has",
]


def main() -> None:
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    ref = [
        o.outputs[0].token_ids
        for o in LLM(quantization="none", kv_cache_memory="256MiB").generate(P, sp, use_tqdm=False)
    ]
    q = LLM(quantization="gguf", kv_cache_memory="256MiB")
    for mode in ("int8", "bf16", None):
        cpu_quant.FORCED_KERNEL = mode
        if mode is None:  # auto, one stream at a time: int8 decode steps, bf16-decode prefill
            out = [q.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in P]
        else:
            out = [o.outputs[0].token_ids for o in q.generate(P, sp, use_tqdm=False)]
        same = sum(list(a) == list(b) for a, b in zip(ref, out))
        first = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            for a, b in zip(ref, out)
        ]
        print(
            f"gguf kernel={mode or 'auto (one stream at a time)'}: {same}/20 prompts' 32 greedy tokens equal to none's; mean tokens before the first difference {sum(first) / 20:.1f}"
        )


if __name__ == "__main__":
    main()
