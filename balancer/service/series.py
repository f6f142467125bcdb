"""The console's time series (pure, no I/O, no clock): a bounded ring of fixed wall-clock intervals.

Dispatch reports three things as requests go (:mod:`balancer.service.dispatch`):

* a committed decision (:meth:`SeriesSampler.on_commit`): the chosen replica, the prompt tokens and
  the cached tokens the router predicted there;
* the time to the first upstream body chunk (:meth:`SeriesSampler.on_ttft`), measured from the
  request's arrival: kvlb's TTFT, the one ``kvlb_http_ttft_seconds`` observes;
* the replica's usage report at the end of an answer (:meth:`SeriesSampler.on_usage`): the cached
  and prompt tokens the engine itself counted.

``GET /admin/series?minutes=`` reads :meth:`SeriesSampler.series`: per interval, the request count
per replica, the predicted and reported hit rates (cached ÷ prompt tokens) and TTFT p50/p90.
The TTFTs of an interval are counted in a :class:`~balancer.service.log_histogram.LogHistogram`
(every one of them; the percentiles within 4.76 % of the exact ones), listed with the row as
``ttft_histogram`` when asked (``ttft_histograms=1``; a gathering worker asks its siblings so), so
the workers of ``kvlb serve --workers N`` add up to the service's (:func:`merge_series`).

Bounded: at most ``series_intervals`` intervals (older ones fall off the ring), at most 194
histogram buckets per interval, and at most ``series_max_replicas`` replica names per interval
(the rest counted under ``"(other)"``, counted in ``kvlb_console_series_overflow_total{kind}``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from balancer.service.log_histogram import BUCKETS, MIN_S, RATIO, RELATIVE_ERROR, LogHistogram
from balancer.tasks import at_once

OTHER_REPLICAS = "(other)"
"""The replica name intervals count requests under once ``series_max_replicas`` names are used."""


@dataclass(slots=True)
class _Interval:
    start: float
    """Wall-clock start (seconds since the epoch), a multiple of the interval length."""
    requests: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    reported_prompt_tokens: int = 0
    reported_cached_tokens: int = 0
    ttft: LogHistogram = field(default_factory=LogHistogram)
    by_replica: dict[str, int] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    """The interval as :meth:`SeriesSampler.series` lists it, kept once a newer interval exists
    (samples only ever land in the newest one, so an older row never changes)."""
    wire: list[int] = field(default_factory=list)
    """The TTFT histogram's wire form, kept with :attr:`row`."""


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..1) of sorted samples; ``None`` for no samples."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def _ratio(part: int, whole: int) -> float | None:
    return None if whole <= 0 else round(part / whole, 4)


class SeriesSampler:
    """The ring of intervals (see the module docstring); every method takes the wall time."""

    def __init__(
        self,
        interval_s: float,
        intervals: int,
        max_replicas: int,
        *,
        on_overflow: Callable[[str], None] | None = None,
    ) -> None:
        if interval_s <= 0 or intervals < 1 or max_replicas < 1:
            raise ValueError("series: interval_s > 0 and intervals, max_replicas >= 1")
        self.interval_s = interval_s
        self.max_replicas = max_replicas
        self._ring: deque[_Interval] = deque(maxlen=intervals)
        self._on_overflow = on_overflow

    @property
    def capacity(self) -> int:
        """Intervals the ring holds at most."""
        maxlen = self._ring.maxlen
        assert maxlen is not None
        return maxlen

    @property
    def span_s(self) -> float:
        """The time the full ring covers."""
        return self.capacity * self.interval_s

    def _overflow(self, kind: str) -> None:
        if self._on_overflow is not None:
            self._on_overflow(kind)

    def _at(self, wall: float) -> _Interval:
        """The interval ``wall`` falls in (a clock stepping back lands in the newest interval)."""
        ring = self._ring
        if ring and wall < ring[-1].start + self.interval_s:
            return ring[-1]  # the common case: still in the newest interval (or the clock stepped back)
        start = math.floor(wall / self.interval_s) * self.interval_s
        interval = _Interval(start)
        ring.append(interval)
        return interval

    def on_commit(self, replica: str, prompt_tokens: int, predicted_cached_tokens: int, wall: float) -> None:
        """A decision was committed: one request to ``replica``."""
        interval = self._at(wall)
        interval.requests += 1
        interval.prompt_tokens += max(0, prompt_tokens)
        interval.predicted_cached_tokens += max(0, predicted_cached_tokens)
        counts = interval.by_replica
        if replica not in counts and len(counts) >= self.max_replicas:
            self._overflow("replicas")
            replica = OTHER_REPLICAS
        counts[replica] = counts.get(replica, 0) + 1

    def on_ttft(self, seconds: float, wall: float) -> None:
        """The first upstream body chunk came ``seconds`` after the request arrived."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        self._at(wall).ttft.add(seconds)

    def on_usage(self, prompt_tokens: int, cached_tokens: int, wall: float) -> None:
        """A replica reported ``cached_tokens`` of ``prompt_tokens`` as cached at the end of an answer."""
        interval = self._at(wall)
        interval.reported_prompt_tokens += max(0, prompt_tokens)
        interval.reported_cached_tokens += max(0, cached_tokens)

    def series(self, minutes: float, wall: float, *, ttft_histograms: bool = False) -> dict[str, Any]:
        """Every interval of the last ``minutes`` up to ``wall``, oldest first; intervals without
        traffic are listed with zero counts and ``null`` rates, so plots have a point per interval.
        With ``ttft_histograms``, each row also has its ``ttft_histogram`` (the wire form of
        :class:`~balancer.service.log_histogram.LogHistogram`, what :func:`merge_series` adds)."""
        newest = math.floor(wall / self.interval_s) * self.interval_s
        count = max(1, min(self.capacity, math.ceil(minutes * 60.0 / self.interval_s)))
        oldest = newest - (count - 1) * self.interval_s
        held = {interval.start: interval for interval in self._ring if interval.start >= oldest}
        newest_held = self._ring[-1] if self._ring else None
        rows = []
        for step in range(count):
            start = oldest + step * self.interval_s
            interval = held.get(start)
            if interval is None:
                row = _row(_Interval(start))
                wire: list[int] = []
            elif interval is newest_held:
                row, wire = _row(interval), interval.ttft.to_json()
            else:
                if interval.row is None:
                    interval.row, interval.wire = _row(interval), interval.ttft.to_json()
                row, wire = interval.row, interval.wire
            rows.append({**row, "ttft_histogram": wire} if ttft_histograms else row)
        return {
            "interval_s": self.interval_s,
            "span_s": self.span_s,
            "now": wall,
            "ttft_buckets": TTFT_BUCKETS,
            "intervals": rows,
        }


def _row(interval: _Interval) -> dict[str, Any]:
    return {
        "ts": interval.start,
        "requests": interval.requests,
        "prompt_tokens": interval.prompt_tokens,
        "predicted_cached_tokens": interval.predicted_cached_tokens,
        "predicted_hit_rate": _ratio(interval.predicted_cached_tokens, interval.prompt_tokens),
        "reported_prompt_tokens": interval.reported_prompt_tokens,
        "reported_cached_tokens": interval.reported_cached_tokens,
        "reported_hit_rate": _ratio(interval.reported_cached_tokens, interval.reported_prompt_tokens),
        **_ttft_fields(interval.ttft),
        "replicas": dict(sorted(interval.by_replica.items())),
    }


def _ttft_fields(ttft: LogHistogram) -> dict[str, Any]:
    """A row's TTFT figures: p50 and p90 (6 significant digits) and the count."""
    p50, p90 = ttft.quantiles((0.5, 0.9))
    return {
        "ttft_p50_s": None if p50 is None else float(f"{p50:.6g}"),
        "ttft_p90_s": None if p90 is None else float(f"{p90:.6g}"),
        "ttft_count": ttft.total,
    }


TTFT_BUCKETS = {
    "min_s": MIN_S,
    "ratio": RATIO,
    "buckets": BUCKETS,
    "relative_error": round(RELATIVE_ERROR, 4),
}
"""How a row's ``ttft_histogram`` is bucketed (:mod:`balancer.service.log_histogram`) and how far
its percentiles may be from the exact ones, as every series answer says under ``ttft_buckets``."""


def merge_series(answers: list[dict[str, Any]], *, ttft_histograms: bool = False) -> dict[str, Any]:
    """Several workers' :meth:`SeriesSampler.series` answers (each asked ``ttft_histograms``) as
    the service's, per interval (intervals start at multiples of the same length on every worker):
    counts and tokens add (``requests``, ``prompt_tokens``, ``predicted_cached_tokens``,
    ``reported_*_tokens`` and each replica's requests), the hit rates are recomputed from the
    summed tokens, and the TTFT histograms add, ``ttft_count`` and the percentiles taken from the
    sum: the figures one worker with all the traffic would give, at the same error. The first
    answer gives the interval length and the number of intervals listed (the newest ones). The rows
    keep their ``ttft_histogram`` only with ``ttft_histograms``. ``ValueError`` for a row whose
    ``ttft_histogram`` is not one. In one go: :func:`merge_series_steps` pauses between rows."""
    return at_once(merge_series_steps(answers, ttft_histograms=ttft_histograms))


ROWS_PER_STEP = 10
"""Merged intervals :func:`merge_series_steps` makes between two pauses (up to ``series_intervals``,
180 by default, each with up to ``series_max_replicas`` counts and two TTFT histograms to add)."""


def merge_series_steps(
    answers: list[dict[str, Any]], *, ttft_histograms: bool = False
) -> Generator[None, None, dict[str, Any]]:
    """:func:`merge_series` as a generator of steps (the gathered ``GET /admin/series`` runs it on
    the event loop, :func:`balancer.tasks.stepwise`): a pause every :data:`ROWS_PER_STEP` merged
    intervals."""
    first = answers[0]
    parts: dict[float, list[dict[str, Any]]] = {}
    for answer in answers:
        for row in answer["intervals"]:
            parts.setdefault(row["ts"], []).append(row)
    listed: list[dict[str, Any]] = []
    for ts in sorted(parts)[-len(first["intervals"]) :]:
        listed.append(_merged_row(parts[ts], ttft_histograms))
        if len(listed) % ROWS_PER_STEP == 0:
            yield
    now = max(answer["now"] for answer in answers)
    return {**first, "now": now, "intervals": listed}


def _merged_row(rows: list[dict[str, Any]], ttft_histograms: bool) -> dict[str, Any]:
    """One interval's rows of several workers as one (see :func:`merge_series`)."""
    if len(rows) == 1:  # one worker's alone: its figures are the service's
        merged = dict(rows[0])
        LogHistogram.from_json(merged["ttft_histogram"])  # checked as any other
        if not ttft_histograms:
            del merged["ttft_histogram"]
        return merged
    merged = {**rows[0], "replicas": dict(rows[0]["replicas"])}
    ttft = LogHistogram.from_json(rows[0]["ttft_histogram"])
    for row in rows[1:]:
        for name in _ADDED:
            merged[name] += row[name]
        for replica, count in row["replicas"].items():
            merged["replicas"][replica] = merged["replicas"].get(replica, 0) + count
        ttft.merge(LogHistogram.from_json(row["ttft_histogram"]))
    merged["predicted_hit_rate"] = _ratio(merged["predicted_cached_tokens"], merged["prompt_tokens"])
    merged["reported_hit_rate"] = _ratio(merged["reported_cached_tokens"], merged["reported_prompt_tokens"])
    merged["replicas"] = dict(sorted(merged["replicas"].items()))
    merged.update(_ttft_fields(ttft))
    if ttft_histograms:
        merged["ttft_histogram"] = ttft.to_json()
    else:
        del merged["ttft_histogram"]
    return merged


_ADDED = (
    "requests",
    "prompt_tokens",
    "predicted_cached_tokens",
    "reported_prompt_tokens",
    "reported_cached_tokens",
)
