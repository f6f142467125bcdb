"""Per-request records and the summary statistics of a run (pure).

A :class:`RequestRecord` is what the driver measured for one request; :func:`summarize` turns records
and the run's duration into a :class:`Summary`. Conventions:

- Latency percentiles use linear interpolation between closest ranks (numpy's default): for sorted
  ``x`` of length n, ``p`` is at position ``p / 100 · (n − 1)``. They cover ``ok`` requests only.
- ITL is the gap between consecutive content chunks of a stream, pooled over requests. A server
  that packs several tokens into a chunk gives fewer, longer gaps.
- Throughputs divide by the run's wall duration: ``req_per_s`` counts ``ok`` requests,
  ``output_tok_per_s`` their completion tokens (``None`` when ``ok`` requests came but none reported
  ``usage.completion_tokens``: a target that does not report it has no figure, not 0 tok/s).
- ``hit_rate`` is Σ cached_tokens / Σ prompt_tokens over ``ok`` requests that reported a plausible
  ``cached_tokens`` (an integer in [0, prompt_tokens]); it is ``None`` when none did (the server does
  not expose it, or sends ``null``). A request without ``cached_tokens`` is left out of both sums
  rather than counted as a miss, and an implausible one (:func:`implausible_cached`, e.g. more cached
  than prompt tokens) is left out too, so a broken server cannot report a hit rate above 1.
- ``errors`` counts ``http_error``, ``error`` and ``timeout`` outcomes; ``cancelled`` (in flight when
  the run's time limit hit) is counted apart and in neither rate.
- ``imbalance`` is max / mean of per-replica request counts over every request that named a replica,
  the replicas passed in ``replicas`` counted with 0 when unseen (1.0 is perfectly even).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

Outcome = Literal["ok", "http_error", "error", "timeout", "cancelled"]
"""``ok``: a complete stream. ``http_error``: a non-200 status. ``error``: a transport or protocol
failure (connection dropped, malformed or unfinished stream). ``timeout``: the request's own timeout.
``cancelled``: still in flight when the run ended."""

ERROR_OUTCOMES: frozenset[str] = frozenset({"http_error", "error", "timeout"})


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did. Times are seconds; ``start_s`` and ``scheduled_s`` count from the run's start."""

    request_id: str
    outcome: Outcome
    start_s: float
    """When the request was sent."""
    session_id: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    scheduled_s: float | None = None
    """When the workload wanted it sent (open loop); ``start_s − scheduled_s`` is the client's lag."""
    status: int | None = None
    """HTTP status; ``None`` when no response head arrived."""
    error: str | None = None
    ttft_s: float | None = None
    """Send → first content chunk."""
    e2e_s: float | None = None
    """Send → end of the response (or of the failure)."""
    itl_s: tuple[float, ...] = ()
    """Gaps between consecutive content chunks."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` as the server reported it."""
    replica: str | None = None
    """The replica header's value (``x-kvlb-replica`` by default)."""
    predicted_cached_tokens: int | None = None
    """kvlb's prediction for the request (its ``x-kvlb-cached-tokens`` header; ``None`` from peers)."""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def tag(self, name: str) -> str | None:
        return dict(self.tags).get(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tags as an object, ``itl_s`` as a list."""
        data = asdict(self)
        data["tags"] = dict(self.tags)
        data["itl_s"] = list(self.itl_s)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        values = dict(data)
        values["tags"] = tuple((str(k), str(v)) for k, v in dict(values.get("tags") or {}).items())
        values["itl_s"] = tuple(float(x) for x in values.get("itl_s") or ())
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Summary:
    """A run's figures (module docstring for the definitions); ``None`` where there is no data."""

    requests: int
    ok: int
    errors: int
    timeouts: int
    cancelled: int
    error_rate: float | None
    duration_s: float
    req_per_s: float | None
    output_tok_per_s: float | None
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    e2e_mean_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_rate: float | None
    replica_requests: dict[str, int]
    replica_share: dict[str, float]
    imbalance: float | None

    def to_dict(self) -> dict[str, Any]:
        """Fields in :data:`SUMMARY_FIELDS` order (copies of the maps)."""
        return {name: _copy(getattr(self, name)) for name in SUMMARY_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        return cls(**{name: _copy(data[name]) for name in SUMMARY_FIELDS})


SUMMARY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Summary))
"""The stable field list (and order) of :meth:`Summary.to_dict`."""

NUMERIC_FIELDS: tuple[str, ...] = tuple(
    name for name in SUMMARY_FIELDS if name not in ("replica_requests", "replica_share")
)


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (0..100) by linear interpolation; ``None`` for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return None
    ordered = sorted(values)
    position = p / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def ratios(a: Summary, b: Summary, names: Iterable[str] = NUMERIC_FIELDS) -> dict[str, float | None]:
    """``a.name / b.name`` for each numeric field (e.g. a cache-aware run over a round-robin one)."""
    return {name: ratio(getattr(a, name), getattr(b, name)) for name in names}


def _replica_figures(
    records: Sequence[RequestRecord], replicas: Iterable[str]
) -> tuple[dict[str, int], dict[str, float], float | None]:
    counts: Counter[str] = Counter({replica: 0 for replica in replicas})
    counts.update(r.replica for r in records if r.replica is not None)
    total = sum(counts.values())
    share = {replica: count / total for replica, count in sorted(counts.items())} if total else {}
    imbalance = ratio(max(counts.values()), total / len(counts)) if total else None
    return dict(sorted(counts.items())), share, imbalance


@dataclass(frozen=True, slots=True)
class SendLag:
    """How far an open-loop client fell behind its schedule (seconds of the records: wall time): a
    request sent late meets a fleet with less load than offered, and its TTFT (measured from the
    send) hides the wait. The figures only: whether the client is behind is
    :func:`loadtests.client_lag.check_client`'s rule (which rescales them to model time on request)."""

    p50_s: float
    """Median of ``start_s − scheduled_s``."""
    p90_s: float
    """90th percentile of ``start_s − scheduled_s``."""
    max_s: float
    """The largest lag."""
    sent_rate_per_s: float
    """Requests per second actually sent: requests over the span of their send times."""
    scheduled_rate_per_s: float
    """Requests per second of the schedule: requests over the span of their scheduled times."""


def send_lag(records: Sequence[RequestRecord]) -> SendLag | None:
    """The client's lag over the records that have a schedule (``None`` when fewer than two)."""
    timed = [r for r in records if r.scheduled_s is not None]
    if len(timed) < 2:
        return None
    lags = [r.start_s - (r.scheduled_s or 0.0) for r in timed]
    starts = [r.start_s for r in timed]
    scheduled = [r.scheduled_s or 0.0 for r in timed]
    sent_span = max(starts) - min(starts)
    scheduled_span = max(scheduled) - min(scheduled)
    n = len(timed) - 1
    return SendLag(
        p50_s=percentile(lags, 50) or 0.0,
        p90_s=percentile(lags, 90) or 0.0,
        max_s=max(lags),
        sent_rate_per_s=n / sent_span if sent_span > 0 else math.inf,
        scheduled_rate_per_s=n / scheduled_span if scheduled_span > 0 else math.inf,
    )


def summarize(
    records: Sequence[RequestRecord], duration_s: float, *, replicas: Iterable[str] = ()
) -> Summary:
    """The :class:`Summary` of ``records`` over a run of ``duration_s`` seconds."""
    ok = [r for r in records if r.ok]
    errors = sum(1 for r in records if r.outcome in ERROR_OUTCOMES)
    cancelled = sum(1 for r in records if r.outcome == "cancelled")
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    with_usage = [r for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    with_cache = [r for r in with_usage if _plausible_cached(r)]
    cached_tokens = sum(r.cached_tokens or 0 for r in with_cache)
    cache_prompt_tokens = sum(r.prompt_tokens or 0 for r in with_cache)
    completion_tokens = sum(r.completion_tokens or 0 for r in ok)
    reported_completion = not ok or any(r.completion_tokens is not None for r in ok)
    replica_requests, replica_share, imbalance = _replica_figures(records, replicas)
    counted = len(records) - cancelled
    return Summary(
        requests=len(records),
        ok=len(ok),
        errors=errors,
        timeouts=sum(1 for r in records if r.outcome == "timeout"),
        cancelled=cancelled,
        error_rate=ratio(errors, counted),
        duration_s=duration_s,
        req_per_s=ratio(len(ok), duration_s),
        output_tok_per_s=ratio(completion_tokens, duration_s) if reported_completion else None,
        ttft_mean_s=mean(ttft),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50),
        itl_p90_s=percentile(itl, 90),
        e2e_mean_s=mean(e2e),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p90_s=percentile(e2e, 90),
        e2e_p99_s=percentile(e2e, 99),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        hit_rate=ratio(cached_tokens, cache_prompt_tokens) if with_cache else None,
        replica_requests=replica_requests,
        replica_share=replica_share,
        imbalance=imbalance,
    )


def _plausible_cached(record: RequestRecord) -> bool:
    cached, prompt = record.cached_tokens, record.prompt_tokens
    return cached is not None and prompt is not None and 0 <= cached <= prompt


def implausible_cached(records: Iterable[RequestRecord]) -> int:
    """``ok`` requests whose reported ``cached_tokens`` is negative or above their ``prompt_tokens``
    (or came without ``prompt_tokens``): left out of the hit rate."""
    return sum(1 for r in records if r.ok and r.cached_tokens is not None and not _plausible_cached(r))


def summarize_by(
    records: Sequence[RequestRecord],
    duration_s: float,
    key: Callable[[RequestRecord], str | None],
) -> dict[str, Summary]:
    """One summary per key value (records whose key is ``None`` are left out), keys sorted."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        value = key(record)
        if value is not None:
            groups.setdefault(value, []).append(record)
    return {value: summarize(groups[value], duration_s) for value in sorted(groups)}


def by_tag(name: str) -> Callable[[RequestRecord], str | None]:
    """A :func:`summarize_by` key: the record's tag ``name``."""
    return lambda record: record.tag(name)
