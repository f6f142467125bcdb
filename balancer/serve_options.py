"""Process-level options of one ``kvlb serve`` process (pure data, no I/O).

Kept apart from :mod:`balancer.app` so that the command line (:mod:`balancer.cli.command`) can parse
its arguments and decide whether to re-execute itself on jemalloc without importing the service
(see that module's docstring).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Process-level options of ``kvlb serve`` that are not part of the shared settings."""

    shutdown_grace_s: float = 30.0
    """After SIGTERM, in-flight requests get this long (seconds) to finish; the rest are cancelled
    (their load released, their upstream connections closed)."""
    worker: WorkerRole | None = None
    """Set when this process is one of ``kvlb serve --workers N`` (:mod:`balancer.cli.workers`)."""
    wall_clock: Callable[[], float] = time.time
    """This process's wall clock, Unix seconds (``ServiceState.wall_clock``: the times it shows and
    stamps; a test gives two balancers skewed clocks). The fleet's shared times are Redis's ``TIME``."""


@dataclass(frozen=True, slots=True)
class WorkerRole:
    """This balancer's place among the workers of one ``kvlb serve --workers N``."""

    index: int
    """0 … ``count - 1``; worker 0 drains the TRT-LLM engines and republishes their events."""
    count: int
    """How many workers serve the port (≥ 1)."""
    listen_fd: int
    """The supervisor's listening HTTP socket, inherited: served instead of binding ``listen.port``."""
    run_dir: str
    """The supervisor's private directory: the ``ipc://`` endpoints of the TRT-LLM relay live here."""
    load_table: str | None = None
    """The supervisor's shared-memory table of per-replica load (:mod:`balancer.load.share`);
    ``None``: each worker's load view is its own."""
    restarts: int = 0
    """Times the supervisor restarted this worker before this process (``kvlb_process_restarts_total``)."""
    supervisor_pid: int | None = None
    """The supervisor's process id: a worker whose parent is another process (its supervisor died)
    stops. ``None``: the parent found when the worker starts serving."""

    @property
    def drains(self) -> bool:
        """Whether this worker drains TRT-LLM engines itself (worker 0) rather than follow the relay."""
        return self.index == 0
