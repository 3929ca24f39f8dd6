"""Operator routes behind their own key: a tenant's API key cannot switch the profile or
pause the engine; without an admin key the routes answer only on a loopback server;
profile switches are rate-limited; debug routes answer bad bodies with 400, not 500."""

from __future__ import annotations

import os

import httpx
import pytest

from pagewarden.faults import remote
from pagewarden.serve.cli import is_loopback
from pagewarden.server.admin import AdminPolicy
from tests.server.test_api import MODEL, _engine, _Running

TENANT, ADMIN = "sk-tenant", "sk-admin"


class _App(_Running):
    """A server on the module's shared engine (stopping it leaves the engine running)."""

    def __init__(self, engine, policy: AdminPolicy) -> None:
        super().__init__(engine, TENANT, admin=policy, shutdown_engine=False)

    def post(self, path: str, body, key: str | None = None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=30, **kw)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    old = os.environ.get(remote.ENV_VAR)
    os.environ[remote.ENV_VAR] = "1"  # the /debug routes exist only with fault injection on
    eng = _engine(tiny_llama_dir)
    yield eng
    eng.shutdown()
    if old is None:
        os.environ.pop(remote.ENV_VAR, None)
    else:
        os.environ[remote.ENV_VAR] = old


@pytest.fixture
def app_with(engine):
    apps: list[_App] = []

    def make(policy: AdminPolicy) -> _App:
        apps.append(_App(engine, policy))
        return apps[-1]

    yield make
    for a in apps:
        a.stop()


def test_a_tenant_key_is_not_an_admin_key(app_with) -> None:
    srv = app_with(AdminPolicy(admin_keys=[ADMIN]))
    for path, body in (("/admin/profile", {"profile": "safe"}), ("/debug/pause", {"seconds": 1})):
        assert srv.post(path, body, TENANT).status_code == 403
        assert srv.post(path, body).status_code == 401
    r = srv.post("/admin/profile", {"profile": "safe"}, ADMIN)
    assert r.status_code == 200 and r.json()["profile"] == "safe"
    assert srv.post("/admin/profile", {"profile": "normal"}, ADMIN).status_code == 200
    # The admin key is not a tenant key either.
    gen = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert srv.post("/v1/completions", gen, ADMIN).status_code == 401
    assert srv.post("/v1/completions", gen, TENANT).status_code == 200


def test_without_an_admin_key_a_public_server_has_no_operator_routes(app_with) -> None:
    srv = app_with(AdminPolicy(enabled=False))
    r = srv.post("/admin/profile", {"profile": "safe"}, TENANT)
    assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
    assert srv.post("/debug/pause", {"seconds": 1}, TENANT).status_code == 403
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("::")


def test_profile_switches_are_rate_limited(app_with) -> None:
    srv = app_with(AdminPolicy(admin_keys=[ADMIN], switch_interval_s=60))
    assert srv.post("/admin/profile", {"profile": "safe"}, ADMIN).status_code == 200
    r = srv.post("/admin/profile", {"profile": "normal"}, ADMIN)
    assert r.status_code == 429 and 55 <= int(r.headers["Retry-After"]) <= 60
    assert "one per 60 s" in r.json()["error"]["message"]
    # The refused switch did not happen.
    assert httpx.get(srv.url + "/health").json()["profile"] == "safe"
    srv_after = app_with(AdminPolicy(admin_keys=[ADMIN]))  # and a fresh policy may switch back
    assert srv_after.post("/admin/profile", {"profile": "normal"}, ADMIN).status_code == 200


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b'"seconds"', b"null"])
def test_debug_routes_refuse_bad_bodies_with_400(app_with, body) -> None:
    srv = app_with(AdminPolicy(admin_keys=[ADMIN]))
    for path in ("/debug/pause", "/debug/faults"):
        r = httpx.post(
            srv.url + path,
            content=body,
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, (path, r.text)
