"""Capacity at an SLO: the SLO, a router's measured points and the search of ``kvlb capacity`` (pure).

A router's **capacity** is the highest offered arrival rate at which it meets the SLO: TTFT p90 (and,
when set, p99) within the bound and an error rate of at most ``max_error_rate``, on a valid run (a
point whose client fell behind its schedule is ``invalid`` and never meets it). :func:`search`
finds it for one router from a ``measure(rate) → RatePoint`` function (the simulator in
``kvlb capacity``): it steps the rate up or down by ``growth`` until one rate passes and one fails,
then bisects (geometrically) until the bracket is narrower than ``rel_tol``. The capacity is the
highest passing rate below the lowest failing one. TTFT is not strictly monotone in the rate on a
finite sample, so a pass above a fail is recorded in the points but does not move the capacity.

The searches become the report in :mod:`loadtests.capacity.report`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from loadtests.stats import Summary

Source = Literal["sim", "fleet", "target"]
"""Where a point was measured: the simulator, the emulated fleet, or a deployed endpoint (``--target``)."""


def parse_seconds(text: str | None) -> float | None:
    """``2s``, ``500ms``, ``2`` → seconds."""
    if text is None:
        return None
    raw = text.strip().lower()
    if raw.endswith("ms"):
        return float(raw[:-2]) / 1000.0
    return float(raw.removesuffix("s"))


@dataclass(frozen=True, slots=True)
class Slo:
    """What a rate must meet."""

    ttft_p90_s: float = 2.0
    ttft_p99_s: float | None = None
    max_error_rate: float = 0.001

    def __post_init__(self) -> None:
        if not self.ttft_p90_s > 0 or (self.ttft_p99_s is not None and not self.ttft_p99_s > 0):
            raise ValueError("SLO TTFT bounds must be > 0")
        if not 0 <= self.max_error_rate < 1:
            raise ValueError(f"max_error_rate must be in [0, 1), got {self.max_error_rate}")

    def latency_bounds_s(self) -> tuple[float, ...]:
        """The TTFT bounds set (seconds, model time in the simulator and on the emulated fleet): what
        bounds the client's send lag (:func:`loadtests.client_lag.lag_bound_s`)."""
        return tuple(b for b in (self.ttft_p90_s, self.ttft_p99_s) if b is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "max_error_rate": self.max_error_rate,
        }


@dataclass(frozen=True, slots=True)
class RatePoint:
    """One run at one offered rate."""

    rate: float
    source: Source
    requests: int
    errors: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    hit_rate: float | None
    prompt_tokens: int
    cached_tokens: int
    """Prefill tokens saved (served from cache)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    invalid: str | None = None
    """Why the run is no measurement at ``rate`` (e.g. the client fell behind its schedule,
    :mod:`loadtests.client_lag`); such a point never meets the SLO."""

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 1.0

    def meets(self, slo: Slo) -> bool:
        if self.invalid is not None:
            return False
        if self.error_rate > slo.max_error_rate or self.ttft_p90_s is None:
            return False
        if self.ttft_p90_s > slo.ttft_p90_s:
            return False
        return slo.ttft_p99_s is None or (self.ttft_p99_s is not None and self.ttft_p99_s <= slo.ttft_p99_s)

    def to_dict(self, slo: Slo | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "rate": self.rate,
            "source": self.source,
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.error_rate,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "hit_rate": self.hit_rate,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            **self.extra,
        }
        if self.invalid is not None:
            data["invalid"] = self.invalid
        if slo is not None:
            data["meets_slo"] = self.meets(slo)
        return data


_POINT_FIELDS = (
    "rate", "source", "requests", "errors", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_rate",
    "prompt_tokens", "cached_tokens",
)  # fmt: skip


def point_from_dict(data: Mapping[str, Any]) -> RatePoint:
    """A point of a saved report (:meth:`RatePoint.to_dict`)."""
    dropped = ("error_rate", "meets_slo", "invalid")
    extra = {k: v for k, v in data.items() if k not in _POINT_FIELDS and k not in dropped}
    return RatePoint(**{k: data[k] for k in _POINT_FIELDS}, extra=extra, invalid=data.get("invalid"))


def searches_from_report(report: Mapping[str, Any]) -> dict[str, Search]:
    """The simulator searches of a saved ``kvlb capacity`` report, by router."""
    found = {}
    for row in report.get("routers", ()):
        if not row.get("points"):
            continue
        points = tuple(point_from_dict(p) for p in row["points"])
        found[row["name"]] = Search(points, row.get("capacity_rate"), row.get("first_failing_rate"))
    return found


def point_of(
    rate: float, summary: Summary, source: Source, invalid: str | None = None, **extra: Any
) -> RatePoint:
    """A :class:`RatePoint` from a run's summary (simulated or measured)."""
    errors = summary.requests - summary.ok
    return RatePoint(
        rate=rate,
        source=source,
        requests=summary.requests,
        errors=errors,
        ttft_p50_s=summary.ttft_p50_s,
        ttft_p90_s=summary.ttft_p90_s,
        ttft_p99_s=summary.ttft_p99_s,
        hit_rate=summary.hit_rate,
        prompt_tokens=summary.prompt_tokens,
        cached_tokens=summary.cached_tokens,
        extra=extra,
        invalid=invalid,
    )


@dataclass(frozen=True, slots=True)
class Search:
    """One router's search: every point run, and the bracket."""

    points: tuple[RatePoint, ...]
    capacity: float | None
    """Highest passing rate below the lowest failing one; ``None``: even the lowest rate tried failed."""
    first_fail: float | None
    """Lowest failing rate above the capacity; ``None``: no failure up to the highest rate tried."""

    def point_at(self, rate: float | None) -> RatePoint | None:
        return next((p for p in self.points if rate is not None and p.rate == rate), None)


def search(
    measure: Callable[[float], RatePoint],
    slo: Slo,
    start_rate: float,
    *,
    growth: float = 1.5,
    rel_tol: float = 0.05,
    max_points: int = 16,
) -> Search:
    """Bracket then bisect the capacity (module docstring); at most ``max_points`` runs."""
    if not start_rate > 0 or not growth > 1 or not rel_tol > 0 or max_points < 2:
        raise ValueError("need start_rate > 0, growth > 1, rel_tol > 0 and max_points >= 2")
    points: dict[float, RatePoint] = {}

    def run(rate: float) -> bool:
        point = points.get(rate)
        if point is None:
            point = points[rate] = measure(rate)
        return point.meets(slo)

    low: float | None = None
    high: float | None = None
    rate = start_rate
    if run(rate):
        low = rate
        while len(points) < max_points:
            rate *= growth
            if not run(rate):
                high = rate
                break
            low = rate
    else:
        high = rate
        while len(points) < max_points:
            rate /= growth
            if run(rate):
                low = rate
                break
            high = rate
    while low is not None and high is not None and high / low > 1 + rel_tol and len(points) < max_points:
        middle = math.sqrt(low * high)
        if run(middle):
            low = middle
        else:
            high = middle
    return Search(tuple(sorted(points.values(), key=lambda p: p.rate)), low, high)
