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

Keys: with ``--api-key`` set, both routes want a key (an API key or the admin key), as
``Authorization: Bearer KEY`` (scripts), as ``?key=KEY`` (a browser's first load; the
answer sets an HttpOnly cookie scoped to ``/dashboard``, a signed session naming the key,
never the key) or as that cookie (the page's own polls and reloads). A tenant's key sees
only its own requests (ids, token counts, the blocks they hold, what a recovery rolled
back); the admin key (``--admin-key``) sees every tenant's. The pool's block map, counts
and time series are the same for all. The schema of the state is in docs/dashboard.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import secrets
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from pagewarden.faults import remote
from pagewarden.server.admin import AdminPolicy
from pagewarden.server.context import ServerContext, cache_salt_for, read_body
from pagewarden.server.dashboard_history import DashboardHistory, HistorySampler, profile_name
from pagewarden.server.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
#: The files under /dashboard/static/ (nothing else there is served).
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
COOKIE = "pagewarden_dashboard_session"
#: How long a dashboard session lasts without a poll; each poll renews it.
SESSION_TTL_S = 3600.0
#: Ask the engine core for a new snapshot at most this often.
REFRESH_S = 0.5
FIRST_SNAPSHOT_WAIT_S = 1.0
#: Version of the /dashboard/state schema (docs/dashboard.md).
STATE_VERSION = 1


def add_dashboard_routes(app: FastAPI, ctx: ServerContext, admin: AdminPolicy) -> None:
    """Add /dashboard, /dashboard/static/*, /dashboard/state and, when fault injection
    is enabled (``faults/remote.py``), ``POST /debug/faults`` and ``POST /debug/pause``."""
    feed = _SnapshotFeed(ctx)
    sessions = SessionTokens()
    history = DashboardHistory()
    sampler = HistorySampler(history, lambda: (ctx.engine.engine_stats(), ctx.engine.stats()))
    app.router.on_shutdown.append(sampler.stop)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        # The one place a key may come in the URL: exchanged for a session cookie at once
        # (the page then strips it from the address bar).
        key_index = _authorize(ctx, admin, request, sessions, allow_query=True)
        page = FileResponse(STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-store"})
        if key_index is not None:
            _set_session(page, sessions.issue(key_index))
        return page

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no dashboard file {name!r}")
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])

    @app.get("/dashboard/state")
    async def state(request: Request) -> Response:
        key_index = _authorize(ctx, admin, request, sessions, allow_query=False)
        tenant = _tenant(ctx, key_index)
        snapshot = await feed.latest()
        body = JSONResponse(
            _state(ctx, snapshot, history, tenant), headers={"Cache-Control": "no-store"}
        )
        if key_index is not None and request.cookies.get(COOKIE):
            _set_session(body, sessions.issue(key_index))  # renewed while the page polls
        return body

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


class SessionTokens:
    """Dashboard sessions: ``index.expiry.mac``, an HMAC under a per-process secret of
    which API key (by its index) opened the page and until when. The cookie never holds
    the key itself; a restart of the server ends every session."""

    def __init__(self, ttl_s: float = SESSION_TTL_S) -> None:
        self.secret = secrets.token_bytes(32)
        self.ttl_s = ttl_s

    def _mac(self, message: str) -> str:
        return hmac.new(self.secret, message.encode(), hashlib.sha256).hexdigest()

    def issue(self, key_index: int, now: float | None = None) -> str:
        expiry = int((time.time() if now is None else now) + self.ttl_s)
        message = f"{key_index}.{expiry}"
        return f"{message}.{self._mac(message)}"

    def verify(self, token: str, now: float | None = None) -> int | None:
        """The key index a valid, unexpired token names; None otherwise."""
        parts = token.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        message = f"{parts[0]}.{parts[1]}"
        if not hmac.compare_digest(parts[2], self._mac(message)):
            return None
        if int(parts[1]) < (time.time() if now is None else now):
            return None
        return int(parts[0])


def _set_session(response: Response, token: str) -> None:
    response.set_cookie(
        COOKIE,
        token,
        max_age=int(SESSION_TTL_S),
        path="/dashboard",
        httponly=True,
        samesite="strict",
    )


def _dashboard_keys(ctx: ServerContext, admin: AdminPolicy) -> list[str]:
    """The keys that open the dashboard: the API keys, then the admin keys."""
    return ctx.api_keys + admin.admin_keys


def _tenant(ctx: ServerContext, key_index: int | None) -> str | None:
    """The cache salt whose requests the key may see; None: it sees every tenant's (the
    admin key, or a server without API keys)."""
    if key_index is None or key_index >= len(ctx.api_keys):
        return None
    return cache_salt_for(ctx.api_keys[key_index])


def _authorize(
    ctx: ServerContext,
    admin: AdminPolicy,
    request: Request,
    sessions: SessionTokens,
    allow_query: bool,
) -> int | None:
    """The index in ``_dashboard_keys`` of the key the request proves (None without API
    keys): a bearer key, a session cookie, or (``allow_query``, the page itself)
    ``?key=``; else 401."""
    if not ctx.api_keys:
        return None
    keys = _dashboard_keys(ctx, admin)
    auth = request.headers.get("authorization", "")
    candidates = [auth[7:] if auth.lower().startswith("bearer ") else ""]
    if allow_query:
        candidates.append(request.query_params.get("key") or "")
    for token in candidates:
        for index, key in enumerate(keys):
            if token and hmac.compare_digest(token.encode(), key.encode()):
                return index
    session = sessions.verify(request.cookies.get(COOKIE) or "")
    if session is not None and session < len(keys):
        return session
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


def _state(ctx: ServerContext, snapshot, history: DashboardHistory, tenant: str | None) -> dict:
    """The dashboard state as ``tenant`` (a cache salt; None: every tenant) may see it."""
    engine = ctx.engine
    stats = engine.engine_stats()
    now = time.time()
    snap = None
    if snapshot is not None:
        snap = _visible(dataclasses.asdict(snapshot), tenant)
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
        "tiers": _tiers(stats),
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


def _tiers(stats) -> dict | None:
    """The KV tiers' counters of the latest step (the /metrics ``kv_tier_*`` families,
    from the same ``KVTierStats``); None without tiers."""
    t = getattr(stats, "kv_tiers", None) if stats is not None else None
    if t is None:
        return None
    per_tier = {
        name: {
            "hits": t.hits.get(name, 0),
            "stores": t.stores.get(name, 0),
            "errors": t.errors.get(name, 0),
            "bytes": t.bytes.get(name, 0),
            "rejected": {r: n for (tier, r), n in sorted(t.rejected.items()) if tier == name},
        }
        for name in sorted(t.hits)
    }
    return {
        "tiers": per_tier,
        "misses": t.misses,
        "offload_dropped": t.offload_dropped,
        "offload_unverified": t.offload_unverified,
        "load_timeouts": t.load_timeouts,
        "loads": t.load_latency.count,
        "load_seconds": t.load_latency.total,
    }


def _visible(snap: dict, tenant: str | None) -> dict:
    """``snap`` (an ``EngineSnapshot`` as a dict) with only ``tenant``'s request ids (all
    for None), and no request's tenant salt."""
    requests = snap["requests"]
    if tenant is not None:
        requests = [r for r in requests if r["tenant"] == tenant]
    for r in requests:
        del r["tenant"]
    snap["requests"] = requests
    if tenant is None:
        return snap
    own = {r["id"] for r in requests}
    holders = {b: [i for i in ids if i in own] for b, ids in snap["holders"].items()}
    snap["holders"] = {b: ids for b, ids in holders.items() if ids}
    snap["host_holders"] = {b: i for b, i in snap["host_holders"].items() if i in own}
    for event in snap["events"]:
        event["rolled_back"] = {i: p for i, p in event["rolled_back"].items() if i in own}
    return snap
