"""The live dashboard: ``GET /dashboard`` (a static page) and ``GET /dashboard/state`` (JSON).

The page (``static/dashboard.*``: plain HTML, JS and SVG, nothing fetched from elsewhere)
polls ``/dashboard/state`` once a second. The state joins three things this process
already holds, so answering never waits on the engine:

- the latest ``EngineSnapshot`` (block map, requests, integrity events): each state
  request asks the engine core for a fresh one, at most every ``REFRESH_S``; the core
  takes it between two steps and the reply lands in ``AsyncEngine.snapshot`` for the
  next poll (only the very first request waits, up to ``FIRST_SNAPSHOT_WAIT_S``);
- the ``EngineStats`` of the latest step or heartbeat (the block counts /metrics shows);
- the time series of ``DashboardHistory``, sampled here once a second.

Keys: with ``--api-key`` set, both routes want a key, as ``Authorization: Bearer KEY``
(scripts), as ``?key=KEY`` (a browser's first load; the answer sets an HttpOnly cookie
scoped to ``/dashboard``) or as that cookie (the page's own polls and reloads).
The schema of the state is in docs/dashboard.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from pagewarden.faults import remote
from pagewarden.server.admin import AdminPolicy
from pagewarden.server.context import ServerContext, read_body
from pagewarden.server.dashboard_history import DashboardHistory, HistorySampler, profile_name
from pagewarden.server.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
#: The files under /dashboard/static/ (nothing else there is served).
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
COOKIE = "pagewarden_dashboard_key"
#: Ask the engine core for a new snapshot at most this often.
REFRESH_S = 0.5
FIRST_SNAPSHOT_WAIT_S = 1.0
#: Version of the /dashboard/state schema (docs/dashboard.md).
STATE_VERSION = 1


def add_dashboard_routes(app: FastAPI, ctx: ServerContext, admin: AdminPolicy) -> None:
    """Add /dashboard, /dashboard/static/*, /dashboard/state and, when fault injection
    is enabled (``faults/remote.py``), ``POST /debug/faults`` and ``POST /debug/pause``."""
    feed = _SnapshotFeed(ctx)
    history = DashboardHistory()
    sampler = HistorySampler(history, lambda: (ctx.engine.engine_stats(), ctx.engine.stats()))
    app.router.on_shutdown.append(sampler.stop)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        key = _authorize(ctx, request)
        page = FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-store"})
        if key is not None and request.query_params.get("key") is not None:
            page.set_cookie(COOKIE, key, path="/dashboard", httponly=True, samesite="strict")
        return page

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no dashboard file {name!r}")
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])

    @app.get("/dashboard/state")
    async def state(request: Request) -> Response:
        _authorize(ctx, request)
        snapshot = await feed.latest()
        return JSONResponse(_state(ctx, snapshot, history), headers={"Cache-Control": "no-store"})

    if remote.enabled():

        @app.post("/debug/faults", include_in_schema=False)
        async def inject_fault(request: Request) -> Response:
            admin.authorize(ctx, request)
            body = await _debug_body(ctx, request)
            kind = body.get("kind")
            if not isinstance(kind, str):
                raise APIError(400, 'send {"kind": "<fault kind>"} (faults/injector.py)')
            ctx.engine.send_debug(("inject", kind))
            return JSONResponse({"queued": kind}, 202)

        @app.post("/debug/pause", include_in_schema=False)
        async def pause(request: Request) -> Response:
            admin.authorize(ctx, request)
            seconds = (await _debug_body(ctx, request)).get("seconds")
            if (
                not isinstance(seconds, (int, float))
                or isinstance(seconds, bool)
                or not 0 < seconds <= remote.MAX_PAUSE_S
            ):
                raise APIError(400, f'send {{"seconds": s}} with 0 < s <= {remote.MAX_PAUSE_S:g}')
            ctx.engine.send_debug(("pause", float(seconds)))
            return JSONResponse({"paused_s": seconds}, 202)


async def _debug_body(ctx: ServerContext, request: Request) -> dict:
    """A debug route's body: a JSON object, else 400 (never a 500)."""
    raw = await read_body(request, ctx.limits.max_body_bytes)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _authorize(ctx: ServerContext, request: Request) -> str | None:
    """The key the request carries (None without keys); 401 when it is missing or wrong."""
    if not ctx.api_keys:
        return None
    auth = request.headers.get("authorization", "")
    candidates = [
        auth[7:] if auth.lower().startswith("bearer ") else "",
        request.query_params.get("key") or "",
        request.cookies.get(COOKIE) or "",
    ]
    for token in candidates:
        for key in ctx.api_keys:
            if token and hmac.compare_digest(token.encode(), key.encode()):
                return key
    raise APIError(
        401,
        "missing or invalid API key; open /dashboard?key=KEY or send 'Authorization: Bearer KEY'",
    )


class _SnapshotFeed:
    """Asks the engine core for snapshots as the page polls; serves the latest one."""

    def __init__(self, ctx: ServerContext) -> None:
        self.engine = ctx.engine
        self.last_request = float("-inf")

    async def latest(self):
        now = time.monotonic()
        if now - self.last_request >= REFRESH_S:
            self.last_request = now
            self.engine.request_snapshot()
        deadline = now + FIRST_SNAPSHOT_WAIT_S
        while self.engine.snapshot is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # only before the first snapshot ever arrives
        return self.engine.snapshot


def _state(ctx: ServerContext, snapshot, history: DashboardHistory) -> dict:
    engine = ctx.engine
    stats = engine.engine_stats()
    now = time.time()
    snap = None
    if snapshot is not None:
        snap = dataclasses.asdict(snapshot)
        snap["age_s"] = max(now - snapshot.taken_at, 0.0)
    kv = None
    if stats is not None:
        kv = {
            "total": stats.total_blocks,
            "free": stats.free_blocks,
            "cached": stats.cached_blocks,
            "used": stats.used_blocks,
            "quarantined": stats.quarantined_blocks,
            "retired": stats.integrity.retired_blocks,
            "usage": stats.kv_cache_usage,
            "step": stats.num_steps,  # the counts are as of this step
            "host_total": stats.host_blocks,
            "host_free": stats.free_host_blocks,
        }
    return {
        "version": STATE_VERSION,
        "model": ctx.model,
        "now": now,
        "engine": {
            "alive": engine.is_alive(),
            "restarts": engine.client.restarts,
            "num_blocks": engine.info.num_blocks,
            "block_size": engine.info.block_size,
            "max_num_seqs": engine.info.max_num_seqs,
        },
        "profile": profile_name(stats),
        "kv": kv,
        "snapshot": snap,
        "series": history.series(),
    }
