"""The bf16 GEMM of ``cpu_gemm.cpp`` (AVX512-BF16): packing and calling it.

``kernels/cpu/linear`` uses it for every bf16 linear layer without a bias where the CPU has
AVX512-BF16 (``available()``): weights packed once into vdpbf16ps column tiles
(``pack_tiles``), o_proj and down_proj with their residual add fused, gate_up_proj with
act(gate) * up fused, act SiLU or GELU-tanh (its tiles interleaved gate, up, gate, up:
``pack_tiles(..., gate_up=True)``), so the (T, 2I) gate_up output is never written. Measured on a 2-core
Zen 4 with the engine's ``OMP_WAIT_POLICY=PASSIVE`` (``bench/linear_prepack.py --packings
tiles onednn --gemm-only``): the decoder's GEMMs of one step (with SiLU*mul) take 9.0 ms
at 1 row where oneDNN's prepacked bf16 GEMM takes 18.5, 39.9 against 45.8 at 64 rows,
1,048 against 1,075 at 2048. Not picked on CPUs with AMX (``kernels/cpu/linear``).

Built at first use like the other extensions (``kernels/cpu/build``); None from ``load()`` where
it cannot build, where the build has no AVX512-BF16 kernel (the CPU lacks it), or with
``PAGEWARDEN_NO_CPU_EXT=1``: callers keep oneDNN.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from pagewarden.kernels.cpu import pool as cpu_pool
from pagewarden.kernels.cpu.build import built_once, compile_extension
from pagewarden.kernels.cpu.fused import DISABLE_ENV

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("gemm.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
TILE = 16  # output columns per packed tile (one AVX-512 register of float32 sums)


@built_once
def load() -> ModuleType | None:
    """The compiled kernel, built on the first call; None where it cannot run here."""
    return _build()


def _build() -> ModuleType | None:
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    try:
        ext = compile_extension("cpu_gemm", _SOURCE, _CFLAGS)
    except Exception as e:  # no compiler, no ninja, a failed build: oneDNN runs
        reason = " ".join(str(e).split())[:300]
        log.warning("bf16 GEMM kernel unavailable, oneDNN runs: %s: %s", type(e).__name__, reason)
        return None
    if not ext.has_kernel():
        return None
    cpu_pool.bind(ext)
    return ext


def available() -> bool:
    """Whether the kernel runs on this CPU (AVX512-BF16, a compiler at hand)."""
    return load() is not None


def fits(weight: torch.Tensor, gate_up: bool = False) -> bool:
    """Whether ``weight`` (N, K) can be packed: bf16 on the CPU, K even (and for
    ``gate_up`` each half a whole number of tiles)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or k % 2:
        return False
    return not gate_up or (n % (2 * TILE) == 0)


def pack_tiles(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """``weight`` (N, K) as (ceil(N / 16), K / 2, 16, 2) column tiles (see cpu_gemm.cpp);
    ``gate_up``: N = 2I rows [gate; up], tiles ordered gate 0, up 0, gate 1, up 1, ..."""
    assert fits(weight, gate_up)
    n, k = weight.shape
    w = weight.detach()
    if gate_up:
        half = n // 2
        gate, up = w[:half].view(-1, TILE, k), w[half:].view(-1, TILE, k)
        w = torch.stack((gate, up), dim=1).reshape(n, k)
    pad = -n % TILE
    if pad:
        w = torch.cat((w, w.new_zeros(pad, k)))
    return w.view(-1, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


#: The gated epilogues of a gate_up packing (``gemm``'s ``act``) -> the kernel's code.
GATED_ACTS = {"silu": 1, "gelu_tanh": 2}


def gemm(
    x: torch.Tensor,
    tiles: torch.Tensor,
    n: int,
    residual: torch.Tensor | None = None,
    act: str | None = None,
) -> torch.Tensor | None:
    """x (M, K) @ W^T (M, n) [+ residual], or act(gate) * up (M, n / 2) for a gate_up
    packing (``act`` a key of ``GATED_ACTS``; GELU-tanh as torch's approximate="tanh");
    None where x does not fit the kernel (not bf16 rows): use the fallback."""
    ext = load()
    if ext is None or x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        return None
    if residual is not None and (residual.dtype != torch.bfloat16 or residual.stride(1) != 1):
        return None
    return ext.gemm(x, tiles, n, residual, 0 if act is None else GATED_ACTS[act])
