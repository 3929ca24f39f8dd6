"""Fused elementwise ops of the decoder on the CPU (RMSNorm, RoPE, SiLU*mul), from a C++
extension (``cpu_fused.cpp``) compiled with ``torch.utils.cpp_extension`` at first use.

Each op does in one pass, and at most one OpenMP region, what the torch path does in
three to nine ops (``rms_norm_heads`` normalises q and k heads in place, where the torch
path normalises copies and concatenates them); with sleeping OpenMP threads
(``OMP_WAIT_POLICY=PASSIVE``) every op saved is a thread wake-up saved. Results: RMSNorm bitwise the torch path's in both
dtypes. In float32, RoPE and SiLU*mul are bitwise the torch path's too (SiLU*mul where
torch does not split a row between threads: its exp differs on a row's last elements).
In bfloat16 they compute in float32 and round once, where the torch path rounds after
each op: SiLU*mul is within one bf16 ulp of it, and RoPE closer to the exact result
where torch's first rounding (x * cos) loses digits that the sum then cancels down to.
``*_reference`` are those torch paths; the tests compare each op with its reference.

The build needs a C++ compiler and the ``ninja`` executable; it is cached
(``build.build_directory``: keyed by the source and the flags) and takes about a minute the
first time on a machine. Where it cannot be built, or ``PAGEWARDEN_NO_CPU_EXT=1``,
``load()`` returns None after logging why once, and callers keep the torch path.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from pagewarden.kernels.cpu import pool as cpu_pool
from pagewarden.kernels.cpu.build import compile_extension

log = logging.getLogger(__name__)

#: Set to 1 to never build or use the CPU extension (the torch path runs instead).
DISABLE_ENV = "PAGEWARDEN_NO_CPU_EXT"

_SOURCE = Path(__file__).with_name("fused.cpp")
_lock = threading.Lock()
_tried = False
_ext: ModuleType | None = None


def _capability_flags() -> tuple[str, list[str]]:
    """The vector ISA torch dispatches to on this CPU, and the flags that compile ATen's
    ``Vectorized`` for it (the same vector width, so the same summation order)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
        return "avx512", [*isa, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if cap.startswith("AVX2"):
        return "avx2", [
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-DCPU_CAPABILITY=AVX2",
            "-DCPU_CAPABILITY_AVX2",
        ]
    return "default", []


def load() -> ModuleType | None:
    """The compiled extension, built on the first call; None where it cannot be (logged once)."""
    global _tried, _ext
    if _tried:
        return _ext
    with _lock:
        if _tried:
            return _ext
        if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
            log.info("fused CPU ops off (%s=1): the torch path runs", DISABLE_ENV)
        else:
            _ext = _build()
        _tried = True
    return _ext


def _build() -> ModuleType | None:
    try:
        isa, flags = _capability_flags()
        # -ffp-contract=off: a * b + c rounds twice, as torch's separate ops round it.
        cflags = ["-O3", "-fopenmp", "-ffp-contract=off", *flags]
        log.info("loading the fused CPU ops (compiled once per machine: about a minute)")
        ext = compile_extension(f"cpu_fused_{isa}", _SOURCE, cflags)
        cpu_pool.bind(ext)
        return ext
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path runs
        reason = " ".join(str(e).split())[:300]
        log.warning(
            "fused CPU ops unavailable, the torch path runs: %s: %s", type(e).__name__, reason
        )
        return None


def _usable(*tensors: torch.Tensor) -> ModuleType | None:
    """The extension if it is loaded and every tensor is a CPU tensor of one supported dtype."""
    # Plain loops and identity tests: every decoder layer asks several times a step.
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return None
    for t in tensors:
        if not t.is_cpu or t.dtype is not dtype:
            return None
        if t.requires_grad and torch.is_grad_enabled():
            return None  # the C++ ops record no autograd graph
    return _ext if _tried else load()


def _usable_norm(x: torch.Tensor, *weights: torch.Tensor) -> ModuleType | None:
    """``_usable`` for a norm: weights of x's dtype, or float32 under a bfloat16 x
    (Gemma's 1 + w, kept in float32)."""
    if x.dtype is torch.bfloat16:
        for w in weights:
            if w.dtype is not torch.float32:
                return _usable(x, *weights)
        return _usable(x) and _usable(*weights)
    return _usable(x, *weights)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (T, H) by weight (H,) -> (T, H), fused where it can be."""
    ext = _usable_norm(x, weight)
    if ext is not None and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous():
        return ext.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_add(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual + rms_norm(x, weight) (T, H): the norm rounded to x's dtype, then the
    add, as two torch ops round them; one pass where the fused op runs."""
    ext = _usable_norm(x, weight)
    if (
        ext is not None
        and x.dim() == 2
        and x.stride(1) == 1
        and weight.is_contiguous()
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and residual.device == x.device
        and residual.stride(1) == 1
        and not (torch.is_grad_enabled() and residual.requires_grad)
    ):
        return ext.rms_norm_add(x, weight, residual, eps)
    return residual + rms_norm_reference(x, weight, eps)


def _dense_heads(qk: torch.Tensor) -> bool:
    """qk is (T, NH, D) with dense (NH, D) rows (any row stride): a view of the fused qkv
    GEMM output, the layout the in-place head ops take."""
    return qk.dim() == 3 and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]


def rms_norm_heads(
    qk: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, n_q: int, eps: float
) -> torch.Tensor:
    """RMSNorm of each head of qk (T, NH, D): heads h < n_q by w_q (D,), the rest by
    w_k (q and k norms). Where the fused op runs, qk is normalised in place and returned
    (its (NH, D) rows must be dense, as for ``rope``); otherwise a new tensor."""
    ext = _usable_norm(qk, w_q, w_k)
    if (
        ext is not None
        and _dense_heads(qk)
        and w_q.dtype == w_k.dtype
        and w_q.is_contiguous()
        and w_k.is_contiguous()
    ):
        return ext.rms_norm_heads_(qk, w_q, w_k, n_q, eps)
    return rms_norm_heads_reference(qk, w_q, w_k, n_q, eps)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of qk (T, NH, D) by cos, sin_signed (T, 1, D) (``rope_reference``).

    Where the fused op runs, qk itself is rotated in place and returned; otherwise qk is
    left as it was and the torch path's new tensor returned. Callers use the result.
    """
    ext = _usable(qk, cos, sin_signed)
    if (
        ext is not None
        and _dense_heads(qk)
        and qk.shape[2] <= 1024
        and cos.is_contiguous()
        and sin_signed.is_contiguous()
    ):
        return ext.rope_(qk, cos, sin_signed)
    return rope_reference(qk, cos, sin_signed)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up (T, 2I) = [gate | up] -> (T, I)."""
    ext = _usable(gate_up)
    if ext is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return ext.silu_mul(gate_up)
    return silu_mul_reference(gate_up)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's first maximum of x (S, V), int64 (S,): ``x.max(dim=-1)
    .indices`` (a NaN is the maximum), one pass per row where the fused op runs."""
    ext = _usable(x)
    if ext is not None and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0:
        return ext.argmax_rows(x)
    return x.max(dim=-1).indices


def mask_rows_(x: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> bool:
    """The grammar's token bitmask (``kernels/token_bitmask.py``) on the listed rows of x
    (S, V), in place, where the fused op runs: True when it ran, False to use another path."""
    ext = _usable(x)
    if (
        ext is None
        or x.dim() != 2
        or x.stride(1) != 1
        or bits.device.type != "cpu"
        or bits.dtype != torch.int32
        or not bits.is_contiguous()
    ):
        return False
    ext.mask_rows_(x, bits, rows)
    return True


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path: float32 math (one fused call when everything is float32)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def rms_norm_heads_reference(
    qk: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, n_q: int, eps: float
) -> torch.Tensor:
    """The torch path: the q and k heads normalised as (rows, D) copies, concatenated."""
    t, _, d = qk.shape
    q = rms_norm_reference(qk[:, :n_q].reshape(-1, d), w_q, eps).view(t, n_q, d)
    k = rms_norm_reference(qk[:, n_q:].reshape(-1, d), w_k, eps).view(t, -1, d)
    return torch.cat((q, k), dim=1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """The torch path: x * cos + [x2, x1] * sin_signed for x (T, H, D), as a new tensor."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # [x2, x1]
    return torch.addcmul(x * cos, swapped, sin_signed)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch path: silu(gate) * up, rounded after each op."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :i]).mul_(gate_up[:, i:])
