"""Mean absolute logprob error of pagewarden against transformers float32 on the same GGUF,
per ``--quantization`` mode (issue 33, item 2):

    python -m bench.quant_logprobs [--modes none gguf] [--tokens 16]

For each of bench/quant_tokens' 20 prompts, each mode generates ``--tokens`` greedy tokens
with ``logprobs=0`` (the decode path: int8 kernel under ``gguf``'s one-stream rule) and
``prompt_logprobs=0`` (the prefill path). transformers (float32, ``gguf_file=``: the file
dequantized exactly) then scores prompt + that mode's own output in one forward, and the
script prints the mean |engine logprob - reference logprob| of the tokens the engine read or
chose, prompt and generated separately, and how many of the 20 greedy outputs equal
transformers' own greedy continuation. Prompts run one at a time (a single stream).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from bench.quant_tokens import P


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1,) float32 logprob of ids[i + 1] after ids[: i + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = logits.log_softmax(dim=-1)[:-1]
    return lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--modes", nargs="+", default=["none", "gguf"])
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    import transformers

    from pagewarden import LLM, SamplingParams
    from pagewarden.models.loader import default_model_path

    path = Path(args.model or default_model_path())
    print(f"uptime: {os.popen('uptime').read().strip()}; model {path.name}")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    greedy: dict[str, list[int]] = {}  # transformers' own greedy continuation per prompt
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=0, prompt_logprobs=0)
    for mode in args.modes:
        llm = LLM(model=str(path), quantization=mode, kv_cache_memory="64MiB")
        prompt_err: list[float] = []
        gen_err: list[float] = []
        same = 0
        for text in P:
            out = llm.generate([text], sp, use_tqdm=False)[0]
            prompt, gen = list(out.prompt_token_ids), out.outputs[0]
            ids = prompt + list(gen.token_ids)
            want = reference_logprobs(ref, ids)
            for i in range(1, len(prompt)):
                prompt_err.append(abs(out.prompt_logprobs[i].logprob - float(want[i - 1])))
            for j, entry in enumerate(gen.logprobs):
                assert entry.token_id == gen.token_ids[j]
                gen_err.append(abs(entry.logprob - float(want[len(prompt) - 1 + j])))
            if text not in greedy:
                with torch.no_grad():
                    greedy[text] = ref.generate(
                        torch.tensor([prompt]), max_new_tokens=args.tokens, do_sample=False
                    )[0, len(prompt) :].tolist()
            same += greedy[text] == list(gen.token_ids)
        print(
            f"quantization={mode:5s} mean |logprob error| vs transformers float32: prompt "
            f"tokens {sum(prompt_err) / len(prompt_err):.4f} (n={len(prompt_err)}), generated "
            f"tokens {sum(gen_err) / len(gen_err):.4f} (n={len(gen_err)}), max "
            f"{max(prompt_err + gen_err):.4f}; greedy {args.tokens} tokens equal to "
            f"transformers' on {same}/{len(P)} prompts"
        )
        del llm
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
