"""The ``workers`` section of the settings (pure): how the supervisor of ``kvlb serve --workers N``
starts, restarts and gives up on its worker processes (docs/operations.md, "A worker that keeps
dying"). Not read with ``--workers 1`` (one process, no supervisor)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkersConfig:
    """How the supervisor starts and restarts workers, and when it counts one as in a crash loop."""

    start_timeout_s: float = 120.0
    """Most seconds (1..3600) a worker may take to announce itself at the start of ``kvlb serve``
    (it loads a tokenizer first); past it the start fails."""
    restart_backoff_s: float = 0.5
    """Seconds (0..60) before restarting a worker whose only exit within :attr:`restart_window_s` is
    this one; each further exit within the window doubles it (``restart_backoff_s × 2^(exits - 1)``),
    up to :attr:`max_restart_backoff_s`."""
    max_restart_backoff_s: float = 30.0
    """Cap (seconds, ``restart_backoff_s``..3600) of the restart delay."""
    restart_window_s: float = 600.0
    """Seconds (> 0, at most 86,400) over which a worker's exits are counted: for its restart delay and its
    crash loop. A worker with no exit for this long (a quiet period) is back to the first delay and
    out of its crash loop. A worker that dies less often than once a window is restarted after
    ``restart_backoff_s`` each time and never counted as a crash loop (its restarts are still
    counted: ``kvlb_process_restarts_total``). The supervisor remembers at most the last
    max(64, :attr:`crash_loop_exits`) exits of each worker."""
    crash_loop_exits: int = 5
    """Exits (1..1000) from which a worker is in a crash loop: this many within
    :attr:`restart_window_s` (whether it served in between or not), or this many in a row before it
    served (however long they took). Such a worker is listed under ``/readyz``'s ``degraded`` and
    counted in ``kvlb_process_workers_crash_looping``; once every worker is, the supervisor stops and
    ``kvlb serve`` exits non-zero (the orchestrator shows the loop). With the defaults, 5 exits in a
    row take about 7.5 s of delays plus the 5 runs."""
    kill_after_s: float = 10.0
    """Seconds (0..600) past the shutdown grace before a worker still alive is killed (SIGKILL)."""
