"""When a ZMQ source polls its engine's replay socket (pure: the caller passes ``now``).

A source (:mod:`balancer.sources.zmq_sub`) whose live stream has been silent for
``replay_poll_min_s`` asks the replay socket for anything after the last batch taken. The interval
doubles while the answers hold nothing, up to ``replay_poll_max_s``, but only once
``replay_poll_busy_s`` has passed since the publisher's last batch: a busy engine's next burst comes
soon and must find the interval short. :class:`ReplayPollSchedule` keeps those times; whether a poll
may start at all (a replay endpoint, a connection caught up, the engine not away) is the source's
replays' (:meth:`~balancer.sources.zmq_replay_merge.ReplayMerge.poll_due`).
"""

from __future__ import annotations

import math


class ReplayPollSchedule:
    """The silence after which the next replay poll is due; times are ``time.monotonic()`` seconds."""

    def __init__(self, min_s: float, max_s: float, busy_s: float, now: float) -> None:
        """``min_s``/``max_s``: the shortest and longest interval (seconds); ``busy_s``: how long
        after the last batch the interval does not double."""
        self._min_s = min_s
        self._max_s = max_s
        self._busy_s = busy_s
        self.interval_s = min_s
        """The silence after which the next poll is due."""
        self._heard_at = now
        """When the live stream (or a poll that found batches) last brought something, or the last
        poll was answered."""
        self._batch_at = -math.inf
        """When the live stream (or a poll that found batches) last brought something: while it is
        within ``busy_s`` the poll interval does not double."""

    def heard(self, now: float) -> None:
        """A batch came (live, or found by a poll): the interval starts again from ``min_s``."""
        self._heard_at = self._batch_at = now
        self.interval_s = self._min_s

    def answered_empty(self, now: float) -> None:
        """A poll found nothing new (or failed): wait a whole interval again, doubled unless a batch
        came within ``busy_s``."""
        self._heard_at = now
        if now - self._batch_at >= self._busy_s:
            self.interval_s = min(self._max_s, 2 * self.interval_s)

    def due(self, now: float) -> bool:
        """The stream has been silent for the interval."""
        return now - self._heard_at >= self.interval_s

    def timeout_ms(self, now: float) -> int:
        """How long to wait for a message before the poll is due (milliseconds, at least 1)."""
        left_s = self._heard_at + self.interval_s - now
        return max(1, int(left_s * 1000) + 1)
