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

Bounded: at most ``series_intervals`` intervals (older ones fall off the ring), at most
``series_ttft_samples`` TTFT samples per interval (a uniform reservoir sample beyond that, the
samples left out counted), and at most ``series_max_replicas`` replica names per interval (the
rest counted under ``"(other)"``). Every overflow is counted in
``kvlb_console_series_overflow_total{kind}``.
"""

from __future__ import annotations

import math
import random
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    ttft_s: array[float] = field(default_factory=lambda: array("d"))
    ttft_seen: int = 0
    by_replica: dict[str, int] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    """The interval as :meth:`SeriesSampler.series` lists it, kept once a newer interval exists
    (samples only ever land in the newest one, so an older row never changes)."""


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
        ttft_samples: int,
        max_replicas: int,
        *,
        rng: random.Random | None = None,
        on_overflow: Callable[[str], None] | None = None,
    ) -> None:
        if interval_s <= 0 or intervals < 1 or ttft_samples < 1 or max_replicas < 1:
            raise ValueError("series: interval_s > 0 and intervals, ttft_samples, max_replicas >= 1")
        self.interval_s = interval_s
        self.ttft_samples = ttft_samples
        self.max_replicas = max_replicas
        self._ring: deque[_Interval] = deque(maxlen=intervals)
        self._rng = rng if rng is not None else random.Random(0)
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
        interval = self._at(wall)
        interval.ttft_seen += 1
        samples = interval.ttft_s
        if len(samples) < self.ttft_samples:
            samples.append(seconds)
            return
        self._overflow("ttft_samples")
        slot = self._rng.randrange(interval.ttft_seen)  # reservoir: every sample equally likely kept
        if slot < self.ttft_samples:
            samples[slot] = seconds

    def on_usage(self, prompt_tokens: int, cached_tokens: int, wall: float) -> None:
        """A replica reported ``cached_tokens`` of ``prompt_tokens`` as cached at the end of an answer."""
        interval = self._at(wall)
        interval.reported_prompt_tokens += max(0, prompt_tokens)
        interval.reported_cached_tokens += max(0, cached_tokens)

    def series(self, minutes: float, wall: float) -> dict[str, Any]:
        """Every interval of the last ``minutes`` up to ``wall``, oldest first; intervals without
        traffic are listed with zero counts and ``null`` rates, so plots have a point per interval."""
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
                rows.append(_row(_Interval(start)))
            elif interval is newest_held:
                rows.append(_row(interval))
            else:
                if interval.row is None:
                    interval.row = _row(interval)
                rows.append(interval.row)
        return {"interval_s": self.interval_s, "span_s": self.span_s, "now": wall, "intervals": rows}


def _row(interval: _Interval) -> dict[str, Any]:
    ordered = sorted(interval.ttft_s)
    p50, p90 = percentile(ordered, 0.5), percentile(ordered, 0.9)
    return {
        "ts": interval.start,
        "requests": interval.requests,
        "prompt_tokens": interval.prompt_tokens,
        "predicted_cached_tokens": interval.predicted_cached_tokens,
        "predicted_hit_rate": _ratio(interval.predicted_cached_tokens, interval.prompt_tokens),
        "reported_prompt_tokens": interval.reported_prompt_tokens,
        "reported_cached_tokens": interval.reported_cached_tokens,
        "reported_hit_rate": _ratio(interval.reported_cached_tokens, interval.reported_prompt_tokens),
        "ttft_p50_s": None if p50 is None else round(p50, 6),
        "ttft_p90_s": None if p90 is None else round(p90, 6),
        "ttft_count": interval.ttft_seen,
        "replicas": dict(sorted(interval.by_replica.items())),
    }


TTFT_MERGED = (
    "ttft_p50_s and ttft_p90_s are the highest of the workers' own percentiles: a percentile of the "
    "service's samples lies between the lowest and the highest of its parts', so this is an upper "
    "bound, exact with one worker"
)
"""What :func:`merge_series` says it did with the TTFT percentiles (they cannot be added)."""


def merge_series(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Several workers' :meth:`SeriesSampler.series` answers as the service's, per interval
    (intervals start at multiples of the same length on every worker): counts and tokens add
    (``requests``, ``prompt_tokens``, ``predicted_cached_tokens``, ``reported_*_tokens``,
    ``ttft_count`` and each replica's requests), the hit rates are recomputed from the summed
    tokens, and the TTFT percentiles are the highest of the workers' (:data:`TTFT_MERGED`). The
    first answer gives the interval length and the number of intervals listed (the newest ones)."""
    first = answers[0]
    rows: dict[float, dict[str, Any]] = {}
    for answer in answers:
        for row in answer["intervals"]:
            merged = rows.get(row["ts"])
            if merged is None:
                rows[row["ts"]] = {**row, "replicas": dict(row["replicas"])}
                continue
            for name in _ADDED:
                merged[name] += row[name]
            for replica, count in row["replicas"].items():
                merged["replicas"][replica] = merged["replicas"].get(replica, 0) + count
            for name in ("ttft_p50_s", "ttft_p90_s"):
                if row[name] is not None and (merged[name] is None or row[name] > merged[name]):
                    merged[name] = row[name]
    listed = sorted(rows.values(), key=lambda r: r["ts"])[-len(first["intervals"]) :]
    for row in listed:
        row["predicted_hit_rate"] = _ratio(row["predicted_cached_tokens"], row["prompt_tokens"])
        row["reported_hit_rate"] = _ratio(row["reported_cached_tokens"], row["reported_prompt_tokens"])
        row["replicas"] = dict(sorted(row["replicas"].items()))
    now = max(answer["now"] for answer in answers)
    return {**first, "now": now, "intervals": listed, "ttft_percentiles": TTFT_MERGED}


_ADDED = (
    "requests",
    "prompt_tokens",
    "predicted_cached_tokens",
    "reported_prompt_tokens",
    "reported_cached_tokens",
    "ttft_count",
)
