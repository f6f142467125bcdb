"""Shared fixtures. The Redis section: one private ``redis-server`` per session (tests/redis_server.py)
and, for the tests that ask for it, one private 3 + 3 Redis Cluster (tests/redis_cluster.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

# tests/ is on sys.path (rootdir conftest, no __init__.py), so helper modules import by name.
from redis_cluster import RedisClusterProcs, RedisTarget, shared_cluster, started_cluster, stop_shared_cluster
from redis_server import RedisServer, shared_server, started_server, stop_shared_server

# ------------------------------------------------------------------------------ make faults only


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "faults_long: long runs of `make faults` (fault scenarios, the alert walks); skipped otherwise",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``faults_long`` run only when ``-m`` names the mark (``make faults``)."""
    if "faults_long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="long run: make faults (pytest -m faults_long)")
    for item in items:
        if "faults_long" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------------------- the session's heap


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The session's heap so far frozen (``gc.freeze``) while the test runs, then given back
    (``gc.unfreeze``): a ``gc.collect()`` in the test, or in a tool it runs in this process, walks
    only what the test made. In a full run the heap left by some 3,000 tests made each collection
    cost seconds (``docs/testing.md``). ``tracemalloc`` counts only what it traced, so no figure a
    test measures changes; the frozen objects are still freed by reference counting, and their
    cycles at the next collection after the test."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private ``redis-server`` on a free port (skips when the binary is missing)."""
    yield shared_server()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    """A private Redis Cluster (3 masters, 3 replicas) on free ports; tests must not kill its nodes
    (a failover test starts its own with :func:`redis_cluster.start_cluster`)."""
    yield shared_cluster()


@pytest.fixture(params=["server", "cluster"])
def redis_target(request: pytest.FixtureRequest) -> RedisTarget:
    """The test runs twice: on the session's single ``redis-server`` and on the session's cluster."""
    if request.param == "server":
        return RedisTarget("server", shared_server().url)
    cluster = shared_cluster()
    return RedisTarget("cluster", cluster.url, cluster)


@pytest.fixture(scope="session", autouse=True)
def _stop_redis_server_at_exit() -> Iterator[None]:
    yield
    stop_shared_server()
    stop_shared_cluster()


@pytest.fixture(autouse=True)
def _flush_redis_after_test() -> Iterator[None]:
    """Empty the session's server (and cluster) after each test once they were started."""
    yield
    server = started_server()
    if server is not None and server.process.poll() is None:
        server.flushall()
    cluster = started_cluster()
    if cluster is not None and all(node.alive for node in cluster.nodes):
        cluster.flush()
