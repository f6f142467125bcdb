"""The SUB's read-ahead: messages taken off the socket before they are handled, and which of them to
shed (does I/O: non-blocking reads of a synchronous shadow of the SUB).

Before a message is handled, :class:`ReadAhead` takes everything queued on the SUB off the socket,
undecoded (zero-copy frames), until the socket is empty or more than ``max_backlog_bytes`` were taken.
The next message is then shed, its payload never copied out of ZMQ (only topic and seq are read), in
a flood (more than ``max_backlog_bytes`` were found queued: cause ``backlog``; or the source has read
for ``max_behind_s`` without finding the socket empty, :class:`BehindClock`: ``behind``) or while the
replica's CPU budget is spent (the ``gate``: ``budget``). What a shed message does to the stream
(its seq taken in order, one resync per run, a flood dropped with the SUB) is
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
from dataclasses import dataclass, field
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
MIN_BEHIND_MESSAGES = 16
"""Messages a run must have handled before it can be ``behind``: a run of fewer is a burst, not a
flood, however long the process was paused in it. A flood handles far more in ``max_behind_s``
(1 s): the traced floods of ``docs/benchmark-history.md`` ("The event flood, round 2") decoded 24-96
messages in their first second (5 in 0.13 s at load 4.8) and shed thousands, and the ``behind``
test of ``tests/integration/test_sources_budget.py`` queues 400."""
MAX_READ_GAP_S = 0.1
"""Most of the wall time between two reads of a run that counts towards ``max_behind_s`` (seconds):
a longer gap is the process paused (a collection, a core taken away on a loaded machine, the event
loop busy elsewhere), not the source falling behind its publisher. A flood's reads come 2-20 ms
apart (the traced floods' wall time a message, 3.97-20.5 ms at its p50)."""


@dataclass(slots=True)
class BehindClock:
    """How long a source has been reading without finding its socket empty, and whether that makes it
    ``behind`` (pure: takes ``now``). Each gap between two reads counts up to :data:`MAX_READ_GAP_S`,
    and a run is ``behind`` only past ``max_behind_s`` of that and :data:`MIN_BEHIND_MESSAGES`
    handled: one pause of the process in a burst of a few messages is not a flood (before
    2026-12-01 it was, and a replica that sent one prompt's events shed them and resynced)."""

    max_behind_s: float
    """The ``behind`` threshold (seconds of reading, ``zmq.max_behind_s``)."""
    reading_s: float = 0.0
    """Time counted in the current run (seconds; each gap capped at :data:`MAX_READ_GAP_S`)."""
    handled: int = 0
    """Messages read in the current run before the one at hand."""
    paused_s: float = 0.0
    """Wall time of the run's gaps not counted (seconds past :data:`MAX_READ_GAP_S` in each)."""
    _last_read_at: float | None = field(default=None, repr=False)

    def read(self, now: float) -> bool:
        """A message read at ``now``: whether the run is now ``behind``."""
        last = self._last_read_at
        if last is not None:
            gap_s = max(0.0, now - last)
            self.reading_s += min(gap_s, MAX_READ_GAP_S)
            self.paused_s += max(0.0, gap_s - MAX_READ_GAP_S)
            self.handled += 1
        self._last_read_at = now
        return self.handled >= MIN_BEHIND_MESSAGES and self.reading_s > self.max_behind_s

    def reset(self) -> None:
        """The socket was found empty (or a replay ran): the next read starts a new run."""
        self.reading_s = 0.0
        self.handled = 0
        self.paused_s = 0.0
        self._last_read_at = None

    def explain(self) -> str:
        """Why the run is behind, for the shed warning."""
        return (
            f"read for {self.reading_s:.2f} s (max_behind_s {self.max_behind_s:g} s; gaps over "
            f"{MAX_READ_GAP_S:g} s, {self.paused_s:.2f} s in all, not counted) without finding the socket "
            f"empty, {self.handled} messages handled in the run"
        )


class ReadAhead:
    """The messages read off one SUB and not yet handled, and whether the source is behind."""

    __slots__ = (
        "_ahead",
        "_ahead_bytes",
        "_behind",
        "_flood",
        "_flood_bytes",
        "_settings",
        "reader",
        "refused",
        "shed_cause",
    )

    def __init__(self, settings: ZmqSourceSettings) -> None:
        self._settings = settings
        self.shed_cause: ShedCause = "budget"
        """Why the last message was shed (counted once per run by the source)."""
        self._behind = BehindClock(settings.max_behind_s)
        """The current run of reads without an empty socket."""
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
        self._flood_bytes = 0
        """What the read-ahead held when it found the flood (bytes)."""

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
        if not self._flood:
            self._flood_bytes = self._ahead_bytes
        self._flood = True

    def caught_up(self) -> None:
        self._behind.reset()
        self._flood = False

    def not_behind(self) -> None:
        """Start the ``max_behind_s`` clock afresh (time spent replaying is not a backlog of the
        live stream)."""
        self._behind.reset()

    def explain(self) -> str:
        """Why the last message was shed (``behind``, ``backlog``, ``frames``), in figures; the
        ``budget`` cause is the gate's to explain."""
        if self.shed_cause == "behind":
            return self._behind.explain()
        if self.shed_cause == "backlog":
            return (
                f"{self._flood_bytes} bytes queued on the socket, over max_backlog_bytes "
                f"{self._settings.max_backlog_bytes}"
            )
        if self.shed_cause == "frames":
            return f"a message of more than {MAX_MESSAGE_FRAMES} frames"
        return "the replica's ingestion budget is spent"

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
        source has read for ``max_behind_s`` without finding the socket empty, :class:`BehindClock`)
        or while the
        replica's budget is spent (``gate``); a shed message's payload is never copied out of
        ZMQ (only topic and seq are read)."""
        if self.drained():
            return None
        parts, size, refused = self._ahead.popleft()
        self._ahead_bytes -= size
        behind = self._behind.read(time.monotonic())
        if refused:
            self.shed_cause = "frames"
        elif self._flood:
            self.shed_cause = "backlog"
        elif behind:
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
