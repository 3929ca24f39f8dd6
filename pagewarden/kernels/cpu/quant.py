"""GGUF block-quantized weights kept quantized: the weight container and ``quant.cpp``.

A ``QuantWeight`` holds one linear layer's weight exactly as the GGUF file stores it: a
(N, row_bytes) uint8 tensor (row n = output column n, its K / block_weights blocks back to
back; a view of the file's memory map where nothing had to be rearranged), the ggml type
and the logical (N, K) shape. ``kernels/cpu/linear`` sends a layer that carries one
(``attach``) through ``gemm`` here instead of a bf16 GEMM; embedding lookups decode only
the rows they gather (``embedding``).

Types with a kernel (``KERNEL_TYPES``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
Two kernels (``pick_kernel`` chooses per call; ``kernel=`` or ``PAGEWARDEN_QUANT_KERNEL``
forces one): ``bf16`` decodes each 32 weights to float32 as ggml does and rounds them to
bf16, so it multiplies by the same bf16 weights the dequantize-at-load path keeps (error:
bf16 weights and activations, float32 sums); ``int8`` (quant_int8.cpp, AVX512-VNNI)
quantizes the activations to int8 per block of 32 and uses the weights exactly (error:
the activations' 8-bit rounding, as llama.cpp). tests/models/test_cpu_quant.py states both
bounds.

Built at first use like the other extensions (``kernels/cpu/build``); ``load()`` is None
where it cannot build or with ``PAGEWARDEN_NO_CPU_EXT=1`` (the loader then dequantizes
at load, as before).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.cpu import pool as cpu_pool
from pagewarden.kernels.cpu.build import built_once, compile_extension
from pagewarden.kernels.cpu.fused import DISABLE_ENV

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(f)
    for f in ("quant.cpp", "quant_int8.cpp", "quant_tiles.cpp", "quant_int8_tiles.cpp")
]
# No FMA contraction: the decoder must round exactly as ggml's float32 mul-then-add.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
#: Flags of the AVX2 build (no AVX-512): the portable path only; tests build it too.
AVX2_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]

#: Which quantized GEMM kernel ``gemm`` runs (``pick_kernel``).
Kernel = Literal["int8", "bf16"]
#: Environment override of ``pick_kernel`` (int8 | bf16; anything else: the rule).
KERNEL_ENV = "PAGEWARDEN_QUANT_KERNEL"
#: ``pick_kernel``: the int8 kernel up to this many rows (the one-row GEMV), the bf16-decode
#: kernel above (bench/quant_gemv.py, docs/quantization.md).
INT8_MAX_ROWS = 1
#: ``pick_kernel``: within ``decode_batch(True)`` (a step where every sequence brings one
#: token, set by the worker), the int8 kernel from this many rows: a decode batch's rows
#: are rounded per row exactly as one-stream decode's int8 GEMV rounds its one row, and
#: the tiles beat the bf16-decode tiles from 5 rows (docs/quantization.md).
INT8_DECODE_MIN_ROWS = 5
_DECODE_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pagewarden_quant_decode_batch", default=False
)
#: ``pick_kernel`` overridden for the whole process (benches; ``KERNEL_ENV`` at import).
FORCED_KERNEL: str | None = os.environ.get(KERNEL_ENV, "").strip().lower() or None

#: ggml type id -> (name, weights per block, bytes per block), for the types with a kernel.
KERNEL_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}


@dataclass(eq=False)
class QuantWeight:
    """A (N, K) weight in GGUF block layout: ``data`` (N, row_bytes) uint8, ``qtype`` a
    key of ``KERNEL_TYPES``."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    #: Return float32 outputs whatever x's dtype (the lm_head: logits not rounded to bf16).
    float_out: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in KERNEL_TYPES:
            raise ValueError(f"no kernel for ggml type {self.qtype}")
        _, per_block, block_bytes = KERNEL_TYPES[self.qtype]
        n, k = self.shape
        if k % per_block or self.data.dtype != torch.uint8:
            raise ValueError(f"{self.type_name} weight of shape {self.shape}: K not whole blocks")
        if tuple(self.data.shape) != (n, k // per_block * block_bytes):
            raise ValueError(
                f"{self.type_name} data {tuple(self.data.shape)} does not hold a {self.shape} weight"
            )

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, start: int, count: int) -> QuantWeight:
        """Rows [start, start + count) (a view)."""
        return QuantWeight(self.data.narrow(0, start, count), self.qtype, (count, self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weight, decoded by the extension's scalar decoder."""
        ext = _require()
        return ext.dequantize(self.data.contiguous(), self.qtype, self.shape[1])

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Row-wise concatenation (each row's blocks are independent): a new tensor."""
        assert parts and all(p.qtype == parts[0].qtype for p in parts)
        assert all(p.shape[1] == parts[0].shape[1] for p in parts)
        data = torch.cat([p.data for p in parts])
        return QuantWeight(data, parts[0].qtype, (data.shape[0], parts[0].shape[1]))


@dataclass(eq=False)
class QuantRows:
    """A (N, K) weight whose row ranges are GGUF tensors of different types (a fused q/k/v
    that a Q4_K_M file stores as Q5_0 q/k and Q8_0 v): ``parts`` in row order, each a
    ``QuantWeight`` over the same K. ``gemm`` runs one call per part and concatenates the
    outputs (no fused SiLU*up: a gated layer computes act(gate) * up after the GEMM)."""

    parts: tuple[QuantWeight, ...]

    def __post_init__(self) -> None:
        if not self.parts or len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError("QuantRows: parts over one K")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def type_name(self) -> str:
        return "+".join(p.type_name for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    @staticmethod
    def of(parts: list[QuantWeight]) -> QuantWeight | QuantRows:
        """Row-wise concatenation of ``parts``: runs of one type concatenated
        (``QuantWeight.cat``), one ``QuantWeight`` where every part has the same type."""
        runs: list[list[QuantWeight]] = []
        for p in parts:
            if runs and runs[-1][0].qtype == p.qtype:
                runs[-1].append(p)
            else:
                runs.append([p])
        joined = [r[0] if len(r) == 1 else QuantWeight.cat(r) for r in runs]
        return joined[0] if len(joined) == 1 else QuantRows(tuple(joined))


@built_once
def load() -> ModuleType | None:
    """The compiled kernel, built on the first call; None where it cannot run here."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    try:
        ext = compile_extension("cpu_quant", _SOURCES, CFLAGS)
    except Exception as e:  # no compiler, no ninja, a failed build: dequantize at load
        reason = " ".join(str(e).split())[:300]
        log.warning(
            "quantized GEMM unavailable, weights dequantized: %s: %s", type(e).__name__, reason
        )
        return None
    cpu_pool.bind(ext)
    bind_norm(ext)
    return ext


def bind_norm(ext: ModuleType) -> None:
    """Give ``ext``'s decode chain (``decode_layer_head`` / ``_tail``) the fused extension's
    one-row RMSNorm; without it (no fused extension) the chain is off."""
    fused = cpu_fused.load()
    ext.set_norm(None if fused is None else fused.norm_api())


def build_variant(name: str, cflags: list[str]) -> ModuleType:
    """The extension built again as ``pagewarden_<name>`` with other ``cflags`` (another
    CPU's instruction sets), bound to the kernels' pool: for tests and benches."""
    ext = compile_extension(name, _SOURCES, cflags)
    cpu_pool.bind(ext)
    bind_norm(ext)
    return ext


def build_avx2() -> ModuleType:
    """The extension built without AVX-512 (its portable path): for tests and benches."""
    return build_variant("cpu_quant_avx2", AVX2_CFLAGS)


def available() -> bool:
    return load() is not None


def _require() -> ModuleType:
    ext = load()
    if ext is None:
        raise RuntimeError("the quantized GEMM extension (kernels/cpu/quant.cpp) is unavailable")
    return ext


def pick_kernel(ext: ModuleType, x: torch.Tensor, w: QuantWeight) -> Kernel:
    """The kernel ``gemm`` uses for x (M, K) against ``w`` under ``kernel="auto"``: int8
    where it exists (bf16 x, an AVX512-VNNI build) and M <= ``INT8_MAX_ROWS`` or, in a
    ``decode_batch``, M >= ``INT8_DECODE_MIN_ROWS`` (never a prompt's prefill:
    int8-rounded activations there turn the default model's greedy chat answer from
    "Paris" to "L'Etoile, ..."); else bf16."""
    forced = FORCED_KERNEL
    if forced in ("int8", "bf16"):
        return "int8" if forced == "int8" and _int8_ok(ext, x) else "bf16"
    rows = x.shape[0]
    int8 = rows <= INT8_MAX_ROWS
    if not int8 and rows >= INT8_DECODE_MIN_ROWS and _DECODE_BATCH.get():
        int8 = bool(ext.has_int8_tiles_kernel())
    return "int8" if int8 and _int8_ok(ext, x) else "bf16"


@contextlib.contextmanager
def decode_batch(decode: bool) -> Iterator[None]:
    """Within: the rows ``gemm`` gets are a decode batch (one new token per sequence) when
    ``decode``, so ``pick_kernel`` may send them to the int8 tiles (``INT8_DECODE_MIN_ROWS``)."""
    token = _DECODE_BATCH.set(decode)
    try:
        yield
    finally:
        _DECODE_BATCH.reset(token)


def _int8_ok(ext: ModuleType, x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and bool(ext.has_int8_kernel())


def gemm(
    x: torch.Tensor,
    w: QuantWeight | QuantRows,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    ext: ModuleType | None = None,
    portable: bool = False,
    kernel: Kernel | Literal["auto"] = "auto",
) -> torch.Tensor:
    """x (M, K) @ W^T (M, N) [+ residual], or silu(gate) * up (M, N / 2) for W = [gate; up].
    x bf16 or float32 (other dtypes are computed in float32 and cast back); the output in
    x's dtype, or float32 for a ``float_out`` weight (not for a ``decode_batch``'s int8
    rows: bf16 logits there, as ``none``'s). ``kernel``: int8 (activations
    quantized per block of 32; bf16 x and an AVX512-VNNI build, else ValueError), bf16
    (weights decoded to bf16), or auto (``pick_kernel``); ``portable`` forces the scalar
    path. A ``QuantRows`` weight: one call per part (no ``silu_mul``: ValueError)."""
    ext = ext or _require()
    if isinstance(w, QuantRows):
        return _gemm_rows(x, w, residual, silu_mul, ext, portable, kernel)
    if kernel == "auto" and not portable and FORCED_KERNEL in (None, "int8") and INT8_MAX_ROWS:
        act = int(silu_mul)  # one bf16 row: the int8 GEMV, checks in C++
        out = ext.gemv_auto(x, w.data, w.qtype, residual, act, w.float_out)
        if out is not None:
            return out
    if kernel == "int8" and not (_int8_ok(ext, x) and not portable):
        raise ValueError("the int8 quantized GEMM needs bf16 activations and an AVX512-VNNI build")
    if kernel == "auto":
        kernel = "bf16" if portable else pick_kernel(ext, x, w)
    dtype = x.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
        residual = None if residual is None else residual.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and (residual.dtype != x.dtype or residual.stride(-1) != 1):
        residual = residual.to(x.dtype).contiguous()
    float_out = w.float_out and residual is None and not silu_mul
    if float_out and kernel == "int8" and x.shape[0] > 1 and _DECODE_BATCH.get():
        # a decode batch's logits in bf16, as ``none``'s: 64 x 262144 float32 logits cost
        # about 1.3x the lm_head's CPU time (docs/quantization.md)
        float_out = False
    out = ext.gemm(x, w.data, w.qtype, residual, silu_mul, portable, float_out, kernel == "int8")
    return out if out.dtype == dtype or float_out else out.to(dtype)


#: ``gemv_gated``'s activations -> the extension's gated epilogue code.
GATED_ACTS = {"silu": 1, "gelu_tanh": 2}


def gemv_gated(x: torch.Tensor, w: QuantWeight, act: str) -> torch.Tensor | None:
    """act(gate) * up (M, N / 2) for W = [gate; up] and bf16 rows x (M, K), through the
    int8 kernels with the activation fused (``act`` "silu" or "gelu_tanh", torch's
    approximate="tanh", in float32 on the float32 sums, rounded once): one row through the
    int8 GEMV, several where ``pick_kernel`` sends them to int8 (a decode batch's tiles)
    and, for GELU-tanh, a prefill's rows through the bf16 tiles (from the extension's
    ``gelu_tiles_min_rows``); None where none applies (then compute the GEMM, then act)."""
    if x.dim() == 2 and x.shape[0] > 1:
        ext = _require()
        gelu = act == "gelu_tanh"
        x = x if x.stride(-1) == 1 else x.contiguous()
        if pick_kernel(ext, x, w) == "int8":
            return ext.gemm(x, w.data, w.qtype, None, True, False, False, True, gelu)
        min_rows = int(ext.gelu_tiles_min_rows())
        if gelu and x.dtype == torch.bfloat16 and 0 < min_rows <= x.shape[0]:
            return ext.gemm(x, w.data, w.qtype, None, True, False, False, False, True)
        return None
    if FORCED_KERNEL not in (None, "int8") or not INT8_MAX_ROWS:
        return None
    return _require().gemv_auto(x, w.data, w.qtype, None, GATED_ACTS[act], False)


def _gemm_rows(
    x: torch.Tensor,
    w: QuantRows,
    residual: torch.Tensor | None,
    silu_mul: bool,
    ext: ModuleType,
    portable: bool,
    kernel: Kernel | Literal["auto"],
) -> torch.Tensor:
    if silu_mul:
        raise ValueError("silu_mul over a QuantRows weight: apply the activation after the GEMM")
    if kernel == "auto" and not portable and FORCED_KERNEL in (None, "int8") and INT8_MAX_ROWS:
        types = [p.qtype for p in w.parts]  # one bf16 row: every part in one C++ call
        out = ext.gemv_parts(x, [p.data for p in w.parts], types, residual)
        if out is not None:
            return out
    outs, start = [], 0
    for p in w.parts:
        res = None if residual is None else residual[..., start : start + p.shape[0]]
        outs.append(gemm(x, p, res, False, ext, portable, kernel))
        start += p.shape[0]
    return torch.cat(outs, dim=-1)  # (M, N)


def embedding(w: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the (vocab, hidden) weight, decoded: (len(ids), hidden) in ``dtype``."""
    ext = _require()
    rows = w.data.index_select(0, ids.reshape(-1).to(torch.long))
    return ext.dequantize(rows, w.qtype, w.shape[1]).to(dtype)
