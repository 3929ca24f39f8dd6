"""Operator routes: ``POST /admin/profile`` switches the engine profile (safe mode).

The switch itself happens in the engine-core process at its next step (an idle engine
steps once to apply it); the route waits briefly for the engine's next status to confirm
it.

Who may call operator routes (``/admin/*`` and the test-only ``/debug/*``), as
``AdminPolicy`` holds it: with admin keys (``--admin-key``), only a request bearing one
(a tenant's API key gets 403); without, only when the server listens on loopback alone,
and then under the API keys like any route; otherwise the routes answer 403. Profile
switches are rate-limited to one per ``switch_interval_s`` (the safe-mode clean period
under ``pagewarden serve``), so no caller can flap the profile or flood the flight
recorder with the record each switch writes.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from pagewarden.server.context import ServerContext, parse_body, read_body
from pagewarden.server.errors import APIError

#: How long the route waits for the engine to confirm a switch before answering 202.
CONFIRM_TIMEOUT_S = 5.0


class ProfileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    profile: str


@dataclass
class AdminPolicy:
    """Who may call operator routes and how often the profile may switch (module doc)."""

    admin_keys: list[str] = field(default_factory=list)
    #: False where the server listens beyond loopback without an admin key.
    enabled: bool = True
    switch_interval_s: float = 0.0
    last_switch: float | None = None

    def authorize(self, ctx: ServerContext, request: Request) -> None:
        """Return when ``request`` may use an operator route; else 401 / 403."""
        if not self.enabled:
            raise APIError(
                403,
                "operator routes are off: this server listens beyond loopback without "
                "--admin-key; restart it with --admin-key KEY",
            )
        if not self.admin_keys:
            ctx.authorize(request)
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if token and any(hmac.compare_digest(token.encode(), k.encode()) for k in self.admin_keys):
            return
        raise APIError(
            403 if token else 401,
            "this route needs the admin key (--admin-key); send 'Authorization: Bearer KEY'",
        )

    def check_switch_rate(self, now: float) -> None:
        """429 while the last switch is less than ``switch_interval_s`` old."""
        if self.last_switch is not None and now - self.last_switch < self.switch_interval_s:
            wait = self.switch_interval_s - (now - self.last_switch)
            raise APIError(
                429,
                f"the profile was switched {now - self.last_switch:.1f} s ago; switches are "
                f"limited to one per {self.switch_interval_s:g} s",
                None,
                {"Retry-After": str(max(1, math.ceil(wait)))},
            )


def add_admin_routes(app: FastAPI, ctx: ServerContext, policy: AdminPolicy) -> None:
    engine = ctx.engine

    @app.post("/admin/profile")
    async def set_profile(request: Request) -> JSONResponse:
        policy.authorize(ctx, request)
        raw = await read_body(request, ctx.limits.max_body_bytes)
        name = parse_body(ProfileRequest, raw).profile  # type: ignore[attr-defined]
        stats = engine.engine_stats()
        if not engine.is_alive() or stats is None:
            raise APIError(503, "the engine is down or restarting; retry shortly")
        known = stats.profile.profiles
        if name not in known:
            raise APIError(400, f"unknown profile {name!r}; known: {', '.join(known)}", "profile")
        previous = stats.profile.active
        now = time.monotonic()
        policy.check_switch_rate(now)
        policy.last_switch = now
        engine.request_profile(name)
        deadline = time.monotonic() + CONFIRM_TIMEOUT_S
        while time.monotonic() < deadline:
            state = engine.engine_stats().profile
            if state.active == name:
                body = {"profile": name, "previous": previous, "applied": True}
                return JSONResponse(body, 200)
            await asyncio.sleep(0.02)
        body = {"profile": name, "previous": previous, "applied": False}
        return JSONResponse(body, 202)
