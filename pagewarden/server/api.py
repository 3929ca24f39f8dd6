"""OpenAI-compatible HTTP API (as vLLM serves it) on top of ``AsyncEngine``.

The HTTP layer never touches KV state and never runs model code: it validates input,
submits through the async engine (whose core runs in another process), and streams
results back as server-sent events. ``build_app`` wires the pieces:

    AdmissionGate (admission.py: 429 before parsing)
      -> FastAPI: /health /version /metrics /v1/models      (this file)
                  /dashboard /dashboard/state               (dashboard.py)
                  /v1/completions                           (completions.py)
                  /v1/chat/completions                      (chat.py)
                  /v1/responses                             (responses_api.py)
                  /tokenize /detokenize                     (tokenize.py)
      (inside the app: X-Request-Id (request_id.py), CORS (cors.py))
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.metrics import prometheus
from pagewarden.server.admin import AdminPolicy, add_admin_routes
from pagewarden.server.admission import (
    BODY_TIMEOUT_S,
    AdmissionController,
    AdmissionGate,
    engine_capacity,
)
from pagewarden.server.browser_guard import BrowserGuard
from pagewarden.server.chat import create_chat_completion
from pagewarden.server.completions import create_completion
from pagewarden.server.context import DEFAULT_MAX_BODY_BYTES, ServerContext, ServerLimits
from pagewarden.server.cors import CorsPolicy, add_cors
from pagewarden.server.dashboard import add_dashboard_routes
from pagewarden.server.errors import APIError, error_body, install_error_handlers
from pagewarden.server.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from pagewarden.server.request_id import RequestIdMiddleware
from pagewarden.server.responses_api import create_response
from pagewarden.server.tokenize import add_tokenize_routes
from pagewarden.server.tools import ToolConfig
from pagewarden.version import __version__

__all__ = ["APIError", "build_app", "default_admission", "error_body"]


def default_admission(engine: AsyncEngine, **kw) -> AdmissionController:
    """Admission sized from the engine's capacity (see ``admission.py``)."""
    info = engine.info
    capacity = engine_capacity(
        info.max_num_seqs, info.num_blocks, info.block_size, info.max_model_len
    )
    return AdmissionController(capacity, **kw)


def build_app(
    engine: AsyncEngine,
    served_model_name: str | list[str],
    api_key: str | list[str] | None = None,
    max_n: int = 8,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    limits: ServerLimits | None = None,
    admission: AdmissionController | None = None,
    vllm_metrics: bool = True,
    admin: AdminPolicy | None = None,
    allowed_hosts: Iterable[str] | None = None,
    enable_docs: bool = False,
    body_timeout_s: float = BODY_TIMEOUT_S,
    max_inflight_per_key: int | None = None,
    tool_config: ToolConfig | None = None,
    cors: CorsPolicy | None = None,
) -> AdmissionGate:
    """The ASGI app (FastAPI behind the admission gate); the caller owns ``engine``.
    ``served_model_name``: the names clients may send, the first the primary one (see
    ``served_names``). ``vllm_metrics``: /metrics also exports the ``vllm:*`` twins of
    pagewarden's metrics. ``admin``: who may call /admin/* and /debug/* (default: the API
    keys, no rate limit; ``pagewarden serve`` builds it from --admin-key, --host and the
    clean period). ``allowed_hosts``: the Host allow-list (None: any;
    ``browser_guard.py``); POSTs must be JSON either way. ``enable_docs``: FastAPI's
    /docs and /redoc, whose pages load their scripts from a CDN (off by default;
    /openapi.json is always served). ``body_timeout_s``, ``max_inflight_per_key``: see
    ``AdmissionGate``. ``tool_config``: tool calling (``tools.py``). ``cors``: who
    browsers may let call the API (default: any origin, no credentials, as vLLM)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    limits = limits or ServerLimits(max_n=max_n, max_body_bytes=max_body_bytes)
    admission = admission or default_admission(engine)
    engine.observer = admission
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
    ctx = ServerContext(engine, names, keys, limits, admission)
    if tool_config is not None:
        ctx.tool_config = tool_config
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="pagewarden", version=__version__, **docs)
    app.state.server = ctx
    install_error_handlers(app)
    add_cors(app, cors or CorsPolicy())
    app.add_middleware(RequestIdMiddleware)  # outermost: every response carries the id
    _add_info_routes(app, ctx, vllm_metrics)
    _add_generation_routes(app, ctx)
    admin = admin or AdminPolicy()
    add_tokenize_routes(app, ctx)
    add_dashboard_routes(app, ctx, admin)
    add_admin_routes(app, ctx, admin)
    _document_request_bodies(app)
    gate = AdmissionGate(
        BrowserGuard(app, allowed_hosts),
        admission,
        max_body_bytes=limits.max_body_bytes,
        body_timeout_s=body_timeout_s,
        max_inflight_per_key=max_inflight_per_key,
    )
    gate.api = app  # the FastAPI app inside the guards, for callers that add routes
    return gate


def _add_info_routes(app: FastAPI, ctx: ServerContext, vllm_metrics: bool) -> None:
    engine = ctx.engine
    # The labels of vllm:cache_config_info that routers read (block size, pool size).
    cache_config = {
        "block_size": str(engine.info.block_size),
        "num_gpu_blocks": str(engine.info.num_blocks),
    }
    registry = prometheus.build_registry(
        engine.engine_stats, engine.stats, ctx.model, vllm_metrics, cache_config
    )

    @app.get("/health")
    async def health() -> Response:
        # From the supervisor's heartbeat: never a call into the engine core.
        if engine.is_alive():
            return JSONResponse(_health_body(engine.engine_stats()))
        return JSONResponse(error_body(503, "the engine is down or stalled; restarting it"), 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = prometheus.render(registry)
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        ctx.authorize(request)
        created = int(time.time())
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagewarden",
                "root": ctx.model,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
            for name in ctx.served_names
        ]
        return {"object": "list", "data": cards}


def _health_body(stats) -> dict:
    """What /health says besides its status: the engine profile in force and why."""
    if stats is None:  # before the engine's first status message
        return {"status": "ok", "profile": None}
    p = stats.profile
    return {
        "status": "ok",
        "profile": p.active,
        "profile_reason": p.reason,
        "profile_detail": p.detail,
        "profile_since_s": round(p.since_s, 3),
    }


def _add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions", openapi_extra=_body_spec(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    @app.post("/v1/chat/completions", openapi_extra=_body_spec(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    @app.post("/v1/responses", openapi_extra=_body_spec(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await create_response(ctx, request)


_REF = "#/components/schemas/{model}"


def _body_spec(model) -> dict:
    """The OpenAPI requestBody of a route that parses its body itself."""
    schema = model.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _document_request_bodies(app: FastAPI) -> None:
    """Add the request models (and the models they use) to the OpenAPI components."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest, ResponsesRequest):
                s = model.model_json_schema(ref_template=_REF)
                comps.update(s.pop("$defs", {}))
                comps[model.__name__] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
