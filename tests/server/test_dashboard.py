"""The dashboard: /dashboard/state over HTTP, and the page itself in headless Chromium.

The browser test drives Debian's ``chromium`` + ``chromium-driver`` with selenium. Where
they are missing it skips with the reason, except when ``PAGEWARDEN_BROWSER_TESTS=required``
(set by .ci/run, which installs them): then it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.engine.config import EngineConfig
from pagewarden.faults import remote
from pagewarden.server.admin import AdminPolicy
from tests.server.test_api import _Running

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 96
PAUSE_S = 4.0  # how long the test holds the step loop still
ARTIFACTS = Path(os.environ.get("PAGEWARDEN_TEST_ARTIFACTS", "test-artifacts"))


class _Server(_Running):
    """The app on loopback (test_api's ``_Running``), API key set, fault injection enabled."""

    def __init__(self, model_dir: Path, offload_dir: Path) -> None:
        # The engine-core process is spawned with this environment.
        self._old_env = os.environ.get(remote.ENV_VAR)
        os.environ[remote.ENV_VAR] = "1"
        cfg = EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_kv_blocks=NUM_BLOCKS,
            block_size=16,
            max_model_len=256,
            kv_offload_dir=str(offload_dir),  # a disk KV tier, shown by the page
        )
        super().__init__(AsyncEngine(cfg), KEY)

    def stop(self) -> None:
        super().stop()
        if self._old_env is None:
            os.environ.pop(remote.ENV_VAR, None)
        else:
            os.environ[remote.ENV_VAR] = self._old_env

    def state(self) -> dict:
        r = httpx.get(self.url + "/dashboard/state", headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        match = re.search(rf"^pagewarden:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        assert match, f"pagewarden:{name} not in /metrics"
        return float(match.group(1))

    def post(self, path: str, body: dict) -> None:
        r = httpx.post(self.url + path, json=body, headers=AUTH, timeout=10)
        assert r.status_code == 202, r.text


@pytest.fixture(scope="module")
def srv(tiny_llama_dir, tmp_path_factory):
    s = _Server(tiny_llama_dir, tmp_path_factory.mktemp("kv_tier"))
    yield s
    s.stop()


def test_state_needs_the_key_and_matches_the_pool(srv):
    assert httpx.get(srv.url + "/dashboard/state").status_code == 401
    assert httpx.get(srv.url + "/dashboard").status_code == 401
    assert httpx.get(srv.url + "/dashboard?key=wrong").status_code == 401
    page = httpx.get(srv.url + f"/dashboard?key={KEY}")
    assert page.status_code == 200 and "blockmap" in page.text
    cookie = page.cookies.get("pagewarden_dashboard_session")
    assert cookie and KEY not in cookie  # a signed session, never the key itself
    by_cookie = httpx.get(
        srv.url + "/dashboard/state", cookies={"pagewarden_dashboard_session": cookie}
    )
    assert by_cookie.status_code == 200
    assert by_cookie.cookies.get("pagewarden_dashboard_session")  # renewed by each poll
    # The raw key as a cookie, a forged or tampered session, or ?key= on the data route: 401.
    for cookies in (
        {"pagewarden_dashboard_session": KEY},
        {"pagewarden_dashboard_session": cookie[:-1] + ("0" if cookie[-1] != "0" else "1")},
        {"pagewarden_dashboard_session": "0.99999999999." + "0" * 64},
    ):
        assert httpx.get(srv.url + "/dashboard/state", cookies=cookies).status_code == 401
    assert httpx.get(srv.url + f"/dashboard/state?key={KEY}").status_code == 401
    assert httpx.get(srv.url + "/dashboard/static/dashboard.js").status_code == 200
    assert httpx.get(srv.url + "/dashboard/static/..%2Fapi.py").status_code == 404

    state = srv.state()
    assert state["version"] == 1 and state["profile"] == "normal"
    snap = state["snapshot"]
    assert len(snap["blocks"]) == NUM_BLOCKS == state["engine"]["num_blocks"]
    assert snap["blocks"][0] == "R" and set(snap["blocks"][1:]) <= set("FCUSQX")
    assert snap["cost_s"] < 0.05
    for column in ("t", "kv_usage", "running", "ttft_p99_ms", "max_num_seqs", "profile"):
        assert column in state["series"]


def _complete_ids(srv: _Server, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


def _tier_metric(srv: _Server, name: str, labels: str = 'tier="disk"') -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    match = re.search(rf"^pagewarden:{name}{{[^}}]*{labels}[^}}]*}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_state_shows_the_kv_tiers_with_the_metrics_numbers(srv):
    """Hits, stores, rejections by reason and bytes of the disk tier, as /metrics has them."""
    # Nine 200-token prompts (13 blocks each with their output) through a 95-block pool:
    # the first ones are evicted to the tier, and the first comes back from it.
    prompts = [[3 + (7 * i + j) % 400 for j in range(200)] for i in range(9)]
    for p in prompts + prompts[:1]:
        _complete_ids(srv, p)
    offload_dir = Path(srv.engine.client.config.kv_offload_dir)
    _wait("tier entries", lambda: len(list(offload_dir.rglob("*.kvb"))) >= 24, timeout=30)
    for path in offload_dir.rglob("*.kvb"):  # a payload bit of every entry: all rejected
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x10
        path.write_bytes(bytes(data))
    _complete_ids(srv, prompts[1])  # evicted earlier: its first entry fails its checksum

    def agreeing():
        state = srv.state()
        t = state["tiers"]
        disk = t["tiers"]["disk"]
        metrics = (
            _tier_metric(srv, "kv_tier_hits_total"),
            _tier_metric(srv, "kv_tier_stores_total"),
            _tier_metric(srv, "kv_tier_bytes"),
            _tier_metric(srv, "kv_tier_rejected_total", 'reason="checksum",tier="disk"'),
        )
        shown = (disk["hits"], disk["stores"], disk["bytes"], disk["rejected"].get("checksum", 0))
        return (t, disk) if shown == metrics and srv.state()["tiers"] == t else None

    t, disk = _wait("the state and /metrics to agree", agreeing, timeout=30, every=0.5)
    assert disk["hits"] >= 11 and disk["stores"] >= 24 and disk["bytes"] > 0
    assert disk["rejected"]["checksum"] >= 1 and disk["errors"] == 0
    assert t["loads"] == disk["hits"] and t["misses"] >= 1


def _start_load(srv: _Server, n: int, max_tokens: int) -> list[threading.Thread]:
    """``n`` streaming requests that run ``max_tokens`` tokens each (ignore_eos)."""

    def run(i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": "Paged attention stores keys and values in blocks. " * (i + 1),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json=body, headers=AUTH, timeout=120
        ) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _poll(cond, timeout: float, every: float = 0.1):
    """The first truthy ``cond()`` within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    return None


def _wait(what: str, cond, timeout: float = 15.0, every: float = 0.1):
    value = _poll(cond, timeout, every)
    if value is None:
        raise AssertionError(f"timed out waiting for {what}")
    return value


def _browser():
    """A headless Chromium driven by selenium, or a skip (a failure where required)."""
    required = os.environ.get("PAGEWARDEN_BROWSER_TESTS") == "required"
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if webdriver is None or not chromium or not driver:
        why = (
            "needs selenium (pip, the test extra) and Debian's chromium + chromium-driver "
            "(apt-get install -y chromium chromium-driver; .ci/run installs them)"
        )
        if required:
            pytest.fail(why)
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def _cells(browser, selector: str = "") -> int:
    return browser.execute_script(
        "return document.querySelectorAll(arguments[0]).length", f"#blockmap .cell{selector}"
    )


def test_dashboard_in_chromium(srv):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser = _browser()
    try:
        browser.get(srv.url + f"/dashboard?key={KEY}")  # sets the cookie the polls carry
        # The block map: one cell per block of the pool.
        _wait("the block map", lambda: _cells(browser) == srv.engine.info.num_blocks)
        assert _cells(browser) == NUM_BLOCKS

        threads = _start_load(srv, n=4, max_tokens=180)
        _wait("blocks in use", lambda: srv.metric("kv_blocks_used") > 0, every=0.02)
        _used_cells_match_metrics(srv, browser)

        # A fault: it appears in the events list and its block is marked quarantined.
        # Sent while the loop is paused with requests running, so the first step after
        # the pause has a written slot to corrupt.
        srv.post("/debug/faults", {"kind": "tag_corruption"})
        row = _wait(
            "the integrity event",
            lambda: browser.find_elements(By.CSS_SELECTOR, "#events tr.event"),
        )[0]
        cols = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
        assert cols[2] == "slot_tag" and cols[3] == "read", cols
        block = int(cols[4].split(",")[0])
        assert srv.state()["snapshot"]["quarantines"][str(block)] >= 1
        cell = _wait(
            f"block {block} marked quarantined",
            lambda: browser.find_elements(
                By.CSS_SELECTOR, f'#blockmap .cell.faulted[data-i="{block}"]'
            ),
        )[0]
        ActionChains(browser).move_to_element(cell).perform()
        tip = browser.find_element(By.ID, "tooltip").text
        assert f"block {block}" in tip and "quarantined" in tip, tip

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        for t in threads:
            t.join(60)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()


_PAGE_STEP = "return document.getElementById('blockmap').dataset.step"
_SUMMARY_STEP = "return document.getElementById('kv-summary').dataset.step"
_SUMMARY_USED = "return document.getElementById('kv-summary').dataset.used"


def _used_cells_match_metrics(srv: _Server, browser) -> None:
    """While requests run, hold the step loop still and compare the page's used cells
    (used + shared) and its summary's used count with ``pagewarden:kv_blocks_used``: one
    unchanging state for all three.
    Returns with the step loop still paused (for at least a second)."""
    for _ in range(3):
        end = time.monotonic() + PAUSE_S
        srv.post("/debug/pause", {"seconds": PAUSE_S})
        time.sleep(0.3)  # the pause starts between two steps
        step = srv.state()["kv"]["step"]
        used = srv.metric("kv_blocks_used")
        seen = _poll(
            lambda s=str(step): (
                browser.execute_script(_PAGE_STEP) == s
                and browser.execute_script(_SUMMARY_STEP) == s
            ),
            timeout=3.0,
        )
        cells = _cells(browser, ".used") + _cells(browser, ".shared")
        summary = browser.execute_script(_SUMMARY_USED)
        meta = browser.find_element("id", "meta").text
        still = srv.state()["kv"]["step"] == step and srv.metric("kv_blocks_used") == used
        if seen and still and end - time.monotonic() > 1.0:
            assert used > 0 and cells == used, (cells, used)
            # The summary's count is the engine stats /metrics exports, and says its
            # step; the map's caption says which step it shows and how old it is.
            assert summary == str(int(used)), (summary, used)
            assert f"block map of step {step} " in meta and " s old" in meta, meta
            return
        time.sleep(max(end - time.monotonic(), 0.0))
    raise AssertionError("the step loop never held still long enough to compare")


# ---- tenants (issue 35 item 4): a key sees only its own requests ---------------------

TENANTS = {"tenant-a": "key-a", "tenant-b": "key-b"}
ADMIN = "admin-key"


def _tenant_load(url: str, tenant: str, n: int) -> list[threading.Thread]:
    """``n`` long streams from ``tenant``'s key, their request ids starting with its name."""

    def run(i: int) -> None:
        headers = {"Authorization": f"Bearer {TENANTS[tenant]}", "X-Request-Id": f"{tenant}-{i}"}
        body = {"model": "tiny", "prompt": "blocks " * 8, "max_tokens": 200, "ignore_eos": True}
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json=body | {"stream": True},
            headers=headers,
            timeout=120,
        ) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _visible_owners(url: str, key: str) -> set[str]:
    """Whose requests the state shows to ``key`` (by request id), checking that no other
    part of the snapshot names a request the list does not, and no salt is sent."""
    r = httpx.get(url + "/dashboard/state", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200, r.text
    snap = r.json()["snapshot"]
    if snap is None:
        return set()
    ids = {req["id"] for req in snap["requests"]}
    assert all("tenant" not in req for req in snap["requests"])
    held = {i for holders in snap["holders"].values() for i in holders}
    assert held <= ids | {i for i in held if not i.startswith("cmpl-tenant")}
    return {t for t in TENANTS if any(f"-{t}-" in i for i in ids | held)}


def test_a_tenant_key_sees_only_its_own_requests_the_admin_key_all(tiny_llama_dir):
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=NUM_BLOCKS,
        block_size=16,
        max_model_len=256,
        max_num_seqs=2,  # the rest wait: listed in the snapshot all the same
    )
    srv = _Running(AsyncEngine(cfg), api_key=list(TENANTS.values()), admin=AdminPolicy([ADMIN]))
    try:
        threads = _tenant_load(srv.url, "tenant-a", 3) + _tenant_load(srv.url, "tenant-b", 3)
        seen: dict[str, set[str]] = {"admin": set(), "tenant-a": set(), "tenant-b": set()}

        def both_seen() -> bool:
            seen["admin"] |= _visible_owners(srv.url, ADMIN)
            for tenant, key in TENANTS.items():
                owners = _visible_owners(srv.url, key)
                assert owners <= {tenant}, f"{tenant}'s key sees {owners}"
                seen[tenant] |= owners
            return all(seen.values()) and seen["admin"] == set(TENANTS)

        _wait("each key's view of the running requests", both_seen, timeout=60, every=0.3)
        # A tenant's session cookie carries the same view as its key.
        page = httpx.get(srv.url + "/dashboard?key=key-a")
        cookie = page.cookies.get("pagewarden_dashboard_session")
        assert cookie and "key-a" not in cookie
        admin_page = httpx.get(srv.url + f"/dashboard?key={ADMIN}")
        assert admin_page.status_code == 200
        for t in threads:
            t.join(120)
    finally:
        srv.stop()
