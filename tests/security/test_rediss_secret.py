"""``rediss://``: the fleet mode over TLS with a password, and the password never shown.

A private ``redis-server`` listens with TLS only (self-signed certificate) and ``requirepass``. A
balancer with ``redis.url: rediss://:<password>@127.0.0.1:<port>/0`` and ``redis.tls_ca_file`` joins
the fleet (it appears in ``/admin/fleet``); one with a wrong password does not get ready. With every
logger at DEBUG, the password appears in no log line, nor in ``/admin/fleet`` or ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from certs import Pem, self_signed
from procs_free import free_port
from test_secrets_not_logged import Capture, captured_fixture  # noqa: F401  (pytest fixture)
from upstream_stub import MODEL, RecordingReplica, balancer_over, stub_settings

from balancer.app import Balancer
from balancer.tokenizer.tokenizer import TokenIdTokenizer

PASSWORD = "r3dis-pass-5e8f1a"
NEVER_READY_S = 2.0
"""How long a balancer with a wrong password or without TLS is watched not getting ready (it was 8 s
until 2026-11-30; with the right password it is ready after about 0.1 s). Readiness waits for every
key space's mirror to be warm, which takes a successful read from Redis: no timer gives up on Redis
and makes it ready later."""

pytestmark = pytest.mark.redis


@contextlib.contextmanager
def tls_redis(tmp: Path, pem: Pem) -> Iterator[int]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (make redis)")
    port = free_port()
    argv = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(pem.cert), "--tls-key-file", str(pem.key),
        "--tls-ca-cert-file", str(pem.cert), "--tls-auth-clients", "no",
        "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp),
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                __import__("socket").create_connection(("127.0.0.1", port), 0.2),
            ):
                break
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


async def gets_ready(url: str, pem: Pem, within_s: float = 1.5) -> bool:
    """Whether a balancer with ``redis.url`` ``url`` answers ``/readyz`` 200 within ``within_s``."""
    replica = RecordingReplica("stub-0")
    await replica.start()
    settings = stub_settings(
        [replica], redis__url=url, redis__tls_ca_file=str(pem.cert), redis__socket_timeout_s=0.5
    )
    balancer = Balancer(settings, tokenizers={MODEL: TokenIdTokenizer()})
    try:
        try:
            await balancer.start()
        except Exception:  # a start that fails is not ready either
            return False
        async with aiohttp.ClientSession() as session:
            deadline = asyncio.get_running_loop().time() + within_s
            while asyncio.get_running_loop().time() < deadline:
                async with session.get(balancer.url + "/readyz") as response:
                    if response.status == 200:
                        return True
                await asyncio.sleep(0.1)
        return False
    finally:
        await balancer.stop()
        await replica.stop()


async def test_the_fleet_over_rediss_with_a_password_that_is_never_shown(
    tmp_path: Path, captured: Capture
) -> None:
    pem = self_signed(tmp_path)
    with tls_redis(tmp_path, pem) as port:
        redis = {
            "redis__url": f"rediss://:{PASSWORD}@127.0.0.1:{port}/0",
            "redis__tls_ca_file": str(pem.cert),
            "redis__instance_id": "tls-member",
            "redis__socket_timeout_s": 2.0,
        }
        async with balancer_over(1, **redis) as run:
            async with run.session.get(run.balancer.url + "/admin/fleet") as response:
                fleet = await response.text()
            assert "tls-member" in fleet and PASSWORD not in fleet
            deadline = time.monotonic() + 10  # kvlb_redis_up is refreshed every fleet tick
            while True:
                async with run.session.get(run.balancer.url + "/metrics") as response:
                    metrics = await response.text()
                assert PASSWORD not in metrics
                if "kvlb_redis_up 1.0" in metrics or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert "kvlb_redis_up 1.0" in metrics
        for url in (
            f"rediss://:wrong-{PASSWORD[:4]}@127.0.0.1:{port}/0",
            f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
        ):
            with pytest.raises((AssertionError, TimeoutError, OSError, Exception)):  # never gets ready
                async with asyncio.timeout(NEVER_READY_S):
                    async with balancer_over(1, redis__url=url, redis__tls_ca_file=str(pem.cert)):
                        pass
    leaks = [line[:200] for line in captured.lines if PASSWORD in line]
    assert not leaks, leaks
