"""One engine replica: an ``AsyncEngine`` (engine core in its own process) behind Serve.

``ray.py`` turns ``EngineReplica`` into a Serve deployment; this file has no Ray in it.
The replica streams cumulative ``RequestOutput`` objects for a ``GenerateCall``, answers
Serve's health check from the engine's heartbeat (the step loop advancing; never a call
into the engine), and reports a ``ReplicaDigest`` (held block hashes, load, stats) that
Serve hands to the request router and that ``publish`` sends to the ingress.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from pagewarden.engine.async_engine import AsyncEngine, EngineDeadError
from pagewarden.engine.config import EngineConfig
from pagewarden.engine.core_proc import EngineInfo
from pagewarden.engine.outputs import RequestOutput
from pagewarden.serve.digest import GenerateCall, HeldBlocks, ReplicaDigest, prompt_hashes

logger = logging.getLogger("pagewarden.serve")


class EngineReplica:
    """Runs one pagewarden engine; every public method is a Serve-callable."""

    def __init__(
        self,
        config: EngineConfig,
        replica_id: str,
        publish: Callable[[ReplicaDigest], None] | None = None,
        digest_period_s: float = 0.5,
        **engine_kwargs,
    ) -> None:
        self.engine = AsyncEngine(config, **engine_kwargs)
        self.replica_id = replica_id
        info = self.engine.info
        self.held = HeldBlocks(capacity=max(1, info.num_blocks - 1))
        self._publish = publish
        self._period = digest_period_s
        self._publisher: asyncio.Task | None = None

    def engine_info(self) -> EngineInfo:
        return self.engine.info

    async def generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        """Stream the request's cumulative outputs; a cancelled call aborts it."""
        info = self.engine.info
        self.held.touch(
            prompt_hashes(call.prompt_token_ids, info.block_size, info.model_name, call.cache_salt)
        )
        stream = await self.engine.add_request(
            call.request_id, call.prompt_token_ids, call.params, call.prompt, call.cache_salt
        )
        last = None
        try:
            async for out in stream:
                last = out
                yield out
        finally:
            stream.abort()
            if last is not None and last.outputs:
                ids = call.prompt_token_ids + last.outputs[0].token_ids
                self.held.touch(
                    prompt_hashes(ids, info.block_size, info.model_name, call.cache_salt)
                )

    def check_health(self) -> None:
        """Serve's health check: raises while the engine's step loop is not advancing."""
        if not self.engine.is_alive():
            raise EngineDeadError(f"replica {self.replica_id}: the engine core is down or stalled")

    def digest(self) -> ReplicaDigest:
        info = self.engine.info
        return ReplicaDigest(
            self.replica_id,
            info.model_name,
            info.block_size,
            self.held.snapshot(),
            self.engine.num_in_flight,
            self.engine.engine_stats(),
            self.engine.is_alive(),
            self.engine.client.restarts,
            time.time(),
        )

    async def record_routing_stats(self) -> dict:
        """Serve calls this every ``request_routing_stats_period_s``; the router reads it."""
        return {"digest": self.digest()}

    def start_publishing(self) -> None:
        """Publish the digest to the ingress every period; call from the replica's loop."""
        if self._publish is None or self._publisher is not None:
            return

        async def loop() -> None:
            while True:
                try:
                    self._publish(self.digest())
                except Exception:  # noqa: BLE001 - the board may be restarting; next period
                    logger.exception("replica %s: publishing the digest failed", self.replica_id)
                await asyncio.sleep(self._period)

        self._publisher = asyncio.get_running_loop().create_task(loop())

    def shutdown(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
        self.engine.shutdown()
