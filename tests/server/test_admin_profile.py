"""``POST /admin/profile`` and the profile in ``/health``: through the HTTP server to the
engine-core process and back in its status, behind the API key."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server.test_api import MODEL, _engine, _Running

KEY = "sk-admin-test"


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    s = _Running(_engine(tiny_llama_dir), api_key=KEY)
    yield s
    s.stop()


def _post(srv, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + "/admin/profile", json=body, headers=headers, timeout=30)


def _profile_gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^pagewarden:engine_profile\{.*profile="(\w+)"\} (\S+)$', text, re.M)
    }


def test_health_carries_the_profile_and_an_operator_switches_it(srv) -> None:
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["profile"] == "normal"
    assert _profile_gauges(srv.url) == {"normal": 1.0, "safe": 0.0}

    r = _post(srv, {"profile": "safe"})
    assert r.status_code == 200, r.text
    assert r.json() == {"profile": "safe", "previous": "normal", "applied": True}
    body = httpx.get(srv.url + "/health").json()
    assert (body["profile"], body["profile_reason"]) == ("safe", "operator")
    assert _profile_gauges(srv.url) == {"normal": 0.0, "safe": 1.0}
    text = httpx.get(srv.url + "/metrics").text
    assert re.search(
        r'^pagewarden:profile_switches_total\{from="normal",model_name="tiny",'
        r'reason="operator",to="safe"\} 1\.0$',
        text,
        re.M,
    ), text
    # Requests are served in safe mode too.
    out = httpx.post(
        srv.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4

    r = _post(srv, {"profile": "normal"})
    assert r.status_code == 200 and r.json()["previous"] == "safe"
    assert httpx.get(srv.url + "/health").json()["profile"] == "normal"


@pytest.mark.parametrize(
    "body,key,status,match",
    [
        ({"profile": "safe"}, None, 401, "API key"),
        ({"profile": "safe"}, "sk-wrong", 401, "API key"),
        ({"profile": "turbo"}, KEY, 400, "unknown profile 'turbo'; known: normal, safe"),
    ],
)
def test_bad_requests_are_refused(srv, body, key, status, match) -> None:
    r = _post(srv, body, key)
    assert r.status_code == status
    assert match in r.json()["error"]["message"]


def test_every_validation_error_is_reported_in_the_bodys_order(srv) -> None:
    """An unknown field and a missing one: both named, the sent field first, whatever order
    the validation library lists them in."""
    r = _post(srv, {"mode": "safe"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "mode"
    first, second = err["message"].split("; ")
    assert first.startswith("mode: ") and second.startswith("profile: ")
