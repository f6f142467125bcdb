"""The TRT-LLM relay between the workers of ``kvlb serve --workers N`` (does I/O: ZMQ ``ipc://``).

A TRT-LLM drain (``POST /kv_cache_events``) removes what it returns, so exactly one process may
drain an engine. Among the workers of one supervisor that is worker 0: its
:class:`~balancer.sources.trtllm_poll.TrtllmPoller` hands every drained body that held something
to a :class:`RelayPublisher` (``tap``), which numbers it and PUBlishes ``[incarnation, seq, body]``
on ``ipc://<run dir>/trtllm-<hash>.ipc``. Every other worker runs a :class:`RelaySource` instead of
a poller: a SUB on that endpoint that decodes each body with its own stateful ``TrtllmDecoder``, so
all workers apply the same events.

**Catch-up.** The publisher keeps the bodies it relayed (``limits.relay_history_bytes``, at most
:data:`RELAY_HISTORY_BODIES`; the oldest are dropped first, counted in
``kvlb_events_relay_history_trimmed_total``) and answers a DEALER on ``…-replay.ipc``: ``[b"",
incarnation, seq]`` → ``[b"", incarnation, seq, body]``… then ``[b"", incarnation, -1, b""]``, from
``seq`` when the incarnation is the asker's, else from the oldest kept. A follower catches up when
its SUB connects (its first connection, and after worker 0 restarted), when a live body's seq skips
(a body the PUB dropped: its high-water mark, a slow join) and when a live body comes from a new
incarnation. Without it a worker that started after the first drain, or restarted, would never
learn the blocks stored before it joined. A catch-up that cannot reach back to the seq wanted
(``partial`` in ``kvlb_events_replays_total``) leaves the decoder's ``event_id`` gap to resync the
rank (``Resync(rank, "gap")``): the index goes stale for that rank, never wrong. Bodies are bounded
by ``max_message_bytes`` (``ZMQ_MAXMSGSIZE`` on the SUB and the DEALER, as for the engines' own
streams).

When worker 0's drain is refused (nothing listens: the engine process and its cache are gone) it
drops the ranks it delivered at once (``Resync(rank, "disconnect")``) and relays that too, as a
message no drain body can be (:func:`disconnect_body`): every other worker drops the same ranks at
once instead of keeping the dead process's blocks until the new one's ``created`` burst. The history
then restarts at that marker: the dead process's bodies are of no use to a later follower.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable

import zmq
import zmq.asyncio

from balancer.engines import DecodedBatch, Decoder
from balancer.errors import EventDecodeError
from balancer.events import Resync
from balancer.log_limit import LimitedWarnings
from balancer.metrics import REPLAY_OUTCOMES, Metrics
from balancer.sources.base import (
    Backoff,
    Emit,
    IngestBatch,
    SourceCounters,
    SourceStatus,
    count_decode_error,
    count_decoded,
    report_malformed,
    resyncs_in,
)
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

RELAY_SNDHWM = 10_000
"""Bodies the relay PUB queues per subscriber before it drops (the subscriber then catches up)."""
RELAY_HISTORY_BODIES = 8_192
"""Most bodies the publisher keeps for catch-ups (and the replay socket's send queue, so that one
whole answer fits)."""
CATCH_UP_TIMEOUT_S = 2.0
"""Longest wait for a catch-up's answer (seconds); past it the follower goes on with the live bodies
(``failed`` in ``kvlb_events_replays_total``)."""
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


DISCONNECT_PREFIX = b"\x00kvlb-disconnect "
"""Starts a relayed disconnect (a drain body is JSON: it never starts with a NUL byte)."""


def disconnect_body(ranks: Iterable[int]) -> bytes:
    """The relayed message for "the engine is gone: drop these ranks"."""
    return DISCONNECT_PREFIX + json.dumps(sorted(ranks)).encode("ascii")


def disconnected_ranks(body: bytes) -> list[int] | None:
    """The ranks of a relayed disconnect; ``None`` for a drain body (or a malformed marker)."""
    if not body.startswith(DISCONNECT_PREFIX):
        return None
    try:
        ranks = json.loads(body[len(DISCONNECT_PREFIX) :])
    except ValueError:
        return None
    if not isinstance(ranks, list) or not all(isinstance(r, int) and r >= 0 for r in ranks):
        return None
    return ranks


def count_drained(
    batch: DecodedBatch, replica: ReplicaId, counters: SourceCounters, metrics: Metrics
) -> list[Resync]:
    """Count one decoded drain body, drained here (the poller) or relayed (a follower): the body,
    its malformed events, its resyncs and its ``event_id`` gaps. Returns its resyncs."""
    counters.messages += 1
    counters.decode_errors += len(batch.errors)
    resyncs = resyncs_in(batch.events)
    counters.resyncs += len(resyncs)
    gaps = sum(1 for resync in resyncs if resync.reason == "gap")
    if gaps:
        counters.gaps += gaps
        metrics.events_seq_gaps_total.labels(replica).inc(gaps)
    return resyncs


def relay_endpoint(run_dir: str, replica: ReplicaId) -> str:
    """The ``ipc://`` endpoint the drainer republishes ``replica``'s bodies on (short: ipc paths are
    limited to about 100 bytes, replica ids are not)."""
    digest = hashlib.sha256(replica.encode("utf-8")).hexdigest()[:16]
    return "ipc://" + os.path.join(run_dir, f"trtllm-{digest}.ipc")


def replay_endpoint(endpoint: str) -> str:
    """The relay's catch-up (ROUTER) endpoint beside its PUB ``endpoint``."""
    return endpoint.removesuffix(".ipc") + "-replay.ipc"


class RelayPublisher:
    """Worker 0's side: number, keep and republish each drained body (bound on first use, never
    blocks), and answer the followers' catch-ups (:meth:`run`, owned by the poller)."""

    def __init__(
        self,
        endpoint: str,
        ctx: zmq.asyncio.Context,
        *,
        replica: ReplicaId,
        metrics: Metrics,
        history_bytes: int = 32 * 1024 * 1024,
        history_bodies: int = RELAY_HISTORY_BODIES,
    ) -> None:
        self.endpoint = endpoint
        self.replica = replica
        self._ctx = ctx
        self._metrics = metrics
        self._history_bytes = history_bytes
        self._history_bodies = history_bodies
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self.incarnation = os.urandom(SEQ_BYTES)
        """Tells this publisher's numbering from a restarted worker 0's."""
        self._next_seq = 0
        self._history: deque[tuple[int, bytes]] = deque()
        self._kept_bytes = 0
        self.published = 0
        self.dropped = 0
        self.trimmed = 0
        self.answered = 0
        metrics.events_relay_history_trimmed_total.labels(replica)

    def bind(self) -> zmq.asyncio.Socket:
        """The PUB (and the catch-up ROUTER), bound on the first call."""
        if self._pub is None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, self._history_bodies + 1)
            router.setsockopt(zmq.MAXMSGSIZE, 1024)  # requests are two short frames
            router.bind(replay_endpoint(self.endpoint))
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, RELAY_SNDHWM)
            pub.bind(self.endpoint)
            self._pub, self._router = pub, router
        return self._pub

    def __call__(self, body: bytes) -> None:
        pub = self.bind()
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        if disconnected_ranks(body) is not None:  # the engine is gone: its bodies help nobody now
            self._history.clear()
            self._kept_bytes = 0
        self._keep(seq, body)
        try:
            pub.send_multipart([self.incarnation, seq.to_bytes(SEQ_BYTES, "big"), body], zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1

    def _keep(self, seq: int, body: bytes) -> None:
        self._history.append((seq, body))
        self._kept_bytes += len(body)
        while len(self._history) > 1 and (
            self._kept_bytes > self._history_bytes or len(self._history) > self._history_bodies
        ):
            _, old = self._history.popleft()
            self._kept_bytes -= len(old)
            self.trimmed += 1
            self._metrics.events_relay_history_trimmed_total.labels(self.replica).inc()

    def kept(self) -> tuple[int, int]:
        """(bodies, bytes) kept for catch-ups."""
        return len(self._history), self._kept_bytes

    async def run(self) -> None:
        """Answer catch-up requests until cancelled (or the context is terminated)."""
        self.bind()
        router = self._router
        assert router is not None
        try:
            while True:
                try:
                    frames = await router.recv_multipart()
                except zmq.ContextTerminated:
                    return
                except zmq.ZMQError as exc:  # a malformed peer; the socket itself stays usable
                    log.warning("replica %s: relay catch-up socket: %s", self.replica, exc)
                    await asyncio.sleep(0.05)
                    continue
                self._answer(router, frames)
        finally:
            self.close()

    def close(self) -> None:
        """Close both sockets (the poller stopped); a later body binds them again."""
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def _answer(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """``[peer, b"", incarnation, seq]`` → every kept body from ``seq`` (from the oldest kept
        when ``incarnation`` is not this publisher's), then the end marker."""
        if len(frames) != 4 or frames[1] != b"" or len(frames[3]) != SEQ_BYTES:
            return  # not a follower of ours
        peer = frames[0]
        start = int.from_bytes(frames[3], "big") if frames[2] == self.incarnation else 0
        try:
            for seq, body in self._history:
                if seq >= start:
                    router.send_multipart(
                        [peer, b"", self.incarnation, seq.to_bytes(SEQ_BYTES, "big"), body], zmq.NOBLOCK
                    )
            router.send_multipart([peer, b"", self.incarnation, END_SEQ, b""], zmq.NOBLOCK)
            self.answered += 1
        except zmq.ZMQError:  # the peer is gone or its queue is full: it times out and goes on
            pass


class RelaySource:
    """Every other worker's side: the drained bodies of one TRT-LLM replica, decoded here in the
    publisher's order (each body once: by incarnation and seq)."""

    kind = "trtllm_relay"

    def __init__(
        self,
        replica: ReplicaId,
        endpoint: str,
        *,
        ctx: zmq.asyncio.Context,
        decoder: Decoder,
        metrics: Metrics,
        max_message_bytes: int,
        catch_up_timeout_s: float = CATCH_UP_TIMEOUT_S,
    ) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self._ctx = ctx
        self._decoder = decoder
        self._metrics = metrics
        self._engine = decoder.engine
        self._warnings = LimitedWarnings(
            log,
            metrics.log_suppressed_total,
            clock=time.monotonic,
            forgotten=metrics.log_causes_forgotten_total,
        )
        self._max_message_bytes = max_message_bytes
        self._catch_up_timeout_s = catch_up_timeout_s
        self._counters = SourceCounters()
        self._incarnation: bytes | None = None
        self._next_seq = 0
        """The next body wanted of ``_incarnation``."""
        for outcome in REPLAY_OUTCOMES:
            metrics.events_replays_total.labels(replica, outcome)

    def status(self) -> SourceStatus:
        return self._counters.status(self.kind, self.replica, self.endpoint)

    async def run(self, emit: Emit) -> None:
        """Receive and decode until cancelled (or the context is terminated)."""
        backoff = Backoff(0.1, 5.0)
        while True:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
            sub.connect(self.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            try:
                while True:
                    ready = dict(await poller.poll())
                    if monitor in ready:  # a (new) publisher: what did we miss before joining?
                        while await monitor.poll(0):
                            await monitor.recv_multipart()
                        await self._catch_up(emit)
                    if sub in ready:
                        backoff.reset()
                        await self._on_live(await sub.recv_multipart(), emit)
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError as exc:
                self._counters.transport_errors += 1
                log.warning("replica %s: relay %s failed (%s); reopening", self.replica, self.endpoint, exc)
            finally:
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            await asyncio.sleep(backoff.next_delay())

    async def _on_live(self, frames: list[bytes], emit: Emit) -> None:
        if len(frames) != 3 or len(frames[0]) != SEQ_BYTES or len(frames[1]) != SEQ_BYTES:
            self._counters.decode_errors += 1
            count_decode_error(
                self._metrics, self._engine, self.replica, EventDecodeError("frame", "not a relay message")
            )
            return
        incarnation, seq = frames[0], int.from_bytes(frames[1], "big")
        if incarnation != self._incarnation or seq > self._next_seq:
            await self._catch_up(emit)  # a new publisher, or bodies the PUB dropped
        if incarnation != self._incarnation:  # the catch-up failed: take it from here
            self._incarnation, self._next_seq = incarnation, seq
        if seq >= self._next_seq:  # past a gap nothing fills, the decoder's event_id gap resyncs
            self._take(seq, frames[2], emit)
        else:
            self._counters.duplicates += 1

    async def _catch_up(self, emit: Emit) -> None:
        """Ask the publisher for every body kept after the last one taken, and take them in order."""
        self._counters.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        outcome = "failed"
        try:
            dealer.connect(replay_endpoint(self.endpoint))
            known = self._incarnation or bytes(SEQ_BYTES)
            await dealer.send_multipart([b"", known, self._next_seq.to_bytes(SEQ_BYTES, "big")])
            outcome = await self._take_answer(dealer, emit)
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as exc:
            log.debug("replica %s: relay catch-up failed: %s", self.replica, exc)
        finally:
            dealer.close(linger=0)
        if outcome == "failed":
            self._counters.replay_failures += 1
        self._metrics.events_replays_total.labels(self.replica, outcome).inc()

    async def _take_answer(self, dealer: zmq.asyncio.Socket, emit: Emit) -> str:
        """Take the answer's bodies; its outcome (``filled``, ``empty``, ``partial``, ``failed``)."""
        outcome = "empty"
        deadline = time.monotonic() + self._catch_up_timeout_s
        for _ in range(RELAY_HISTORY_BODIES + 1):
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not await dealer.poll(int(left_s * 1000) + 1):
                return "failed"
            frames = await dealer.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != SEQ_BYTES:
                return "failed"
            incarnation, seq_bytes, body = frames[1], frames[2], frames[3]
            if seq_bytes == END_SEQ:
                return outcome
            seq = int.from_bytes(seq_bytes, "big")
            if incarnation != self._incarnation:  # a new publisher: its numbering starts again
                self._incarnation, self._next_seq = incarnation, 0
            if seq < self._next_seq:
                continue
            if outcome == "empty":
                outcome = "filled" if seq == self._next_seq else "partial"
            self._take(seq, body, emit)
        return "failed"

    def _take(self, seq: int, body: bytes, emit: Emit) -> None:
        self._next_seq = seq + 1
        self._on_body(body, emit)

    def _on_body(self, body: bytes, emit: Emit) -> None:
        ranks = disconnected_ranks(body)
        if ranks is not None:
            self._counters.resyncs += len(ranks)
            self._metrics.events_disconnects_total.labels(self.replica).inc()
            log.info(
                "replica %s: the draining worker found the engine disconnected; its blocks dropped "
                "(ranks %s)",
                self.replica,
                ranks,
            )
            if ranks:
                emit(IngestBatch(tuple(Resync(rank, "disconnect") for rank in ranks)))
            return
        try:
            batch = self._decoder.decode([body])
        except EventDecodeError as exc:
            self._counters.decode_errors += 1
            count_decode_error(self._metrics, self._engine, self.replica, exc)
            report_malformed(self._counters, self._warnings, self.replica, None, time.time(), undecodable=exc)
            return
        count_decoded(self._metrics, self._engine, self.replica, batch)
        if batch.errors:
            report_malformed(self._counters, self._warnings, self.replica, batch, time.time())
        count_drained(batch, self.replica, self._counters, self._metrics)
        if batch.events:
            self._counters.last_event_wall_ts = time.time()
            emit(IngestBatch(tuple(batch.events)))
