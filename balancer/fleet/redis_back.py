"""A writer's error backoff (pure) and the "Redis is back" signal that cuts it short (I/O).

After a Redis outage each :class:`~balancer.fleet.writer.FencedWriter` attempt used to wait out its
own backoff (up to ``RetrySettings.max_s``, 0.5 s) before its first write, though another call of
the same balancer had found Redis answering again. Now every component's successful call (a lease
tick, a policy or drain poll, another writer's write: the fleet runtime's ``on_redis`` reports)
tells :class:`RedisBack`, which wakes every attempt sleeping in its backoff at once.

No retry storm while Redis keeps failing: a wake comes only from a call that worked, and an attempt
that was woken and fails again waits its next, longer, backoff in full (:class:`Backoff`), so a
flapping Redis (reads answered, writes refused) costs a writer at most two attempts per backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RetrySettings:
    initial_s: float = 0.05
    """First wait after a failed write (seconds); doubles per consecutive failure."""
    max_s: float = 0.5
    """Longest wait between two attempts while Redis is unreachable (seconds): also how late, at
    most, the queued batches start going out once Redis is back if no other call wakes them."""


@dataclass(slots=True)
class Backoff:
    """The waits of one write's attempts (pure: the caller passes ``now``, monotonic seconds)."""

    settings: RetrySettings
    delay_s: float = field(init=False)
    """The wait after the next failure (seconds)."""
    failures: int = 0
    """Failed attempts so far."""
    wakeable: bool = True
    """Whether the current wait may be cut short by :class:`RedisBack` (not after a woken attempt
    failed: that wait is served in full)."""
    failed_at: float | None = None
    """When the last attempt failed (``now`` of :meth:`failed`)."""

    def __post_init__(self) -> None:
        self.delay_s = self.settings.initial_s

    def failed(self, now: float, *, woken: bool) -> float:
        """The attempt made ``woken`` (early, after a wake) or not failed at ``now``: the seconds to
        wait before the next one (doubling, up to ``max_s``)."""
        wait_s = self.delay_s
        self.delay_s = min(self.settings.max_s, self.delay_s * 2)
        self.failures += 1
        self.failed_at = now
        self.wakeable = not woken
        return wait_s


class RedisBack:
    """Wakes the writers' attempts sleeping in their backoff when any Redis call of this balancer
    worked (I/O; thread-safe: the calls end on the request loop and on the ingest thread's loop).

    It owns no task: each sleeper parks a future of its own loop here, resolved on that loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sleepers: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
        """One per attempt sleeping (at most one per held replica: bounded by the replicas)."""
        self.wakes = 0
        """Calls of :meth:`succeeded` that woke at least one sleeper."""
        self.woke_at: float | None = None
        """``time.monotonic()`` of the last such call (``None``: none yet)."""

    def succeeded(self) -> None:
        """A Redis call worked: wake every sleeper (a no-op when none sleeps)."""
        with self._lock:
            if not self._sleepers:
                return
            sleepers, self._sleepers = self._sleepers, set()
            self.wakes += 1
            self.woke_at = time.monotonic()
        for loop, future in sleepers:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile (shutdown)
                loop.call_soon_threadsafe(_resolve, future)

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until :meth:`succeeded`, whichever comes first; ``True`` if woken."""
        loop = asyncio.get_running_loop()
        sleeper = (loop, loop.create_future())
        with self._lock:
            self._sleepers.add(sleeper)
        try:
            done, _ = await asyncio.wait((sleeper[1],), timeout=seconds)
            return bool(done)
        finally:
            with self._lock:
                self._sleepers.discard(sleeper)
            sleeper[1].cancel()  # a no-op once resolved


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
