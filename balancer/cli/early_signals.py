"""``kvlb serve``'s signals before its event loop handles them (I/O: process signal state).

``kvlb serve`` installs its SIGTERM/SIGINT handlers on its event loop, after its imports (about a
second) and, for ``allocator: auto`` with jemalloc installed, after re-executing itself. A signal
before then used to end it with the default action (exit 143, killed by SIGTERM; a traceback for
SIGINT). :func:`install` is the first thing ``kvlb serve`` does: until the loop's own handlers replace
these, either signal ends the process with 0 at once (nothing serves yet, nothing is lost).
A tool's command line instead takes SIGINT as ``KeyboardInterrupt`` from the start, even when it
was started with SIGINT ignored (:func:`take_sigint`): :func:`balancer.cli.main.main` makes one that
comes before the tool's own handling (while the tools are imported) one line and exit 130.
SIGHUP is ignored from the start (:data:`NO_RELOAD`): kvlb has no reload, and its default action
killed the supervisor of ``--workers N``, whose workers the kernel then SIGKILLs, cutting every stream.
:func:`exec_keeping_signals` re-executes with both signals blocked, so one that arrives while the
new image starts waits (the mask and the pending signals survive ``execve``) until :func:`install`
unblocks it there.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import NoReturn

EARLY_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop ``kvlb serve``."""


NO_RELOAD = (
    "SIGHUP ignored: kvlb serve has no reload (settings: restart it; replicas: discovery; policy and "
    "drains: kvlb admin)"
)
"""What ``kvlb serve`` logs at a SIGHUP once its event loop runs (before, it ignores it silently)."""


def _exit_at_once(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(0)


def install() -> None:
    """End the process with 0 on SIGTERM or SIGINT (until the event loop's handlers replace this),
    ignore SIGHUP, then unblock the first two (blocked by :func:`exec_keeping_signals`: one that
    came meanwhile is handled now)."""
    for sig in EARLY_SIGNALS:
        signal.signal(sig, _exit_at_once)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, EARLY_SIGNALS)


def take_sigint() -> None:
    """For a tool's command line (``kvlb tune …``, ``kvlb capacity …``): SIGINT raises
    ``KeyboardInterrupt`` (the interpreter's handler, installed here), then unblock it, so that one
    blocked across the process's start (as :func:`exec_keeping_signals` does) is taken now, while
    :func:`balancer.cli.main.main` handles it, rather than whenever the tool's code unblocks it
    (never). The handler is installed even when the process was started with SIGINT ignored (a
    shell's ``&`` without job control, a CI step's background job): Python then installs none, and
    ``kvlb capacity`` ignored the SIGINT meant to stop it and write its points (2026-12-01,
    h-sigcap). SIGHUP is left as inherited (``nohup`` keeps its meaning)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT,))


def exec_keeping_signals(executable: str, argv: Sequence[str], environ: Mapping[str, str]) -> NoReturn:
    """``os.execve`` with SIGTERM and SIGINT blocked across it; the mask is restored if it fails."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_SIGNALS)
    try:
        os.execve(executable, list(argv), dict(environ))
    finally:  # only reached when the exec failed
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
