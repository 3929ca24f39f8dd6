"""CORS, as vLLM configures it: any origin by default, never credentials with ``*``.

Starlette's ``CORSMiddleware`` answers preflight requests (200 for an allowed origin and
method) and adds ``Access-Control-Allow-Origin`` to the others. With ``*`` and
credentials it would reflect the caller's origin and let any web page send the user's
cookies; that combination is refused here. (429s answered by the admission gate before
the app carry no CORS headers: a browser sees them as network errors and retries.)
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


class CorsPolicyError(ValueError):
    """A CORS policy that would be unsafe or is malformed; the message says which flag."""


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and "*" in self.allowed_origins:
            raise CorsPolicyError(
                "--allow-credentials needs explicit --allowed-origins: with '*' any web "
                "page could send the user's credentials"
            )
        for flag, values in (
            ("--allowed-origins", self.allowed_origins),
            ("--allowed-methods", self.allowed_methods),
            ("--allowed-headers", self.allowed_headers),
        ):
            if any(not v or not v.isprintable() or " " in v for v in values):
                raise CorsPolicyError(f"{flag}: values must be non-empty, without spaces")


def add_cors(app: FastAPI, policy: CorsPolicy) -> None:
    """Install ``policy`` on ``app``; an empty origin list turns CORS off."""
    if not policy.allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(policy.allowed_origins),
        allow_methods=list(policy.allowed_methods),
        allow_headers=list(policy.allowed_headers),
        allow_credentials=policy.allow_credentials,
        expose_headers=["X-Request-Id", "Retry-After", "retry-after-ms"],
    )
