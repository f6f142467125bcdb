"""The fleet over ``rediss://`` with AUTH: a private TLS ``redis-server`` with a test CA (openssl).

A balancer whose ``redis.url`` is ``rediss://:password@…`` with ``redis.tls_ca_file`` becomes ready
(its mirror warmed over TLS), ingests through its lease and routes on the blocks that came back
through the stream; a wrong password or no CA is refused.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvlb_harness import MODEL, running, shared_deepseek, wait_for
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError

from balancer.config import RedisConfig
from balancer.fleet.runtime import redis_client

pytestmark = pytest.mark.redis
PASSWORD = "tls-test-secret"


def _run(*argv: str, cwd: Path) -> None:
    subprocess.run(argv, cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    binary, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if binary is None or openssl is None:
        pytest.skip("needs redis-server and openssl")
    d = tmp_path_factory.mktemp("tls")
    _run(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "1", "-subj", "/CN=kvlb-test-ca", cwd=d)  # fmt: skip
    _run(openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
         "-subj", "/CN=127.0.0.1", cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _run(openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
            "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no",
            "--requirepass", PASSWORD]  # fmt: skip
    process = subprocess.Popen(argv, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield port, d / "ca.crt"
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_auth_and_ca_are_required(tls_server: tuple[int, Path]) -> None:
    port, ca = tls_server
    good = redis_client(
        RedisConfig(url=f"rediss://:{PASSWORD}@127.0.0.1:{port}/0", tls_ca_file=str(ca)), decode=True
    )
    assert await good.ping()
    await good.aclose()
    wrong = redis_client(
        RedisConfig(url=f"rediss://:nope@127.0.0.1:{port}/0", tls_ca_file=str(ca)), decode=True
    )
    with pytest.raises((AuthenticationError, ResponseError)):
        await wrong.ping()
    await wrong.aclose()
    untrusted = redis_client(RedisConfig(url=f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"), decode=True)
    with pytest.raises(ConnectionError):  # the system CAs do not know the test CA
        await untrusted.ping()
    await untrusted.aclose()


async def test_a_balancer_runs_its_fleet_over_tls(tls_server: tuple[int, Path]) -> None:
    port, ca = tls_server
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
    async with running(
        shared_deepseek(), redis__url=url, redis__tls_ca_file=str(ca), redis__key_prefix="tls",
        redis__lease_ttl_s=1.5, redis__tick_s=0.25, limits__speculative_ttl_s=0.001,
    ) as h:  # fmt: skip
        prompt = list(range(7000, 7032))  # 8 blocks of the emulator's 4-token pages
        holder = await h.warm(prompt)  # waits until the holder's blocks came back through the stream
        answer = await h.post("/v1/completions", {"model": MODEL, "prompt": [*prompt, 1], "max_tokens": 1})
        assert answer.headers["x-kvlb-replica"] == holder
        assert answer.headers["x-kvlb-cached-tokens"] == "32"

        async def all_leased() -> bool:
            fleet = (await h.admin("GET", "/admin/fleet"))["fleet"]
            return len(fleet["leases"]) == 2 and fleet["redis_up"]

        await wait_for("both leases over TLS", all_leased)
