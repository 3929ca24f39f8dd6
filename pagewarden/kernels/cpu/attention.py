"""The CPU attention backend: ``AttentionOps`` over the C++ kernels of this folder
(``attention_decode.cpp``, ``attention_fresh.cpp``, shared pieces in ``attention_common.h``,
bound in ``attention_module.cpp``).

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (g++ and
the ninja binary, ``-O3 -march=native``, so the loops vectorise for the CPU they run on)
into a build directory keyed by the sources' hash, and loaded from there afterwards.
Where it cannot build (no compiler, no ninja, a compile error), ``load_extension``
returns None and logs one line saying why; ``kernels/backend.check_backend`` reports the
same reason to whoever asked for ``--attention-backend cpu``.

What runs where in ``CpuAttention.attend``:

    decode rows   the kernel: K/V read in place through ``meta.block_index``, tags (and in
                  strict, checksums) checked in the same loop (``meta.read_checks``)
    fresh prompts causal attention on the step's own K/V: the kernel's ``fresh_attention``
                  for bf16 where the CPU has AVX512-BF16 (probabilities kept in float32),
                  else ``_fresh`` of ``kernels/attention.py``
    chunked       ``_chunked`` of ``kernels/attention.py``, a gather through
                  ``meta.block_index``

and for the fresh and chunked rows the kernel's ``check_reads`` over the same rows of
``meta.block_index``: tags of every position [0, context + query), checksums of the
cached context; so every position any row reads is checked through the index it is read
with, as the guard's ``fused_reads`` contract asks.

K/V writes (``write_kv``) are ``attention_step.cpp``'s: K, V and the slot tags through
``meta.slot_mapping`` in one call, byte for byte the torch ``write_kv``. A step whose
every row decodes may instead go through ``rope_write_decode`` (the layer calls it after
its qkv GEMM): RoPE of q and k in place, that same write, then the decode kernel with the
same read checks, in one C++ call where the torch path makes a dozen ops per layer.

A sliding-window layer (``sliding_window``) reads only the blocks of its window on every
path (the kernel skips the blocks before it; the torch path gathers through
``meta.windowed``), and ``check_reads`` checks exactly those blocks; ``softcap`` caps the
logits on every path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from pagewarden.kernels.attention import (
    AttentionBackendError,
    AttentionMetadata,
    ReadChecks,
    _chunked,
    _fresh,
    check_window_args,
    read_new_kv,
    write_kv,
)
from pagewarden.kernels.cpu import pool as cpu_pool
from pagewarden.kernels.cpu.build import compile_extension

logger = logging.getLogger("pagewarden.kernels")

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "attention_module.cpp",
        "attention_decode.cpp",
        "attention_fresh.cpp",
        "attention_step.cpp",
    )
]
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# Work items (row, split) per thread below which each row's key range is split.
_ITEMS_PER_THREAD = 4
_MIN_BLOCKS_PER_SPLIT = 2

_extension: ModuleType | None = None
_error: str | None = None  # why the extension is unavailable; None: not tried or built


def load_extension() -> ModuleType | None:
    """The compiled kernel module, built on the first call; None where it cannot build."""
    global _extension, _error
    if _extension is not None or _error is not None:
        return _extension
    try:
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            raise RuntimeError("the ninja build tool is not on PATH (apt-get install ninja-build)")
        _extension = compile_extension("cpu_attention", _SOURCES, _CFLAGS)
        cpu_pool.bind(_extension)
    except Exception as exc:  # a compiler's failure comes in many types; all mean "no"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _error = f"{type(exc).__name__}: {first_line}"
        logger.warning("cpu attention extension unavailable, torch path instead (%s)", _error)
    return _extension


def unavailable_reason() -> str | None:
    """Why the extension cannot run here (building it if not tried yet); None if it can."""
    load_extension()
    return _error


def choose_num_splits(num_rows: int, max_blocks: int) -> int:
    """Split each row's key range only when the rows alone leave threads idle."""
    wanted = -(-_ITEMS_PER_THREAD * torch.get_num_threads() // num_rows)
    return max(1, min(wanted, max_blocks // _MIN_BLOCKS_PER_SPLIT))


@dataclass
class _StepArgs:
    """What every layer's kernel call of one step shares, built at its first layer."""

    meta: AttentionMetadata
    block_index: torch.Tensor  # the meta.block_index it was built from
    read_checks: ReadChecks | None  # the meta.read_checks it was built from
    decode_rows: torch.Tensor  # (S_d,) int64 rows of the decode sequences
    other_rows: torch.Tensor  # (S - S_d,) int64 rows of all others
    tables: torch.Tensor  # (S, max_blocks) int64, a view of meta.block_index
    num_splits: int  # of each decode row's key range
    checks: list  # the check arguments (``CpuAttention._check_args``), layer keys unset
    # The extension's DecodeStep with the step's shared arguments bound (built at the
    # first ``rope_write_decode``), and the metadata tensors it was bound to.
    bound: Any = None
    bound_to: tuple = ()

    def current(self, meta: AttentionMetadata) -> bool:
        """Built from ``meta`` as it is now (a fault injector may swap its tensors)."""
        return (
            self.meta is meta
            and self.block_index is meta.block_index
            and self.read_checks is meta.read_checks
        )


class CpuAttention:
    """``AttentionOps`` for CPU caches: decode through the C++ kernel, which checks what it
    reads (``fused_reads``); fresh and chunked rows through the torch path, their reads
    checked by the kernel's ``check_reads`` (see the module docstring). K/V writes in
    C++ (``write_kv``), and a decode step's RoPE, write and attention in one call
    (``rope_write_decode``)."""

    fused_reads = True
    #: Each open (partly filled) context block's checksum over the slots a row reads is
    #: in ``read_sums`` (strict's guard verifies it there; the Triton kernel's is not).
    sums_open_blocks = True

    def __init__(
        self,
        caches: list[torch.Tensor],
        limb_keys: torch.Tensor | None = None,
        offset_keys: torch.Tensor | None = None,
    ) -> None:
        # limb_keys (num_layers, 2, limbs per slot row) int64, offset_keys (block_size,)
        # int64: the checksum keys of worker/integrity.py; None when checksums are off.
        ext = load_extension()
        if ext is None:
            raise AttentionBackendError(f"the cpu attention extension is unavailable: {_error}")
        dtype = caches[0].dtype
        if dtype not in (torch.float32, torch.bfloat16) or caches[0].device.type != "cpu":
            raise AttentionBackendError(
                f"attention backend 'cpu' reads float32 or bfloat16 caches in host memory, "
                f"not {dtype} on {caches[0].device}; use --attention-backend torch"
            )
        self._ext = ext
        self._layer_of = {cache.data_ptr(): i for i, cache in enumerate(caches)}
        self.limb_keys = limb_keys
        self.offset_keys = offset_keys
        # Each layer's (2, limbs per slot row) keys, split once.
        self._layer_keys = list(limb_keys) if limb_keys is not None else []
        # The same, for the extension's DecodeStep to look up in C++ (rope_write_decode).
        self._bound_keys = ext.LayerKeys(caches, limb_keys) if limb_keys is not None else None
        self._step: _StepArgs | None = None  # of the step being run

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """``kernels/attention.write_kv`` (K, V and tags through ``meta.slot_mapping``),
        in one C++ call where k and v are rows of the cache's dtype."""
        if _rows_fit(k, cache) and _rows_fit(v, cache):
            self._ext.write_kv(cache, k, v, meta.slot_mapping, meta.new_tags, meta.slot_tags)
        else:
            write_kv(cache, k, v, meta)

    def rope_write_decode(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor | None:
        """RoPE of qkv's (T, (n_heads + 2 n_kv) * D) q and k heads in place, ``write_kv``
        of its K and V, then ``attend``: the attention (T, n_heads * D), in one C++ call
        for a step whose every row decodes. None (nothing done) where it does not apply:
        a step with prompt rows, or qkv, cos and sin not rows of the cache's dtype."""
        if not meta.is_decode or meta.seq_info is None:
            return None
        dtype = cache.dtype
        if qkv.dtype != dtype or cos.dtype != dtype or sin_signed.dtype != dtype:
            return None
        if qkv.dim() != 2 or qkv.stride(1) != 1 or not cos.is_contiguous():
            return None
        if not sin_signed.is_contiguous():
            return None
        w, c = check_window_args(sliding_window, softcap)
        step = self._step_args(meta)
        tensors = (meta.slot_mapping, meta.new_tags, meta.slot_tags)
        if step.bound is None or any(a is not b for a, b in zip(tensors, step.bound_to)):
            checks = step.checks
            step.bound = self._ext.DecodeStep(
                *tensors, step.tables, meta.seq_info, step.decode_rows, *checks[:5], checks[6],
                step.num_splits, self._bound_keys,
            )  # fmt: skip
            step.bound_to = tensors
        # No keys: the DecodeStep finds this layer's in the bound LayerKeys when it sums.
        return step.bound.rope_write_decode(qkv, cos, sin_signed, cache, scale, None, w, c)

    def attend(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention (T, n_heads, D) of the step's queries over the paged cache (the
        window and cap as ``AttentionOps.attend`` says)."""
        assert meta.seq_info is not None, "build the metadata with AttentionMetadata.build"
        w, c = check_window_args(sliding_window, softcap)
        step = self._step_args(meta)
        out = q.new_empty(q.shape)  # (T, n_heads, D)
        if meta.decode is not None:
            self._decode(q, cache, meta, step, scale, out, w, c)
        if step.other_rows.numel():
            self._check_reads(cache, step, w)
            if meta.fresh and new_kv is None:
                new_kv = read_new_kv(cache, meta.slot_mapping)
            if meta.fresh:
                k, v = new_kv  # type: ignore[misc]
                fused = self._fresh_kernel_fits(q, k, v, cache)
            for batch in meta.fresh:
                if fused:  # writes its rows of out itself
                    self._ext.fresh_attention(
                        q, k, v, out, batch.token_index, batch.num_seqs, batch.query_len,
                        scale, w, c,
                    )  # fmt: skip
                else:
                    part = _fresh(q, k, v, cache.dtype, batch, scale, w, c)
                    _put(out, batch.token_index, part)
            if meta.chunked is not None:
                part = _chunked(q, cache, meta, meta.chunked, scale, w, c)
                _put(out, meta.chunked.token_index, part)
        return out

    def _fresh_kernel_fits(self, q, k, v, cache) -> bool:
        """Fresh prompts go through the kernel's ``fresh_attention`` (bf16 on AVX512-BF16,
        head dim 64, 128 or 256) when the step's q, K, V and cache are all bf16 rows with dense
        heads; elsewhere through torch's causal SDPA."""
        head_dim = q.shape[2]
        if cache.dtype != torch.bfloat16 or not self._ext.has_fresh_attention(head_dim):
            return False
        return all(
            x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == head_dim
            for x in (q, k, v)
        )

    def _step_args(self, meta: AttentionMetadata) -> _StepArgs:
        """The step's shared kernel arguments, built at its first layer."""
        step = self._step
        if step is None or not step.current(meta):
            decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
            other = [i for i, n in enumerate(meta.query_lens) if n != 1]
            max_blocks = meta.decode.max_blocks if meta.decode is not None else 1
            step = self._step = _StepArgs(
                meta=meta,
                block_index=meta.block_index,
                read_checks=meta.read_checks,
                decode_rows=_int64(decode),
                other_rows=_int64(other),
                tables=meta.block_index.view(meta.num_seqs, meta.max_blocks),
                num_splits=choose_num_splits(max(1, len(decode)), max_blocks),
                checks=self._check_args(meta),
            )
        return step

    def _decode(
        self, q, cache, meta: AttentionMetadata, step: _StepArgs, scale: float, out, window, softcap
    ) -> None:
        """Writes the decode tokens' rows of ``out`` (T, n_heads, D)."""
        # A wider q is cast down to the cache's dtype, as the torch path does.
        qc = q if q.dtype == cache.dtype else q.to(cache.dtype)
        target = out if out.dtype == cache.dtype else torch.empty_like(qc)
        self._ext.decode_attention(
            qc, cache, step.tables, meta.seq_info, step.decode_rows, scale, target,
            *self._layer_checks(step, cache), step.num_splits, window, softcap,
        )  # fmt: skip
        if target is not out:
            index = meta.decode.token_index
            part = target if index is None else target.index_select(0, index)
            _put(out, index, part.to(out.dtype))

    def _check_reads(self, cache: torch.Tensor, step: _StepArgs, window) -> None:
        if step.read_checks is None:
            return
        args = self._layer_checks(step, cache)
        self._ext.check_reads(
            cache, step.tables, step.meta.seq_info, step.other_rows, *args, window
        )

    def _check_args(self, meta: AttentionMetadata) -> list:
        """slot_tags, expected, tag_faults, read_sums, read_layers, limb_keys, offset_keys
        (None: off); limb_keys is None here, each layer's own (``_layer_checks``)."""
        checks = meta.read_checks
        if checks is None:
            return [None] * 7
        assert meta.slot_tags is not None, "read checks compare the tags write_kv wrote"
        args = [meta.slot_tags, checks.expected_tags, checks.tag_faults, None, None, None, None]
        if checks.read_sums is not None:
            assert self.limb_keys is not None, "checksums need their keys"
            assert checks.read_layers is not None, "checksums count the layers that read"
            args[3:] = [checks.read_sums, checks.read_layers, None, self.offset_keys]
        return args

    def _layer_checks(self, step: _StepArgs, cache: torch.Tensor) -> list:
        """The step's check arguments with this layer's checksum keys (when on)."""
        if step.checks[3] is None:
            return step.checks
        args = list(step.checks)
        args[5] = self._layer_key(cache)
        return args

    def _layer_key(self, cache: torch.Tensor) -> torch.Tensor:
        """The checksum limb keys of the layer whose cache this is."""
        return self._layer_keys[self._layer_of[cache.data_ptr()]]


def _rows_fit(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """x is (T, n_kv, D) of the cache's dtype with dense (n_kv, D) rows: ``write_kv``'s layout."""
    return (
        x.dtype == cache.dtype
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.device == cache.device
    )


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _put(out: torch.Tensor, index: torch.Tensor | None, part: torch.Tensor) -> None:
    """Rows ``index`` of ``out`` = ``part``; every row when ``index`` is None."""
    if index is None:
        out.copy_(part)
    else:
        out.index_copy_(0, index, part)
