"""Exceptions raised by the KV metadata layer. Each message says what went wrong and what to do."""

from __future__ import annotations


class KVError(Exception):
    """Base class for KV-metadata errors."""


class StaleBlockError(KVError):
    """A ``BlockRef`` was resolved after its block was freed (its epoch moved on)."""


class BlockPoolExhausted(KVError):
    """More blocks were requested than the pool has free; preempt or wait for frees."""


class BlockStateError(KVError):
    """A block was used in a state that forbids it (double free, reserved block, ...)."""


class QuarantinedBlockError(KVError):
    """A quarantined block was resolved or handed out; it must be released first."""


class UnknownRequestError(KVError):
    """The KV manager holds no block table for this request id."""


class DuplicateRequestError(KVError):
    """A block table already exists for this request id."""


class KVOwnershipError(KVError):
    """KV or scheduler state was mutated from a thread that does not own it.

    Only the engine-core thread may change the block pool and block tables; submit work
    through the engine's queues (``EngineCore.add_request`` / ``abort_request``) instead.
    """
