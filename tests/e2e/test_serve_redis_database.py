"""``kvlb serve`` with a ``redis.url`` naming a database the server does not have: one line naming
the setting, the database and how many the server has, exit 2 (as every start-up configuration
error), with one worker and with two. A real ``redis-server --databases 4`` on a free port.

Until 2026-12-01 (h-smallfollow) the balancer started and found it at run time only: ``DB index is
out of range`` logged once per component, the mirrors never warm, ``/readyz`` not ready.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from redis_server import RedisServer, start_server

COMMAND_TIMEOUT_S = 60.0
"""``kvlb serve`` stops well within this (before any worker or tokenizer: 1-3 s on a loaded machine)."""

pytestmark = pytest.mark.redis


@pytest.fixture
def four_databases() -> Iterator[RedisServer]:
    server = start_server(extra_args=["--databases", "4"])
    try:
        yield server
    finally:
        server.stop()


def _serve(url: str, workers: int) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVLB_")}
    argv = ["serve", "--workers", str(workers), "--set", "listen.port=0", "--set", f"redis.url={url}"]
    return subprocess.run(
        [sys.executable, "-m", "balancer", *argv],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env=env,
        check=False,
    )


def _said(stderr: str) -> list[str]:
    """The lines ``kvlb serve`` wrote itself (not its log lines, which carry a timestamp)."""
    return [line for line in stderr.splitlines() if line.startswith("kvlb serve:")]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_database_the_server_does_not_have_stops_the_start(
    four_databases: RedisServer, workers: int
) -> None:
    done = _serve(f"redis://127.0.0.1:{four_databases.port}/9", workers)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert _said(done.stderr) == [
        "kvlb serve: redis.url: database 9 is not on the server (DB index is out of range): "
        "the server has 4 (0..3; its `databases` setting)"
    ], done.stderr


def test_the_server_s_count_unread_is_said_so(four_databases: RedisServer) -> None:
    """A user without ``CONFIG`` (a managed service's): the line says the count could not be read,
    and never shows the password."""
    with redis.Redis(host="127.0.0.1", port=four_databases.port) as admin:
        rules = ("on", ">s3cret", "~kvlb:*", "&kvlb:*", "+@all", "-config")
        admin.execute_command("ACL", "SETUSER", "kvlb", *rules)
    done = _serve(f"redis://kvlb:s3cret@127.0.0.1:{four_databases.port}/4", 1)
    assert done.returncode == 2, done.stderr
    assert _said(done.stderr) == [
        "kvlb serve: redis.url: database 4 is not on the server (DB index is out of range): how many "
        "the server has could not be read (CONFIG GET databases refused)"
    ], done.stderr
    assert "s3cret" not in done.stderr
