"""The replays of one ZMQ source's stream (does I/O): each answer merged into the stream, and counted.

:class:`~balancer.sources.zmq_sub.ZmqEventSource` (the shell: the SUB, its monitor, the live
messages) asks the publisher's replay socket for the batches it still holds in three cases, each a
method of :class:`ReplayMerge`:

* **A new connection's catch-up** (:meth:`ReplayMerge.catch_up`; the first connection, and every one
  after a lost connection): everything from the wanted seq (0, or the resume point; the publisher
  answers from the earliest batch it kept). Live messages queue on the SUB meanwhile and are merged
  by seq: when the buffer no longer reaches back to the wanted seq, the live messages queued below
  its first seq are taken first (they are older), the first at or above it is held for after the
  answer (the rule is the order's, pure: :func:`~balancer.sources.zmq_order.queued_live`). An
  answer with nothing at or after the wanted seq counts as ``empty``. A catch-up that finds the
  buffer's newest batch below the seq the publisher had reached before its connection dropped
  shows a restarted publisher (:mod:`balancer.sources.zmq_incarnation`).
* **A gap** (:meth:`ReplayMerge.fill_gap`; a live seq beyond the next wanted one, e.g. PUB
  high-water-mark drops): replay from the next wanted seq. What it cannot fill becomes
  ``Resync(rank, "gap")`` (:mod:`balancer.sources.zmq_order`).
* **A silent live stream's poll** (:meth:`ReplayMerge.poll`, once :meth:`ReplayMerge.poll_due`):
  anything after the last batch taken, or, before the first one, once connected and caught up, from
  the wanted seq; merged with the SUB's queued live messages as a catch-up's answer is. The interval
  (:mod:`balancer.sources.replay_poll`) doubles while the answers hold nothing, up to
  ``replay_poll_max_s``, but only once ``replay_poll_busy_s`` has passed since the publisher's last
  batch. A publisher that goes on publishing while its live messages are lost (a PUB high-water
  mark, a stalled connection, a subscription not yet in force right after the catch-up) is then
  read from its replay buffer: the index stays exact instead of waiting for the next live message
  to show a gap the buffer may no longer cover. No poll while a dropped flood's count is pending,
  before the connection's catch-up, or while the engine is away. Counted in
  ``kvlb_events_replay_polls_total`` (``new``, ``nothing``, ``failed``, ``abandoned``); one that
  finds the buffer past the wanted seq is also a ``partial`` replay (and a gap resync).

Every replay but a poll that found nothing or everything is counted in
``kvlb_events_replays_total`` (``filled``, ``partial``, ``failed``, ``empty``) and the source's
counters; a partial one outside a catch-up is said (rate-limited). No replay is asked while the
publisher's lost connection's last messages are handled (:attr:`ReplayMerge.dropping`). A
replay waiting on the engine when it goes (a poll, a catch-up, a gap) ends at once, logged as the
engine having gone away, not at its timeout blaming the replay endpoint: the SUB's monitor is
watched while it waits, and the replica's health probe, finding nothing listening at the engine,
tells the source so across the thread boundary (:mod:`balancer.sources.replay_watch`).

The exchange itself (the DEALER, its frames, timeout and abandon) is
:class:`~balancer.sources.zmq_replay.ReplayClient`'s, owned here; which replayed batch the stream
takes is :class:`~balancer.sources.zmq_order.StreamOrder`'s (pure); a batch taken goes back to the
shell (:class:`ReplayShell`), which applies the order's actions and emits it. The source's parts
(its order, read-ahead, message reader, incarnation, poll schedule, engine watch, counters,
warnings, logger) are shared with the shell as one
:class:`~balancer.sources.zmq_parts.ZmqSourceParts`; what is said here is said under the source's
logger, as the source's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import zmq
import zmq.asyncio

from balancer.engines import DecodedBatch
from balancer.errors import EventDecodeError
from balancer.sources.base import Emit, Gate
from balancer.sources.zmq_order import Queued, queued_live, reads_queued_live
from balancer.sources.zmq_parts import ZmqSourceParts
from balancer.sources.zmq_replay import ReplayClient


class ReplayShell(Protocol):
    """The source's side of the seam: where the batches a replay brings, and the live messages it
    reads off the SUB, are taken."""

    gate: Gate | None
    """The replica's CPU budget: a live message read during a replay is shed while it is spent."""

    async def take_live(
        self, batch: DecodedBatch, digest: int | None, emit: Emit, *, may_replay: bool = True
    ) -> None:
        """One live message (``digest``: of its payload; ``None``: shed), in the SUB's order;
        ``may_replay``: a gap before it may be replayed now."""

    def take_replayed(self, batch: DecodedBatch, digest: int, emit: Emit) -> None:
        """A replayed batch the stream's order takes, as the next in order."""


class ReplayMerge:
    """The replays of one source (one replica, one DP rank); lives on the ingest loop."""

    def __init__(
        self, parts: ZmqSourceParts, endpoint: str, *, shell: ReplayShell, ctx: zmq.asyncio.Context
    ) -> None:
        """``parts``: the source's, shared with its shell (its stream order, read-ahead, message
        reader, publisher incarnation, poll schedule, engine watch, counters, warnings and log);
        ``endpoint``: the publisher's replay socket."""
        self.replica = parts.replica
        self.dp_rank = parts.dp_rank
        self._parts = parts
        self._shell = shell
        self._order = parts.order
        self._ahead = parts.ahead
        self._messages = parts.messages
        self._counters = parts.counters
        self._log = parts.log
        self._client = ReplayClient(parts, endpoint, ctx=ctx)
        """The replay requests' DEALER and exchange."""
        self.catch_up_due = True
        """Ask for everything from the wanted seq at the SUB's next connection: at start (whatever
        the resume point) and after every lost connection (set by the shell)."""
        self.dropping = False
        """The publisher's connection dropped and its last messages are being handled: no replay
        (the rank's blocks are dropped right after them). Set by the shell, cleared by
        :meth:`closed`."""
        self._abandoned = False
        """The last replay ended because the engine went away (:class:`EngineGone`)."""
        self._held: tuple[DecodedBatch, int | None] | None = None
        """A live message read during a catch-up or poll that is newer than the answer's first
        batch: taken after the answer."""

    def closed(self) -> None:
        """The SUB is closed (a lost connection, an error, shutdown): so is the DEALER."""
        self.dropping = False
        self._client.close()

    def poll_timeout_ms(self, now: float) -> int | None:
        """How long to wait, from ``now`` (monotonic seconds), for a live message before the next
        poll (``None``: no poll)."""
        if self._order.backlog_dropped or self.catch_up_due:
            return None  # after a dropped flood, no position to poll from; unconnected, no publisher
        if self._parts.watch.away is not None:  # the engine is away: look again later whether it is back
            return max(1, int(self._parts.settings.replay_poll_max_s * 1000))
        return self._parts.polls.timeout_ms(now)

    def poll_due(self, now: float) -> bool:
        """Whether a poll is due at ``now`` (monotonic seconds): the live stream silent for the
        interval, the connection caught up, no dropped flood's count pending, the engine not away.
        Before the first batch too (polled from the wanted seq, 0 or the resume point): a batch
        lost live right after the catch-up (a subscription not yet in force at the publisher, a
        high-water mark) was otherwise noticed only at the next live message, which an idle engine
        may never send: its blocks missed from the index meanwhile, fleet-wide when this source is
        a new lease holder's."""
        return (
            not self._order.backlog_dropped
            and not self.catch_up_due  # not connected yet (or again): its catch-up comes first
            and self._parts.watch.away is None  # the probe finds nothing listening: it would wait out
            and self._parts.polls.due(now)
        )

    async def catch_up(self, sub: zmq.asyncio.Socket, emit: Emit) -> None:
        """A new connection: replay everything the publisher still holds from the wanted seq, merged
        with the live messages the ``sub`` queued meanwhile (:meth:`_on_replayed`,
        :meth:`_take_live_below`)."""
        self.catch_up_due = False
        start = self._order.catch_up_started()
        try:
            _, complete = await self._replay(start, emit, live=sub)
        finally:
            self._order.catch_up_ended()
        incarnation = self._parts.incarnation
        lost, last_seq = incarnation.lost, self._order.last_seq
        if lost is not None and complete and last_seq is not None and last_seq < lost[0]:
            incarnation.restarted(f"its newest batch is seq {last_seq}, it had reached {lost[0]}")
        await self._take_held(emit)

    async def fill_gap(self, emit: Emit) -> None:
        """A live message showed a gap: replay from the next wanted seq."""
        await self._replay(self._order.expected(), emit)

    async def poll(self, sub: zmq.asyncio.Socket, emit: Emit) -> None:
        """The live stream is silent: ask the replay socket for anything after the last batch."""
        before = self._order.last_seq
        found, complete = await self._replay(self._order.expected(), emit, live=sub, poll=True)
        outcome = "new" if found else ("nothing" if complete else "failed")
        if self._abandoned and not found:
            outcome = "abandoned"  # the engine went away meanwhile
        self._parts.metrics.events_replay_polls_total.labels(self.replica, outcome).inc()
        if found:  # not a gap in itself: the live copies of these batches may only be late
            self._log.debug(
                "replica %s rank %d: a poll found batches after seq %s", self.replica, self.dp_rank, before
            )
            self._parts.polls.heard(time.monotonic())
        else:
            self._parts.polls.answered_empty(time.monotonic())
        await self._take_held(emit)

    async def _take_held(self, emit: Emit) -> None:
        """After an answer: the live message held during it (:meth:`_take_live_below`), if any."""
        held, self._held = self._held, None
        if held is not None:
            await self._shell.take_live(held[0], held[1], emit)

    async def _take_live_below(self, limit: int, emit: Emit) -> None:
        """During a catch-up (or poll) whose answer starts at ``limit``, above the wanted seq: the
        live messages queued on the SUB in the order's merge (:func:`queued_live`): those below
        ``limit`` taken first (they are older), the first at or above it held for after the answer.
        These are shed as the shell's drain would shed them."""
        for _ in range(self._parts.settings.rcvhwm):
            read = self._ahead.read(self._shell.gate)
            if read is None:
                return
            frames, shed = read
            taken = self._messages.take(frames, shed, self._shell.gate)
            if taken is None:
                continue
            batch, digest = taken
            assert batch.seq is not None
            if queued_live(batch.seq, limit) is Queued.AFTER:
                self._held = (batch, digest)
                return
            await self._shell.take_live(batch, digest, emit, may_replay=False)

    async def _replay(
        self, start_seq: int, emit: Emit, live: zmq.asyncio.Socket | None = None, *, poll: bool = False
    ) -> tuple[bool, bool]:
        """Ask the replay socket for every batch from ``start_seq`` and take the new ones in order;
        ``live`` (a catch-up or a poll) is the SUB whose queued messages merge with the answer.
        Returns whether any batch came and whether the answer was complete (its end marker arrived).
        A ``poll`` is counted by its caller, and in ``kvlb_events_replays_total`` only when it
        shows lost batches (``partial``)."""
        self._abandoned = False
        if self.dropping:  # the publisher's connection dropped: its blocks go right after this
            return False, False
        try:
            return await self._replay_from(start_seq, emit, live, poll=poll)
        finally:
            self._ahead.not_behind()  # time spent replaying is not a backlog of the live stream

    async def _replay_from(
        self, start_seq: int, emit: Emit, live: zmq.asyncio.Socket | None, *, poll: bool
    ) -> tuple[bool, bool]:
        """One exchange (:class:`~balancer.sources.zmq_replay.ReplayClient`), its replies taken by
        :meth:`_on_replayed` (the first with the ``live`` SUB), then counted."""
        if not poll:
            self._counters.replays += 1
        first_seq: int | None = None

        async def on_reply(frames: list[bytes]) -> None:
            nonlocal first_seq
            seq = await self._on_replayed(frames, emit, live if first_seq is None else None)
            if first_seq is None:
                first_seq = seq

        complete, self._abandoned = await self._client.request(start_seq, on_reply)
        lossy = first_seq is not None and (first_seq > start_seq or not complete)
        if not poll or lossy:  # a poll that found nothing, or everything, is counted by its caller only
            if poll:
                self._counters.replays += 1
            self._count_replay(start_seq, first_seq, complete)
        return first_seq is not None, complete

    async def _on_replayed(
        self, frames: Sequence[bytes], emit: Emit, live: zmq.asyncio.Socket | None
    ) -> int | None:
        """Take one replayed ``[b"", seq8, payload]`` (SGLang) or ``[b"", topic, seq8, payload]``
        (vLLM ≥ 0.32); returns its seq (``None`` when unusable). ``live``: the first batch of a
        catch-up (or poll), when older live messages may wait on the SUB."""
        if len(frames) not in (3, 4) or frames[0] != b"":
            self._messages.decode_failed(EventDecodeError("frame", f"replay reply has {len(frames)} frames"))
            return None
        batch = self._messages.decode(frames[1:])
        if batch is None or batch.seq is None:
            return None
        digest = hash(frames[-1])
        if live is not None and reads_queued_live(self._order.expected(), batch.seq):
            await self._take_live_below(batch.seq, emit)
        if self._order.replayed(batch.seq, digest):
            self._shell.take_replayed(batch, digest, emit)
        return batch.seq

    def _count_replay(self, start_seq: int, first_seq: int | None, complete: bool) -> None:
        if first_seq is None and complete and self._order.last_seq is None:
            outcome = "empty"  # a catch-up found nothing newer than the resume point
        elif first_seq is None:
            outcome = "failed"
        elif first_seq > start_seq or not complete:
            outcome = "partial"
        else:
            outcome = "filled"
        if outcome not in ("filled", "empty"):
            self._counters.replay_failures += 1
        self._parts.metrics.events_replays_total.labels(self.replica, outcome).inc()
        if first_seq is not None and first_seq > start_seq and not self._order.catching_up:
            self._parts.warnings.warning(
                "replay_partial",
                f"{self.replica}/{self.dp_rank}",
                "replica %s rank %d: replay from %d found the publisher's buffer starting at %d: "
                "batches %d-%d are lost, the rank resyncs",
                self.replica,
                self.dp_rank,
                start_seq,
                first_seq,
                start_seq,
                first_seq - 1,
            )
        self._log.debug(
            "replica %s rank %d: replay from %d %s", self.replica, self.dp_rank, start_seq, outcome
        )
