"""Poller of TRT-LLM's ``POST /kv_cache_events`` drain for one replica (does I/O; the path is the
engine spec's ``drain_path``).

Each POST returns, and removes from the engine, every event buffered since the last one: the poller
must be the only consumer of that replica (with Redis, its ingestion lease: ``docs/redis-fleet.md``).
Ordering lives in the stateful :class:`balancer.engines.trtllm.TrtllmDecoder` (``event_id`` per rank,
``created``), whose ``Resync`` events flow through unchanged.

Pacing: after a drain that held anything the next poll comes after ``min_interval_s``; each empty
drain doubles the wait up to ``max_interval_s``. Connection errors, timeouts and bad statuses back
off (``error_backoff_*``) and never end the loop; a 404 (events disabled on the engine) is logged
once and retried every ``disabled_retry_s``.

**Engine down.** A drain whose connection is *refused* means nothing listens on the engine's port:
its process is gone, and its KV cache with it (a timeout or a server error does not say that; those
only back off). The poller then drops the blocks of every rank it has delivered at once
(``Resync(rank, "disconnect")``) and logs the engine as disconnected, without waiting for a new
process's ``created`` events; once a drain answers again and the decoder sees a new start-up burst
(``created``) or an ``event_id`` regression, the engine is logged as restarted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from balancer.config.settings import Secret
from balancer.engines import DecodedBatch, Decoder
from balancer.errors import ConfigError, EventDecodeError
from balancer.events import Resync
from balancer.gc_tuning import thread_cpu_s
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
    report_malformed,
)
from balancer.sources.http import BodyTooLarge, read_capped
from balancer.sources.trtllm_relay import count_drained, disconnect_body
from balancer.types import ReplicaId
from balancer.upstream.auth import REFUSED_CALLER_STATUSES, engine_auth_headers, refused_caller

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PollSettings:
    """Settings of every :class:`TrtllmPoller`."""

    min_interval_s: float = 0.01
    """Wait after a drain that returned events (seconds). Must be > 0."""
    max_interval_s: float = 0.5
    """Longest wait between polls of an idle engine (seconds); the staleness bound of the index
    for TRT-LLM when traffic resumes. Must be ≥ ``min_interval_s``."""
    request_timeout_s: float = 5.0
    """Whole-request timeout (seconds). Older engines hold an idle drain ~2 s, so keep it above
    that; at the limit the poll counts as an error and backs off."""
    error_backoff_initial_s: float = 0.2
    """First wait after a failed poll (seconds); doubles per consecutive failure."""
    error_backoff_max_s: float = 5.0
    """Longest wait after failures (seconds), e.g. while the engine is down or not started yet."""
    disabled_retry_s: float = 30.0
    """Wait between polls while the engine answers 404 (events disabled) (seconds)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest drain body accepted (bytes; ``limits.event_message_bytes``). A larger one is read no
    further than this, dropped and counted as a transport error; the decoder then sees an
    ``event_id`` gap on the next drain and resyncs."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field out of range."""
        for name in (
            "min_interval_s",
            "max_interval_s",
            "request_timeout_s",
            "error_backoff_initial_s",
            "error_backoff_max_s",
            "disabled_retry_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"trtllm_poll.{name} must be a finite number > 0, got {value}")
        if self.min_interval_s > self.max_interval_s:
            raise ConfigError("trtllm_poll.min_interval_s must be <= max_interval_s")
        if self.error_backoff_initial_s > self.error_backoff_max_s:
            raise ConfigError("trtllm_poll.error_backoff_initial_s must be <= error_backoff_max_s")
        if self.max_body_bytes < 2:
            raise ConfigError("trtllm_poll.max_body_bytes must be >= 2")


class PollError(Exception):
    """One poll failed at the HTTP level (bad status, oversized body)."""


GATE_WAIT_S = 0.05
"""Pause (seconds) between checks of a spent ingestion budget before the next drain."""


class DrainTap(Protocol):
    """Gets every drained body that held something (the relay to the other workers)."""

    def __call__(self, body: bytes) -> None: ...

    async def run(self) -> None:
        """Its own loop (answering late subscribers), run for as long as the poller runs."""
        ...


class TrtllmPoller:
    """The single consumer of one replica's ``/kv_cache_events`` drain."""

    kind = "trtllm"

    def __init__(
        self,
        replica: ReplicaId,
        base_url: str,
        *,
        path: str,
        session: aiohttp.ClientSession,
        decoder: Decoder,
        metrics: Metrics,
        settings: PollSettings | None = None,
        tap: DrainTap | None = None,
        api_key: Secret | None = None,
    ) -> None:
        """``path``: the drain's endpoint on ``base_url`` (the engine spec's ``drain_path``);
        ``session`` is shared and owned by the caller; ``decoder`` is this stream's own
        (stateful) ``TrtllmDecoder``; ``tap`` gets every drained body that held something, and
        a disconnect marker when a refused drain drops the ranks (the relay to the other workers,
        :mod:`balancer.sources.trtllm_relay`); ``api_key``, the replica's own key, is sent with every
        drain."""
        self._api_key = api_key
        self.tap = tap
        self.gate: Gate | None = None
        """The replica's ingestion CPU budget (set by the ingest); while spent, drains wait."""
        self.replica = replica
        self.url = base_url.rstrip("/") + path
        self.settings = settings or PollSettings()
        self.settings.validate()
        self._session = session
        self._decoder = decoder
        self._metrics = metrics
        self._warnings = LimitedWarnings(
            log,
            metrics.log_suppressed_total,
            clock=time.monotonic,
            forgotten=metrics.log_causes_forgotten_total,
        )
        self._engine = decoder.engine
        self._interval_s = self.settings.min_interval_s
        self._backoff = Backoff(self.settings.error_backoff_initial_s, self.settings.error_backoff_max_s)
        self._failing = False
        self._disabled = False
        self._down = False
        """A refused drain dropped the replica's blocks; not yet seen back with a new start-up."""
        self._ranks: set[int] = set()
        """DP ranks this poller delivered events of (at most the engine's attention-DP size)."""
        self._counters = SourceCounters()
        self._finishing = False
        self._exchanging = False
        self._unsure = False
        """The last drain failed in a way that may have emptied the engine's buffer (a timeout, a
        broken connection, an oversized body): until a drain answers, a hand-over is not clean."""

    def finish(self) -> None:
        """Start no new drain: a graceful stop follows
        (:class:`~balancer.sources.pipeline.ConsumingSource`)."""
        self._finishing = True

    @property
    def exchanging(self) -> bool:
        """A drain is under way: the engine may have handed over events not yet emitted."""
        return self._exchanging

    @property
    def settled(self) -> bool:
        """Every drain so far emitted what it took, or failed before the engine could hand anything over."""
        return not self._unsure

    def status(self) -> SourceStatus:
        return self._counters.status(self.kind, self.replica, self.url, disabled=self._disabled)

    async def run(self, emit: Emit) -> None:
        """Poll until cancelled. While the replica's ingestion CPU budget is spent (:attr:`gate`) the
        next drain waits: the engine keeps the events (up to its ``event_buffer_max_size``; past it
        the ``event_id`` gap resyncs), kvlb spends nothing on them. The ``tap``'s own loop runs as
        long as this one (and is cancelled with it)."""
        if self.tap is None:
            await self._poll_forever(emit)
            return
        async with asyncio.TaskGroup() as group:
            group.create_task(self.tap.run(), name=f"relay-{self.replica}")
            await self._poll_forever(emit)

    async def _poll_forever(self, emit: Emit) -> None:
        while True:
            while self.gate is not None and not self.gate.admits():  # noqa: ASYNC110 (a budget refills with time)
                await asyncio.sleep(GATE_WAIT_S)
            delay_s = await self.poll_once(emit)
            await asyncio.sleep(delay_s)

    async def poll_once(self, emit: Emit) -> float:
        """One drain; returns how long to wait before the next (seconds). No drain once
        :meth:`finish` was called. :attr:`exchanging` from the request until its events are
        emitted: a graceful stop waits for that instead of cancelling a drain whose events the
        engine already gave up."""
        if self._finishing:
            return self.settings.min_interval_s
        self._exchanging = True
        try:
            return await self._poll(emit)
        finally:
            self._exchanging = False

    async def _poll(self, emit: Emit) -> float:
        try:
            body = await self._drain()
        except (aiohttp.ClientError, TimeoutError, PollError) as exc:
            self._metrics.events_drains_total.labels(self.replica, "failed").inc()
            refused = _refused(exc)
            self._unsure = not refused  # a refused connection never reached the engine
            if refused and self._ranks:
                self._engine_gone(emit)
            return self._failed(exc)
        self._unsure = False
        if self._failing:
            log.info("replica %s: %s reachable again", self.replica, self.url)
        self._failing = False
        self._backoff.reset()
        if body is None:
            self._metrics.events_drains_total.labels(self.replica, "disabled").inc()
            self._counters.note_error(
                f"{self.url} answers 404: KV events are off on the engine "
                "(set kv_cache_config.event_buffer_max_size > 0), or it is not a TRT-LLM server "
                "(check the replica's engine)",
                time.time(),
            )
            if not self._disabled:
                log.warning(
                    "replica %s: %s answers 404; KV events are off on the engine "
                    "(set kv_cache_config.event_buffer_max_size > 0), or it is not a TRT-LLM server "
                    "(check the replica's engine); retrying every %.0f s",
                    self.replica,
                    self.url,
                    self.settings.disabled_retry_s,
                )
            self._disabled = True
            return self.settings.disabled_retry_s
        self._disabled = False
        batch = self._decode(body)
        busy = batch is None or bool(batch.events or batch.ignored or batch.errors)
        self._metrics.events_drains_total.labels(self.replica, "events" if busy else "empty").inc()
        if batch is not None:
            self._deliver(batch, emit)
        if busy and self.tap is not None:
            self.tap(body)
        if busy:
            self._interval_s = self.settings.min_interval_s
        else:
            self._interval_s = min(self.settings.max_interval_s, self._interval_s * 2)
        return self._interval_s

    async def _drain(self) -> bytes | None:
        """POST the drain; the body, or ``None`` for 404. Raises on errors."""
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s)
        headers = engine_auth_headers(self._api_key)  # per call: the key may rotate
        async with self._session.post(self.url, timeout=timeout, headers=headers) as resp:
            if resp.status == 404:
                await resp.release()
                return None
            if resp.status in REFUSED_CALLER_STATUSES:
                if self._api_key is not None:
                    self._api_key.refused()  # re-read a rotated key now (any thread may call it)
                raise PollError(refused_caller(resp.status, self._api_key))
            if resp.status != 200:
                raise PollError(f"HTTP {resp.status}")
            try:
                return await read_capped(resp, self.settings.max_body_bytes)
            except BodyTooLarge as exc:
                raise PollError(str(exc)) from None

    def _engine_gone(self, emit: Emit) -> None:
        """Nothing listens on the engine's port: drop what every rank held, at once."""
        ranks, self._ranks = sorted(self._ranks), set()
        self._down = True
        self._counters.resyncs += len(ranks)
        self._metrics.events_disconnects_total.labels(self.replica).inc()
        log.warning(
            "replica %s: %s refused the connection: engine disconnected (down or restarting); "
            "its blocks dropped (ranks %s)",
            self.replica,
            self.url,
            ranks,
        )
        emit(IngestBatch(tuple(Resync(rank, "disconnect") for rank in ranks)))
        if self.tap is not None:  # the other workers drop the same ranks (:mod:`.trtllm_relay`)
            self.tap(disconnect_body(ranks))

    def _failed(self, exc: BaseException) -> float:
        self._counters.transport_errors += 1
        self._counters.note_error(f"drain {self.url} failed: {exc}", time.time())
        delay_s = self._backoff.next_delay()
        if not self._failing:
            log.warning(
                "replica %s: drain %s failed (%s); retrying with backoff", self.replica, self.url, exc
            )
        else:
            log.debug("replica %s: drain failed again: %s", self.replica, exc)
        self._failing = True
        return delay_s

    def _decode(self, body: bytes) -> DecodedBatch | None:
        started = thread_cpu_s()
        try:
            return self._decode_body(body)
        finally:
            if self.gate is not None:
                self.gate.charge(thread_cpu_s() - started)

    def _decode_body(self, body: bytes) -> DecodedBatch | None:
        try:
            batch = self._decoder.decode([body])
        except EventDecodeError as exc:
            self._decode_failed(exc)
            return None
        except Exception as exc:  # a decoder bug on odd input must not stop polling
            self._warnings.warning(
                "decoder_failed", self.replica, "replica %s: decoder failed", self.replica, exc_info=exc
            )
            self._decode_failed(exc)
            return None
        count_decoded(self._metrics, self._engine, self.replica, batch)
        if batch.errors:
            report_malformed(self._counters, self._warnings, self.replica, batch, time.time())
        return batch

    def _decode_failed(self, exc: Exception) -> None:
        self._counters.decode_errors += 1
        count_decode_error(self._metrics, self._engine, self.replica, exc)
        report_malformed(self._counters, self._warnings, self.replica, None, time.time(), undecodable=exc)

    def _deliver(self, batch: DecodedBatch, emit: Emit) -> None:
        resyncs = count_drained(batch, self.replica, self._counters, self._metrics)
        if self._down and any(resync.reason in ("restart", "regression") for resync in resyncs):
            self._down = False
            log.info("replica %s: engine restarted (a new start-up burst of events)", self.replica)
        self._ranks.update(event.dp_rank for event in batch.events)
        if batch.events:
            self._counters.last_event_wall_ts = time.time()
            emit(IngestBatch(tuple(batch.events), positions=batch.positions))


def _refused(exc: BaseException) -> bool:
    """Whether a drain failed because nothing listens on the engine's port."""
    return isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno == errno.ECONNREFUSED
