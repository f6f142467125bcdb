"""The SUB's read-ahead: messages taken off the socket before they are handled, and which of them to
shed (does I/O: non-blocking reads of a synchronous shadow of the SUB).

Before a message is handled, :class:`ReadAhead` takes everything queued on the SUB off the socket,
undecoded (zero-copy frames), until the socket is empty or more than ``max_backlog_bytes`` were taken.
The next message is then shed, its payload never copied out of ZMQ (only topic and seq are read), in
a flood (more than ``max_backlog_bytes`` were found queued: cause ``backlog``; or the source has read
for ``max_behind_s`` without finding the socket empty: ``behind``) or while the replica's CPU budget
is spent (the ``gate``: ``budget``). What a shed message does to the stream (its seq taken in order,
one resync per run, a flood dropped with the SUB) is
:class:`~balancer.sources.zmq_sub.ZmqEventSource`'s.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Literal

import zmq

from balancer.sources.base import Gate
from balancer.sources.zmq_settings import ZmqSourceSettings

ShedCause = Literal["budget", "behind", "backlog"]
"""Why a source sheds: its replica's CPU budget is spent (or its queue over half full), it has
read for ``max_behind_s`` without finding its socket empty, or it found more than
``max_backlog_bytes`` queued."""


class ReadAhead:
    """The messages read off one SUB and not yet handled, and whether the source is behind."""

    __slots__ = ("_ahead", "_ahead_bytes", "_behind_since", "_flood", "_settings", "reader", "shed_cause")

    def __init__(self, settings: ZmqSourceSettings) -> None:
        self._settings = settings
        self.shed_cause: ShedCause = "budget"
        """Why the last message was shed (counted once per run by the source)."""
        self._behind_since: float | None = None
        """When the current run of reads without an empty socket began (``None``: caught up)."""
        self.reader: zmq.Socket[bytes] | None = None
        """A synchronous shadow of the SUB: the read-ahead's plain non-blocking reads."""
        self._ahead: deque[tuple[list[zmq.Frame], int]] = deque()
        """Messages read off the SUB, not yet handled (zero-copy frames, and their bytes)."""
        self._ahead_bytes = 0
        self._flood = False
        """The read-ahead found more than ``max_backlog_bytes`` queued, and has not been empty since."""

    @property
    def pending(self) -> bool:
        """Whether messages read off the SUB wait to be handled."""
        return bool(self._ahead)

    def _fill(self) -> None:
        """Take what is queued on the SUB off the socket, undecoded, until it is empty or the
        read-ahead holds more than ``max_backlog_bytes`` (then the backlog is a flood)."""
        reader = self.reader
        if reader is None:
            return
        limit = self._settings.max_backlog_bytes
        ahead = self._ahead
        while self._ahead_bytes <= limit:
            try:
                parts = reader.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            size = sum(len(part) for part in parts)
            ahead.append((parts, size))
            self._ahead_bytes += size
        self._flood = True

    def caught_up(self) -> None:
        self._behind_since = None
        self._flood = False

    def not_behind(self) -> None:
        """Start the ``max_behind_s`` clock afresh (time spent replaying is not a backlog of the
        live stream)."""
        self._behind_since = None

    def drained(self) -> bool:
        """Whether nothing is left to handle (the read-ahead and the socket empty); if so, caught up."""
        self._fill()
        if self._ahead:
            return False
        self.caught_up()
        return True

    def read(self, gate: Gate | None) -> tuple[list[bytes], bool] | None:
        """The next message queued on the SUB and whether to shed it (``None``: the socket is empty).
        A message is shed in a flood (the read-ahead found more than ``max_backlog_bytes``, or the
        source has read for ``max_behind_s`` without finding the socket empty) or while the
        replica's budget is spent (``gate``); a shed message's payload is never copied out of
        ZMQ (only topic and seq are read)."""
        if self.drained():
            return None
        parts, size = self._ahead.popleft()
        self._ahead_bytes -= size
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        if self._flood:
            self.shed_cause = "backlog"
        elif now - self._behind_since > self._settings.max_behind_s:
            self.shed_cause = "behind"
        elif gate is not None and not gate.admits():
            self.shed_cause = "budget"
        else:
            return [part.bytes for part in parts], False
        return [part.bytes if i < 2 else b"" for i, part in enumerate(parts)], True

    def clear(self) -> None:
        """Drop what was read ahead (a flood dropped with the SUB, or a fresh SUB): caught up."""
        self._ahead.clear()
        self._ahead_bytes = 0
        self.caught_up()
