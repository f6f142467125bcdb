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

A message is read frame by frame, at most :data:`MAX_MESSAGE_FRAMES`: ZMQ bounds each frame
(``MAXMSGSIZE``) and the pipe in messages (``RCVHWM``), not the frames of a message, and each frame
read costs a Python object and about 10 µs of this thread (a message of 1,000,000 empty frames: 10 s of
CPU and 200 MB traced, then refused by the decoder). One with more is shed (cause ``frames``) with
only its first frames read; nothing more is read off that SUB, which the source then drops (the
rest of the message with it) as it drops a flood.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Literal

import zmq

from balancer.sources.base import Gate
from balancer.sources.zmq_settings import ZmqSourceSettings

ShedCause = Literal["budget", "behind", "backlog", "frames"]
"""Why a source sheds: its replica's CPU budget is spent (or its queue over half full), it has
read for ``max_behind_s`` without finding its socket empty, it found more than
``max_backlog_bytes`` queued, or the message has more than :data:`MAX_MESSAGE_FRAMES` frames."""
FRAME_COST_BYTES = 200
"""What a frame read ahead holds besides its bytes, counted against ``max_backlog_bytes``: its
``zmq.Frame`` and its share of the message's list (200 B traced a frame of no bytes, 2026-12-01),
so that messages of few bytes cannot fill the read-ahead's memory while its byte count stays low."""
MAX_MESSAGE_FRAMES = 8
"""Frames of a SUB message read at most: an engine's live message has 3 (``[topic, seq, payload]``);
one of 4 to 8 still reaches the decoder, which refuses it (``kvlb_events_decode_errors_total``)."""


class ReadAhead:
    """The messages read off one SUB and not yet handled, and whether the source is behind."""

    __slots__ = (
        "_ahead",
        "_ahead_bytes",
        "_behind_since",
        "_flood",
        "_settings",
        "reader",
        "refused",
        "shed_cause",
    )

    def __init__(self, settings: ZmqSourceSettings) -> None:
        self._settings = settings
        self.shed_cause: ShedCause = "budget"
        """Why the last message was shed (counted once per run by the source)."""
        self._behind_since: float | None = None
        """When the current run of reads without an empty socket began (``None``: caught up)."""
        self.reader: zmq.Socket[bytes] | None = None
        """A synchronous shadow of the SUB: the read-ahead's plain non-blocking reads."""
        self._ahead: deque[tuple[list[zmq.Frame], int, bool]] = deque()
        """Messages read off the SUB, not yet handled (zero-copy frames, their bytes, and whether the
        message had more than :data:`MAX_MESSAGE_FRAMES` frames: then only those were read)."""
        self.refused = False
        """A message of more than :data:`MAX_MESSAGE_FRAMES` frames was met: the rest of it is still
        on the SUB, so nothing more is read off it until :meth:`clear` (the source drops the SUB)."""
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
        if reader is None or self.refused:
            return
        limit = self._settings.max_backlog_bytes
        ahead = self._ahead
        while self._ahead_bytes <= limit:
            try:
                parts = [reader.recv(zmq.NOBLOCK, copy=False)]
            except zmq.Again:
                return
            while parts[-1].more:  # a message arrives whole: its other frames are there
                if len(parts) == MAX_MESSAGE_FRAMES:
                    self.refused = True
                    break
                parts.append(reader.recv(zmq.NOBLOCK, copy=False))
            size = sum(len(part) for part in parts) + FRAME_COST_BYTES * len(parts)
            ahead.append((parts, size, self.refused))
            self._ahead_bytes += size
            if self.refused:
                return
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
        parts, size, refused = self._ahead.popleft()
        self._ahead_bytes -= size
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        if refused:
            self.shed_cause = "frames"
        elif self._flood:
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
        self.refused = False
        self.caught_up()
