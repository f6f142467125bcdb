"""The web console's security (balancer/api/webui.py, middleware.check_origin) and its series
endpoint, against a real balancer in front of emulated replicas.

* ``/admin/*`` needs the admin token, including the endpoints the console reads
  (``/admin/series``); the token is never taken from the query string, only from the header.
* ``/ui`` answers carry the CSP, ``nosniff``, ``no-referrer`` and ``no-cache``; the shipped HTML has
  no inline script, inline style, ``style=`` attribute or ``on*=`` handler (parsed, not grepped).
* An admin write whose ``Origin`` is another origin is refused (403) and changes nothing; the same
  origin, and no ``Origin`` at all (``curl``, ``kvlb admin``), are accepted.
* ``GET /admin/policy`` lists every weight's documented range and the policy names.
* ``GET /admin/series`` reports what dispatch measured for real requests.
"""

from __future__ import annotations

import fnmatch
import tomllib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from kvlb_harness import MODEL, Harness, running, shared_deepseek

from balancer.api.webui import CONTENT_SECURITY_POLICY
from balancer.console import STATIC_FILES, read_static
from balancer.policy import POLICY_NAMES
from balancer.policy.base import WEIGHT_RANGES
from balancer.tokenizer.tokenizer import Tokenizer

ADMIN = "console-admin-1"


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


class _Inline(HTMLParser):
    """Collects every place an HTML document could run or style inline."""

    def __init__(self) -> None:
        super().__init__()
        self.findings: list[str] = []
        self.scripts: list[dict[str, str | None]] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        for name, _ in attrs:
            if name.startswith("on"):
                self.findings.append(f"<{tag} {name}=>")
            if name == "style":
                self.findings.append(f"<{tag} style=>")
        if tag == "style":
            self.findings.append("<style>")
        if tag == "script":
            self.scripts.append(named)
            if not named.get("src"):
                self.findings.append("<script> without src")
        if tag in ("a", "iframe", "form") and any((v or "").startswith("javascript:") for _, v in attrs):
            self.findings.append(f"<{tag}> javascript: URL")
        self._in = tag

    def handle_data(self, data: str) -> None:
        if self._in == "script" and data.strip():
            self.findings.append("inline script text")

    def handle_endtag(self, tag: str) -> None:
        self._in = None


def inline_findings(html: str) -> tuple[list[str], int]:
    parser = _Inline()
    parser.feed(html)
    return parser.findings, len(parser.scripts)


def test_the_inline_check_bites() -> None:
    for bad in (
        "<script>alert(1)</script>",
        '<div style="color:red">x</div>',
        "<style>p{}</style>",
        '<img src=x onerror="alert(1)">',
        '<a href="javascript:alert(1)">x</a>',
    ):
        assert inline_findings(bad)[0], bad
    assert inline_findings('<script src="app.js" defer></script>') == ([], 1)


def test_the_shipped_html_has_no_inline_script_or_style() -> None:
    findings, scripts = inline_findings(read_static("index.html").decode())
    assert findings == [] and scripts == 1
    js = read_static("app.js").decode()
    for risky in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert risky not in js, risky
    assert "localStorage" not in js and "document.cookie" not in js  # sessionStorage only, no cookies


def test_the_static_files_are_package_data() -> None:
    """``pip install`` ships them: pyproject's package-data covers every file the console serves."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["balancer"]
    for name in STATIC_FILES:
        assert any(fnmatch.fnmatch(f"console/static/{name}", p) for p in patterns), name


async def call(
    h: Harness, method: str, path: str, *, token: str | None = ADMIN, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    sent = dict(headers)
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    body = b'{"weights": {"decode_weight": 0.2}}' if method == "PUT" else None
    async with h.session.request(
        method, h.url + path, data=body, headers=sent, allow_redirects=False
    ) as response:
        return response.status, {k.lower(): v for k, v in response.headers.items()}, await response.read()


async def test_console_headers_and_files(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, auth__admin_token=ADMIN) as h:
        status, headers, _ = await call(h, "GET", "/ui", token=None)
        assert status == 308 and headers["location"] == "/ui/"
        for name, content_type in {"": "text/html", **STATIC_FILES}.items():
            status, headers, body = await call(h, "GET", "/ui/" + name, token=None)
            assert status == 200, name
            assert headers["content-type"].startswith(content_type.split(";")[0] if name else "text/html")
            assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert "script-src 'self'" in CONTENT_SECURITY_POLICY
            assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
            assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
            assert headers["x-content-type-options"] == "nosniff"
            assert headers["referrer-policy"] == "no-referrer"
            assert headers["cache-control"] == "no-cache"
            assert body == read_static(name or "index.html")
            etag = {"If-None-Match": headers["etag"]}
            status, _, _ = await call(h, "GET", "/ui/" + name, token=None, **etag)
            assert status == 304
        for name in ("../balancer/app.py", "x.js", "__init__.py", "%2e%2e/app.py"):
            status, headers, _ = await call(h, "GET", "/ui/" + name, token=None)
            assert status == 404, name


async def test_admin_needs_the_header_token_never_a_query_string(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, auth__admin_token=ADMIN) as h:
        console_reads = ("/admin/series", "/admin/decisions", "/admin/decisions/1", "/admin/audit")
        for path in ("/admin/policy", "/admin/replicas", "/admin/fleet", *console_reads):
            assert (await call(h, "GET", path, token=None))[0] == 401, path
            assert (await call(h, "GET", path, token="wrong"))[0] == 401, path
            for query in ("token", "access_token", "admin_token", "authorization"):
                status, _, _ = await call(h, "GET", f"{path}?{query}={ADMIN}", token=None)
                assert status == 401, (path, query)
            assert (await call(h, "GET", path))[0] in (200, 404), path  # decision 1: not made yet
        assert (await call(h, "POST", "/admin/whatif", token=None))[0] == 401
        # the cookie a browser would attach is not a credential either
        status, _, _ = await call(h, "GET", "/admin/policy", token=None, Cookie=f"token={ADMIN}")
        assert status == 401


async def test_cross_origin_admin_writes_are_refused(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, auth__admin_token=ADMIN) as h:
        own = h.url.removeprefix("http://")
        before = (await call(h, "GET", "/admin/policy"))[2]
        for origin in (
            "http://evil.example",
            "null",
            f"http://{own}.evil.example",
            "file://",
            f"ftp://{own}",
        ):
            status, _, body = await call(h, "PUT", "/admin/policy", Origin=origin)
            assert status == 403, (origin, body)
            assert b"another origin" in body
            for path in ("/admin/replicas/r0/drain", "/admin/whatif"):
                status, _, _ = await call(h, "POST", path, Origin=origin)
                assert status == 403, (path, origin)
        assert (await call(h, "GET", "/admin/policy"))[2] == before  # nothing changed
        # reads are not writes: a cross-origin GET still needs the token, and gets nothing without it
        assert (await call(h, "GET", "/admin/policy", token=None, Origin="http://evil.example"))[0] == 401
        status, _, body = await call(h, "PUT", "/admin/policy", Origin=f"http://{own}")
        assert status == 200, body
        status, _, body = await call(h, "PUT", "/admin/policy")  # no Origin: curl, kvlb admin
        assert status == 200, body


async def test_policy_lists_ranges_and_names(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, auth__admin_token=ADMIN) as h:
        policy = await h.admin("GET", "/admin/policy")
        assert policy["policies"] == list(POLICY_NAMES)
        assert set(policy["ranges"]) == set(WEIGHT_RANGES) == set(policy["weights"])
        for name, weight_range in WEIGHT_RANGES.items():
            shown = policy["ranges"][name]
            assert (shown["low"], shown["high"], shown["low_open"]) == (
                weight_range.low,
                weight_range.high,
                weight_range.low_open,
            )
        assert policy["ranges"]["kv_usage_ceiling"]["nullable"] is True
        assert policy["ranges"]["decode_weight"]["nullable"] is False


async def test_series_reports_real_requests(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 2, auth__admin_token=ADMIN) as h:
        prompt = list(range(1, 65))
        await h.warm(prompt)
        for _ in range(5):
            answer = await h.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert answer.status == 200
        series: dict[str, Any] = await h.admin("GET", "/admin/series?minutes=1")
        rows = series["intervals"]
        assert series["interval_s"] == 5.0 and len(rows) == 12
        assert sum(r["requests"] for r in rows) == 6
        assert sum(sum(r["replicas"].values()) for r in rows) == 6
        assert sum(r["ttft_count"] for r in rows) == 6
        busy = [r for r in rows if r["requests"]]
        assert all(r["ttft_p50_s"] > 0 and r["ttft_p90_s"] >= r["ttft_p50_s"] for r in busy)
        # the warm request missed; the 5 repeats were predicted (and reported) mostly cached
        assert sum(r["predicted_cached_tokens"] for r in rows) >= 5 * 60
        assert any(r["reported_hit_rate"] for r in busy)
        for bad in ("0", "-1", "nan", "inf", "x", ""):
            async with h.session.get(
                h.url + "/admin/series?minutes=" + bad, headers={"Authorization": f"Bearer {ADMIN}"}
            ) as response:
                assert response.status == 400, bad
