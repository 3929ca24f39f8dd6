"""``pagewarden serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import signal
import threading

from pagewarden.server.admission import BODY_TIMEOUT_S
from pagewarden.server.fast_reject import HEADER_TIMEOUT_S

logger = logging.getLogger("pagewarden.server")


def add_serve_parser(subparsers) -> None:
    from pagewarden.engine.args import DefaultsHelpFormatter, add_engine_args
    from pagewarden.serve.options import add_ray_args

    p = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this bearer key; repeat for several (default: no key)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names clients may send, the first the primary one (default: "
        "SmolLM2-135M-Instruct for the default model, else the --model argument and its "
        "file or directory name)",
    )
    p.add_argument(
        "--vllm-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also export vLLM's metric names (vllm:num_requests_running, ...) in /metrics, "
        "for routers and dashboards built for vLLM",
    )
    p.add_argument(
        "--admin-key",
        action="append",
        default=None,
        help="the bearer key of /admin/* (and /debug/*); repeat for several. Without one "
        "those routes answer only on a loopback-only server, under --api-key",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated Host header names the server answers ('*': any); default: "
        "the bind address and localhost, 127.0.0.1, [::1] when it listens on loopback, "
        "any otherwise (a DNS-rebinding page arrives under its own name)",
    )
    p.add_argument(
        "--enable-docs",
        action="store_true",
        help="serve FastAPI's /docs and /redoc (their pages load scripts from a CDN)",
    )
    p.add_argument(
        "--kv-events-allow-remote",
        action="store_true",
        help="allow --kv-events-endpoint to bind a wildcard or non-loopback TCP address "
        "while --api-key is set (events are unauthenticated: see docs/kv-events.md)",
    )
    _add_tool_args(p)
    _add_cors_args(p)
    _add_limit_args(p)
    add_engine_args(p)
    add_ray_args(p)
    p.set_defaults(func=cmd_serve)


def _add_tool_args(p) -> None:
    """Tool calling (server/tools.py), named as in vLLM."""
    from pagewarden.server.tool_parsers import TOOL_PARSERS

    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the model decides, --tool-call-parser reads its calls',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the model's tool-call format, for tool_choice auto",
    )


def _list_arg(value: str) -> list[str]:
    """One value, or vLLM's JSON list form (``'["https://a.example", "https://b"]'``)."""
    if value.startswith("["):
        try:
            items = json.loads(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [value]


def _add_cors_args(p) -> None:
    """CORS for browser clients (server/cors.py); vLLM's flags."""
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "headers")):
        p.add_argument(
            f"--allowed-{flag}",
            type=_list_arg,
            nargs="+",
            default=None,
            metavar="VALUE",
            help=f"CORS: allowed {what}, as values or one JSON list (default: *)",
        )
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: let browsers send credentials (needs explicit --allowed-origins)",
    )


def _cors_policy(args: argparse.Namespace):
    from pagewarden.server.cors import CorsPolicy

    def values(name: str) -> tuple[str, ...]:
        given = getattr(args, name)
        return ("*",) if given is None else tuple(v for group in given for v in group)

    return CorsPolicy(
        values("allowed_origins"),
        values("allowed_methods"),
        values("allowed_headers"),
        args.allow_credentials,
    )


def _add_limit_args(p) -> None:
    """Front-door limits and admission control (see server/admission.py)."""
    from pagewarden.server.admission import DEFAULT_TARGET_ITL_RATIO, DEFAULT_TARGET_QUEUE_S

    p.add_argument(
        "--admission-control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shed load with 429 before parsing when the engine is saturated (default on)",
    )
    p.add_argument(
        "--max-inflight-requests",
        type=int,
        default=None,
        help="pin the admission limit on generation requests in flight (default: adaptive, "
        "sized from the KV pool and --max-num-seqs)",
    )
    p.add_argument(
        "--admission-target-queue-time",
        type=float,
        default=DEFAULT_TARGET_QUEUE_S,
        metavar="SECONDS",
        help="the adaptive limit shrinks when requests wait longer than this for a first token",
    )
    p.add_argument(
        "--admission-target-itl-ratio",
        type=float,
        default=DEFAULT_TARGET_ITL_RATIO,
        metavar="RATIO",
        help="the adaptive limit shrinks when admitted streams' tokens come this many times "
        "slower than on a lightly loaded engine",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="429 when this many requests wait in the engine (default: no limit)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="429 when this many prompt tokens wait in the engine (default: no limit)",
    )
    p.add_argument(
        "--max-inflight-per-key",
        type=int,
        default=None,
        help="most generation requests one API key may have in flight (default: a fair "
        "share, the admission limit divided by the keys with requests in flight)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="a generation request's body must arrive within this long (408 otherwise); "
        "no admission slot is held while it arrives",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request line and headers take longer than this",
    )
    p.add_argument("--max-logprobs", type=int, default=20, help="as vLLM's (default 20)")
    p.add_argument("--max-n", type=int, default=8, help="largest n per request")
    p.add_argument(
        "--max-prompts-per-request", type=int, default=32, help="largest prompt list per request"
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="restart the engine core after this long without step progress while "
        "requests are in flight",
    )


def _check_limits(args: argparse.Namespace) -> None:
    for name in (
        "max_logprobs",
        "max_n",
        "max_prompts_per_request",
        "max_inflight_requests",
        "max_inflight_per_key",
    ):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "max_logprobs" else 1):
            raise SystemExit(f"--{name.replace('_', '-')} is out of range: {value}")
    if args.body_timeout <= 0 or args.header_timeout <= 0:
        raise SystemExit("--body-timeout and --header-timeout must be > 0")
    if args.engine_stall_timeout <= 0 or args.admission_target_queue_time <= 0:
        raise SystemExit("--engine-stall-timeout and --admission-target-queue-time must be > 0")
    if args.admission_target_itl_ratio <= 1:
        raise SystemExit("--admission-target-itl-ratio must be > 1")
    _check_kv_events_exposure(args)


def _check_kv_events_exposure(args: argparse.Namespace) -> None:
    """With API keys, KV events (which carry prompt token ids) must not be readable by
    anyone who can reach a port: a wildcard bind needs --kv-events-allow-remote."""
    from pagewarden.engine.kv_events import binds_remotely

    endpoint = getattr(args, "kv_events_endpoint", None)
    if args.api_key and endpoint and binds_remotely(endpoint):
        if not args.kv_events_allow_remote:
            raise SystemExit(
                f"--kv-events-endpoint {endpoint} binds an address other machines can reach, "
                "and KV events are not authenticated while --api-key is set: bind "
                "tcp://127.0.0.1:PORT or ipc://PATH, add --kv-events-no-token-ids and "
                "--kv-events-allow-remote to publish hashes only, or see docs/kv-events.md "
                "for ZeroMQ CURVE"
            )
        if args.kv_events_token_ids:
            logger.warning(
                "pagewarden: KV events on %s carry prompt token ids to any subscriber; "
                "--kv-events-no-token-ids sends hashes only",
                endpoint,
            )


def _graceful_server(config):
    """A uvicorn server whose SIGINT/SIGTERM start a drain and then let ``serve`` return.

    uvicorn re-raises a captured signal once it has drained, which under SIGTERM kills the
    process before the engine thread is shut down; here the signal only sets
    ``should_exit`` (a second SIGINT forces the exit), so the caller's cleanup always runs.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def on_signal(sig, _frame) -> None:
                logger.info("pagewarden: %s received, draining", signal.Signals(sig).name)
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True

            previous = {
                sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
            }
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return _Server(config)


def _build_app(args: argparse.Namespace, engine, names: list[str]):
    """The app with the front-door limits and admission control the flags ask for."""
    from pagewarden.server.admin import AdminPolicy
    from pagewarden.server.api import build_app, default_admission
    from pagewarden.server.browser_guard import default_allowed_hosts
    from pagewarden.server.context import ServerLimits
    from pagewarden.server.tools import ToolConfig

    limits = ServerLimits(
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_prompts_per_request=args.max_prompts_per_request,
    )
    admission = default_admission(
        engine,
        target_queue_s=args.admission_target_queue_time,
        target_itl_ratio=args.admission_target_itl_ratio,
        fixed_limit=args.max_inflight_requests,
        enabled=args.admission_control,
    )
    return build_app(
        engine,
        names,
        args.api_key,
        limits=limits,
        admission=admission,
        vllm_metrics=args.vllm_metrics,
        admin=AdminPolicy(
            admin_keys=list(args.admin_key or []),
            enabled=bool(args.admin_key) or is_loopback(args.host),
            switch_interval_s=args.safe_mode_clean_period,
        ),
        allowed_hosts=(
            default_allowed_hosts(args.host, is_loopback(args.host))
            if args.allowed_hosts is None
            else [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
        ),
        enable_docs=args.enable_docs,
        body_timeout_s=args.body_timeout,
        max_inflight_per_key=args.max_inflight_per_key,
        tool_config=ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser),
        cors=_cors_policy(args),
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as given to --host) listens on this machine's loopback only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _serve_on_ray(args: argparse.Namespace) -> int:
    """Replicas on Ray Serve (pagewarden/serve/ray.py); needs ``pagewarden[ray]``."""
    from dataclasses import asdict

    from pagewarden.engine.args import engine_config
    from pagewarden.serve.options import options_from_args

    try:
        from pagewarden.serve.ray import run_cli
    except ImportError as exc:
        raise SystemExit(f"--ray needs Ray Serve: pip install 'pagewarden[ray]' ({exc})") from None
    options = options_from_args(args, asdict(engine_config(args)))
    return run_cli(options, args.host, args.port, args.ray_address)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagewarden.engine.args import engine_config
    from pagewarden.engine.async_engine import AsyncEngine
    from pagewarden.server.cors import CorsPolicyError
    from pagewarden.server.fast_reject import available as fast_reject_available
    from pagewarden.server.fast_reject import reject_fast_protocol
    from pagewarden.server.model_names import ServedNameError, served_names

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _check_limits(args)
    try:  # before the engine starts: a bad name or policy costs no model load
        served_names(args.served_model_name, args.model, "")
        _cors_policy(args)
    except (ServedNameError, CorsPolicyError) as exc:
        raise SystemExit(str(exc)) from None
    if args.ray:
        return _serve_on_ray(args)
    engine = AsyncEngine(
        engine_config(args),
        max_waiting_requests=args.max_waiting_requests,
        max_queued_tokens=args.max_queued_tokens,
        stall_timeout_s=args.engine_stall_timeout,
    )
    names = served_names(args.served_model_name, args.model, engine.info.model_name)
    name = names[0]
    # The start-up heap lives as long as the process: freeze it so that no later
    # collection walks it.
    gc.collect()
    gc.freeze()
    app = _build_app(args, engine, names)
    # 429s straight from the HTTP parser where uvicorn allows it (see fast_reject.py).
    http = (
        reject_fast_protocol(app.controller, app, args.header_timeout)
        if fast_reject_available()
        else "auto"
    )
    server = _graceful_server(
        uvicorn.Config(
            app,
            http=http,
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=10,
        )
    )

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            logger.info("pagewarden: serving %s on http://%s:%d", name, args.host, args.port)
        await task

    try:
        asyncio.run(serve())
    finally:
        engine.shutdown()  # stops the engine-core process; in-flight requests fail
        logger.info("pagewarden: stopped")
    return 0
