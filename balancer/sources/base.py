"""The event-source seam and what every source shares (pure: no sockets, no clock reads).

A source (:mod:`balancer.sources.zmq_sub`, :mod:`balancer.sources.trtllm_poll`) talks to one engine
stream, decodes its messages with the engine's sans-IO decoder, keeps the stream in order (gaps,
replay, restarts) and hands ordered :class:`IngestBatch` es to an :data:`Emit` callback. The callback
is :meth:`balancer.sources.pipeline.ReplicaPipeline.offer`: synchronous and never blocking, so a slow
index can never stall a socket (the pipeline's bounded queue drops and resyncs instead).

Sources do I/O; this module only holds the seam, the status record and small helpers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from balancer.engines import DecodedBatch
from balancer.errors import ConfigError, EventDecodeError
from balancer.events import KvEvent, Resync
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

PER_EVENT_ERROR = "event"
"""``reason`` label for one malformed event inside a good message (the detail is only logged)."""
INTERNAL_ERROR = "internal"
"""``reason`` label for a decoder that failed with something other than ``EventDecodeError``."""
MAX_ERROR_CHARS = 400
"""The longest :attr:`SourceStatus.last_error` kept (characters)."""
MALFORMED_CAUSE = "events_malformed"
"""The warning cause of events a source could not use (:func:`report_malformed`)."""


@dataclass(frozen=True, slots=True)
class IngestBatch:
    """Events of one replica, in order, ready for ``PrefixIndex.apply``.

    ``engine_ts`` is the engine's wall-clock timestamp of the batch (ZMQ envelope ``ts``), used only
    for the lag gauge; ``None`` when the transport has none (TRT-LLM) and for a replayed batch
    published before the source connected (its age is the time the engine sat idle, not lag).
    """

    events: tuple[KvEvent, ...]
    engine_ts: float | None = None
    seq: int | None = None
    """The engine's sequence number of the message (ZMQ seq), so a new ingester can resume after it;
    ``None`` when the transport has none or for batches a source made up (``Resync``)."""
    dp_rank: int | None = None
    """The DP rank whose sequence ``seq`` counts (the publisher's rank)."""
    positions: Mapping[int, int] = field(default_factory=dict)
    """DP rank → the last per-event id of that rank among ``events`` (TRT-LLM's ``event_id``:
    ``DecodedBatch.positions``), stored like ``seq`` so a new ingester checks that it follows on."""


Emit = Callable[[IngestBatch], None]
"""Where a source puts ordered batches; must not block (see ``ReplicaPipeline.offer``)."""


class Gate(Protocol):
    """What a source asks before decoding and tells after: its replica's ingestion CPU budget
    (:meth:`balancer.sources.pipeline.ReplicaPipeline.admits` and ``charge``)."""

    def admits(self) -> bool: ...

    def charge(self, cpu_s: float) -> None: ...

    def spent(self) -> str:
        """Why it does not admit now, in figures (for the shed warning)."""
        ...


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """What a source knows about its stream, for ``/admin/replicas`` (a point-in-time copy)."""

    kind: str
    """``"zmq"`` or ``"trtllm"``."""
    replica: ReplicaId
    endpoint: str
    dp_rank: int | None
    """The DP rank this source serves; ``None`` when one stream carries every rank (TRT-LLM)."""
    last_seq: int | None
    """Last ZMQ sequence number taken in order; ``None`` before the first or after a restart."""
    last_event_wall_ts: float | None
    """Our wall clock (``time.time()``) when the last message with events arrived."""
    messages: int
    gaps: int
    replays: int
    replay_failures: int
    resyncs: int
    duplicates: int
    decode_errors: int
    transport_errors: int
    epoch: str | None = None
    disabled: bool = False
    """TRT-LLM answered 404: the engine runs without ``event_buffer_max_size``."""
    connected: bool | None = None
    """Whether the ZMQ SUB holds a connection to a PUB that completed the ZMQ handshake;
    ``None`` for a transport without a standing connection (the TRT-LLM drain)."""
    last_error: str | None = None
    """The newest problem with what the engine sends or where, in words that name the fix (a block
    size that differs from the engine's, a port nothing listens on, a peer that is not a PUB, an
    undecodable message); ``None``: none so far. Kept after the problem ends: see its age."""
    last_error_wall_ts: float | None = None
    """Our wall clock (``time.time()``) when :attr:`last_error` was last seen."""


@dataclass(slots=True)
class SourceCounters:
    """Mutable counters a source updates as it goes; :meth:`status` freezes them."""

    messages: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    resyncs: int = 0
    duplicates: int = 0
    decode_errors: int = 0
    transport_errors: int = 0
    last_event_wall_ts: float | None = None
    last_error: str | None = None
    last_error_wall_ts: float | None = None

    def note_error(self, text: str, wall_ts: float) -> None:
        """``text`` is the stream's newest problem (:attr:`SourceStatus.last_error`), seen at
        ``wall_ts`` (our wall clock); bounded to :data:`MAX_ERROR_CHARS` characters."""
        self.last_error = text[:MAX_ERROR_CHARS]
        self.last_error_wall_ts = wall_ts

    def status(
        self,
        kind: str,
        replica: ReplicaId,
        endpoint: str,
        *,
        dp_rank: int | None = None,
        last_seq: int | None = None,
        epoch: str | None = None,
        disabled: bool = False,
        connected: bool | None = None,
    ) -> SourceStatus:
        """The counters as they are now, with the source's identity."""
        return SourceStatus(
            kind=kind,
            replica=replica,
            endpoint=endpoint,
            dp_rank=dp_rank,
            last_seq=last_seq,
            last_event_wall_ts=self.last_event_wall_ts,
            messages=self.messages,
            gaps=self.gaps,
            replays=self.replays,
            replay_failures=self.replay_failures,
            resyncs=self.resyncs,
            duplicates=self.duplicates,
            decode_errors=self.decode_errors,
            transport_errors=self.transport_errors,
            epoch=epoch,
            disabled=disabled,
            connected=connected,
            last_error=self.last_error,
            last_error_wall_ts=self.last_error_wall_ts,
        )


class EventSource(Protocol):
    """One engine event stream of one replica. ``run`` returns only when cancelled (or the ZMQ
    context is terminated); transport errors are retried with backoff, bad input is counted."""

    replica: ReplicaId

    async def run(self, emit: Emit) -> None: ...

    def status(self) -> SourceStatus: ...


@dataclass(slots=True)
class Backoff:
    """Exponential delays for retries: ``initial_s``, ×``factor`` each failure, capped at ``max_s``."""

    initial_s: float
    max_s: float
    factor: float = 2.0
    _next_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial_s) and 0 < self.initial_s <= self.max_s):
            raise ConfigError(f"backoff needs 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.factor < 1:
            raise ConfigError(f"backoff factor must be >= 1, got {self.factor}")
        self._next_s = self.initial_s

    def next_delay(self) -> float:
        """The delay to wait now (seconds); the following one grows."""
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * self.factor)
        return delay

    def reset(self) -> None:
        """A success: the next failure waits ``initial_s`` again."""
        self._next_s = self.initial_s


def count_decode_error(metrics: Metrics, engine: str, replica: ReplicaId, exc: Exception) -> None:
    """Count a message of ``replica`` that could not be decoded at all (``EventDecodeError`` or a
    decoder bug)."""
    reason = exc.reason if isinstance(exc, EventDecodeError) else INTERNAL_ERROR
    metrics.events_decode_errors_total.labels(replica, engine, reason).inc()


def count_decoded(metrics: Metrics, engine: str, replica: ReplicaId, batch: DecodedBatch) -> None:
    """Count what a good message still lost: malformed events and events ignored on purpose; and
    what its decoder forgot at a cap (``kvlb_events_decoder_forgotten_total``)."""
    if batch.errors:
        metrics.events_decode_errors_total.labels(replica, engine, PER_EVENT_ERROR).inc(len(batch.errors))
        log.debug("replica %s: %d malformed events, first: %s", replica, len(batch.errors), batch.errors[0])
    if batch.ignored:
        metrics.events_applied_total.labels(engine, "other", "ignored").inc(batch.ignored)
    if batch.forgotten:
        metrics.events_decoder_forgotten_total.labels(replica).inc(batch.forgotten)


def report_malformed(
    counters: SourceCounters,
    warnings: LimitedWarnings,
    replica: ReplicaId,
    batch: DecodedBatch | None,
    wall_ts: float,
    *,
    undecodable: Exception | None = None,
) -> None:
    """Tell the operator about events that could not be used: a good message's malformed events
    (``batch``) or a whole message that did not decode (``undecodable``). The first reason becomes
    the source's :attr:`~SourceCounters.last_error` (``/admin/replicas``) and a warning, the first at
    once, then one a minute per replica with the count (:class:`LimitedWarnings`). A steady stream
    of them is a misconfiguration, not noise: the engine's block size differs from the replica's, or
    another engine kind publishes on the endpoint; the decoders' reasons name the fix."""
    if undecodable is not None:
        reason = str(undecodable) if isinstance(undecodable, EventDecodeError) else repr(undecodable)
        text = f"a message could not be decoded ({reason})"
    elif batch is not None and batch.errors:
        count = len(batch.errors)
        events = "event" if count == 1 else "events"
        text = f"{count} malformed {events} skipped in one message, first: {batch.errors[0]}"
    else:
        return
    counters.note_error(text, wall_ts)
    warnings.warning(MALFORMED_CAUSE, replica, "replica %s: %s", replica, text)


SILENT_AFTER_ANSWERS = 8
"""Receipts (answers whose usage the engine reported) of a replica whose event sources never
brought a batch after which :func:`silent_stream_hint` speaks."""


def silent_stream_hint(sources: Sequence[SourceStatus], answered: int) -> str | None:
    """Why a replica that answered ``answered`` requests (its receipts) has had no KV event batch
    since kvlb connected, when nothing else explains it: every source connected (or a drain), none
    ever brought a batch with events, none saw an error. Then the engine is publishing nothing: its
    prefix cache is off, or it publishes on another topic than the replica's (a SUB drops those
    without a word). ``None`` while that is not the case, or before :data:`SILENT_AFTER_ANSWERS`."""
    if answered < SILENT_AFTER_ANSWERS or not sources:
        return None
    if any(
        s.last_event_wall_ts is not None or s.last_error is not None or s.connected is False or s.disabled
        for s in sources
    ):
        return None
    return (
        f"no KV event batch from the engine since kvlb connected, while it answered {answered} "
        "requests: its prefix cache is off (vLLM: --enable-prefix-caching; SGLang: without "
        "--disable-radix-cache) or it publishes on another topic than this replica's topic"
    )


def last_batch_wall_s(sources: Sequence[SourceStatus]) -> float | None:
    """Our wall clock when the newest KV event batch of any of a replica's sources came (``None``:
    none since kvlb connected)."""
    times = [s.last_event_wall_ts for s in sources if s.last_event_wall_ts is not None]
    return max(times) if times else None


def stalled_stream_hint(
    computed_blocks: int, first_computed_wall_s: float, now_wall_s: float, bound_s: float
) -> str | None:
    """Why a replica that has published KV events needs a look: requests decided after its last
    batch, the first ``now_wall_s - first_computed_wall_s`` seconds ago, computed
    ``computed_blocks`` new prompt blocks (its answers' ``cached_tokens``), which an engine with its
    prefix cache on stores and publishes, and no batch came since. ``None`` within ``bound_s``
    (``events_stalled_hint_s``) or when nothing was computed."""
    waited_s = now_wall_s - first_computed_wall_s
    if computed_blocks <= 0 or bound_s <= 0 or waited_s < bound_s:
        return None
    return (
        f"no KV event batch for {waited_s:.0f} s while the engine computed {computed_blocks} new "
        "prompt blocks (its answers' cached_tokens) in requests decided since its last batch: its "
        "event publisher stopped or the stream is lost (is the engine's publisher still running, "
        "and the replica's endpoint and topic its own?); routing predicts from receipts meanwhile"
    )


def resyncs_in(events: tuple[KvEvent, ...] | list[KvEvent]) -> list[Resync]:
    """The ``Resync`` events among ``events`` (decoders emit their own, e.g. TRT-LLM ``created``)."""
    return [event for event in events if isinstance(event, Resync)]
