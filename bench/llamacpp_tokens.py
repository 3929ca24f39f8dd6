"""Greedy-token agreement of pagewarden with llama.cpp on the same GGUF: the 20 prompts of
bench/quant_tokens.py, 32 greedy tokens each, end-of-text ignored on both sides.

    python -m bench.llamacpp_tokens --llama-cpp-src SRC --llama-cpp-bin BUILD/bin
        [--model FILE|gemma3] [--variants gguf none none-float32] [--tokens 32]

llama.cpp's side is bench/llamacpp_greedy.cpp, a small program on llama.cpp's own library
(its greedy sampler; compiled on first use into --greedy-dir, docs/llamacpp.md). Each
prompt is tokenized by llama.cpp; pagewarden's tokenization of the same text is compared
with it, and pagewarden is then fed llama.cpp's token ids, so a tokenizer difference
cannot make the generations differ. Per prompt: whether the prompt tokens match, and for
each pagewarden variant the common-prefix length of its 32 tokens with llama.cpp's (and
gguf's with none's). Overall: prompts whose 32 tokens all match, the mean common prefix,
and agreement = summed common prefixes / (20 x 32). Agreement is reported, not required:
llama.cpp computes in float32 with int8-quantized activations, pagewarden in bfloat16.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from bench.quant_tokens import P

ROOT = Path(__file__).resolve().parents[1]
TOP = 5  # logprobs asked of pagewarden per position, for the margin at a divergence
VARIANTS = {  # name -> LLM keyword arguments
    "gguf": {"quantization": "gguf"},
    "none": {"quantization": "none"},
    "none-float32": {"quantization": "none", "dtype": "float32"},
}


class GreedyToolError(RuntimeError):
    """bench/llamacpp_greedy.cpp failed to build or to run."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parse_greedy_output(text: str) -> list[tuple[list[int], list[int]]]:
    """The (prompt ids, generated ids) pairs of llamacpp_greedy's "prompt:"/"gen:" lines."""
    prompts, gens = [], []
    for line in text.splitlines():
        label, _, ids = line.partition(":")
        if label in ("prompt", "gen"):
            (prompts if label == "prompt" else gens).append([int(t) for t in ids.split()])
    if len(prompts) != len(gens):
        raise GreedyToolError(f"{len(prompts)} prompt lines but {len(gens)} gen lines")
    return list(zip(prompts, gens))


def build_greedy(src: Path, bin_dir: Path, out_dir: Path) -> Path:
    """Compile bench/llamacpp_greedy.cpp against a llama.cpp build (once per source change)."""
    source = ROOT / "bench" / "llamacpp_greedy.cpp"
    exe = out_dir / "llamacpp_greedy"
    if exe.exists() and exe.stat().st_mtime > source.stat().st_mtime:
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["g++", "-O2", "-std=c++17", str(source), "-I", str(src / "include")]
    cmd += ["-I", str(src / "ggml" / "include"), "-L", str(bin_dir)]
    cmd += ["-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{bin_dir}", "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise GreedyToolError(f"building {source.name} failed:\n{res.stderr[-3000:]}")
    return exe


def llama_greedy(exe: Path, model: str, prompts: list[str], n: int, threads: int) -> list:
    lines = "".join(f"text:{p}\n" for p in prompts)
    cmd = [str(exe), "-m", model, "-n", str(n), "-t", str(threads)]
    res = subprocess.run(cmd, input=lines, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise GreedyToolError(f"llamacpp_greedy exited {res.returncode}:\n{res.stderr[-3000:]}")
    return parse_greedy_output(res.stdout)


def divergence_gap(ours: list[int], top: list[list[tuple[int, float]]], ref: list[int]):
    """At the first position where ``ours`` and ``ref`` differ: our top-1 logprob minus
    our logprob of ref's token (nats; None if ref's token is outside our top list or the
    sequences never differ)."""
    k = common_prefix(ours, ref)
    if k == min(len(ours), len(ref)):
        return None
    lps = dict(top[k])
    return top[k][0][1] - lps[ref[k]] if ref[k] in lps else None


def pagewarden_greedy(model: str, variant: str, prompt_ids: list[list[int]], n: int, threads: int):
    """(pagewarden's own tokenization of P, its greedy ids from llama.cpp's prompt ids,
    the top-5 (id, logprob) at each generated position)."""
    from pagewarden import LLM, SamplingParams

    llm = LLM(model=model, kv_cache_memory="256MiB", cpu_threads=threads, **VARIANTS[variant])
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sp, use_tqdm=False)
    own = [list(llm.get_tokenizer().encode(p)) for p in P]
    tops = [[lp.top for lp in o.outputs[0].logprobs] for o in outs]
    return own, [list(o.outputs[0].token_ids) for o in outs], tops


def report_gaps(variant: str, ours: list, tops: list, ref: list) -> None:
    """How close pagewarden's own choice was to llama.cpp's token where they first differ."""
    gaps = [divergence_gap(o, t, r) for o, t, r in zip(ours, tops, ref)]
    diverged = sum(common_prefix(o, r) < len(r) for o, r in zip(ours, ref))
    found = sorted(g for g in gaps if g is not None)
    if not diverged:
        return
    text = f"  at {variant}'s {diverged} first differences, llama.cpp's token is in its top {TOP} "
    text += f"{len(found)} times"
    if found:
        text += (
            f"; logprob gap to its top-1: median {found[len(found) // 2]:.3f}, max {found[-1]:.3f}"
        )
    print(text + " (nats)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-cpp-src", type=Path, required=True, help="llama.cpp source (include/)")
    ap.add_argument("--llama-cpp-bin", type=Path, required=True, help="dir with libllama.so")
    ap.add_argument("--greedy-dir", type=Path, default=Path("/tmp/pagewarden-llamacpp-greedy"))
    ap.add_argument("--model", default=None, help="GGUF path, or gemma3 (default: SmolLM2 Q4_1)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from bench.llamacpp import resolve_model

    model = resolve_model(args.model)
    exe = build_greedy(args.llama_cpp_src, args.llama_cpp_bin, args.greedy_dir)
    ref = llama_greedy(exe, model, P, args.tokens, args.threads)
    ids = [p for p, _ in ref]
    gens: dict[str, list[list[int]]] = {}
    tops: dict[str, list] = {}
    own: list[list[int]] = []
    for v in args.variants:
        own, gens[v], tops[v] = pagewarden_greedy(model, v, ids, args.tokens, args.threads)
    print(f"{model}; {args.tokens} greedy tokens per prompt; end-of-text ignored")
    pairs = [(v, "llama.cpp") for v in gens]
    if "gguf" in gens and "none" in gens:
        pairs.append(("gguf", "none"))
    get = {"llama.cpp": [g for _, g in ref], **gens}
    print("prompt  same prompt ids  " + "  ".join(f"{a} vs {b}" for a, b in pairs))
    for i, p in enumerate(P):
        cells = [f"{common_prefix(get[a][i], get[b][i]):>{len(a) + len(b) + 4}d}" for a, b in pairs]
        print(f"{i:6d}  {str(own[i] == ids[i]):>15s}  " + "  ".join(cells) + f"  {p!r}")
    same_ids = sum(o == r for o, r in zip(own, ids))
    print(f"prompt tokenization equal to llama.cpp's: {same_ids}/{len(P)}")
    for a, b in pairs:
        pre = [common_prefix(x, y) for x, y in zip(get[a], get[b])]
        full = sum(n == args.tokens for n in pre)
        print(
            f"{a} vs {b}: {full}/{len(P)} prompts all {args.tokens} tokens equal; mean common "
            f"prefix {sum(pre) / len(P):.1f}; agreement {sum(pre) / (len(P) * args.tokens):.1%}"
        )
        if b == "llama.cpp":
            report_gaps(a, gens[a], tops[a], get[b])
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
