"""A private Redis Cluster for tests: 3 masters, 3 replicas, on 127.0.0.1 (I/O: six subprocesses).

``start_cluster`` starts six ``redis-server --cluster-enabled yes`` on free ports (each with its own
directory under ``data_dir``), joins them with ``redis-cli --cluster create ... --cluster-replicas 1``
and waits until every node reports ``cluster_state:ok`` and the same slot table. Nodes are stopped
by PID (:meth:`RedisClusterProcs.stop`; ``atexit`` as a backstop for the session's cluster). Never
touches a server on 6379. Tests are skipped, not failed, when ``redis-server`` or ``redis-cli`` is
missing.

The cluster is tuned for fast failover (``cluster-node-timeout`` 1 s, any replica may be promoted);
:meth:`RedisClusterProcs.kill_master_of` SIGKILLs the master serving a key and
:meth:`RedisClusterProcs.wait_promoted` waits until its replica serves the slot.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from procs_free import free_port
from redis.crc import key_slot

from balancer.index.redis.client import RedisClient, connect

NODE_TIMEOUT_MS = 1000
"""``cluster-node-timeout``: a master unreachable this long is flagged as failing (PFAIL → FAIL)."""
_START_TIMEOUT_S = 30.0
_POLL_S = 0.05


@dataclass
class Node:
    """One ``redis-server`` of the cluster."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, decode_responses=True)

    def answers(self) -> bool:
        if not self.alive:
            return False
        with self.client() as client:
            return bool(client.ping())


@dataclass
class RedisClusterProcs:
    """A running 3-master, 3-replica cluster."""

    nodes: list[Node]
    data_dir: Path
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """A seed node's URL (the client discovers the others); ``redis.cluster: true`` with it."""
        return f"redis://127.0.0.1:{self.seed().port}/0"

    def seed(self) -> Node:
        return next(node for node in self.nodes if node.alive)

    def slots(self) -> list[tuple[int, int, int]]:
        """``(first slot, last slot, master port)`` per range, as a live node sees it."""
        with self.seed().client() as client:
            ranges = client.execute_command("CLUSTER", "SLOTS")
        return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in ranges)

    def master_port(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        slot = key_slot(key.encode())
        return next(port for first, last, port in self.slots() if first <= slot <= last)

    def node(self, port: int) -> Node:
        return next(node for node in self.nodes if node.port == port)

    def kill_master_of(self, key: str) -> Node:
        """SIGKILL the master serving ``key`` (no save, no goodbye); returns it."""
        node = self.node(self.master_port(key))
        node.process.kill()
        node.process.wait(timeout=5)
        return node

    def wait_promoted(self, key: str, old_port: int, timeout_s: float = 15.0) -> int:
        """Wait until a live master other than ``old_port`` serves ``key`` and the cluster is ok on
        every live node; returns the new master's port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                port = self.master_port(key)
                if port != old_port and self.node(port).alive and self._all_ok():
                    return port
            except (redis.RedisError, OSError, StopIteration):
                pass
            time.sleep(_POLL_S)
        raise RuntimeError(f"no replica promoted for {key!r} within {timeout_s} s")

    def _all_ok(self) -> bool:
        for node in self.nodes:
            if not node.alive:
                continue
            with node.client() as client:
                if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
        return True

    def flush(self) -> None:
        """Empty every master (tests mostly use fresh key names anyway)."""
        ports = {port for _, _, port in self.slots()}
        for port in ports:
            with self.node(port).client() as client:
                client.flushall()

    def stop(self) -> None:
        """Stop every node by PID (SIGTERM, then SIGKILL after 5 s) and remove the data directory."""
        for node in self.nodes:
            if node.alive:
                node.process.terminate()
        for node in self.nodes:
            try:
                node.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.skip("redis-server or redis-cli not found (make redis)")
    return server, cli


def _start_node(binary: str, port: int, directory: Path) -> Node:
    directory.mkdir(parents=True, exist_ok=True)
    argv = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--dir", str(directory),
        "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-replica-validity-factor", "0",
        "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1",
    ]  # fmt: skip
    with open(directory / "redis.log", "wb") as log:  # the child keeps its own descriptor
        return Node(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), port)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_answering_node(binary: str, data_dir: Path, taken: set[int], attempts: int = 5) -> Node:
    """A node on a free port whose cluster-bus port (+10000) is free too, answering PING. A port can
    be taken between the check and the server's bind (by another test's process), and redis-server
    then exits: that node is started again on another port, ``attempts`` times at most (a drawn
    port whose bus port is out of range or taken is drawn again, 100 draws at most, and is no
    attempt). The error quotes the last node's own log."""
    started: list[Path] = []
    for _ in range(100):
        if len(started) == attempts:
            break
        port = free_port()
        if port in taken or port + 10000 >= 65536 or not _bindable(port + 10000):
            continue
        started.append(data_dir / str(port))
        node = _start_node(binary, port, started[-1])
        deadline = time.monotonic() + 10.0
        while node.alive and time.monotonic() < deadline:
            try:
                if node.answers():
                    return node
            except (redis.RedisError, OSError):
                pass
            time.sleep(_POLL_S)
        if node.alive:
            node.process.kill()
        node.process.wait(timeout=5)
    log = (started[-1] / "redis.log").read_text(errors="replace")[-2000:] if started else "no port drawn"
    raise RuntimeError(f"redis cluster: no node answered PING in {len(started)} attempts; last log: {log}")


def _wait(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(_POLL_S)
    raise RuntimeError(f"redis cluster: {what} not within {timeout_s} s")


def start_cluster(data_dir: Path | None = None) -> RedisClusterProcs:
    """Start and join six nodes; ``pytest.skip`` if a binary is missing. Without ``data_dir`` a
    temporary directory is used (removed by :meth:`RedisClusterProcs.stop`)."""
    server, cli = _binaries()
    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvlb-cluster-")
        data_dir = Path(tmp.name)
    nodes: list[Node] = []
    procs = RedisClusterProcs(nodes, data_dir, tmp)
    try:
        for _ in range(6):
            nodes.append(_start_answering_node(server, data_dir, {node.port for node in nodes}))
        ports = [node.port for node in nodes]
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        create += ["--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, timeout=_START_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout!r} {done.stderr!r}")

        def settled() -> bool:
            tables = set()
            for node in nodes:
                with node.client() as client:
                    if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                        return False
                    ranges = client.execute_command("CLUSTER", "SLOTS")
                    tables.add(tuple(sorted((int(r[0]), int(r[1]), int(r[2][1]), len(r)) for r in ranges)))
            if len(tables) != 1:  # every node agrees, and every master has its replica listed
                return False
            (table,) = tables
            return len(table) == 3 and all(size == 4 for *_, size in table)

        _wait("every node ok with the same slot table", settled, _START_TIMEOUT_S)
        return procs
    except BaseException:
        procs.stop()
        raise


class _Shared:
    """The session's cluster, started lazily; tests that kill nodes start their own."""

    cluster: RedisClusterProcs | None = None

    @classmethod
    def get(cls) -> RedisClusterProcs:
        if cls.cluster is None or not all(node.alive for node in cls.cluster.nodes):
            if cls.cluster is not None:
                cls.cluster.stop()
            cls.cluster = start_cluster()
            atexit.register(cls.cluster.stop)
        return cls.cluster

    @classmethod
    def stop(cls) -> None:
        if cls.cluster is not None:
            cls.cluster.stop()
            cls.cluster = None


def shared_cluster() -> RedisClusterProcs:
    """The session's cluster (started on first call)."""
    return _Shared.get()


def started_cluster() -> RedisClusterProcs | None:
    return _Shared.cluster


def stop_shared_cluster() -> None:
    _Shared.stop()


@dataclass(frozen=True)
class RedisTarget:
    """Where a parametrized Redis test runs: the session's single server or the session's cluster."""

    name: str
    """``server`` or ``cluster`` (the test id)."""
    url: str
    cluster: RedisClusterProcs | None = None

    @property
    def is_cluster(self) -> bool:
        return self.cluster is not None

    def client(self, *, decode: bool) -> RedisClient:
        """A fresh client of the right kind (the caller closes it)."""
        return connect(self.url, cluster=self.is_cluster, decode=decode, socket_timeout_s=5)

    def overrides(self) -> dict[str, Any]:
        """kvlb settings (``settings_for`` style) that point a balancer at this target."""
        return {"redis__url": self.url, "redis__cluster": self.is_cluster}
