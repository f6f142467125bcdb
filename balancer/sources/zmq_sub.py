"""ZMQ subscriber for one SGLang/vLLM publisher (one DP rank): the source's async shell (does I/O).

The engine PUBlishes ``[topic, seq (8 bytes big-endian), msgpack batch]``; ``seq`` counts batches
per publisher from 0. :class:`ZmqEventSource` is the shell of the source that keeps that stream in
order: the subscription loop, its SUB and monitor (a new connection's catch-up, a lost connection's
resync and reopened SUB, a refused connect or handshake), the live messages drained off the SUB
(shed while the budget is spent, a flood dropped with the SUB), and what the stream's order
(:class:`~balancer.sources.zmq_order.StreamOrder`, pure) answers for each, applied: resyncs, counts,
the restart log, a batch accepted and emitted with its lag rule. Its replays (catch-up, gap, poll)
are :class:`~balancer.sources.zmq_replay_merge.ReplayMerge`'s; the parts both share (order,
read-ahead, message reader, incarnation, poll schedule, engine watch, counters, warnings) are one
:class:`~balancer.sources.zmq_parts.ZmqSourceParts`. What the whole source does, case by case (start,
gap, silence, restart, lost connection, shedding, floods, a wrong endpoint), and which module holds
each part: :mod:`balancer.sources` and docs/architecture.md ("One ZMQ source, case by case"). The
parts log under this module's logger, as the source's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio

from balancer.engines import DecodedBatch, Decoder
from balancer.events import Resync
from balancer.metrics import Metrics
from balancer.sources.base import (
    Backoff,
    Emit,
    Gate,
    IngestBatch,
    SourceStatus,
    count_decoded,
    report_malformed,
)
from balancer.sources.zmq_connection import (
    DropBacklog,
    HandshakeRefused,
    ReopenSub,
    SubConnection,
    next_monitor_event,
    open_sub,
)
from balancer.sources.zmq_order import (
    DUPLICATE,
    REPLAY,
    Action,
    Duplicate,
    FloodLost,
    Gap,
    Restarted,
    Resynced,
    ShedRunStarted,
)
from balancer.sources.zmq_parts import ZmqSourceParts
from balancer.sources.zmq_replay_merge import ReplayMerge
from balancer.sources.zmq_settings import ZmqSourceSettings
from balancer.types import ReplicaId

log = logging.getLogger(__name__)


class ZmqEventSource:
    """Subscribes to one publisher (one replica, one DP rank) and emits its batches in order."""

    kind = "zmq"

    def __init__(
        self,
        replica: ReplicaId,
        endpoint: str,
        *,
        ctx: zmq.asyncio.Context,
        decoder: Decoder,
        metrics: Metrics,
        dp_rank: int = 0,
        topic: bytes = b"",
        replay_endpoint: str | None = None,
        resume_seq: int | None = None,
        settings: ZmqSourceSettings | None = None,
    ) -> None:
        """``resume_seq`` is the next seq the index still needs (from a durable store); ``None``
        means the index holds nothing of this rank, so seq 0 is wanted."""
        self.replica = replica
        self.endpoint = endpoint
        self.dp_rank = dp_rank
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.settings = settings or ZmqSourceSettings()
        self.settings.validate()
        self._ctx = ctx
        self._metrics = metrics
        self._engine = decoder.engine
        want = resume_seq if resume_seq is not None else 0
        parts = ZmqSourceParts.build(
            replica, dp_rank, decoder=decoder, metrics=metrics, settings=self.settings, want=want, log=log
        )
        # the parts by name (each documented in ZmqSourceParts): one look-up each on the message path
        self._warnings = parts.warnings
        self._counters = parts.counters
        self._order = parts.order
        self._incarnation = parts.incarnation
        self._polls = parts.polls
        self._messages = parts.messages
        self._ahead = parts.ahead
        self._watch = parts.watch
        self._connected_wall_s: float | None = None
        """Our wall clock when the SUB that is to catch up was opened (:meth:`_open_sub`): a replayed
        batch published before it is history, and stays out of the lag gauge. Taken at the open, not
        at the connection's monitor event, which a busy loop reads late: the catch-up starts once the
        handshake is done, when the engine may already be publishing to us, and those batches, read
        back from the replay socket, are no history."""
        self.gate: Gate | None = None
        """The replica's CPU budget (set by the ingest): while spent, messages are shed undecoded."""
        self._link = SubConnection(parts, endpoint)
        """The SUB's connection as its monitor reports it: handshaken, refused, not listening."""
        self._replays = (
            None if replay_endpoint is None else ReplayMerge(parts, replay_endpoint, shell=self, ctx=ctx)
        )
        """The catch-up, gap and poll replays, merged into the stream (``None``: no replay endpoint)."""

    @property
    def shed(self) -> int:
        """Messages dropped undecoded (the budget was spent, or a flood)."""
        return self._messages.shed

    def engine_gone(self, why: str) -> None:
        """The replica's health probe found nothing listening at the engine (``why``): a replay in
        flight ends at once, and no replay poll starts until the engine is back. Call on the ingest
        loop (:meth:`~balancer.sources.pipeline.EventIngest.engine_gone`)."""
        self._watch.engine_gone(why)

    def engine_back(self) -> None:
        """The replica's health probe passes again: replay polls resume."""
        self._watch.engine_back()

    def status(self) -> SourceStatus:
        return self._counters.status(
            self.kind,
            self.replica,
            self.endpoint,
            dp_rank=self.dp_rank,
            last_seq=self._order.last_seq,
            epoch=self._order.epoch,
            connected=self._link.handshaken,
        )

    async def run(self, emit: Emit) -> None:
        """Receive until cancelled (or the context is terminated); reopen the socket on errors."""
        backoff = Backoff(self.settings.reconnect_initial_s, self.settings.reconnect_max_s)
        while True:
            replays = self._replays
            sub, monitor = self._open_sub()
            self._watch.monitor = monitor
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            dropped = False
            try:
                while True:
                    stashed = bool(self._watch.stash)  # monitor events a replay read meanwhile
                    if self._ahead.pending or stashed:
                        timeout_ms: int | None = 0
                    else:  # until the next replay poll (``None``: none)
                        timeout_ms = None if replays is None else replays.poll_timeout_ms(time.monotonic())
                    ready = dict(await poller.poll(timeout=timeout_ms))
                    # first: a new connection's catch-up merges the queued live
                    if monitor in ready or self._watch.stash:
                        await self._on_monitor(monitor, sub, emit)
                    if sub in ready or self._ahead.pending:
                        backoff.reset()
                        await self._drain(sub, emit, may_drop=True)
                    elif not ready and replays is not None and replays.poll_due(time.monotonic()):
                        await replays.poll(sub, emit)
            except DropBacklog:
                dropped = True
            except HandshakeRefused:
                pass  # the backoff below: a fresh SUB at once would be refused at once, in a loop
            except ReopenSub:
                backoff.reset()
                continue  # a fresh socket at once (``finally`` closes this one); ZMQ paces the connects
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                self._counters.transport_errors += 1
                self._warnings.warning(
                    "zmq_sub_failed",
                    f"{self.replica}/{self.dp_rank}",
                    "replica %s rank %d: SUB %s failed: %s",
                    self.replica,
                    self.dp_rank,
                    self.endpoint,
                    exc,
                )
            finally:
                self._ahead.reader = None  # a shadow: it must not outlive the SUB
                self._watch.reset()
                self._link.handshaken = False
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
                if replays is not None:
                    replays.closed()
            if dropped:  # away for a while: what the flood sends meanwhile is dropped by the publisher
                await asyncio.sleep(self.settings.flood_pause_s)
                continue
            await asyncio.sleep(backoff.next_delay())

    async def _drain(
        self, sub: zmq.asyncio.Socket, emit: Emit, limit: int = 1_000, *, may_drop: bool = False
    ) -> None:
        """Handle the messages queued on ``sub`` now (at most ``limit``, so the monitor gets a turn).
        ``may_drop``: a flood is dropped with the SUB (:meth:`_drop_backlog`); elsewhere (a catch-up,
        the last messages of a lost connection) its messages are shed one by one. A message of too
        many frames shed where the SUB could not be dropped is dropped with it at the next turn here
        (the rest of that message is still on the SUB, to be read by no one)."""
        for _ in range(limit):
            read = self._ahead.read(self.gate)
            if read is None:
                if may_drop and self._ahead.refused:
                    self._drop_backlog(emit)
                return
            await self._on_message(*read, emit)
            if may_drop and read[1] and self._ahead.shed_cause != "budget":
                self._drop_backlog(emit)
            if self.gate is not None:
                await asyncio.sleep(0)  # the ingest loop's applier gets a turn between messages
        self._ahead.drained()  # it may have ended at its limit with the socket empty

    def _drop_backlog(self, emit: Emit) -> None:
        """A flood: its first message was shed (and resynced the rank, if it was taken in order); drop
        the read-ahead and have the SUB reopened, so that libzmq frees the rest of the backlog (and
        the publisher what it still queued for us) without this thread reading it. The next live
        message's seq counts what went (:meth:`take_live`)."""
        self._apply(self._order.drop_backlog(), emit)  # nothing when the shed message started the run
        self._ahead.clear()
        raise DropBacklog

    async def _on_monitor(self, monitor: zmq.asyncio.Socket, sub: zmq.asyncio.Socket, emit: Emit) -> None:
        """Connection events of the SUB. A dropped TCP connection means the publisher's process went
        away (a crash or restart takes its cache with it) or the network did: once the old
        connection's queued messages are handled the rank's blocks are dropped at once
        (``Resync(rank, "disconnect")``), and on the next connection the replay socket is asked for
        everything from seq 0, so a live publisher's buffer refills the index. Without this a
        restarted engine whose first live seq lands above the old last seq would look like a gap, and
        replay would stack the new process's blocks on the dead one's. Every new connection (the
        first one too) starts with that catch-up."""
        while True:
            event = await next_monitor_event(monitor, self._watch)
            if event is None:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECT_RETRIED:
                self._link.connect_refused()
            elif kind == zmq.EVENT_DISCONNECTED and not self._link.handshaken:
                self._link.refused_handshake()
            elif kind == zmq.EVENT_DISCONNECTED:
                self._link.handshaken = False
                replays = self._replays
                if replays is not None:
                    replays.dropping = True  # no replay while its last messages are handled
                await self._drain(sub, emit, limit=self.settings.rcvhwm)
                self._metrics.events_disconnects_total.labels(self.replica).inc()
                self._warnings.warning(
                    "zmq_disconnected",
                    f"{self.replica}/{self.dp_rank}",
                    "replica %s rank %d: publisher %s disconnected (engine down, network, or a message "
                    "over limits.event_message_bytes = %d); its blocks dropped, reconnecting",
                    self.replica,
                    self.dp_rank,
                    self.endpoint,
                    self.settings.max_message_bytes,
                )
                lost, actions = self._order.disconnected()
                if lost is not None:
                    self._incarnation.disconnected(*lost)
                self._apply(actions, emit)
                if replays is not None:
                    replays.catch_up_due = True  # at the next connection
                raise ReopenSub  # ZMQ would not reconnect after a protocol error (an oversized message)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._link.handshaken = True
                self._watch.engine_back()  # a publisher is there (again)
                self._link.problems_over()
                if self._replays is not None and self._replays.catch_up_due:  # a new connection
                    await self._replays.catch_up(sub, emit)  # (once it is a PUB's)

    def _open_sub(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """A SUB and its monitor (:func:`~balancer.sources.zmq_connection.open_sub`), read ahead."""
        self._ahead.clear()  # a fresh socket has no backlog of ours
        if self._replays is not None and self._replays.catch_up_due:  # what came before is history
            self._connected_wall_s = time.time()
        sub, monitor = open_sub(self._ctx, self.endpoint, self.topic, self.settings)
        self._ahead.reader = zmq.Socket.shadow(sub.underlying)
        return sub, monitor

    async def _on_message(self, frames: Sequence[bytes], shed: bool, emit: Emit) -> None:
        taken = self._messages.take(frames, shed, self.gate)
        if taken is not None:
            await self.take_live(taken[0], taken[1], emit)

    async def take_live(
        self, batch: DecodedBatch, digest: int | None, emit: Emit, *, may_replay: bool = True
    ) -> None:
        """One live message (``digest``: of its payload; ``None``: shed, the payload unknown), in the
        order the SUB received it (:class:`~balancer.sources.zmq_replay_merge.ReplayShell`)."""
        assert batch.seq is not None
        self._counters.messages += 1
        self._polls.heard(time.monotonic())
        if self._watch.away is not None:
            self._watch.engine_back()  # it publishes: its replay socket may answer
        replays = self._replays
        actions, verdict = self._order.live(
            batch.seq, digest, batch.epoch, may_replay=may_replay and replays is not None
        )
        if actions:
            self._apply(actions, emit)
        if verdict is DUPLICATE:
            return
        if verdict is REPLAY:
            assert replays is not None  # ``may_replay``
            await replays.fill_gap(emit)
            if self._order.delivered(batch.seq):
                return  # the replay delivered it
        self._accept(batch, digest, emit, live=True)

    def _apply(self, actions: Sequence[Action], emit: Emit) -> None:
        """Do what the stream's order asks (:mod:`balancer.sources.zmq_order`), in order."""
        for action in actions:
            if isinstance(action, Resynced):
                self._counters.resyncs += 1
                emit(IngestBatch((Resync(self.dp_rank, action.reason),)))
            elif isinstance(action, Restarted):
                self._incarnation.restarted(action.why)
            elif isinstance(action, Duplicate):
                self._counters.duplicates += 1
            elif isinstance(action, Gap):
                self._counters.gaps += 1
                self._metrics.events_seq_gaps_total.labels(self.replica).inc()
            elif isinstance(action, FloodLost):
                self._messages.count_shed(action.messages)
            elif isinstance(action, ShedRunStarted):
                self._shed_run_started()

    def take_replayed(self, batch: DecodedBatch, digest: int, emit: Emit) -> None:
        """A replayed batch the stream takes (:class:`~balancer.sources.zmq_replay_merge.ReplayShell`)."""
        self._accept(batch, digest, emit, live=False)

    def _accept(self, batch: DecodedBatch, digest: int | None, emit: Emit, *, live: bool) -> None:
        """Take ``batch`` as the next in order (:meth:`StreamOrder.accept`). Its malformed and ignored
        events are counted here, once, whichever copy (live or replayed) arrived first. ``digest``
        ``None``: a shed message (no events)."""
        assert batch.seq is not None
        if self._incarnation.lost is not None:
            self._incarnation.note(batch, digest, live=live)
        actions = self._order.accept(batch.seq, digest)
        if actions:
            self._apply(actions, emit)
        self._counters.decode_errors += len(batch.errors)
        count_decoded(self._metrics, self._engine, self.replica, batch)
        if batch.errors:
            report_malformed(self._counters, self._warnings, self.replica, batch, time.time())
        if batch.events:
            self._counters.last_event_wall_ts = time.time()
            # a replayed batch published before this connection is history (its age is the time
            # the engine sat idle before kvlb came), not lag: the lag gauge (``engine_ts``) reads it
            # from live batches and those replayed from this connection on (a catch-up, a gap)
            connected = self._connected_wall_s
            history = not live and (connected is None or (batch.timestamp or 0.0) < connected)
            engine_ts = None if history else batch.timestamp
            events = self._messages.ranked(batch, self.dp_rank, self.endpoint)
            emit(IngestBatch(tuple(events), engine_ts, batch.seq, self.dp_rank))

    def _shed_run_started(self) -> None:
        """A run of shed messages starts (its resync follows): counted by its cause, and said."""
        cause, gate = self._ahead.shed_cause, self.gate
        why = gate.spent() if cause == "budget" and gate is not None else self._ahead.explain()
        self._messages.shed_run_started(self.dp_rank, cause, why)
