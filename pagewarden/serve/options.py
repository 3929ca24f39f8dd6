"""How a pagewarden Serve application is shaped: plain values, no Ray.

They become Ray Serve's own deployment options (``num_replicas``,
``autoscaling_config``, ``max_ongoing_requests``, ``max_queued_requests``,
``ray_actor_options``, ``request_router_config``), so a Serve config YAML can override
any of them under ``deployments:`` exactly as for any Serve application.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

ROUTERS = ("prefix", "pow2")


class ServeOptionsError(ValueError):
    """A scale-out option is out of range; the message names it."""


@dataclass(frozen=True)
class ServeOptions:
    """Replicas, their resources, autoscaling, load shedding and routing."""

    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    limits: dict[str, Any] = field(default_factory=dict)  # server.context.ServerLimits fields
    engine_stall_timeout: float = 60.0  # seconds; as `pagewarden serve`'s flag
    served_model_name: str | tuple[str, ...] | None = None  # one name or aliases
    api_keys: tuple[str, ...] = ()
    num_replicas: int = 1
    # Autoscaling (Serve's autoscaling_config) when max_replicas is set.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 64  # per replica, before Serve queues at the handle
    max_queued_requests: int = -1  # Serve's: -1 = unbounded, else 503s past it
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    router: str = "prefix"  # "prefix" (router.py) or "pow2" (Serve's default)
    imbalanced_threshold: int = 8
    digest_period_s: float = 0.5

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ServeOptionsError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.num_replicas < 1:
            raise ServeOptionsError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.max_replicas is not None:
            lo = self.min_replicas if self.min_replicas is not None else 1
            if not 0 <= lo <= self.max_replicas or self.max_replicas < 1:
                raise ServeOptionsError(
                    f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                    f"got {self.min_replicas}, {self.max_replicas}"
                )
        if (
            self.digest_period_s <= 0
            or self.imbalanced_threshold < 0
            or (self.engine_stall_timeout <= 0)
        ):
            raise ServeOptionsError(
                "digest_period_s and engine_stall_timeout must be > 0, imbalanced_threshold >= 0"
            )

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ServeOptions:
        """From a Serve config's ``args:``; unknown keys are an error, not ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise ServeOptionsError(
                f"unknown pagewarden serve args {unknown}; known: {sorted(names)}"
            )
        values = dict(args)
        if "api_keys" in values:
            values["api_keys"] = tuple(values["api_keys"] or ())
        return cls(**values)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """``pagewarden serve --ray``: the flags that become Ray Serve's options."""
    g = p.add_argument_group("scale-out on Ray Serve (pip install pagewarden[ray])")
    g.add_argument(
        "--ray", action="store_true", help="serve through Ray Serve replicas (default off)"
    )
    g.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: local)")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (fixed count)")
    g.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="autoscaling floor (default: 1 when autoscaling)",
    )
    g.add_argument(
        "--max-replicas", type=int, default=None, help="set to autoscale (default: no autoscaling)"
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=16.0,
        help="autoscaling target of requests in flight per replica",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=64,
        help="requests in flight per replica before Ray Serve queues",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=-1,
        help="requests Ray Serve queues before it answers 429 (-1: no limit)",
    )
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="CPUs per replica")
    g.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="GPUs per replica")
    g.add_argument(
        "--router",
        choices=ROUTERS,
        default="prefix",
        help="prefix: prefix-aware on the engine's block hashes; pow2: Ray's default",
    )
    g.add_argument(
        "--imbalanced-threshold",
        type=int,
        default=8,
        help="in-flight difference past which the prefix router takes the least-loaded replica",
    )


def options_from_args(args: argparse.Namespace, engine: dict[str, Any]) -> ServeOptions:
    return ServeOptions(
        engine=engine,
        limits=dict(
            max_n=args.max_n,
            max_logprobs=args.max_logprobs,
            max_prompts_per_request=args.max_prompts_per_request,
        ),
        engine_stall_timeout=args.engine_stall_timeout,
        served_model_name=tuple(args.served_model_name or ()) or None,
        api_keys=tuple(args.api_key or ()),
        num_replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        num_cpus_per_replica=args.num_cpus_per_replica,
        num_gpus_per_replica=args.num_gpus_per_replica,
        router=args.router,
        imbalanced_threshold=args.imbalanced_threshold,
    )
