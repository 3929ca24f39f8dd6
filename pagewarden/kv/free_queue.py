"""Intrusive doubly linked free list with sentinel nodes.

::

    head <-> b7 <-> b3 <-> b9 <-> tail
             ^ evicted first       ^ freed last (most recently used)

``remove`` is O(1) because the links live in the blocks themselves: a cached-free block
that gets a prefix hit is unlinked from the middle without a scan.
"""

from __future__ import annotations

from collections.abc import Iterator

from pagewarden.kv.block import KVBlock


class FreeBlockQueue:
    """Free blocks in eviction order (head first). A block is linked at most once."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: list[KVBlock] | None = None) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        # How many blocks are linked. Read-only outside this class; hot paths read it
        # directly because ``len()`` on a Python-level ``__len__`` costs a call.
        self.num_free = 0
        for block in blocks or []:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        """Unlink and return the block evicted first. Raises IndexError when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("pop from an empty free queue")
        nxt = block.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self.num_free -= 1
        return block

    def popleft_many(self, n: int) -> list[KVBlock]:
        """Unlink and return the ``n`` blocks evicted first, in order.

        Raises IndexError (with nothing unlinked) when fewer than ``n`` are queued.
        """
        if n > self.num_free:
            raise IndexError(f"pop of {n} blocks from a free queue of {self.num_free}")
        out: list[KVBlock] = []
        block = self._head.next_free
        for _ in range(n):
            nxt = block.next_free  # type: ignore[union-attr]
            block.prev_free = block.next_free = None  # type: ignore[union-attr]
            out.append(block)  # type: ignore[arg-type]
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head  # type: ignore[union-attr]
        self.num_free -= n
        return out

    def append(self, block: KVBlock) -> None:
        """Link ``block`` at the tail (evicted last)."""
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        last = self._tail.prev_free
        last.next_free = block  # type: ignore[union-attr]
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def extend(self, blocks: list[KVBlock]) -> None:
        """Link ``blocks`` at the tail in order (the last one is evicted last)."""
        tail = self._tail
        last = tail.prev_free
        for block in blocks:
            assert block.prev_free is None and block.next_free is None, f"{block} already queued"
            last.next_free = block  # type: ignore[union-attr]
            block.prev_free = last
            last = block
        last.next_free = tail  # type: ignore[union-attr]
        tail.prev_free = last
        self.num_free += len(blocks)

    def appendleft(self, block: KVBlock) -> None:
        """Link ``block`` at the head (handed out first)."""
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        first = self._head.next_free
        first.prev_free = block  # type: ignore[union-attr]
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it is, in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def reset(self, blocks: list[KVBlock]) -> None:
        """Relink exactly ``blocks``, in order (recovery rebuilds a damaged queue; the
        caller has cleared every block's links)."""
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.extend(blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def ids(self) -> list[int]:
        """Block ids in eviction order (for tests and debugging)."""
        return [b.block_id for b in self]
