"""``pagewarden serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import threading

logger = logging.getLogger("pagewarden.server")


def add_serve_parser(subparsers) -> None:
    from pagewarden.cli import add_engine_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None, help="repeat for several keys")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-waiting-requests", type=int, default=None)
    p.add_argument("--max-queued-tokens", type=int, default=None)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagewarden.cli import engine_config
    from pagewarden.engine.async_engine import AsyncEngine
    from pagewarden.server.api import build_app

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    engine = AsyncEngine(
        engine_config(args),
        max_waiting_requests=args.max_waiting_requests,
        max_queued_tokens=args.max_queued_tokens,
    )
    name = args.served_model_name or engine.core.loaded.name
    # The start-up heap (model, tokenizer) lives as long as the process: freeze it so
    # that no later collection walks it.
    gc.collect()
    gc.freeze()
    app = build_app(engine, name, args.api_key)
    server = _graceful_server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10
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
        engine.shutdown()  # aborts what is still in flight and joins the engine thread
        logger.info("pagewarden: stopped")
    return 0
