"""Helper processes of ``kvlb demo`` and ``kvlb bench overhead`` (I/O).

A :class:`Child` is a ``python -m <module> ...`` process that announces itself with one JSON line on
stdout (``{"kvlb": "serving", "url": ...}`` for ``kvlb serve``, ``{"replicas": [...]}`` for
``kvlb emulate``). :func:`spawn` waits a bounded time for that line; :func:`stop` always ends the process
(SIGTERM, then SIGKILL after a bounded wait). Stderr goes to a file so a failure can show its tail.
:func:`cpu_seconds` reads a process's user + system CPU time from ``/proc`` (Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60.0
"""How long a child may take to print its JSON line (it may load a tokenizer first)."""
STOP_TIMEOUT_S = 10.0
"""How long a child may take to exit after SIGTERM before it is killed."""
_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ChildFailed(RuntimeError):
    """A helper process exited or stayed silent before announcing itself."""


@dataclass
class Child:
    """A started helper process and what it announced."""

    name: str
    process: asyncio.subprocess.Process
    stderr_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the child's stderr (empty when there is none)."""
        try:
            text = self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


async def spawn(
    name: str,
    module: str,
    args: Sequence[str],
    *,
    log_dir: Path,
    ready_key: str,
    timeout_s: float = START_TIMEOUT_S,
) -> Child:
    """Start ``python -m module args`` and wait for a JSON stdout line holding ``ready_key``."""
    stderr_path = log_dir / f"{name}.stderr"
    with stderr_path.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *args, stdout=asyncio.subprocess.PIPE, stderr=err
        )
    child = Child(name, process, stderr_path)
    try:
        child.info = await _read_announcement(process, ready_key, timeout_s)
    except BaseException as exc:
        await stop(child)
        if isinstance(exc, Exception):
            raise ChildFailed(f"{name} did not start: {exc}\n{child.log_tail()}") from None
        raise
    return child


async def _read_announcement(
    process: asyncio.subprocess.Process, ready_key: str, timeout_s: float
) -> dict[str, Any]:
    assert process.stdout is not None
    async with asyncio.timeout(timeout_s):
        while line := await process.stdout.readline():
            text = line.decode(errors="replace").strip()
            if text.startswith("{") and f'"{ready_key}"' in text:
                info: dict[str, Any] = json.loads(text)
                return info
    raise RuntimeError(f"exited with code {await process.wait()} before announcing itself")


async def stop(child: Child, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code. Safe to call twice."""
    process = child.process
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


async def stop_all(children: Sequence[Child]) -> None:
    """Stop every child (in reverse start order); never raises for one that is already gone."""
    for child in reversed(children):
        await stop(child)


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
