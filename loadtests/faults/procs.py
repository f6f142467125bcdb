"""Real processes for fault runs: ``kvlb emulate`` replicas and ``kvlb serve`` (I/O).

Every child gets fixed ports chosen up front, so a killed replica can be started again on the same
ports (as an orchestrator would restart it). Each start is a :mod:`loadtests.fleet.child_process`
child, stopped by PID only (SIGCONT, SIGTERM, then SIGKILL after a bounded wait); stderr goes to a
file under the run's directory for post-mortems. Used by the soak mode of ``kvlb loadtest`` and by
``tests/faults``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtests.fleet import child_process
from replicas.sim.ports import free_port_run

START_TIMEOUT_S = 40.0
"""How long a replica or kvlb may take to print its JSON line."""
MODEL = "sim-test"
BLOCK_SIZE = 4


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free right now on 127.0.0.1 (the kernel picks them)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class Child:
    """A restartable child: ``python -m balancer <args>`` with its stderr appended to ``stderr``
    across starts. Each :meth:`start` runs a fresh :class:`loadtests.fleet.child_process.Child`
    (``running``); on top of it the fault rig's own needs: signals, SIGKILL, RSS and fds."""

    name: str
    args: list[str]
    stderr: Path
    running: child_process.Child | None = None
    """The process of the last start (``None``: never started)."""

    @property
    def info(self) -> dict[str, Any]:
        """The JSON line the last start announced."""
        return {} if self.running is None else self.running.info

    @property
    def pid(self) -> int:
        if self.running is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.running.pid

    @property
    def alive(self) -> bool:
        return self.running is not None and self.running.alive

    def log_tail(self, lines: int = 40) -> str:
        return child_process.log_tail(self.stderr, lines)

    async def start(self, ready_key: str) -> None:
        """Start a fresh process and wait (bounded) for its JSON line holding ``"ready_key"``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLB_")}  # only the config file
        argv = child_process.python_module("balancer", *self.args)
        self.running = await child_process.spawn(
            self.name, argv, self.stderr, ready_key=ready_key, timeout_s=START_TIMEOUT_S, env=env, append=True
        )

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` unless the child is gone. asyncio's child watcher reaps an exited child on
        its own thread and tells the event loop later, so a child can look alive here after its
        PID is gone: that is not an error."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def kill(self) -> None:
        """SIGKILL: no graceful close of anything."""
        if self.running is not None and self.alive:
            self.running.process.kill()
            await self.running.process.wait()

    async def stop(self) -> None:
        """SIGCONT (a stopped child cannot handle SIGTERM), then the shared stop."""
        if self.running is None or not self.alive:
            return
        self.signal(signal.SIGCONT)
        await self.running.stop()

    def rss_bytes(self) -> int:
        """Resident set size from /proc (0 when the process is gone)."""
        try:
            fields = Path(f"/proc/{self.pid}/statm").read_text().split()
        except (OSError, RuntimeError):
            return 0
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")

    def fd_count(self) -> int:
        """Open file descriptors: entries of /proc/<pid>/fd (0 when the process is gone)."""
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except (OSError, RuntimeError):
            return 0


@dataclass
class Sim(Child):
    engine: str = "sglang"
    http_port: int = 0
    event_port: int = 0
    replay_via: int | None = None
    """The port kvlb reaches the replay socket on (a proxy in front of it); ``None``: its own."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def replay_port(self) -> int:
        """The replay socket of an SGLang replica (one DP rank)."""
        return self.event_port + 1

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "id": self.name,
            "url": self.url,
            "engine": self.engine,
            "block_size": BLOCK_SIZE,
        }
        if self.engine == "sglang":
            entry["events"] = f"tcp://127.0.0.1:{self.event_port}"
            entry["replay"] = f"tcp://127.0.0.1:{self.replay_via or self.replay_port}"
        return entry


def sim(name: str, engine: str, tmp: Path, *extra: str, time_scale: float = 1.0) -> Sim:
    # Ports below the kernel's ephemeral range: a port the kernel handed out and took back (bind to
    # port 0) is the next outgoing connection's, and the emulator binds only later.
    http_port, event_port = free_port_run("127.0.0.1", 1), free_port_run("127.0.0.1", 2)
    args = [
        "emulate", "--replicas", "1", "--engine", engine, "--profile", "cpu-test",
        "--page-size", str(BLOCK_SIZE), "--time-scale", str(time_scale), "--tokenizer", "none",
        "--base-port", str(http_port),
        "--event-port-base", str(event_port), "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    return Sim(name, args, tmp / f"{name}.stderr", engine=engine, http_port=http_port, event_port=event_port)


def write_config(tmp: Path, sims: list[Sim], name: str = "kvlb", **top: Any) -> Path:
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": [s.entry() for s in sims]}],
        "policy": {"seed": 3},
        "health_interval_s": 0.25,
        "scrape_interval_s": 0.5,
        **top,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def serve(tmp: Path, config: Path, name: str = "kvlb") -> Child:
    # One process per fleet member: the scenarios kill, pause and restart kvlb processes and read
    # their ports; a --workers supervisor is tested on its own (tests/e2e/test_serve_workers.py).
    args = [
        "serve",
        "--config",
        str(config),
        "--shutdown-grace-s",
        "2",
        "--log-level",
        "INFO",
        "--workers",
        "1",
    ]
    return Child(name, args, tmp / f"{name}.stderr")
