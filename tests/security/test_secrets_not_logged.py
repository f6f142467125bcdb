"""Secrets never reach the logs: API keys, the admin token, and credentials a client sends.

A balancer runs with every logger at DEBUG (tracebacks included) while clients use the right and
wrong keys, change the policy, ask for explanations, send oversized and malformed heads carrying the
key, and trigger upstream failures. Then the captured log text is searched for each secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest
from upstream_stub import MODEL, StubRun, balancer_over

API_KEY = "sk-live-7f3a9c1e5b2d4f60"
ADMIN_TOKEN = "adm-4d1c8e2b9a7f6e53"
CLIENT_SECRET = "cookie-secret-91b2c3d4"
SECRETS = (API_KEY, ADMIN_TOKEN, CLIENT_SECRET)
BODY = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1}


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(name="captured")
def captured_fixture() -> Iterator[Capture]:
    """Every log record of the test, formatted, in ``lines`` (the root logger at DEBUG meanwhile)."""
    handler = Capture()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def raw(run: StubRun, data: bytes) -> None:
    host, port = run.balancer.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            await reader.read(65536)
    finally:
        writer.close()


async def test_no_secret_appears_in_any_log_line(captured: Capture) -> None:
    async with balancer_over(1, auth__api_keys=[API_KEY], auth__admin_token=ADMIN_TOKEN) as run:
        url = run.balancer.url
        client = {"Authorization": f"Bearer {API_KEY}", "Cookie": f"s={CLIENT_SECRET}"}
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        session = run.session
        for headers in (client, admin, {"Authorization": f"Bearer {API_KEY}x"}, {}):
            async with session.post(url + "/v1/completions", json=BODY, headers=headers) as response:
                await response.read()
            async with session.get(url + "/admin/replicas", headers=headers) as response:
                await response.read()
        change = {"weights": {"overlap_credit": 0.5}}
        async with session.put(url + "/admin/policy", json=change, headers=admin) as response:
            assert response.status == 200
        async with session.post(url + "/admin/explain", json=BODY, headers=admin) as response:
            assert response.status == 200
        async with session.post(url + "/v1/completions", data=b"{bad", headers=client) as response:
            assert response.status == 400
        padding = "p" * 9000
        await raw(run, f"GET /healthz HTTP/1.1\r\nAuthorization: Bearer {API_KEY}{padding}\r\n\r\n".encode())
        await raw(run, f"GET /healthz HTTP/1.1\r\nCookie: {CLIENT_SECRET}{padding}\r\n\r\n".encode())
        await raw(run, f"GET /v1/models?key={API_KEY}{padding} HTTP/1.1\r\n\r\n".encode())
        await run.replicas[0].stop()  # upstream failures are logged too
        async with session.post(url + "/v1/completions", json=BODY, headers=client) as response:
            await response.read()
    text = "\n".join(captured.lines)
    assert len(captured.lines) > 5, "nothing was logged: the test would prove nothing"
    leaks = [line[:200] for line in captured.lines if any(secret in line for secret in SECRETS)]
    assert not leaks, json.dumps(leaks, indent=1)
    assert "token:" in text  # the policy change is audited with a token fingerprint instead
