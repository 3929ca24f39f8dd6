"""What a web page must not do to a local server: cross-site "simple" POSTs (text/plain,
forms, no type) are refused with 415 before any route runs; a Host outside the
allow-list (DNS rebinding) gets 400; /docs loads nothing from a CDN unless asked."""

from __future__ import annotations

import httpx
import pytest

from pagewarden.server.browser_guard import BrowserGuard, _host_name, default_allowed_hosts
from tests.server.test_api import MODEL, _engine, _Running


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    running = _Running(
        _engine(tiny_llama_dir),
        allowed_hosts=default_allowed_hosts("127.0.0.1", loopback=True),
    )
    yield running.url, running.engine
    running.stop()


BODY = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL.encode()


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"],
)
def test_cross_site_simple_posts_are_refused(srv, content_type) -> None:
    url, _ = srv
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path in ("/v1/completions", "/admin/profile"):
        r = httpx.post(url + path, content=BODY, headers=headers, timeout=30)
        assert r.status_code == 415, r.text
        assert "application/json" in r.json()["error"]["message"]


def test_json_posts_still_work(srv) -> None:
    url, _ = srv
    for content_type in ("application/json", "application/json; charset=utf-8"):
        r = httpx.post(
            url + "/v1/completions", content=BODY, headers={"Content-Type": content_type}
        )
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "10.0.0.5"])
def test_a_rebinding_host_is_refused(srv, host) -> None:
    url, _ = srv
    r = httpx.get(url + "/v1/models", headers={"Host": host})
    assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"]


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"])
def test_loopback_names_are_served(srv, host) -> None:
    url, _ = srv
    assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200


def test_docs_are_off_by_default_and_openapi_stays(srv) -> None:
    url, _ = srv
    assert httpx.get(url + "/docs").status_code == 404
    assert httpx.get(url + "/redoc").status_code == 404
    assert httpx.get(url + "/openapi.json").status_code == 200


def test_host_parsing_and_defaults() -> None:
    assert _host_name("Example.COM:8000") == "example.com"
    assert _host_name("[::1]:8000") == "[::1]" and _host_name("::1") == "::1"
    assert default_allowed_hosts("0.0.0.0", loopback=False) is None
    assert "localhost" in default_allowed_hosts("127.0.0.1", loopback=True)
    assert BrowserGuard(None, ["*"]).allowed_hosts == frozenset({"*"})
