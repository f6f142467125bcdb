"""How the supervisor of ``kvlb serve --workers N`` paces a worker's restarts and when it counts that
worker as in a crash loop (pure: the caller passes ``now``, a ``time.monotonic()`` reading, which is
the same clock in every process of the machine).

A worker's exits are counted over :attr:`~balancer.config.WorkersConfig.restart_window_s`: its
restart delay doubles with each exit within the window, and ``crash_loop_exits`` of them (or as many
failed starts in a row, however long they took) make a crash loop. A quiet window resets both.
"""

from __future__ import annotations

from collections.abc import Sequence

from balancer.config.workers import WorkersConfig

EXITS_KEPT_MIN = 64
"""Exit times remembered per worker at least (the newest; more when ``crash_loop_exits`` is higher):
past ~7 doublings the delay is at its cap anyway."""


def exits_kept(config: WorkersConfig) -> int:
    """How many of a worker's newest exit times the supervisor keeps."""
    return max(EXITS_KEPT_MIN, config.crash_loop_exits)


def recent_exits(exit_times: Sequence[float], now: float, window_s: float) -> int:
    """The exits within the last ``window_s`` seconds before ``now``."""
    return sum(1 for at in exit_times if now - at < window_s)


def restart_delay_s(recent: int, config: WorkersConfig) -> float:
    """The delay before restarting a worker with ``recent`` exits within the window (this one
    included): ``restart_backoff_s × 2^(recent - 1)``, at most ``max_restart_backoff_s``."""
    doublings = min(max(recent - 1, 0), 32)  # 2^32 × anything > 0 is past any cap
    return min(config.max_restart_backoff_s, config.restart_backoff_s * 2.0**doublings)


def crash_looping(recent: int, failed_starts: int, config: WorkersConfig) -> bool:
    """Whether a worker with ``recent`` exits within the window and ``failed_starts`` exits in a row
    before serving is in a crash loop."""
    return recent >= config.crash_loop_exits or failed_starts >= config.crash_loop_exits
