"""The load tools' child processes (I/O): one :class:`Child`, :func:`spawn` and :meth:`Child.stop`.

A child is a process started from an argv (:func:`python_module` builds ``python -m <module> ...``)
with its stderr in a file, so a failure can show its tail (:meth:`Child.log_tail`). With a
``ready_key``, :func:`spawn` waits a bounded time for the child to announce itself with one JSON line
on stdout holding that key (``{"kvlb": "serving", "url": ...}`` for ``kvlb serve``, ``{"replicas":
[...]}`` for ``kvlb emulate``); a child that exits or stays silent first is stopped and
:class:`ChildFailed` raised. :meth:`Child.stop` always ends the process, by its own pid (SIGTERM, then
SIGKILL after a bounded wait). :func:`cpu_seconds` reads a process's user + system CPU time from
``/proc`` (Linux).

Used by ``kvlb demo``, ``kvlb bench overhead`` and ``flood``, the load test's fleet and routers
(:mod:`loadtests.fleet.processes`) and the fault rig (:mod:`loadtests.faults.procs`, which adds
restarts, signals and ``/proc`` readings on top).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60.0
"""How long a child may take to print its JSON line by default (it may load a tokenizer first)."""
STOP_TIMEOUT_S = 10.0
"""How long a child may take to exit after SIGTERM before it is killed."""
LOG_TAIL_LINES = 20
"""How many stderr lines a failure shows by default."""
ONE_LINE_TAIL_LINES = 3
"""How many of those :meth:`ChildFailed.one_line` puts on its line."""
ONE_LINE_MAX_CHARS = 400
"""About how long :meth:`ChildFailed.one_line` may be."""
_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ChildFailed(RuntimeError):
    """A child process exited or stayed silent before announcing itself (or could not be started).

    ``str()`` is the reason and the stderr's last :data:`LOG_TAIL_LINES` lines (several lines);
    :meth:`one_line` says the same on one line, for a command's last word."""

    def __init__(
        self,
        name: str,
        pid: int | None,
        reason: str,
        *,
        exit_code: int | None = None,
        stderr_path: Path | None = None,
    ) -> None:
        self.name = name
        self.pid = pid
        """The child's pid (``None``: it could not be started)."""
        self.reason = reason
        self.exit_code = exit_code
        """Its exit code when it exited by itself (``None``: stayed silent and was stopped, or never ran)."""
        self.stderr_path = stderr_path
        self.tail = log_tail(stderr_path) if stderr_path is not None else ""
        """The last :data:`LOG_TAIL_LINES` lines of its stderr, read when it failed."""
        started = f"pid {pid}" if pid is not None else "no process"
        tail = f"\n{self.tail}" if self.tail else ""
        super().__init__(f"{name} did not start ({started}): {reason}{tail}")

    def one_line(self, lines: int = ONE_LINE_TAIL_LINES, max_chars: int = ONE_LINE_MAX_CHARS) -> str:
        """``fleet-0 (pid 12): exited with code 1 before announcing itself; its stderr (PATH) ends:
        LINE | LINE``: the child, why, and its stderr's last ``lines`` non-blank lines, the whole
        cut to about ``max_chars`` characters (the start of the tail goes first)."""
        started = f"pid {self.pid}" if self.pid is not None else "no process"
        text = f"{self.name} ({started}): {self.reason}"
        last = [line.strip() for line in self.tail.splitlines() if line.strip()][-lines:]
        if last:
            where = f" ({self.stderr_path})" if self.stderr_path is not None else ""
            ends = " | ".join(last)
            room = max(40, max_chars - len(text))
            if len(ends) > room:
                ends = "..." + ends[len(ends) - room + 3 :]
            text += f"; its stderr{where} ends: {ends}"
        return text


def python_module(module: str, *args: str) -> list[str]:
    """The argv of ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the file at ``path`` (empty when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Child:
    """A started child process, its stderr file and the JSON it announced (empty without one)."""

    name: str
    process: asyncio.subprocess.Process
    stderr_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Whether the event loop has not yet seen the process exit."""
        return self.process.returncode is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the child's stderr (empty when there is none)."""
        return log_tail(self.stderr_path, lines)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code. Safe to call twice."""
        process = self.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        assert process.returncode is not None
        return process.returncode


async def spawn(
    name: str,
    argv: Sequence[str],
    stderr_path: Path,
    *,
    ready_key: str | None,
    timeout_s: float = START_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    append: bool = False,
) -> Child:
    """Start ``argv`` with stderr to ``stderr_path`` (appended to with ``append``) and environment
    ``env`` (``None``: this process's). With ``ready_key``, wait up to ``timeout_s`` for a JSON stdout
    line holding ``"ready_key"`` (stopping the child and raising :class:`ChildFailed` when none
    comes); without, stdout goes to the stderr file too and nothing is awaited."""
    with stderr_path.open("ab" if append else "wb") as err:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE if ready_key is not None else err,
            stderr=err,
            env=dict(env) if env is not None else None,
        )
    child = Child(name, process, stderr_path)
    if ready_key is None:
        return child
    try:
        child.info = await _read_announcement(process, ready_key, timeout_s)
    except BaseException as exc:
        exited = process.returncode  # before the stop: None when it stayed silent
        await child.stop()
        if isinstance(exc, Exception):
            failed = ChildFailed(name, process.pid, str(exc), exit_code=exited, stderr_path=stderr_path)
            raise failed from None
        raise
    return child


async def _read_announcement(
    process: asyncio.subprocess.Process, ready_key: str, timeout_s: float
) -> dict[str, Any]:
    assert process.stdout is not None
    try:
        async with asyncio.timeout(timeout_s):
            while line := await process.stdout.readline():
                text = line.decode(errors="replace").strip()
                if text.startswith("{") and f'"{ready_key}"' in text:
                    info: dict[str, Any] = json.loads(text)
                    return info
    except TimeoutError:
        raise RuntimeError(f"no announcement within {timeout_s:g} s") from None
    raise RuntimeError(f"exited with code {await process.wait()} before announcing itself")


async def stop_all(children: Sequence[Child]) -> None:
    """Stop every child (in reverse start order); never raises for one that is already gone."""
    for child in reversed(children):
        await child.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (all its threads); Linux only."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, man 5 proc).
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_PER_S


def tree_cpu_seconds(pid: int) -> float:
    """:func:`cpu_seconds` of ``pid`` plus its live children's (``kvlb serve --workers N``: the
    supervisor and its workers); Linux only. A child that exited meanwhile is left out."""
    total = cpu_seconds(pid)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == pid:
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if int(fields[1]) == pid:
                total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_PER_S
        except (OSError, ValueError, IndexError):
            continue
    return total
