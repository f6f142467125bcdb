"""The supervisor's record of its workers (``kvlb serve --workers N``): restarts and crash loops (I/O:
one small file in the supervisor's run dir).

The supervisor owns each worker's restart count, so a worker that dies before it serves is counted
too. It rewrites ``<run dir>/workers.json`` (atomically: write, then rename) at every exit and every
announcement; a worker reads it when asked for ``/metrics`` or ``/readyz``, so the workers that
serve report the ones that cannot or keep dying (:func:`crash_loop_reasons`, and the restart count of
a worker that did not answer a gathered ``/metrics``). The file holds a few numbers per worker and
the times of its newest exits (at most max(64, ``workers.crash_loop_exits``) each): bounded by
``--workers``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from balancer import strict_json
from balancer.config.workers import WorkersConfig
from balancer.worker_restarts import crash_looping, recent_exits

RECORD_FILE = "workers.json"
"""The record's name in the run dir."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """Per worker (by index): its restarts, how many times in a row it exited before it announced
    itself, and the times of its newest exits."""

    restarts: tuple[int, ...]
    """Times the supervisor restarted each worker (``kvlb_process_restarts_total``)."""
    failed_starts: tuple[int, ...]
    """Exits in a row before the worker announced itself (0 once it serves)."""
    crash_loop_exits: int
    """Exits from which a worker counts as in a crash loop (``workers.crash_loop_exits``)."""
    exit_times: tuple[tuple[float, ...], ...] = ()
    """Each worker's newest exits, ``time.monotonic()`` seconds (the same clock in every process of
    the machine); at most :func:`~balancer.worker_restarts.exits_kept` each."""
    restart_window_s: float = 600.0
    """Seconds over which exits count (``workers.restart_window_s``)."""

    def config(self) -> WorkersConfig:
        return WorkersConfig(crash_loop_exits=self.crash_loop_exits, restart_window_s=self.restart_window_s)

    def recent_exits(self, index: int, now: float) -> int:
        """Worker ``index``'s exits within the window before ``now``."""
        times = self.exit_times[index] if index < len(self.exit_times) else ()
        return recent_exits(times, now, self.restart_window_s)

    def crash_looping(self, now: float) -> list[int]:
        """The workers in a crash loop at ``now``, by index."""
        config = self.config()
        return [
            index
            for index, failed in enumerate(self.failed_starts)
            if crash_looping(self.recent_exits(index, now), failed, config)
        ]

    def to_json(self) -> str:
        return strict_json.dumps(
            {
                "restarts": list(self.restarts),
                "failed_starts": list(self.failed_starts),
                "crash_loop_exits": self.crash_loop_exits,
                "exit_times": [list(times) for times in self.exit_times],
                "restart_window_s": self.restart_window_s,
            }
        )


def write_record(run_dir: str, record: WorkerRecord) -> None:
    """Replace the run dir's record (a reader sees the old one or the new one, never half of one)."""
    path = Path(run_dir) / RECORD_FILE
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(record.to_json())
    temporary.replace(path)


def read_record(run_dir: str) -> WorkerRecord | None:
    """The run dir's record; ``None`` when there is none yet or it cannot be read."""
    try:
        view = strict_json.loads((Path(run_dir) / RECORD_FILE).read_bytes())
        return WorkerRecord(
            tuple(int(n) for n in view["restarts"]),
            tuple(int(n) for n in view["failed_starts"]),
            int(view["crash_loop_exits"]),
            tuple(tuple(float(t) for t in times) for times in view["exit_times"]),
            float(view["restart_window_s"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def crash_loop_reasons(record: WorkerRecord | None, now: float) -> list[str]:
    """What ``/readyz`` says (``degraded``) at ``now`` (``time.monotonic()``) while a worker keeps
    dying and the others serve."""
    if record is None:
        return []
    reasons = []
    for index in record.crash_looping(now):
        failed, restarts = record.failed_starts[index], record.restarts[index]
        if failed >= record.crash_loop_exits:
            how = f"it exited {failed} times in a row before serving"
        else:
            recent = record.recent_exits(index, now)
            how = f"it exited {recent} times in the last {record.restart_window_s:g} s"
        reasons.append(
            f"worker {index} is in a crash loop: {how} ({restarts} restarts); the other workers serve"
        )
    return reasons
