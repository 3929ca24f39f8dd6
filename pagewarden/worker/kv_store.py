"""Physical KV cache: one tensor per layer, written by slot and read by block table.

Layout per layer::

    cache[layer] : (2, num_blocks, block_size, num_kv_heads, head_dim)
                    ^ 0 = K, 1 = V

    flat slot s  = block_id * block_size + offset
    cache[layer][0].view(-1, num_kv_heads, head_dim)[s]  is K of the token in slot s

Block 0 is reserved: the scheduler never hands it out, so padding may write there.

The host (swap) tier has the same layout per layer, ``num_host_blocks`` blocks in host
memory (pinned when the cache is on a GPU); swapping copies whole blocks between tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewarden.kernels.cpu import hugepages
from pagewarden.kv.swap_space import BlockSwap
from pagewarden.kvstore.tier import parse_size


class KVCacheSizeError(ValueError):
    """The KV cache size is malformed or too small to hold a single sequence."""


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string like "2GiB", "512MB", "1.5 GiB" (the tiers' parser)."""
    try:
        return parse_size(value)
    except ValueError:
        raise KVCacheSizeError(
            f"kv_cache_memory {value!r} is not a positive size; use bytes or e.g. '2GiB', '512MB'"
        ) from None


@dataclass(frozen=True)
class KVCacheShape:
    """Geometry of the physical cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @classmethod
    def from_budget(
        cls,
        memory: int | str,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> KVCacheShape:
        """The largest cache that fits in ``memory`` bytes."""
        probe = cls(num_layers, 1, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = parse_memory(memory) // probe.bytes_per_block
        if num_blocks < 2:
            raise KVCacheSizeError(
                f"kv_cache_memory {memory!r} holds {num_blocks} blocks of "
                f"{probe.bytes_per_block} bytes; at least 2 are needed (block 0 is reserved)"
            )
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)


class KVStore:
    """Owns the per-layer cache tensors (device and host tier) and applies copy-on-write
    and swap copies."""

    def __init__(
        self, shape: KVCacheShape, device: torch.device | str = "cpu", num_host_blocks: int = 0
    ) -> None:
        if shape.num_blocks < 2:
            raise KVCacheSizeError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.shape = shape
        # (2, num_blocks, block_size, num_kv_heads, head_dim) per layer
        dims = (2, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        if torch.device(device).type == "cpu" and hugepages.enabled():
            # In huge pages: a decode step reads each sequence's blocks from all over the
            # pool (and the guard sums single slots), one TLB miss per 4 KiB page
            # otherwise; bench/integrity_step_parts.py.
            self.caches = hugepages.zeros(shape.num_layers, dims, shape.dtype)
        else:
            self.caches = [
                torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)
            ]
        self.num_host_blocks = num_host_blocks
        pin = torch.device(device).type == "cuda"
        self.host_caches: list[torch.Tensor] = (
            [
                # (2, num_host_blocks, block_size, num_kv_heads, head_dim), host memory
                torch.zeros(
                    2,
                    num_host_blocks,
                    shape.block_size,
                    shape.num_kv_heads,
                    shape.head_dim,
                    dtype=shape.dtype,
                    pin_memory=pin,
                )
                for _ in range(shape.num_layers)
            ]
            if num_host_blocks
            else []
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each ``src`` block into ``dst`` in every layer (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for cache in self.caches:
            cache[:, dst] = cache[:, src]

    def swap_out(self, swaps: list[BlockSwap]) -> None:
        """Copy device blocks to host blocks (``src`` device, ``dst`` host), every layer."""
        self._copy_between(self.caches, self.host_caches, swaps)

    def swap_in(self, swaps: list[BlockSwap]) -> None:
        """Copy host blocks to device blocks (``src`` host, ``dst`` device), every layer."""
        self._copy_between(self.host_caches, self.caches, swaps)

    @staticmethod
    def _copy_between(
        sources: list[torch.Tensor], targets: list[torch.Tensor], swaps: list[BlockSwap]
    ) -> None:
        if not swaps:
            return
        assert targets, "swap copies need a host tier (num_host_blocks > 0)"
        src = torch.tensor([w.src for w in swaps], dtype=torch.long)
        dst = torch.tensor([w.dst for w in swaps], dtype=torch.long)
        for source, target in zip(sources, targets):
            # (2, n, block_size, heads, dim), across devices when the tiers differ
            target[:, dst] = source[:, src.to(source.device)].to(target.device)

    # ----------------------------------------------------------------- KV tiers
    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's bytes as a KV tier stores them: (num_layers, 2, block_size,
        num_kv_heads, head_dim), contiguous (``kvstore/format.py``)."""
        if not block_ids:
            return []
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.caches[0].device)
        # (num_layers, 2, n, block_size, heads, dim) -> (n, num_layers, 2, block_size, ...)
        stacked = torch.stack([cache.index_select(1, idx) for cache in self.caches])
        stacked = stacked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        return [row.view(torch.uint8).numpy().tobytes() for row in stacked]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Copy tier payloads (``read_blocks``' layout) into device blocks, every layer."""
        if not block_ids:
            return
        s = self.shape
        rows = [
            torch.frombuffer(bytearray(p), dtype=torch.uint8)
            .view(s.dtype)
            .view(s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim)
            for p in payloads
        ]
        device = self.caches[0].device
        data = torch.stack(rows, dim=2).to(device)  # (L, 2, n, block_size, heads, dim)
        dst = torch.tensor(block_ids, dtype=torch.long, device=device)
        for layer, cache in enumerate(self.caches):
            cache[:, dst] = data[layer]
