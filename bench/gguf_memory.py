"""What loading a GGUF adds to resident memory, per ``--quantization`` mode.

    python bench/gguf_memory.py [--model FILE] [--modes none gguf]

For each mode, a fresh process imports torch, reads its RSS, builds
``LLM(model=FILE, kv_cache_memory="16MiB", quantization=MODE)``, runs one short
generation (so the weights the kernels read are faulted in) and reads its RSS again; the
figure is the difference, printed beside the file's size and the budget (file + 128 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import torch  # noqa: E402
base = rss()
from pagewarden import LLM  # noqa: E402
from pagewarden.sampling_params import SamplingParams  # noqa: E402
llm = LLM(model=sys.argv[1], kv_cache_memory="16MiB", quantization=sys.argv[2])
loaded = rss()
llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
print(json.dumps({"base": base, "loaded": loaded, "after_generate": rss()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--modes", nargs="+", default=["none", "gguf"])
    args = ap.parse_args()
    model = args.model
    if model is None:
        from pagewarden.models.loader import default_model_path

        model = str(default_model_path())
    size = os.path.getsize(model)
    mib = 1 << 20
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"{model}: {size / mib:.1f} MiB; budget (file + 128 MiB): {size / mib + 128:.1f} MiB")
    for mode in args.modes:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, model, mode], capture_output=True, text=True, check=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"quantization={mode:5s} loading adds {(r['loaded'] - r['base']) / mib:7.1f} MiB, "
            f"after a generation {(r['after_generate'] - r['base']) / mib:7.1f} MiB"
        )


if __name__ == "__main__":
    main()
