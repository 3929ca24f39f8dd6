"""The Triton attention backend: ``AttentionOps`` over the kernels of this package.

Both kernels take the step's indices from ``AttentionMetadata`` only: ``slot_mapping``
for the write (K, V and tags in one kernel), ``block_index`` for the read. When the guard
sets ``meta.read_checks``, the attention kernel compares tags and (in strict mode)
accumulates block checksums as it reads; the checksum keys of each layer are given here,
one row per layer, since a kernel call sees one layer's cache.
"""

from __future__ import annotations

import torch

from pagewarden.kernels.attention import AttentionMetadata, check_window_args
from pagewarden.kernels.triton import kv_write
from pagewarden.kernels.triton.attention import ReadCheckBuffers, paged_attention, query_tiles


class TritonAttention:
    """``AttentionOps`` backed by Triton; checks its reads (``fused_reads``)."""

    fused_reads = True

    def __init__(
        self,
        caches: list[torch.Tensor],
        element_keys: torch.Tensor | None = None,
        offset_keys: torch.Tensor | None = None,
    ) -> None:
        # element_keys (num_layers, 2, n_kv * D) int64, offset_keys (block_size,) int64:
        # the checksum keys; None when checksums are off.
        self._layer_of = {cache.data_ptr(): i for i, cache in enumerate(caches)}
        self.element_keys = element_keys
        self.offset_keys = offset_keys
        # The launch grid of the step being run, built once for all its layers.
        self._tiles: tuple[AttentionMetadata, torch.Tensor] | None = None

    def write_kv(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        kv_write.write_kv(cache, k, v, meta.slot_mapping, meta.new_tags, meta.slot_tags)

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
        """Attention (T, n_heads, D); the step's own K/V are read back from the cache, so
        ``new_kv`` is not needed (window and cap as ``AttentionOps.attend`` says)."""
        assert meta.seq_info is not None, "build the metadata with AttentionMetadata.build"
        sliding_window, softcap = check_window_args(sliding_window, softcap)
        tables = meta.block_index.view(meta.num_seqs, meta.max_blocks)
        return paged_attention(
            q,
            cache,
            tables,
            meta.seq_info,
            meta.max_query_len,
            scale,
            checks=self._buffers(cache, meta),
            tiles=self._step_tiles(meta, q.shape[1] // cache.shape[3]),
            sliding_window=sliding_window,
            softcap=softcap,
        )

    def _step_tiles(self, meta: AttentionMetadata, group: int) -> torch.Tensor:
        if self._tiles is None or self._tiles[0] is not meta:
            tiles = query_tiles(meta.query_lens, group).to(meta.slot_mapping.device)
            self._tiles = (meta, tiles)
        return self._tiles[1]

    def _buffers(self, cache: torch.Tensor, meta: AttentionMetadata) -> ReadCheckBuffers | None:
        checks = meta.read_checks
        if checks is None:
            return None
        assert meta.slot_tags is not None, "read checks compare the tags write_kv wrote"
        buffers = ReadCheckBuffers(
            slot_tags=meta.slot_tags,
            expected_tags=checks.expected_tags,
            tag_faults=checks.tag_faults,
            read_sums=checks.read_sums,
            read_layers=checks.read_layers,
            element_keys=None,
            offset_keys=None,
        )
        if checks.read_sums is not None:
            assert self.element_keys is not None, "checksums need their keys"
            buffers.element_keys = self.element_keys[self._layer_of[cache.data_ptr()]]
            buffers.offset_keys = self.offset_keys
        return buffers
