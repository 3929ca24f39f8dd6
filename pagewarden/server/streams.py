"""Consuming request streams: interleave several, or wait for their final outputs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from pagewarden.engine.async_engine import EngineDeadError, RequestStream
from pagewarden.engine.outputs import RequestOutput
from pagewarden.server.errors import APIError


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream to finish; aborts all if the client disconnects."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def collect() -> None:
        async for i, out in merge(streams):
            finals[i] = out

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        task.result()
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    finally:
        for s in streams:
            s.abort()
    return finals  # type: ignore[return-value]
