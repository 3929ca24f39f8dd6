"""Operator routes: ``POST /admin/profile`` switches the engine profile (safe mode).

The switch itself happens in the engine-core process at its next step (an idle engine
steps once to apply it); the route waits briefly for the engine's next status to confirm
it. Protected by the API key when keys are set, like the generation routes.
"""

from __future__ import annotations

import asyncio
import time

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


def add_admin_routes(app: FastAPI, ctx: ServerContext) -> None:
    engine = ctx.engine

    @app.post("/admin/profile")
    async def set_profile(request: Request) -> JSONResponse:
        ctx.authorize(request)
        raw = await read_body(request, ctx.limits.max_body_bytes)
        name = parse_body(ProfileRequest, raw).profile  # type: ignore[attr-defined]
        stats = engine.engine_stats()
        if not engine.is_alive() or stats is None:
            raise APIError(503, "the engine is down or restarting; retry shortly")
        known = stats.profile.profiles
        if name not in known:
            raise APIError(400, f"unknown profile {name!r}; known: {', '.join(known)}", "profile")
        previous = stats.profile.active
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
