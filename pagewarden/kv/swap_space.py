"""The host (swap) tier's block bookkeeping: which host blocks hold which request's KV.

A preempted request can be swapped out instead of recomputed: each of its device blocks
is copied to a host block, its device blocks are freed, and later it is swapped back in
to fresh device blocks and resumes where it stopped::

    swap out   device table [7, 3, 9]  ->  host blocks [0, 4, 2]   (pairs (7,0) (3,4) (9,2))
    swap in    host blocks  [0, 4, 2]  ->  device table [5, 8, 1]  (pairs (0,5) (4,8) (2,1))

Host blocks are private to one swapped request (no sharing, no prefix cache): a block
shared by forked children or a prefix hit is copied once per request that swaps it out.
The copies themselves are done by the worker, from the pairs in the scheduler output.

Invariant: every host block is either free or listed by exactly one swapped table, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagewarden.kv.block import BlockHash


@dataclass(frozen=True, slots=True)
class BlockSwap:
    """Copy block ``src`` of one tier to block ``dst`` of the other.

    Slots ``[0, num_slots)`` hold K/V; the rest of the block was never written (it is
    the request's last, partly filled block), so only those slots carry meaning.
    """

    src: int
    dst: int
    num_slots: int


class SwappedTable:
    """A swapped-out request's KV: ``host_ids[i]`` holds its logical block i, and
    ``num_tokens`` tokens' K/V is stored in all.

    ``hashes`` are the chained prefix hashes already known for its full blocks (kept so
    that they are not recomputed when the request returns).
    """

    __slots__ = ("host_ids", "hashes", "extra_keys", "num_tokens")

    def __init__(
        self, host_ids: list[int], hashes: list[BlockHash], extra_keys: bytes, num_tokens: int
    ) -> None:
        self.host_ids = host_ids
        self.hashes = hashes
        self.extra_keys = extra_keys
        self.num_tokens = num_tokens


class SwapSpace:
    """``num_blocks`` host blocks and the swapped tables that hold them.

    ``check_owner`` (the device pool's owner check) runs before ``allocate`` or
    ``release`` changes anything: a call from a foreign thread raises
    ``KVOwnershipError`` with the free list untouched.
    """

    def __init__(self, num_blocks: int, check_owner: Callable[[], None] | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._check_owner = check_owner if check_owner is not None else _no_owner
        # Handed out from the end; reversed so that block 0 goes first (readable tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, SwappedTable] = {}
        self.num_swapped_out = 0  # blocks copied device -> host, ever
        self.num_swapped_in = 0  # blocks copied host -> device, ever

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free host blocks, or None (nothing taken) when fewer are free."""
        self._check_owner()
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def release(self, host_ids: list[int]) -> None:
        """Return host blocks to the free list (a swapped table gave them up)."""
        self._check_owner()
        self._free.extend(reversed(host_ids))

    def check_invariants(self) -> list[str]:
        """Violations of the host-tier conservation invariant; empty when sound."""
        errors: list[str] = []
        held: dict[int, str] = {}
        for req_id, table in self.tables.items():
            for host_id in table.host_ids:
                if host_id in held:
                    errors.append(f"host block {host_id} held by {held[host_id]} and {req_id}")
                held[host_id] = req_id
                if not 0 <= host_id < self.num_blocks:
                    errors.append(f"{req_id} holds host block {host_id} outside the tier")
        free = self._free
        if len(set(free)) != len(free):
            errors.append("a host block is listed twice in the free list")
        both = set(free) & set(held)
        if both:
            errors.append(f"host blocks both free and held: {sorted(both)}")
        if len(set(free)) + len(held) != self.num_blocks:
            errors.append(
                f"host blocks: {len(set(free))} free + {len(held)} held != {self.num_blocks}"
            )
        return errors


def _no_owner() -> None:
    """The owner check of a host tier that nobody claimed (tests of this module alone)."""
