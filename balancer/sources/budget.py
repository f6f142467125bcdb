"""``CpuBudget``: how much CPU one replica's event ingestion may spend (pure: takes ``now``).

Event ingestion shares the interpreter (and its GIL) with the request loop, so its CPU is the
request loop's latency. Each replica's pipeline owns one budget: a token bucket of CPU seconds
refilled at ``share`` seconds per second up to ``burst_s``. Decoding (the sources) and applying (the
pipeline) charge what they spent (``time.thread_time`` deltas, measured by the caller). While the
bucket is empty a source *sheds*: it reads each message off its socket (so neither ZMQ nor the
kernel buffers a flood) and drops it undecoded, counted in ``kvlb_events_shed_total``; the rank
resyncs once when it sheds the first message of a run. A flooding engine therefore costs at most
``share`` of a core and only its own index entries go stale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from balancer.errors import ConfigError


@dataclass(slots=True)
class CpuBudget:
    """A token bucket of CPU seconds (``share`` per second, at most ``burst_s`` saved up)."""

    share: float
    """CPU seconds per wall second (0.25: a quarter of one core). Must be > 0."""
    burst_s: float
    """Most CPU seconds saved up while idle (spent at once by a burst). Must be > 0."""
    _tokens_s: float = field(init=False, default=0.0)
    _at: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        for name in ("share", "burst_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"ingest budget {name} must be a finite number > 0, got {value}")
        self._tokens_s = self.burst_s

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._tokens_s = min(self.burst_s, self._tokens_s + (now - self._at) * self.share)
        self._at = now if self._at is None else max(self._at, now)

    def allows(self, now: float) -> bool:
        """Whether work may run now (some CPU is left in the bucket)."""
        self._refill(now)
        return self._tokens_s > 0

    def level_s(self, now: float) -> float:
        """CPU seconds left in the bucket at ``now`` (below zero: the debt)."""
        self._refill(now)
        return self._tokens_s

    def charge(self, cpu_s: float, now: float) -> None:
        """Spend ``cpu_s`` (it may go below zero: the debt is paid back before the next work)."""
        self._refill(now)
        self._tokens_s -= max(0.0, cpu_s)
