"""Rate limiting of repeated warnings, per cause (pure core, plus a thin logging helper).

A loop that meets the same failure on every turn (a corrupt policy in Redis polled every 0.5 s, every
queued batch of a replica whose lease is gone) must not write a line per turn: a flood hides the
first, useful line and fills disks. :class:`RepeatLimiter` lets the first occurrence of a cause
through, then lets through one line per ``interval_s`` that carries the number of occurrences held
back since the last line. It reads no clock (``now`` is passed in) and remembers at most
``max_causes`` causes (the least recently seen is forgotten first: it then logs again at its next
occurrence, which is harmless; :attr:`RepeatLimiter.evicted` names the cause forgotten).

:class:`LimitedWarnings` wires a limiter to a logger and the counters
``kvlb_log_suppressed_total{cause}`` and ``kvlb_log_causes_forgotten_total{cause}``: ``cause`` is a
fixed name per call site (bounded label values); ``subject`` (a replica id, a stream) tells apart
causes that are limited separately.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from balancer.errors import ConfigError

DEFAULT_INTERVAL_S = 60.0
"""Seconds between two lines of one cause while it keeps occurring."""
DEFAULT_MAX_CAUSES = 1024
"""Causes remembered at once (each costs a few hundred bytes)."""


@dataclass(slots=True)
class _Cause:
    logged_at: float
    held_back: int = 0


class RepeatLimiter:
    """Decides, per cause, whether an occurrence is logged (pure; ``now`` in seconds, monotonic)."""

    __slots__ = ("_causes", "evicted", "forgotten", "interval_s", "max_causes")

    def __init__(
        self, *, interval_s: float = DEFAULT_INTERVAL_S, max_causes: int = DEFAULT_MAX_CAUSES
    ) -> None:
        if not interval_s > 0 or max_causes < 1:
            raise ConfigError(
                f"log limiter: interval_s must be > 0 and max_causes >= 1, got {interval_s}, {max_causes}"
            )
        self.interval_s = interval_s
        self.max_causes = max_causes
        self._causes: OrderedDict[str, _Cause] = OrderedDict()
        self.forgotten = 0
        """Causes dropped at ``max_causes``, least recently seen first."""
        self.evicted: str | None = None
        """The cause the last :meth:`occur` dropped at ``max_causes`` (``None``: it dropped none)."""

    def __len__(self) -> int:
        return len(self._causes)

    def occur(self, cause: str, now: float) -> int | None:
        """One occurrence of ``cause`` at ``now``: ``None`` when it is to be held back, else the
        number of occurrences held back since the cause's last logged line (0 the first time)."""
        self.evicted = None
        entry = self._causes.get(cause)
        if entry is None:
            self._causes[cause] = _Cause(now)
            if len(self._causes) > self.max_causes:
                self.evicted = self._causes.popitem(last=False)[0]
                self.forgotten += 1
            return 0
        self._causes.move_to_end(cause)
        if now - entry.logged_at < self.interval_s:
            entry.held_back += 1
            return None
        held_back, entry.held_back, entry.logged_at = entry.held_back, 0, now
        return held_back

    def resolve(self, cause: str) -> int:
        """``cause`` stopped (e.g. a valid policy was read again): forget it, so that its next
        occurrence is logged at once; returns the occurrences held back and never logged."""
        entry = self._causes.pop(cause, None)
        return 0 if entry is None else entry.held_back


class LimitedWarnings:
    """A logger's repeated warnings through a :class:`RepeatLimiter`, counting what is held back."""

    def __init__(
        self,
        logger: logging.Logger,
        suppressed: Counter | None,
        *,
        clock: Callable[[], float],
        limiter: RepeatLimiter | None = None,
        forgotten: Counter | None = None,
    ) -> None:
        """``suppressed`` is ``kvlb_log_suppressed_total`` (label ``cause``; ``None`` counts nothing,
        for tools without metrics); ``forgotten`` is ``kvlb_log_causes_forgotten_total`` (label
        ``cause``, the forgotten one's; ``None`` counts nothing); ``clock`` is monotonic seconds."""
        self.logger = logger
        self.limiter = limiter if limiter is not None else RepeatLimiter()  # an empty one is falsy
        self._suppressed = suppressed
        self._forgotten = forgotten
        self._clock = clock

    def warning(
        self, cause: str, subject: str, message: str, *args: Any, exc_info: BaseException | bool = False
    ) -> bool:
        """Log ``message % args`` at WARNING unless ``cause`` for ``subject`` was logged within the
        limiter's interval; ``True`` when a line was written. A line after held-back occurrences ends
        with how many there were."""
        limiter = self.limiter
        held_back = limiter.occur(f"{cause}\x00{subject}", self._clock())
        if limiter.evicted is not None and self._forgotten is not None:
            self._forgotten.labels(limiter.evicted.partition("\x00")[0]).inc()
        if held_back is None:
            if self._suppressed is not None:
                self._suppressed.labels(cause).inc()
            return False
        if held_back:
            message += ' (%d more since the last such line; kvlb_log_suppressed_total{cause="%s"})'
            args = (*args, held_back, cause)
        self.logger.warning(message, *args, exc_info=exc_info, stacklevel=2)  # the caller's line
        return True

    def resolved(self, cause: str, subject: str) -> None:
        """The condition behind ``cause`` for ``subject`` is over: its next occurrence logs at once."""
        self.limiter.resolve(f"{cause}\x00{subject}")
