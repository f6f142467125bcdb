"""The TRT-LLM relay between the workers of ``kvlb serve --workers N`` (does I/O: ZMQ ``ipc://``).

A TRT-LLM drain (``POST /kv_cache_events``) removes what it returns, so exactly one process may
drain an engine. Among the workers of one supervisor that is worker 0: its
:class:`~balancer.sources.trtllm_poll.TrtllmPoller` hands every drained body that held something
to a :class:`RelayPublisher` (``tap``), which PUBlishes it on ``ipc://<run dir>/trtllm-<hash>.ipc``.
Every other worker runs a :class:`RelaySource` instead of a poller: a SUB on that endpoint that
decodes each body with its own stateful ``TrtllmDecoder``, so all workers apply the same events.

A body the PUB drops (its high-water mark, a subscriber that connects late, worker 0 restarting and
draining while a subscriber reconnects) shows as an ``event_id`` gap in the decoder, which resyncs
that rank (``Resync(rank, "gap")``): the index goes stale for that rank, never wrong. Bodies are
bounded by ``max_message_bytes`` (``ZMQ_MAXMSGSIZE`` on the SUB, as for the engines' own streams).

When worker 0's drain is refused (nothing listens: the engine process and its cache are gone) it
drops the ranks it delivered at once (``Resync(rank, "disconnect")``) and relays that too, as a
message no drain body can be (:func:`disconnect_body`): every other worker drops the same ranks at
once instead of keeping the dead process's blocks until the new one's ``created`` burst.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable

import zmq
import zmq.asyncio

from balancer.engines import Decoder
from balancer.errors import EventDecodeError
from balancer.events import Resync
from balancer.metrics import Metrics
from balancer.sources.base import (
    Backoff,
    Emit,
    IngestBatch,
    SourceCounters,
    SourceStatus,
    count_decode_error,
    count_decoded,
    resyncs_in,
)
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

RELAY_SNDHWM = 10_000
"""Bodies the relay PUB queues per subscriber before it drops (then the subscriber's decoder resyncs)."""


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


def relay_endpoint(run_dir: str, replica: ReplicaId) -> str:
    """The ``ipc://`` endpoint the drainer republishes ``replica``'s bodies on (short: ipc paths are
    limited to about 100 bytes, replica ids are not)."""
    digest = hashlib.sha256(replica.encode("utf-8")).hexdigest()[:16]
    return "ipc://" + os.path.join(run_dir, f"trtllm-{digest}.ipc")


class RelayPublisher:
    """Worker 0's side: republish each drained body (bound on first use, never blocks)."""

    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context) -> None:
        self.endpoint = endpoint
        self._ctx = ctx
        self._pub: zmq.asyncio.Socket | None = None
        self.published = 0
        self.dropped = 0

    def bind(self) -> zmq.asyncio.Socket:
        """The PUB, bound on the first call."""
        if self._pub is None:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, RELAY_SNDHWM)
            pub.bind(self.endpoint)
            self._pub = pub
        return self._pub

    def __call__(self, body: bytes) -> None:
        pub = self.bind()
        try:
            pub.send(body, zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1


class RelaySource:
    """Every other worker's side: the drained bodies of one TRT-LLM replica, decoded here."""

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
    ) -> None:
        self.replica = replica
        self.endpoint = endpoint
        self._ctx = ctx
        self._decoder = decoder
        self._metrics = metrics
        self._engine = decoder.engine
        self._max_message_bytes = max_message_bytes
        self._counters = SourceCounters()

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
            sub.connect(self.endpoint)
            try:
                while True:
                    body = await sub.recv()
                    backoff.reset()
                    self._on_body(body, emit)
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError as exc:
                self._counters.transport_errors += 1
                log.warning("replica %s: relay %s failed (%s); reopening", self.replica, self.endpoint, exc)
            finally:
                sub.close(linger=0)
            await asyncio.sleep(backoff.next_delay())

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
            count_decode_error(self._metrics, self._engine, exc)
            return
        count_decoded(self._metrics, self._engine, self.replica, batch)
        self._counters.messages += 1
        self._counters.decode_errors += len(batch.errors)
        resyncs = resyncs_in(batch.events)
        self._counters.resyncs += len(resyncs)
        gaps = sum(1 for resync in resyncs if resync.reason == "gap")
        if gaps:
            self._counters.gaps += gaps
            self._metrics.events_seq_gaps_total.labels(self.replica).inc(gaps)
        if batch.events:
            self._counters.last_event_wall_ts = time.time()
            emit(IngestBatch(tuple(batch.events)))
