"""Periodic scrape of one replica's own load report (does I/O; each engine's parsers are in
:mod:`balancer.engines`, built on :mod:`balancer.load.scrape`).

Each engine's spec (:mod:`balancer.engines`) lists its load endpoints in order (the caller hands them
over: nothing in :mod:`balancer.load` imports :mod:`balancer.engines`); a 404 moves to the
next one (remembered), so an SGLang without ``/v1/loads`` falls back to ``/metrics``. Every result
goes to the ``observe`` callback (``LoadTracker.observe``) with ``time.monotonic()``; failures count
in ``kvlb_scrape_errors_total{replica}`` and the loop goes on at the same interval. A figure out of
range in a report that parsed (:mod:`balancer.load.gauge_checks`) is dropped by the parser, counted in
``kvlb_scrape_rejected_values_total{replica, reason}``, logged through the log limiter (the first,
then one line a minute per replica) and kept as the status' ``last_rejection``.

TRT-LLM's ``/metrics`` is a drain of iteration stats like ``/kv_cache_events``: one consumer only. An
empty drain means no iteration ran since the last scrape, reported as 0 running and 0 waiting.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from balancer.config.settings import Secret
from balancer.errors import ConfigError
from balancer.load.gauge_checks import Rejection
from balancer.load.scrape import ScrapedLoad, ScrapeError, ScrapeTarget, with_metrics_path
from balancer.load.tracker import EngineStats
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.sources.http import BodyTooLarge, read_capped
from balancer.types import ReplicaId
from balancer.upstream.auth import REFUSED_CALLER_STATUSES, engine_auth_headers, refused_caller

log = logging.getLogger(__name__)

Observe = Callable[[ReplicaId, EngineStats, float], object]
"""``LoadTracker.observe(replica, stats, now)``; ``now`` is monotonic seconds."""


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    """Settings of every :class:`MetricsScraper`."""

    interval_s: float = 1.0
    """Period between scrape starts (seconds). Must be > 0; keep it below the load tracker's
    ``stale_after_s`` or scraped stats expire between scrapes."""
    timeout_s: float = 3.0
    """Whole-request timeout (seconds); at the limit the scrape counts as an error. Must be > 0."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest report accepted (bytes); a larger one is an error. Must be ≥ 1."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field out of range."""
        for name in ("interval_s", "timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"scrape.{name} must be a finite number > 0, got {value}")
        if self.max_body_bytes < 1:
            raise ConfigError("scrape.max_body_bytes must be >= 1")


HTTP_STATUS_ERROR = "HTTP "
"""How a :class:`ScrapeError` for an answer other than 200 (and 404) begins: an engine that is busy
or failing, not one of another kind (whose load report fails to parse, or has no endpoint)."""


@dataclass(frozen=True, slots=True)
class ScraperStatus:
    """A scraper's state for ``/admin/replicas``."""

    replica: ReplicaId
    url: str
    """The endpoint in use now (after any 404 fallback)."""
    scrapes: int
    errors: int
    last_ok_wall_ts: float | None
    last: ScrapedLoad | None
    last_error: str | None
    rejected_values: int
    """Figures refused since the start (each also in ``kvlb_scrape_rejected_values_total``)."""
    last_rejection: Rejection | None
    """The last figure refused (gauge, value as read, reason); ``None`` when none ever was."""
    last_rejection_wall_ts: float | None


class MetricsScraper:
    """Scrapes one replica every ``interval_s`` and reports to ``observe``.

    ``targets`` are the engine's load endpoints in the order tried (its spec's ``scrape_targets``:
    the caller reads the spec, so that this package never imports :mod:`balancer.engines`);
    ``engine`` names the engine in error messages; ``metrics_path``, when set, replaces the path of
    its Prometheus targets; ``api_key``, the replica's
    own key, is sent with every scrape."""

    def __init__(
        self,
        replica: ReplicaId,
        base_url: str,
        engine: str,
        targets: Sequence[ScrapeTarget],
        *,
        session: aiohttp.ClientSession,
        observe: Observe,
        metrics: Metrics,
        settings: ScrapeSettings | None = None,
        metrics_path: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        api_key: Secret | None = None,
    ) -> None:
        self.replica = replica
        self._api_key = api_key
        self.base_url = base_url.rstrip("/")
        self.settings = settings or ScrapeSettings()
        self.settings.validate()
        self.engine = engine
        if not targets:
            raise ConfigError(f"engine {engine}: no scrape targets")
        self._targets = with_metrics_path(targets, metrics_path)
        self._target = 0
        self._session = session
        self._observe = observe
        self._metrics = metrics
        self._monotonic = monotonic
        self._scrapes = 0
        self._errors = 0
        self._last: ScrapedLoad | None = None
        self._last_ok_wall_ts: float | None = None
        self._last_error: str | None = None
        self._rejected_values = 0
        self._last_rejection: Rejection | None = None
        self._last_rejection_wall_ts: float | None = None
        self._warnings = LimitedWarnings(
            log, metrics.log_suppressed_total, clock=monotonic, forgotten=metrics.log_causes_forgotten_total
        )

    def status(self) -> ScraperStatus:
        return ScraperStatus(
            replica=self.replica,
            url=self.base_url + self._targets[self._target].path,
            scrapes=self._scrapes,
            errors=self._errors,
            last_ok_wall_ts=self._last_ok_wall_ts,
            last=self._last,
            last_error=self._last_error,
            rejected_values=self._rejected_values,
            last_rejection=self._last_rejection,
            last_rejection_wall_ts=self._last_rejection_wall_ts,
        )

    async def run(self) -> None:
        """Scrape until cancelled; errors are counted and logged on change, never raised."""
        while True:
            started = self._monotonic()
            await self.scrape_and_observe()
            elapsed_s = self._monotonic() - started
            await asyncio.sleep(max(0.0, self.settings.interval_s - elapsed_s))

    async def scrape_and_observe(self) -> ScrapedLoad | None:
        """One scrape; reports a success to ``observe`` and returns it (``None`` on failure)."""
        self._scrapes += 1
        try:
            load = await self.scrape_once()
        except (aiohttp.ClientError, TimeoutError, ScrapeError) as exc:
            self._errors += 1
            self._metrics.scrape_errors_total.labels(self.replica).inc()
            message = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ScrapeError) and not str(exc).startswith(HTTP_STATUS_ERROR):
                # the engine answered 200 (or 404 everywhere), but not as this engine kind does
                message += f" (read as {self.engine}'s load report: is the replica's engine {self.engine}?)"
            if message != self._last_error:
                log.warning("replica %s: load scrape failed: %s", self.replica, message)
            self._last_error = message
            return None
        if self._last_error is not None:
            log.info("replica %s: load scrape works again", self.replica)
        self._last_error = None
        self._last = load
        self._last_ok_wall_ts = time.time()
        if load.rejected:
            self._rejections(load.rejected)
        self._observe(self.replica, load.engine_stats(), self._monotonic())
        return load

    def _rejections(self, rejections: tuple[Rejection, ...]) -> None:
        """Count, keep and log (limited) the figures the parser refused."""
        for rejection in rejections:
            self._metrics.scrape_rejected_values_total.labels(self.replica, rejection.reason).inc()
        self._rejected_values += len(rejections)
        self._last_rejection = rejections[-1]
        self._last_rejection_wall_ts = self._last_ok_wall_ts
        self._warnings.warning(
            "scrape_rejected_value",
            self.replica,
            "replica %s: load report figures out of range, read as unknown: %s",
            self.replica,
            "; ".join(f"{r.gauge} {r.value} ({r.reason})" for r in rejections),
        )

    async def scrape_once(self) -> ScrapedLoad:
        """Fetch and parse the load report, trying the next endpoint on 404. Raises on failure."""
        for _ in range(len(self._targets)):
            target = self._targets[self._target]
            status, body = await self._get(target.path)
            if status == 404 and len(self._targets) > 1:
                self._target = (self._target + 1) % len(self._targets)
                log.info("replica %s: %s is 404, trying %s", self.replica, target.path, self.status().url)
                continue
            if status in REFUSED_CALLER_STATUSES:
                if self._api_key is not None:
                    self._api_key.refused()  # re-read a rotated key now
                raise ScrapeError(
                    f"{HTTP_STATUS_ERROR}{status} from {target.path}: {refused_caller(status, self._api_key)}"
                )
            if status != 200:
                raise ScrapeError(f"{HTTP_STATUS_ERROR}{status} from {target.path}")
            load = target.parse(body)
            return load if load is not None else ScrapedLoad(running_reqs=0, waiting_reqs=0)
        raise ScrapeError("every load endpoint answered 404")

    async def _get(self, path: str) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        headers = engine_auth_headers(self._api_key)  # per call: the key may rotate
        async with self._session.get(self.base_url + path, timeout=timeout, headers=headers) as resp:
            if resp.status != 200:
                await resp.release()
                return resp.status, b""
            try:
                return resp.status, await read_capped(resp, self.settings.max_body_bytes)
            except BodyTooLarge as exc:
                raise ScrapeError(str(exc)) from None
