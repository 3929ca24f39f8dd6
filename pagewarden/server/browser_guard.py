"""What a web page in the user's browser must not be able to do to a local server.

A page on any site can make the browser send requests to ``http://127.0.0.1:8000``:
"simple" cross-site POSTs (``text/plain``, form bodies, or no type at all) go out
without a CORS preflight, and a DNS-rebinding page can even read the answers, since the
browser believes the server is the page's own origin. Two checks, in a raw ASGI
middleware before any route runs:

- **Host allow-list**: a request whose ``Host`` is not one of ``allowed_hosts`` gets 400.
  A rebinding attack arrives with the attacker's name in ``Host``. ``None`` allows any
  (a server bound beyond loopback, reached under names it cannot know).
- **JSON only**: a POST whose ``Content-Type`` is not ``application/json`` (or
  ``application/*+json``) gets 415. Browsers can send JSON cross-site only after a
  CORS preflight, which the CORS policy answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


def default_allowed_hosts(bind_host: str, loopback: bool) -> frozenset[str] | None:
    """The bind address and the loopback names on a loopback server; else any host."""
    if not loopback:
        return None
    return frozenset({*LOOPBACK_HOSTS, bind_host.lower()})


def _host_name(value: str) -> str:
    """``Host`` without its port: ``example.com:8000`` -> ``example.com``,
    ``[::1]:8000`` -> ``[::1]``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class BrowserGuard:
    """Raw ASGI middleware: the Host allow-list and JSON-only POSTs (module doc)."""

    def __init__(self, app, allowed_hosts: Iterable[str] | None = None) -> None:
        self.app = app
        self.allowed_hosts = (
            None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if self.allowed_hosts is not None and "*" not in self.allowed_hosts:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                await _refuse(
                    send,
                    400,
                    f"Host {host!r} is not served here; start the server with "
                    "--allowed-hosts to add it",
                )
                return
        if scope["method"] == "POST":
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            if not _is_json(content_type):
                await _refuse(
                    send,
                    415,
                    "POST bodies must be JSON: send 'Content-Type: application/json'",
                )
                return
        await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str) -> None:
    kind = {400: "BadRequestError", 415: "UnsupportedMediaType"}.get(status, "APIError")
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
