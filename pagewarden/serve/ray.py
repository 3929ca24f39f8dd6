"""pagewarden on Ray Serve: one engine per replica behind an OpenAI-compatible ingress.

::

    client --HTTP--> Serve proxy --> PagewardenIngress (pagewarden.server routes on a
                                      RemoteEngine)  --handle + request router-->
                                      PagewardenEngine replica x N (AsyncEngine each)

Build the application with ``build_app(ServeOptions(...))``, from a Serve config YAML
(``import_path: pagewarden.serve.ray:app_builder``, ``args:`` = ``ServeOptions``
fields; see ``examples/serve-config.yaml``) or with ``pagewarden serve --ray``.
Replica count, autoscaling, per-replica resources and load shedding are Serve's own
deployment options, so a Serve config overrides them under ``deployments:``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from pagewarden.engine.async_engine import AdmissionRejected
from pagewarden.engine.config import EngineConfig
from pagewarden.serve.board import board_for
from pagewarden.serve.digest import ClusterView, ReplicaDigest
from pagewarden.serve.options import ServeOptions
from pagewarden.serve.remote_engine import RemoteEngine, RemoteErrors
from pagewarden.serve.replica import EngineReplica
from pagewarden.server.admission import AdmissionController
from pagewarden.server.api import build_app as build_http_app
from pagewarden.server.context import ServerLimits
from pagewarden.server.model_names import served_names

logger = logging.getLogger("pagewarden.serve")

ENGINE_DEPLOYMENT = "PagewardenEngine"
INGRESS_DEPLOYMENT = "PagewardenIngress"
#: A replica whose digest is older than this many periods counts as gone.
_STALE_PERIODS = 4


def _app_name() -> str:
    return serve.get_replica_context().app_name


class PagewardenEngine(EngineReplica):
    """The Serve deployment class: an ``EngineReplica`` publishing to the app's board."""

    async def __init__(self, options: ServeOptions) -> None:
        ctx = serve.get_replica_context()
        board = board_for(ctx.app_name)
        engine = dict(options.engine)
        if engine.get("cpu_threads") is None:  # as many torch threads as CPUs reserved
            engine["cpu_threads"] = max(1, int(options.num_cpus_per_replica))
        super().__init__(
            EngineConfig(**engine),
            ctx.replica_id.unique_id,
            publish=board.publish.remote,
            digest_period_s=options.digest_period_s,
            stall_timeout_s=options.engine_stall_timeout,
        )
        self.start_publishing()  # the ingress sees this replica before its first request

    def __del__(self) -> None:
        self.shutdown()


def _errors() -> RemoteErrors:
    def cause(exc: BaseException) -> BaseException:
        return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc

    def lost(exc: BaseException) -> bool:
        return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))

    def overloaded(exc: BaseException) -> BaseException | None:
        if isinstance(exc, BackPressureError):
            return AdmissionRejected(f"every replica's queue is full: {exc}")
        return None

    return RemoteErrors(cause, lost, overloaded)


@serve.ingress()
class PagewardenIngress:
    """The OpenAI routes of ``pagewarden.server`` over the engine replicas."""

    async def __init__(self, engine: DeploymentHandle, options: ServeOptions) -> None:
        self.options = options
        info = await engine.engine_info.remote()
        seed: ReplicaDigest = await engine.digest.remote()
        self.view = ClusterView.of([seed], None)
        self.board = board_for(_app_name())
        self.remote = RemoteEngine(engine, info, _errors(), lambda: self.view)
        requested = options.served_model_name
        self.model = served_names(
            [requested] if isinstance(requested, str) else list(requested or ()),
            options.engine.get("model"),
            info.model_name,
        )
        self._poller = asyncio.get_running_loop().create_task(self._poll(seed.engine_stats))

    async def _poll(self, fallback_stats: object) -> None:
        """Refresh the cluster view from the board every digest period."""
        period = self.options.digest_period_s
        while True:
            try:
                digests = await self.board.fresh.remote(period * _STALE_PERIODS)
                self.view = ClusterView.of(digests, fallback_stats)
            except Exception:  # noqa: BLE001 - keep the last view; retry next period
                logger.exception("pagewarden ingress: reading the digest board failed")
            await asyncio.sleep(period)

    def __serve_build_asgi_app__(self):
        # Ray Serve sheds load (max_queued_requests); the single-process gate stays off.
        admission = AdmissionController(1, enabled=False)
        gate = build_http_app(
            self.remote,
            self.model,
            list(self.options.api_keys),
            limits=ServerLimits(**self.options.limits),
            admission=admission,
        )
        ctx = gate.api.state.server

        async def replicas(request: Request) -> dict:
            ctx.authorize(request)  # as every /v1 route: 401 without a key when keys are set
            return self._replicas()

        gate.api.add_api_route("/v1/replicas", replicas, methods=["GET"])
        return gate

    def _replicas(self) -> dict:
        """Per-replica view (a pagewarden extension): liveness, load, held blocks, stats."""
        now = time.time()
        return {
            "object": "list",
            "data": [
                {
                    "replica_id": d.replica_id,
                    "alive": d.alive,
                    "num_in_flight": d.num_in_flight,
                    "held_blocks": len(d.hashes),
                    "prompt_tokens": getattr(d.engine_stats, "prompt_tokens", 0),
                    "prefix_cache_queries": getattr(d.engine_stats, "prefix_cache_queries", 0),
                    "prefix_cache_hits": getattr(d.engine_stats, "prefix_cache_hits", 0),
                    "digest_age_s": round(now - d.created, 3),
                }
                for d in self.view.replicas
            ],
            "request_migrations": self.remote.migrations,
        }


def engine_deployment_options(options: ServeOptions) -> dict[str, Any]:
    """Serve's options for the engine deployment (overridable under ``deployments:``)."""
    opts: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "max_ongoing_requests": options.max_ongoing_requests,
        "max_queued_requests": options.max_queued_requests,
        "ray_actor_options": {
            "num_cpus": options.num_cpus_per_replica,
            "num_gpus": options.num_gpus_per_replica,
        },
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
    }
    if options.max_replicas is not None:
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=options.min_replicas if options.min_replicas is not None else 1,
            max_replicas=options.max_replicas,
            target_ongoing_requests=options.target_ongoing_requests,
        )
    else:
        opts["num_replicas"] = options.num_replicas
    if options.router == "prefix":
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class="pagewarden.serve.router:PrefixAwareRouter",
            request_router_kwargs={"imbalanced_threshold": options.imbalanced_threshold},
            request_routing_stats_period_s=options.digest_period_s,
            request_routing_stats_timeout_s=max(1.0, 4 * options.digest_period_s),
        )
    return opts


def build_app(options: ServeOptions) -> serve.Application:
    """The Serve application: the ingress bound to the engine deployment."""
    engine = serve.deployment(PagewardenEngine).options(**engine_deployment_options(options))
    ingress = serve.deployment(PagewardenIngress).options(
        name=INGRESS_DEPLOYMENT,
        max_ongoing_requests=max(256, 4 * options.max_ongoing_requests),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(options), options)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The ``import_path`` target of a Serve config: ``args`` are ``ServeOptions`` fields."""
    return build_app(ServeOptions.from_dict(args))


def run_cli(options: ServeOptions, host: str, port: int, address: str | None) -> int:
    """``pagewarden serve --ray``: deploy on a Ray cluster (or a local one) and wait."""
    import signal

    import ray

    def stop(sig: int, _frame) -> None:
        raise KeyboardInterrupt(signal.Signals(sig).name)

    # Explicitly: a shell starts background jobs with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    ray.init(address=address, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(options), name="pagewarden", route_prefix="/")
    logger.info("pagewarden: serving on Ray Serve at http://%s:%d (Ctrl-C stops)", host, port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logger.info("pagewarden: stopping the Serve application")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
