"""Shared fixtures. The Redis section: one private ``redis-server`` per session (tests/redis_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# tests/ is on sys.path (rootdir conftest, no __init__.py), so helper modules import by name.
from redis_server import RedisServer, shared_server, started_server, stop_shared_server

# ---------------------------------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private ``redis-server`` on a free port (skips when the binary is missing)."""
    yield shared_server()


@pytest.fixture(scope="session", autouse=True)
def _stop_redis_server_at_exit() -> Iterator[None]:
    yield
    stop_shared_server()


@pytest.fixture(autouse=True)
def _flush_redis_after_test() -> Iterator[None]:
    """Empty the session's server after each test that started or used it."""
    yield
    server = started_server()
    if server is not None and server.process.poll() is None:
        server.flushall()
