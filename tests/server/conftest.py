"""One real ``pagewarden serve`` on the default model for the whole session, shared by the
structured-outputs, tools and Responses tests (each would otherwise start its own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.serve_process import ServeProcess


@pytest.fixture(scope="session")
def serve_proc() -> Iterator[ServeProcess]:
    """The server, with the hermes tool-call parser for ``tool_choice: auto``."""
    s = ServeProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()
