"""The quantized kernels' code paths for CPUs this machine is not: rebuilds the extension
with some of this CPU's instruction sets switched off and checks it against the native
build, bit for bit, on random weights of every kernel type.

    python -m bench.quant_isa_paths [--without avx512bitalg]

Why: the one-row int8 GEMV picks Q5_0 / Q5_1's fifth bits with one ``vpshufbitqmb``
(AVX512-BITALG, Zen 4 and Ice Lake on) and otherwise with two mask moves per half
(``kernels/cpu/quant_int8_row.h``); the test suite runs only the path of the machine it
runs on. Each call compiles one build (about a minute on 2 cores); not part of the
suite for that reason. Exits 1 on the first difference. Needs the native build's
AVX512-VNNI (else there is no int8 GEMV to compare).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagewarden.kernels.cpu import quant as cpu_quant  # noqa: E402
from tests.models.test_cpu_quant import random_weight  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def compare(ext, native, name: str) -> int:
    """Checks one type's one-row GEMV (plain and GELU-gated); returns the cases run."""
    cases = 0
    for k in (96, 512, 1536):
        if name.endswith("_K") and k % 256:
            continue
        for n in (14, 40, 576):
            w = random_weight(name, n, k, seed=n + k)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16()
            for act in (0, 2) if n % 2 == 0 else (0,):
                got = ext.gemv_auto(x, w.data, w.qtype, None, act, False)
                want = native.gemv_auto(x, w.data, w.qtype, None, act, False)
                if not torch.equal(got, want):
                    diff = (got.float() - want.float()).abs().max().item()
                    sys.exit(f"{name} K={k} N={n} act={act}: builds differ (max {diff})")
                cases += 1
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--without", nargs="+", default=["avx512bitalg"], help="-mno-<isa> flags")
    args = ap.parse_args()
    native = cpu_quant.load()
    if native is None or not native.has_int8_kernel():
        sys.exit("the native build has no AVX512-VNNI int8 GEMV here: nothing to compare")
    flags = cpu_quant.CFLAGS + [f"-mno-{isa}" for isa in args.without]
    ext = cpu_quant.build_variant("cpu_quant_no_" + "_".join(args.without), flags)
    if not ext.has_int8_kernel():
        sys.exit(f"without {args.without} the build has no int8 GEMV: nothing to compare")
    for t in TYPES:
        print(f"{t}: {compare(ext, native, t)} one-row GEMV calls, equal bit for bit")
    print(f"build without {', '.join(args.without)}: equal to the native build")


if __name__ == "__main__":
    main()
