"""Health probes (I/O): one task per replica, ``GET <url>/health`` every ``interval_s``.

Each result goes to :meth:`balancer.health.book.HealthBook.on_probe` with ``time.monotonic()``: a 200 marks
the replica live (a replica is not routable before its first good probe), anything else (status,
timeout, refused connection) counts against its circuit breaker and takes the replica out of
routing, a timeout only from the book's ``probe_timeouts_to_drop``-th in a row. Transitions are
logged once, not every period; a replica whose probe passes while its engine refuses kvlb's key or
serves another model (below) is logged as answering its probe but out of routing, not as healthy.

When it is given the pool's model (an engine whose spec ``checks_model_name``: vLLM, which answers
every request for another name 404; SGLang and TRT-LLM serve any name), a good probe of a replica
that was not healthy reads ``GET <url>/v1/models`` (bounded in time and bytes) *before* the replica
counts as live, and so does every good probe while the engine lists other models, and one every
``models_recheck_s`` (the setting ``health_models_recheck_s``, 30 s by default) while it serves
the pool's model (an engine renamed without failing a probe): a list that does not name the
pool's model takes the replica out of routing
(:meth:`~balancer.health.book.HealthBook.set_model_mismatch`, a warning once), and it comes back at
the first probe whose list names it. An engine without the endpoint, or a list that does not parse,
is not judged (routable as before); a read that fails (timeout, refused) keeps the last verdict.

The same read tells whether the engine accepts kvlb's key: vLLM's ``--api-key`` guards only
``/v1/*`` (SGLang's does not guard ``/health`` either), so with a wrong key the ``/health`` probe
passes while every request is refused. Given ``key_check`` (the balancer does, for every engine), the
list is read at the same times without a model too, for its refusal only. A 401, 403 or 407 there
takes the replica out of routing (:meth:`~balancer.health.book.HealthBook.set_key_refused`:
``engine refuses kvlb's key (<source>)``, a warning once) and wakes the key watcher; the list is
read again at every probe while it refuses, and at the first probe after the key changed (a
rotation), whatever the verdict; the first answer that is not a refusal puts the replica back.

Given an ``engine_watch`` (the balancer's ingest, or its fleet runtime), a probe whose connection
was refused or dropped (nothing listens at the engine: it stopped or crashed; not a timeout, which a
hung or slow engine gives too) tells the replica's event sources at once, once per spell
(:meth:`EngineWatch.engine_gone`), and the first good probe after it tells them it is back: a
replay request waiting on the engine ends then instead of running into its timeout
(:mod:`balancer.sources.replay_watch`). The call only posts a signal to the ingest thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from balancer import strict_json
from balancer.config.settings import Secret
from balancer.errors import ConfigError
from balancer.health.book import HealthBook
from balancer.sources.http import BodyTooLarge, read_capped
from balancer.types import ReplicaId
from balancer.upstream.auth import (
    REFUSED_CALLER_STATUSES,
    engine_auth_headers,
    key_refused_reason,
    refused_caller,
)

log = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"
MAX_MODELS_BYTES = 256 * 1024
"""The largest ``/v1/models`` answer read for the served-model check (bytes); a longer one is not
checked."""
MAX_NAME_CHARS = 128
"""Characters of each served model name kept in the mismatch's text (at most 8 names are named)."""


class EngineWatch(Protocol):
    """Who hears that a replica's engine is gone or back (the ingest's handle, the fleet runtime).
    Both calls return at once: they post a signal, they do not wait on the ingest."""

    def engine_gone(self, replica: ReplicaId, why: str) -> None: ...

    def engine_back(self, replica: ReplicaId) -> None: ...


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """Settings of every :class:`HealthProber`."""

    interval_s: float = 2.0
    """Period between probe starts (seconds), > 0. A dead replica is noticed within about one
    period (plus the breaker, which opens after its failure threshold)."""
    timeout_s: float = 2.0
    """Whole-probe timeout (seconds), > 0; at the limit the probe counts as failed."""
    path: str = "/health"
    """Probed path; SGLang, vLLM and trtllm-serve all answer 200 on ``/health`` when up."""
    models_recheck_s: float = 30.0
    """Seconds (> 0) after which a good probe of a replica serving its pool's model reads the
    engine's ``/v1/models`` again: an engine renamed without failing a probe leaves routing within
    about this long (one small GET per period per replica whose engine checks names)."""

    def validate(self) -> None:
        for name in ("interval_s", "timeout_s", "models_recheck_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"probe.{name} must be a finite number > 0, got {value}")


class HealthProber:
    """Probes one replica until cancelled."""

    def __init__(
        self,
        replica: ReplicaId,
        base_url: str,
        *,
        session: aiohttp.ClientSession,
        health: HealthBook,
        settings: ProbeSettings | None = None,
        model: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        api_key: Secret | None = None,
        key_check: bool = False,
        engine_watch: EngineWatch | None = None,
    ) -> None:
        """``model``: the pool's model, checked against the engine's ``/v1/models`` each time the
        replica turns healthy, at every probe while the engine lists other models, and every
        ``settings.models_recheck_s`` (``None``: not checked). ``api_key``: the replica's own key,
        sent with every probe and model check. ``key_check``: read ``/v1/models`` as the model
        check does (the same times) also without ``model``, for its refusal only (an engine
        whose names are not judged: SGLang, TRT-LLM behind a proxy). ``engine_watch``: told when a
        probe finds nothing listening at the engine, and when a probe passes after that."""
        self._engine_watch = engine_watch
        self._engine_gone = False
        """The watch was told the engine is gone, and not yet that it is back."""
        self._key_check = key_check or model is not None
        self._api_key = api_key
        self.replica = replica
        self.model = model
        self._models_url = base_url.rstrip("/") + MODELS_PATH
        self.served_models: tuple[str, ...] | None = None
        """The model ids the engine listed at its last check (``None``: not read)."""
        self.settings = settings or ProbeSettings()
        self.url = base_url.rstrip("/") + self.settings.path
        self.settings.validate()
        self._session = session
        self._health = health
        self._monotonic = monotonic
        self._last_ok: bool | None = None
        self._models_read_at: float | None = None
        """When the engine's model list was last asked for (monotonic seconds; ``None``: never)."""
        self._checked_key: str | None = None if api_key is None else api_key.value
        """The key the last model check sent (a rotated key is checked at the next probe)."""

    async def run(self) -> None:
        """Probe at once, then every ``interval_s``; never raises but for cancellation."""
        while True:
            started = self._monotonic()
            await self.probe_once()
            elapsed_s = self._monotonic() - started
            await asyncio.sleep(max(0.0, self.settings.interval_s - elapsed_s))

    async def probe_once(self) -> bool:
        error, timed_out, gone = await self._probe()
        ok = error is None
        if (
            ok
            and self._key_check
            and (
                ok != self._last_ok
                or self._mismatched()
                or self._refused()
                or self._key_rotated()
                or self._recheck_due()
            )
        ):
            await self._check_models(self.model)  # before the replica counts as live
        self._health.on_probe(self.replica, ok, self._monotonic(), error, timed_out=timed_out)
        self._tell_watch(ok, gone, error)
        if ok != self._last_ok:
            if ok:
                kept_out = self._kept_out()
                if kept_out is None:
                    log.info("replica %s is healthy", self.replica)
                else:
                    log.info(
                        "replica %s answers its health probe but stays out of routing: %s",
                        self.replica,
                        kept_out,
                    )
            else:
                record = self._health.replicas.get(self.replica)
                kept = record is not None and record.probe_ok
                log.warning(
                    "replica %s failed its health probe: %s%s",
                    self.replica,
                    error,
                    " (still taking traffic: one timeout)" if kept else "",
                )
        self._last_ok = ok
        return ok

    def _tell_watch(self, ok: bool, gone: bool, error: str | None) -> None:
        """Tell the engine watch of a spell in which nothing listens at the engine (once), and of
        the first good probe after it."""
        watch = self._engine_watch
        if watch is None:
            return
        if gone and not self._engine_gone:
            self._engine_gone = True
            watch.engine_gone(self.replica, f"its health probe: {error}")
        elif ok and self._engine_gone:
            self._engine_gone = False
            watch.engine_back(self.replica)

    def _kept_out(self) -> str | None:
        """Why the replica stays out of routing although its probe passes (its engine refuses
        kvlb's key, or serves another model), ``None`` when nothing but the probe decides."""
        record = self._health.replicas.get(self.replica)
        if record is None:
            return None
        return record.key_refused if record.key_refused is not None else record.model_mismatch

    def _recheck_due(self) -> bool:
        return self._models_read_at is None or (
            self._monotonic() - self._models_read_at >= self.settings.models_recheck_s
        )

    def _refused(self) -> bool:
        record = self._health.replicas.get(self.replica)
        return record is not None and record.key_refused is not None

    def _key_rotated(self) -> bool:
        """The key changed since the last model check (the key watcher rotated it): check again now."""
        return self._api_key is not None and self._api_key.value != self._checked_key

    def _mismatched(self) -> bool:
        record = self._health.replicas.get(self.replica)
        return record is not None and record.model_mismatch is not None

    async def _probe(self) -> tuple[str | None, bool, bool]:
        """``(None, False, False)`` when healthy, else why not, whether the probe timed out, and
        whether nothing listens at the engine (its connection refused, reset or dropped)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        try:
            headers = engine_auth_headers(self._api_key)  # per call: the key may rotate
            async with self._session.get(self.url, timeout=timeout, headers=headers) as response:
                if response.status == 200:
                    return None, False, False
                if response.status in REFUSED_CALLER_STATUSES:
                    if self._api_key is not None:
                        self._api_key.refused()  # re-read a rotated key now
                    refused = refused_caller(response.status, self._api_key)
                    return f"{self.settings.path}: {refused}", False, False
                return f"{self.settings.path} answered {response.status}", False, False
        except TimeoutError:
            return f"{self.settings.path} timed out after {self.settings.timeout_s}s", True, False
        except (aiohttp.ClientConnectionError, OSError) as exc:  # nothing listens, or it went
            gone = not isinstance(exc, aiohttp.ClientSSLError)  # a TLS refusal: something listens
            return f"{self.settings.path}: {type(exc).__name__}", False, gone
        except aiohttp.ClientError as exc:
            return f"{self.settings.path}: {type(exc).__name__}", False, False

    async def _check_models(self, model: str | None) -> None:
        """Read the engine's model list; take the replica out of routing while it does not name
        ``model``, back in once it does (each said once)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        self._models_read_at = self._monotonic()
        self._checked_key = None if self._api_key is None else self._api_key.value
        try:
            async with self._session.get(
                self._models_url, timeout=timeout, headers=engine_auth_headers(self._api_key)
            ) as response:
                if response.status in REFUSED_CALLER_STATUSES:
                    if self._api_key is not None:
                        self._api_key.refused()
                    if self._health.set_key_refused(self.replica, key_refused_reason(self._api_key)):
                        log.warning(
                            "replica %s is out of routing: GET %s: %s",
                            self.replica,
                            MODELS_PATH,
                            refused_caller(response.status, self._api_key),
                        )
                    return
                if self._health.set_key_refused(self.replica, None):
                    log.info("replica %s: its engine accepts kvlb's key: back in routing", self.replica)
                if response.status != 200:
                    served = None  # an engine without the endpoint says nothing about its names
                else:
                    body = await read_capped(response, MAX_MODELS_BYTES)
                    served = _listed_ids(body)
        except (TimeoutError, aiohttp.ClientError, OSError, BodyTooLarge):
            return  # not read this time: the last verdict stands
        self.served_models = served
        if model is None:
            return  # read for the key only: the names are not judged
        was = self._mismatched()
        mismatch = None
        if served and model not in served:
            named = [name[:MAX_NAME_CHARS] for name in served[:8]]
            mismatch = (
                f"the engine serves {named} (GET {MODELS_PATH}), not the pool's model "
                f"{model!r}: it answers every request for {model!r} 404; set the pool's model, or "
                "the engine's --served-model-name"
            )
        self._health.set_model_mismatch(self.replica, mismatch)
        if mismatch is not None and not was:
            log.warning("replica %s is out of routing: %s", self.replica, mismatch)
        elif mismatch is None and was:
            log.info("replica %s serves its pool's model %r again: back in routing", self.replica, model)


def _listed_ids(body: bytes) -> tuple[str, ...] | None:
    """The ``id`` of every entry of an OpenAI model list; ``None`` when it does not parse as one."""
    try:
        listed = strict_json.loads(body)["data"]
        return tuple(str(entry["id"]) for entry in listed)
    except (ValueError, KeyError, TypeError):
        return None
