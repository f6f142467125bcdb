"""Settings and endpoint arithmetic of the ZMQ event source (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from balancer.config import endpoint_for_rank as endpoint_for_rank  # its home; imported from here too
from balancer.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ZmqSourceSettings:
    """Settings of every :class:`ZmqEventSource`."""

    replay_timeout_s: float = 2.0
    """Budget for one whole replay exchange (seconds). At the limit the batches read so far are kept
    and the rest of the gap becomes a ``Resync``. Must be > 0."""
    replay_max_batches: int = 20_000
    """Most batches read in one replay (engines keep 10 000 by default). Beyond it the replay stops
    and the remainder resyncs; bounds the time spent away from the live socket. Must be ≥ 1."""
    rcvhwm: int = 100_000
    """SUB receive high-water mark (messages). Above it ZMQ drops messages, which shows as a gap.
    Must be ≥ 1."""
    max_message_bytes: int = 16 * 1024 * 1024
    """``ZMQ_MAXMSGSIZE`` of the SUB and replay sockets: a publisher sending a larger message is
    disconnected by ZMQ (then a resync; the source opens a fresh socket, as libzmq does not
    reconnect after that protocol error). Bounds one message in memory. Must be ≥ 1."""
    max_behind_s: float = 1.0
    """Longest the source may keep reading without ever finding the socket empty (seconds;
    ``limits.event_max_behind_s``; each gap between two reads counts at most
    :data:`~balancer.sources.read_ahead.MAX_READ_GAP_S`, and a run of fewer than
    :data:`~balancer.sources.read_ahead.MIN_BEHIND_MESSAGES` is never behind: a pause of the process
    is not a flood): past it
    the publisher sends faster than kvlb decodes and applies, so the message at hand is shed (the
    rank resyncs once, ``kvlb_events_shed_total``, a run counted in
    ``kvlb_events_shed_runs_total{cause="behind"}``) and the rest of the backlog is dropped with the
    SUB (closed, reopened ``flood_pause_s`` later). Bounds what ZMQ buffers in a flood and how stale
    the index gets; what a flood's first ``max_behind_s`` decodes
    is cleared again by its run's resync (0.25 s was measured: it did not improve the other pools'
    p99s, ``docs/benchmark-history.md``, "The event flood, round 2"). Must be > 0."""
    max_backlog_bytes: int = 32 * 1024 * 1024
    """Most bytes of messages the source reads ahead of its decoding (bytes; a frame counts 200 B
    besides its own, what its ``zmq.Frame`` holds): it takes everything
    queued on the SUB off the socket before decoding the next message, and a backlog larger than
    this is a flood at once, without waiting ``max_behind_s``: the message at hand and everything
    after it are dropped undecoded (the rank resyncs once, a run counted in
    ``kvlb_events_shed_runs_total{cause="backlog"}``). Bounds the read-ahead's memory and the
    decoding a flood costs before it is recognised (32 MiB: about 220 of the flood bench's 150 kB
    messages; the read-ahead reached it with 1-11 of them decoded, ``docs/benchmark-history.md``, "The
    event flood, round 3"). Must be ≥ ``max_message_bytes``."""
    flood_pause_s: float = 0.5
    """How long the source stays unsubscribed after dropping a flood (``max_backlog_bytes`` or
    ``max_behind_s``) with its SUB (seconds): what the publisher sends meanwhile it drops for us (the
    rank has resynced; the next message's seq counts it as shed), instead of the rest of a flood
    arriving on the fresh connection and being decoded until it is a backlog again. The flooding
    engine's blocks stay out of the index this long. Must be > 0."""
    reconnect_initial_s: float = 0.1
    """First wait (seconds) before reopening a failed socket; doubles per failure. Must be > 0."""
    reconnect_max_s: float = 5.0
    """Longest wait between reopen attempts of a failed socket (seconds). Must be > 0."""
    publisher_reconnect_max_s: float = 0.5
    """ZMQ's own cap on the interval between TCP reconnect attempts to a publisher that went away
    (seconds; ZMQ doubles the interval from 0.1 s up to it). A restarted engine's events reach kvlb
    at most this long after it listens again (the replay from seq 0 then fills what it sent before);
    each attempt is one TCP connect, so a low cap is cheap. Must be > 0."""

    replay_poll_min_s: float = 0.05
    """How long the live stream may be silent before the replay socket is asked for anything newer
    than the last batch taken (seconds). A publisher whose live messages are lost while it goes on
    publishing (a PUB high-water mark, a stalled connection) is read from its replay buffer instead,
    as long as the buffer outlasts this interval; an answer with nothing new doubles the interval up
    to ``replay_poll_max_s`` (once ``replay_poll_busy_s`` has passed since the last batch), a live
    message or a poll that found batches resets it. Must be > 0."""
    replay_poll_busy_s: float = 2.0
    """How long after the publisher's last batch (live, or found by a poll) the interval between
    polls of a silent stream stays at ``replay_poll_min_s`` instead of doubling (seconds). A busy
    engine publishes in bursts (a request's prefill, its pages, its end) with quiet spells between
    them; while its live stream is lost, an interval doubled over a quiet spell let the next burst
    rotate a short replay buffer past the lost batches (a resync). An idle engine costs this long at
    the minimum interval after its last batch, then backs off as before. ``0``: double at once.
    Must be ≥ 0."""
    replay_poll_max_s: float = 2.0
    """Longest interval between such polls of a silent publisher (seconds): what an idle engine
    costs (one small request per DP rank per interval), and how late a publisher that went on
    without its live stream after a long idle spell is noticed. Must be ≥ ``replay_poll_min_s``."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field out of range."""
        timeouts = (
            "replay_timeout_s",
            "reconnect_initial_s",
            "reconnect_max_s",
            "publisher_reconnect_max_s",
            "replay_poll_min_s",
            "replay_poll_max_s",
            "max_behind_s",
            "flood_pause_s",
        )
        for name in timeouts:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"zmq.{name} must be a finite number > 0, got {value}")
        if self.reconnect_initial_s > self.reconnect_max_s:
            raise ConfigError("zmq.reconnect_initial_s must be <= zmq.reconnect_max_s")
        busy = self.replay_poll_busy_s
        if not (math.isfinite(busy) and busy >= 0):
            raise ConfigError(f"zmq.replay_poll_busy_s must be a finite number >= 0, got {busy}")
        if self.replay_poll_min_s > self.replay_poll_max_s:
            raise ConfigError("zmq.replay_poll_min_s must be <= zmq.replay_poll_max_s")
        if self.max_backlog_bytes < self.max_message_bytes:
            raise ConfigError("zmq.max_backlog_bytes must be >= zmq.max_message_bytes")
        for name in ("replay_max_batches", "rcvhwm", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"zmq.{name} must be >= 1, got {getattr(self, name)}")
