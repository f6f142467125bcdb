"""One message of a ZMQ source turned into a batch: decoded, shed, or unusable (counts and warns).

:class:`~balancer.sources.zmq_sub.ZmqEventSource` hands each message it read (live, or a replayed
batch's frames) to :class:`MessageReader`: decoded by the engine's decoder, its CPU charged to the
replica's ingestion budget (the ``gate``), or, when the budget is spent or the message is part of a
flood, shed: only its seq is read, so the stream stays in order without a replay
(``kvlb_events_shed_total``). A message that cannot be decoded, or has no seq, is counted
(``kvlb_events_decode_errors_total``) and reported as malformed; a decoder that raises anything
else is a bug on odd input, warned about, and does not stop ingestion. A run of shed messages is
counted by its cause and said here; a batch's events get the source's DP rank when the envelope
names none. Where the batch goes in the stream is the source's (:mod:`balancer.sources.zmq_order`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from balancer.engines import DecodedBatch, Decoder
from balancer.errors import EventDecodeError
from balancer.events import KvEvent
from balancer.gc_tuning import collections_paused, thread_cpu_s
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.sources.base import Gate, SourceCounters, count_decode_error, report_malformed
from balancer.sources.read_ahead import MAX_MESSAGE_FRAMES, ShedCause
from balancer.sources.zmq_replay import SEQ_BYTES
from balancer.types import ReplicaId


class MessageReader:
    """Decodes or sheds one source's messages; its problems go to the source's ``counters`` and
    ``warnings``."""

    def __init__(
        self,
        replica: ReplicaId,
        decoder: Decoder,
        *,
        metrics: Metrics,
        counters: SourceCounters,
        warnings: LimitedWarnings,
        log: logging.Logger,
    ) -> None:
        """``log``: the source's logger (what is said here is said as the source's)."""
        self.replica = replica
        self._decoder = decoder
        self._engine = decoder.engine
        self._metrics = metrics
        self._counters = counters
        self._warnings = warnings
        self._log = log
        self.shed = 0
        """Messages dropped undecoded (the budget was spent, or a flood)."""
        self._rank_warned = False

    def decode(self, frames: Sequence[bytes]) -> DecodedBatch | None:
        """``frames`` decoded (``None``: unusable, counted)."""
        try:
            with collections_paused():  # the decoded envelope dies within: no collection inside
                batch = self._decoder.decode(frames)
        except EventDecodeError as exc:
            self.decode_failed(exc)
            return None
        except Exception as exc:  # a decoder bug on odd input must not stop ingestion
            self._warnings.warning(
                "decoder_failed", self.replica, "replica %s: decoder failed", self.replica, exc_info=exc
            )
            self.decode_failed(exc)
            return None
        if batch.seq is None:
            self.decode_failed(EventDecodeError("frame", "message has no sequence number"))
            return None
        return batch

    def _shed(self, frames: Sequence[bytes]) -> DecodedBatch | None:
        """A message dropped undecoded (the replica's CPU budget is spent): only its seq is read, so
        the stream stays in order without a replay. The rank resyncs when the first shed message of
        a run is accepted (the source's ``_accept``), at its place in the stream."""
        if len(frames) < 3 or len(frames[1]) != SEQ_BYTES:
            return None
        self.count_shed(1)
        return DecodedBatch([], seq=int.from_bytes(frames[1], "big"))

    def count_shed(self, messages: int) -> None:
        """``messages`` dropped undecoded (one shed, or the messages a dropped flood took along)."""
        self.shed += messages
        self._metrics.events_shed_total.labels(self.replica).inc(messages)

    def take(
        self, frames: Sequence[bytes], shed: bool, gate: Gate | None
    ) -> tuple[DecodedBatch, int | None] | None:
        """One live message decoded (its decode charged to the ``gate``) or shed, with its payload's
        digest (``None``: shed, the payload is unknown); ``None`` when it is unusable."""
        if shed:
            batch = self._shed(frames)
        elif gate is None:
            batch = self.decode(frames)
        else:
            started = thread_cpu_s()
            batch = self.decode(frames)
            gate.charge(thread_cpu_s() - started)
        if batch is None or batch.seq is None:
            return None
        return batch, None if shed else hash(frames[-1])

    def decode_failed(self, exc: Exception) -> None:
        """A message (or a replay reply) that could not be decoded: counted and reported."""
        self._counters.decode_errors += 1
        count_decode_error(self._metrics, self._engine, self.replica, exc)
        report_malformed(self._counters, self._warnings, self.replica, None, time.time(), undecodable=exc)

    def shed_run_started(self, dp_rank: int, cause: ShedCause, why: str) -> None:
        """A run of shed messages of rank ``dp_rank`` starts (the source resyncs the rank): counted
        by its ``cause`` and said (``why``: what spent the budget, or the read-ahead's account)."""
        self._metrics.events_shed_runs_total.labels(self.replica, cause).inc()
        if cause == "frames":
            self._warnings.warning(
                "events_frames",
                self.replica,
                "replica %s rank %d: a message of more than %d frames (no engine sends one): read no "
                "further, dropped with the SUB, resyncing",
                self.replica,
                dp_rank,
                MAX_MESSAGE_FRAMES,
            )
        else:
            self._warnings.warning(
                "events_shed",
                self.replica,
                "replica %s rank %d: shedding events (cause %s: %s); dropping messages undecoded and "
                "resyncing",
                self.replica,
                dp_rank,
                cause,
                why,
            )

    def ranked(self, batch: DecodedBatch, dp_rank: int, endpoint: str) -> list[KvEvent]:
        """The events of a batch of the source of rank ``dp_rank`` (publisher at ``endpoint``), with
        that rank when the envelope names none (the port decides the rank)."""
        if batch.dp_rank is None:
            if dp_rank == 0:
                return batch.events
            return [dataclasses.replace(event, dp_rank=dp_rank) for event in batch.events]
        if batch.dp_rank != dp_rank:
            text = (
                f"the publisher at {endpoint} says data_parallel_rank {batch.dp_rank}, this source "
                f"is rank {dp_rank} (port + rank): its events go to rank {batch.dp_rank}; check "
                "the replica's events port and dp_size against the engine's"
            )
            self._counters.note_error(text, time.time())
            if not self._rank_warned:
                self._rank_warned = True
                self._log.warning("replica %s: %s", self.replica, text)
        return batch.events
