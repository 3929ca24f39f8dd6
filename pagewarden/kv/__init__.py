"""KV metadata: block pool, block tables, prefix hashing, audit. Stdlib only (no torch)."""

from __future__ import annotations

from pagewarden.kv.block import BlockHash, BlockId, BlockRef, BlockState, KVBlock
from pagewarden.kv.block_pool import BlockPool
from pagewarden.kv.block_table import RequestBlocks
from pagewarden.kv.errors import (
    BlockPoolExhausted,
    BlockStateError,
    DuplicateRequestError,
    KVError,
    QuarantinedBlockError,
    StaleBlockError,
    UnknownRequestError,
)
from pagewarden.kv.free_queue import FreeBlockQueue
from pagewarden.kv.kv_manager import KVCacheManager
from pagewarden.kv.prefix_hash import ExtraKeyKind, encode_extra_keys, hash_block_tokens
from pagewarden.kv.swap_space import BlockSwap, SwappedTable, SwapSpace

__all__ = [
    "BlockHash",
    "BlockId",
    "BlockPool",
    "BlockPoolExhausted",
    "BlockRef",
    "BlockState",
    "BlockStateError",
    "BlockSwap",
    "DuplicateRequestError",
    "ExtraKeyKind",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVError",
    "QuarantinedBlockError",
    "RequestBlocks",
    "StaleBlockError",
    "SwapSpace",
    "SwappedTable",
    "UnknownRequestError",
    "encode_extra_keys",
    "hash_block_tokens",
]
