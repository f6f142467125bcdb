"""The supervisor's record of its workers (``kvlb serve --workers N``): restarts and crash loops (I/O:
one small file in the supervisor's run dir).

The supervisor owns each worker's restart count, so a worker that dies before it serves is counted
too. It rewrites ``<run dir>/workers.json`` (atomically: write, then rename) at every exit and every
announcement; a worker reads it when asked for ``/metrics`` or ``/readyz``, so the workers that
serve report the ones that cannot (:func:`crash_loop_reasons`, and the restart count of a worker that
did not answer a gathered ``/metrics``). The file holds a few numbers per worker: bounded by
``--workers``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from balancer import strict_json

RECORD_FILE = "workers.json"
"""The record's name in the run dir."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """Per worker (by index): its restarts, and how many times in a row it exited before it
    announced itself."""

    restarts: tuple[int, ...]
    """Times the supervisor restarted each worker (``kvlb_process_restarts_total``)."""
    failed_starts: tuple[int, ...]
    """Exits in a row before the worker announced itself (0 once it serves)."""
    crash_loop_after: int
    """Failed starts in a row from which a worker counts as in a crash loop (the supervisor's
    ``give_up_after_failed_starts``)."""

    def crash_looping(self) -> list[int]:
        """The workers in a crash loop, by index."""
        return [index for index, failed in enumerate(self.failed_starts) if failed >= self.crash_loop_after]

    def to_json(self) -> str:
        return strict_json.dumps(
            {
                "restarts": list(self.restarts),
                "failed_starts": list(self.failed_starts),
                "crash_loop_after": self.crash_loop_after,
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
            int(view["crash_loop_after"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def crash_loop_reasons(record: WorkerRecord | None) -> list[str]:
    """What ``/readyz`` says (``degraded``) while a worker cannot start and the others serve."""
    if record is None:
        return []
    return [
        f"worker {index} is in a crash loop: it exited {record.failed_starts[index]} times in a row "
        f"before serving ({record.restarts[index]} restarts); the other workers serve"
        for index in record.crash_looping()
    ]
