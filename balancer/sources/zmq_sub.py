"""ZMQ subscriber for one SGLang/vLLM publisher (one DP rank), with DEALER replay (does I/O).

The engine PUBlishes ``[topic, seq (8 bytes big-endian), msgpack batch]``; ``seq`` counts batches per
publisher from 0. This source keeps the stream in order:

* **Start / late join.** With no state yet, the first message decides: if its seq is the one wanted
  (0, or the ``resume_seq`` given to the constructor) it is taken; if it is beyond, the replay socket
  is asked for everything from the wanted seq. When replay is off, fails, or starts above the wanted
  seq (its buffer no longer holds it), ``Resync(rank, "gap")`` goes out first and the stream goes on.
  With a ``resume_seq`` the replay socket is also asked at once, before any live message, so a
  replica that went quiet after the previous ingester stopped still gets its missed batches to the
  index (a new holder of its Redis lease); an answer with nothing newer counts as ``empty``.
* **Gap** (seq > last + 1, e.g. PUB high-water-mark drops): replay from ``last + 1`` over a fresh
  DEALER (``[b"", seq8]`` → ``[b"", seq8, payload]``… until seq ``-1``), bounded in time and count.
  Replayed batches newer than ``last`` are taken in order; what replay cannot fill becomes
  ``Resync(rank, "gap")``. Live messages queued meanwhile are then dropped by seq as duplicates.
* **Restart.** The live stream itself only moves forward, so a live seq that does not exceed the
  previous live seq means the publisher restarted: ``Resync(rank, "restart")``, then the message is
  handled as a fresh start (replaying from 0 if it is not seq 0). A new SGLang epoch in the topic
  metadata is the same with reason ``"epoch"``.
* **Lost connection.** A socket monitor sees the SUB's TCP connection drop: the publisher's process
  died (its cache with it), the network failed, or ZMQ refused a message over ``max_message_bytes``
  (``ZMQ_MAXMSGSIZE``; the monitor does not say which). The disconnect is counted
  (``kvlb_events_disconnects_total``) and logged (rate-limited), ``Resync(rank, "disconnect")`` clears
  the rank, the SUB is reopened (libzmq does not reconnect after the protocol error of an oversize
  message) and the next connection asks the replay socket for everything from seq 0. This is also
  what catches a crash and restart whose new seq happens to land above the old one.
* **Shedding.** A message is read but dropped undecoded (``kvlb_events_shed_total``; the rank
  resyncs once per run, the seq still advances so no replay is asked) while the replica's ingestion
  CPU budget is spent or its queue is over half full (the ``gate``, :mod:`balancer.sources.budget`),
  or while the source has read for ``max_behind_s`` without finding the socket empty: a flood then
  costs reading it, not decoding it, and ZMQ does not buffer it.
* Bad messages are counted (``kvlb_events_decode_errors_total``) and skipped; socket errors reopen
  the socket after a backoff. ZMQ connects lazily, so an engine may start after the balancer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from balancer.engines import DecodedBatch, Decoder
from balancer.errors import EventDecodeError
from balancer.events import KvEvent, Resync, ResyncReason
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.sources.base import (
    Backoff,
    Emit,
    Gate,
    IngestBatch,
    SourceCounters,
    SourceStatus,
    count_decode_error,
    count_decoded,
)
from balancer.sources.zmq_settings import ZmqSourceSettings, endpoint_for_rank
from balancer.types import ReplicaId

__all__ = ["ZmqEventSource", "ZmqSourceSettings", "endpoint_for_rank"]

log = logging.getLogger(__name__)

SEQ_BYTES = 8
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


class _Reopen(Exception):
    """The SUB lost its publisher: open a fresh socket (libzmq does not reconnect a connection it
    dropped for a protocol error, such as a message over ``ZMQ_MAXMSGSIZE``)."""


def _is_replay_end(frames: Sequence[bytes]) -> bool:
    """The end of a replay: ``[b"", seq -1, b""]`` (SGLang) or ``[b"", b"", seq -1, b""]`` (vLLM)."""
    return len(frames) in (3, 4) and frames[0] == b"" and frames[-2] == REPLAY_END and frames[-1] == b""


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
        self._decoder = decoder
        self._metrics = metrics
        self._warnings = LimitedWarnings(log, metrics.log_suppressed_total, clock=time.monotonic)
        self._engine = decoder.engine
        self._want = resume_seq if resume_seq is not None else 0
        self._catch_up = resume_seq is not None and replay_endpoint is not None
        self._caught_up_from: int | None = None
        """The seq a catch-up replay started at, until the first live message: a live seq below it
        means the engine restarted meanwhile (everything published since we subscribed is newer)."""
        self._last_seq: int | None = None
        self._live_last: int | None = None
        self._epoch: str | None = None
        self._rank_warned = False
        self._replay_on_connect = False
        self._counters = SourceCounters()
        self.gate: Gate | None = None
        """The replica's CPU budget (set by the ingest): while spent, messages are shed undecoded."""
        self._shedding = False
        self._behind_since: float | None = None
        """When the current run of reads without an empty socket began (``None``: caught up)."""
        self.shed = 0
        """Messages dropped undecoded (the budget was spent)."""

    def status(self) -> SourceStatus:
        c = self._counters
        return SourceStatus(
            kind=self.kind,
            replica=self.replica,
            endpoint=self.endpoint,
            dp_rank=self.dp_rank,
            last_seq=self._last_seq,
            last_event_wall_ts=c.last_event_wall_ts,
            messages=c.messages,
            gaps=c.gaps,
            replays=c.replays,
            replay_failures=c.replay_failures,
            resyncs=c.resyncs,
            duplicates=c.duplicates,
            decode_errors=c.decode_errors,
            transport_errors=c.transport_errors,
            epoch=self._epoch,
        )

    async def run(self, emit: Emit) -> None:
        """Receive until cancelled (or the context is terminated); reopen the socket on errors."""
        backoff = Backoff(self.settings.reconnect_initial_s, self.settings.reconnect_max_s)
        while True:
            sub = self._open_sub()
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            try:
                if self._catch_up:  # live messages queue on the SUB meanwhile; duplicates are dropped
                    self._catch_up = False
                    self._caught_up_from = self._want
                    await self._replay(self._want, emit)
                while True:
                    ready = dict(await poller.poll())
                    if sub in ready:
                        backoff.reset()
                        await self._drain(sub, emit)
                    if monitor in ready:
                        await self._on_monitor(monitor, sub, emit)
            except _Reopen:
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
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            await asyncio.sleep(backoff.next_delay())

    async def _drain(self, sub: zmq.asyncio.Socket, emit: Emit, limit: int = 1_000) -> None:
        """Handle the messages queued on ``sub`` now (at most ``limit``, so the monitor gets a turn)."""
        for _ in range(limit):
            try:
                parts = await sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._behind_since = None  # caught up
                return
            now = time.monotonic()
            if self._behind_since is None:
                self._behind_since = now
            gate = self.gate
            shed = now - self._behind_since > self.settings.max_behind_s
            shed = shed or (gate is not None and not gate.admits())
            if shed:  # only topic and seq are read: the payload is never copied out of ZMQ
                frames = [part.bytes if i < 2 else b"" for i, part in enumerate(parts)]
            else:
                frames = [part.bytes for part in parts]
            await self._on_message(frames, emit, shed)
            if self.gate is not None:
                await asyncio.sleep(0)  # the ingest loop's applier gets a turn between messages

    async def _on_monitor(self, monitor: zmq.asyncio.Socket, sub: zmq.asyncio.Socket, emit: Emit) -> None:
        """Connection events of the SUB. A dropped TCP connection means the publisher's process went
        away (a crash or restart takes its cache with it) or the network did: the rank is resynced
        once the old connection's queued messages are handled, and on the next connection the replay
        socket is asked for everything from seq 0, so a live publisher's buffer refills the index.
        Without this a restarted engine whose first live seq lands above the old last seq would look
        like a gap, and replay would stack the new process's blocks on the dead one's."""
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                await self._drain(sub, emit, limit=self.settings.rcvhwm)
                self._metrics.events_disconnects_total.labels(self.replica).inc()
                self._warnings.warning(
                    "zmq_disconnected",
                    f"{self.replica}/{self.dp_rank}",
                    "replica %s rank %d: publisher %s dropped the connection (engine restart, network, "
                    "or a message over limits.event_message_bytes = %d); resyncing, reconnecting",
                    self.replica,
                    self.dp_rank,
                    self.endpoint,
                    self.settings.max_message_bytes,
                )
                if self._live_last is not None or self._last_seq is not None:
                    self._restart(emit, "disconnect")
                    self._replay_on_connect = True
                raise _Reopen  # ZMQ would not reconnect after a protocol error (an oversized message)
            elif event["event"] == zmq.EVENT_CONNECTED and self._replay_on_connect:
                self._replay_on_connect = False
                if self.replay_endpoint is not None:
                    await self._replay(0, emit)

    def _open_sub(self) -> zmq.asyncio.Socket:
        self._behind_since = None  # a fresh socket has no backlog of ours
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.settings.publisher_reconnect_max_s * 1000)))
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        return sub

    def _decode(self, frames: Sequence[bytes]) -> DecodedBatch | None:
        try:
            batch = self._decoder.decode(frames)
        except EventDecodeError as exc:
            self._decode_failed(exc)
            return None
        except Exception as exc:  # a decoder bug on odd input must not stop ingestion
            self._warnings.warning(
                "decoder_failed", self.replica, "replica %s: decoder failed", self.replica, exc_info=exc
            )
            self._decode_failed(exc)
            return None
        if batch.seq is None:
            self._decode_failed(EventDecodeError("frame", "message has no sequence number"))
            return None
        self._counters.decode_errors += len(batch.errors)
        count_decoded(self._metrics, self._engine, self.replica, batch)
        return batch

    def _shed(self, frames: Sequence[bytes], emit: Emit) -> DecodedBatch | None:
        """Drop a message undecoded (the replica's CPU budget is spent): only its seq is read, so the
        stream stays in order without a replay; the first of a run resyncs the rank."""
        if len(frames) < 3 or len(frames[1]) != SEQ_BYTES:
            return None
        self.shed += 1
        self._metrics.events_shed_total.labels(self.replica).inc()
        if not self._shedding:
            self._shedding = True
            self._warnings.warning(
                "events_shed",
                self.replica,
                "replica %s rank %d: events arrive faster than its ingestion budget allows; "
                "dropping messages undecoded "
                "and resyncing",
                self.replica,
                self.dp_rank,
            )
            self._resync(emit, "overflow")
        return DecodedBatch([], seq=int.from_bytes(frames[1], "big"))

    def _decode_failed(self, exc: Exception) -> None:
        self._counters.decode_errors += 1
        count_decode_error(self._metrics, self._engine, exc)
        log.debug("replica %s rank %d: undecodable message: %s", self.replica, self.dp_rank, exc)

    async def _on_message(self, frames: Sequence[bytes], emit: Emit, shed: bool = False) -> None:
        gate = self.gate
        if shed:
            batch = self._shed(frames, emit)
        elif gate is None:
            batch = self._decode(frames)
            self._shedding = False
        else:
            started = time.thread_time()
            batch = self._decode(frames)
            gate.charge(time.thread_time() - started)
            self._shedding = False
        if batch is None or batch.seq is None:
            return
        self._counters.messages += 1
        seq = batch.seq
        if batch.epoch is not None:
            if self._epoch is not None and batch.epoch != self._epoch:
                self._restart(emit, "epoch")
            self._epoch = batch.epoch
        caught_up_from, self._caught_up_from = self._caught_up_from, None
        went_back = self._live_last is not None and seq <= self._live_last
        below_catch_up = caught_up_from is not None and self._last_seq is not None and seq < caught_up_from
        if went_back or below_catch_up:
            self._restart(emit, "restart")
        self._live_last = seq
        expected = self._expected()
        if seq < expected:
            if self._last_seq is not None:
                self._counters.duplicates += 1  # already taken from a replay
                return
            # No state, and the engine is behind our resume point: it restarted meanwhile.
            self._resync(emit, "restart")
            self._want = expected = seq
        if seq > expected:
            if self._last_seq is not None:
                self._counters.gaps += 1
                self._metrics.events_seq_gaps_total.labels(self.replica).inc()
            if self.replay_endpoint is not None:
                await self._replay(expected, emit)
            if seq < self._expected():
                return  # the replay delivered it
        self._accept(batch, emit)

    def _expected(self) -> int:
        return self._want if self._last_seq is None else self._last_seq + 1

    def _restart(self, emit: Emit, reason: ResyncReason) -> None:
        log.info("replica %s rank %d: publisher restarted (%s)", self.replica, self.dp_rank, reason)
        self._resync(emit, reason)
        self._last_seq = None
        self._live_last = None
        self._want = 0

    def _resync(self, emit: Emit, reason: ResyncReason) -> None:
        self._counters.resyncs += 1
        emit(IngestBatch((Resync(self.dp_rank, reason),)))

    def _accept(self, batch: DecodedBatch, emit: Emit) -> None:
        """Take ``batch`` as the next in order; anything skipped before it is lost: resync."""
        assert batch.seq is not None
        if batch.seq > self._expected():
            self._resync(emit, "gap")
        self._last_seq = batch.seq
        if batch.events:
            self._counters.last_event_wall_ts = time.time()
            emit(IngestBatch(tuple(self._ranked(batch)), batch.timestamp, batch.seq, self.dp_rank))

    def _ranked(self, batch: DecodedBatch) -> list[KvEvent]:
        """Events with this source's rank when the envelope names none (the port decides the rank)."""
        if batch.dp_rank is None:
            if self.dp_rank == 0:
                return batch.events
            return [dataclasses.replace(event, dp_rank=self.dp_rank) for event in batch.events]
        if batch.dp_rank != self.dp_rank and not self._rank_warned:
            self._rank_warned = True
            log.warning(
                "replica %s: publisher %s says dp_rank %d, configured %d (check dp_size/ports)",
                self.replica,
                self.endpoint,
                batch.dp_rank,
                self.dp_rank,
            )
        return batch.events

    async def _replay(self, start_seq: int, emit: Emit) -> None:
        """Ask the replay socket for every batch from ``start_seq`` and take the new ones in order."""
        assert self.replay_endpoint is not None
        try:
            await self._replay_from(start_seq, emit)
        finally:
            self._behind_since = None  # time spent replaying is not a backlog of the live stream

    async def _replay_from(self, start_seq: int, emit: Emit) -> None:
        assert self.replay_endpoint is not None
        self._counters.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        first_seq: int | None = None
        complete = False
        try:
            dealer.connect(self.replay_endpoint)
            async with asyncio.timeout(self.settings.replay_timeout_s):
                # A DEALER with no peer yet holds the send: keep it inside the time budget.
                await dealer.send_multipart([b"", start_seq.to_bytes(SEQ_BYTES, "big")])
                for _ in range(self.settings.replay_max_batches):
                    frames = await dealer.recv_multipart()
                    if _is_replay_end(frames):
                        complete = True
                        break
                    seq = self._on_replayed(frames, emit)
                    if first_seq is None:
                        first_seq = seq
        except TimeoutError:
            log.info("replica %s rank %d: replay from %d timed out", self.replica, self.dp_rank, start_seq)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                raise
            self._warnings.warning(
                "replay_failed",
                f"{self.replica}/{self.dp_rank}",
                "replica %s rank %d: replay failed: %s",
                self.replica,
                self.dp_rank,
                exc,
            )
        finally:
            dealer.close(linger=0)
        self._count_replay(start_seq, first_seq, complete)

    def _on_replayed(self, frames: Sequence[bytes], emit: Emit) -> int | None:
        """Take one replayed ``[b"", seq8, payload]`` (SGLang) or ``[b"", topic, seq8, payload]``
        (vLLM ≥ 0.32); returns its seq (``None`` when unusable)."""
        if len(frames) not in (3, 4) or frames[0] != b"":
            self._decode_failed(EventDecodeError("frame", f"replay reply has {len(frames)} frames"))
            return None
        batch = self._decode(frames[1:])
        if batch is None or batch.seq is None:
            return None
        if batch.seq >= self._expected():
            self._accept(batch, emit)
        return batch.seq

    def _count_replay(self, start_seq: int, first_seq: int | None, complete: bool) -> None:
        if first_seq is None and complete and self._last_seq is None:
            outcome = "empty"  # a catch-up found nothing newer than the resume point
        elif first_seq is None:
            outcome = "failed"
        elif first_seq > start_seq or not complete:
            outcome = "partial"
        else:
            outcome = "filled"
        if outcome not in ("filled", "empty"):
            self._counters.replay_failures += 1
        self._metrics.events_replays_total.labels(self.replica, outcome).inc()
        log.debug("replica %s rank %d: replay from %d %s", self.replica, self.dp_rank, start_seq, outcome)
