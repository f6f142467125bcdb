"""A fault run's child that exits on its own while the event loop is busy: signalling it is not an
error (CI once failed a soak with ``[Errno 3] No such process`` from exactly this window)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

from loadtests.faults.procs import Child
from loadtests.fleet import child_process


def _reaped(pid: int) -> bool:
    """True once ``pid`` is gone from the process table (a zombie still has its entry)."""
    return not Path(f"/proc/{pid}").exists()


async def test_signal_to_a_child_reaped_behind_the_loops_back(tmp_path: Path) -> None:
    child = Child("short", [], tmp_path / "short.err")
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    child.running = child_process.Child("short", process, child.stderr)
    # Block the loop (no await) until the watcher thread has reaped the child: the loop has not yet
    # heard of the exit, so the child still looks alive while its PID no longer exists.
    deadline = time.monotonic() + 20.0
    while not _reaped(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # noqa: ASYNC251 - blocking the loop is the point
    assert _reaped(child.pid), "the child did not exit within 20 s"
    assert child.alive
    child.signal(signal.SIGCONT)
    await child.stop()
    assert not child.alive
    assert process.returncode == 0
