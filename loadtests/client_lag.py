"""Whether an open-loop client kept its schedule, and when a run is no measurement at its rate (pure).

An open-loop load test claims an offered rate, but the endpoint gets what the client really sent.
The client falls behind when its in-flight cap (``kvlb loadtest --concurrency``) holds launches back
(:attr:`loadtests.driver.RunResult.slot_waits`) or when it is too busy to send on time; TTFT runs
from the send, so a late client both offers less load than claimed and hides its own wait
(docs/loadtest.md, "The client's send lag"). :func:`check_client` gathers the client's figures from
the records (:func:`loadtests.stats.send_lag`) and applies the rule. The run's client is **behind**,
and the run is not a valid measurement at its offered rate, when any of these holds:

1. it sent at less than :data:`MIN_SENT_SHARE` (95%) of the schedule's rate **and** its lag p90 is
   above :data:`MIN_SUSTAINED_LAG_SHARE` (2%) of the schedule's span: the endpoint was offered less
   than the report claims, for most of the run (a client sending at 95% of the rate throughout
   ends ≈ 5% of the span late, lag p90 ≈ 4.7%; one late send at the end of a short run moves the
   rate but not the p90, and is no shortfall of load);
2. a launch waited for the in-flight cap (``slot_waits > 0``): the endpoint never saw more requests
   in flight than the cap where the schedule asked for more (the open loop turned partly closed),
   and each waiting request's time in the client's queue is missing from its TTFT;
3. with a latency objective (a TTFT or e2e bound), the lag p90 is above
   :data:`MAX_LAG_SHARE_OF_SLO` (10%) of the tightest bound: the arrivals reached the endpoint
   reshaped on the time scale the verdict is about.

A closed loop has no schedule and no check (``None``). Times are the records' (wall seconds) unless
the caller gives a ``time_scale`` (model seconds per wall second): ``kvlb capacity --confirm`` runs
the emulated fleet at ``--time-scale`` and judges its client in model time, the time of its rates
and of its SLO (:func:`check_client`). Rules 1 and 2 do not change with the scale (rule 1 compares
rates with rates and a lag with a span); rule 3 compares the lag with a bound in the same time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtests.stats import RequestRecord, SendLag, send_lag

MIN_SENT_SHARE = 0.95
"""Rule 1: the client must send at least this share of the schedule's rate (the figure
``kvlb capacity --confirm`` used alone before it took this rule, 2026-11-30)."""

MIN_SUSTAINED_LAG_SHARE = 0.02
"""Rule 1: a rate shortfall counts only when the lag p90 exceeds this share of the schedule's span
(a sustained shortfall, not one stall at the end of a short run)."""

MAX_LAG_SHARE_OF_SLO = 0.1
"""Rule 3: the client's lag p90 may be at most this share of the tightest latency bound."""

LATENCY_SLO_PREFIXES: tuple[str, ...] = ("ttft_", "e2e_")
"""Objectives whose bound scales rule 3: time from the send (ITL does not depend on arrivals)."""

LOADTEST_ADVICE = (
    "raise --concurrency (the open loop's in-flight cap), run the client on another machine, or "
    "lower the rate"
)
"""What a ``kvlb loadtest`` user can do about a client behind its schedule."""

FIELDS: tuple[str, ...] = (
    "client_scheduled_rate_per_s", "client_sent_rate_per_s", "client_lag_p50_s", "client_lag_p90_s",
    "client_lag_max_s", "client_slot_waits", "client_concurrency_cap", "client_lag_bound_s",
    "client_behind", "client_behind_reasons",
)  # fmt: skip
"""Keys of :meth:`ClientCheck.to_dict` (each ``None`` in :func:`no_schedule`)."""


@dataclass(frozen=True, slots=True)
class ClientCheck:
    """The open-loop client against its schedule over one run (seconds and requests per second)."""

    scheduled_rate_per_s: float
    """The schedule's rate over the sent requests: (n − 1) over the span of their scheduled times
    (``math.inf`` when they were all scheduled at once)."""
    sent_rate_per_s: float
    """The rate really sent: (n − 1) over the span of the send times."""
    lag_p50_s: float
    lag_p90_s: float
    lag_max_s: float
    """Percentiles of ``start_s − scheduled_s``: how late the client sent."""
    slot_waits: int
    """Launches that waited for the in-flight cap."""
    concurrency_cap: int
    """The cap on requests in flight the run had."""
    lag_bound_s: float | None
    """Rule 3's bound (:func:`lag_bound_s`); ``None``: no latency objective, no lag bound."""
    reasons: tuple[str, ...]
    """Each broken rule, in words; empty when the client kept its schedule."""

    @property
    def behind(self) -> bool:
        return bool(self.reasons)

    def note(self, advice: str = LOADTEST_ADVICE) -> str | None:
        """The run's invalid note (``None`` when the client kept its schedule)."""
        if not self.reasons:
            return None
        return (
            f"client behind its schedule ({'; '.join(self.reasons)}): not a valid measurement at the "
            f"offered rate; {advice}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, keys :data:`FIELDS` (an infinite rate is ``None``)."""
        return {
            "client_scheduled_rate_per_s": _finite(self.scheduled_rate_per_s),
            "client_sent_rate_per_s": _finite(self.sent_rate_per_s),
            "client_lag_p50_s": self.lag_p50_s,
            "client_lag_p90_s": self.lag_p90_s,
            "client_lag_max_s": self.lag_max_s,
            "client_slot_waits": self.slot_waits,
            "client_concurrency_cap": self.concurrency_cap,
            "client_lag_bound_s": self.lag_bound_s,
            "client_behind": self.behind,
            "client_behind_reasons": list(self.reasons),
        }


def summary_line(figures: Mapping[str, Any]) -> str:
    """One line from :meth:`ClientCheck.to_dict`'s figures: sent against scheduled, lag, waits."""

    def rate(key: str) -> str:
        value = figures[key]
        return "∞" if value is None else _rate(value)

    return (
        f"client sent {rate('client_sent_rate_per_s')} of {rate('client_scheduled_rate_per_s')} req/s "
        f"scheduled, lag p50 / p90 / max {_ms(figures['client_lag_p50_s'])} / "
        f"{_ms(figures['client_lag_p90_s'])} / {_ms(figures['client_lag_max_s'])} ms, "
        f"{figures['client_slot_waits']} slot waits (in-flight cap {figures['client_concurrency_cap']})"
    )


def no_schedule() -> dict[str, Any]:
    """The figures of a run without a schedule (closed loop, or a router that did not run)."""
    return dict.fromkeys(FIELDS)


def lag_bound_s(latency_bounds_s: Iterable[float]) -> float | None:
    """Rule 3's bound: :data:`MAX_LAG_SHARE_OF_SLO` of the tightest latency bound (``None`` for none)."""
    bounds = list(latency_bounds_s)
    return MAX_LAG_SHARE_OF_SLO * min(bounds) if bounds else None


def check_client(
    records: Sequence[RequestRecord],
    *,
    slot_waits: int,
    concurrency_cap: int,
    lag_bound_s: float | None = None,
    time_scale: float = 1.0,
) -> ClientCheck | None:
    """The client's figures and the module's rule over ``records`` (``None`` when fewer than two
    have a schedule: a closed loop, or too few requests to have a rate).

    ``time_scale`` is model seconds per wall second of the records (``--time-scale`` of the emulated
    fleet; 1: the figures are the records' own wall time): every figure of the check is in model
    time (a lag of ``w`` wall s is ``w × time_scale`` model s, a rate of ``r`` per wall s is
    ``r / time_scale`` per model s), and ``lag_bound_s`` must be in model time too."""
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
    wall = send_lag(records)
    if wall is None:
        return None
    lag = SendLag(
        p50_s=wall.p50_s * time_scale,
        p90_s=wall.p90_s * time_scale,
        max_s=wall.max_s * time_scale,
        sent_rate_per_s=wall.sent_rate_per_s / time_scale,
        scheduled_rate_per_s=wall.scheduled_rate_per_s / time_scale,
    )
    reasons = []
    scheduled = [r.scheduled_s for r in records if r.scheduled_s is not None]
    scheduled_span_s = (max(scheduled) - min(scheduled)) * time_scale
    sustained = lag.p90_s > MIN_SUSTAINED_LAG_SHARE * scheduled_span_s
    if lag.sent_rate_per_s < MIN_SENT_SHARE * lag.scheduled_rate_per_s and sustained:
        share = lag.sent_rate_per_s / lag.scheduled_rate_per_s
        reasons.append(
            f"sent {_rate(lag.sent_rate_per_s)} of {_rate(lag.scheduled_rate_per_s)} req/s, "
            f"{share:.0%} < {MIN_SENT_SHARE:.0%}"
        )
    if slot_waits > 0:
        reasons.append(f"{slot_waits} launches waited for the in-flight cap of {concurrency_cap}")
    if lag_bound_s is not None and lag.p90_s > lag_bound_s:
        reasons.append(
            f"lag p90 {_ms(lag.p90_s)} ms > {_ms(lag_bound_s)} ms "
            f"({MAX_LAG_SHARE_OF_SLO:.0%} of the tightest latency SLO)"
        )
    return ClientCheck(
        scheduled_rate_per_s=lag.scheduled_rate_per_s,
        sent_rate_per_s=lag.sent_rate_per_s,
        lag_p50_s=lag.p50_s,
        lag_p90_s=lag.p90_s,
        lag_max_s=lag.max_s,
        slot_waits=slot_waits,
        concurrency_cap=concurrency_cap,
        lag_bound_s=lag_bound_s,
        reasons=tuple(reasons),
    )


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _rate(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "∞"


def _ms(value: float) -> str:
    return f"{value * 1000:.0f}" if value >= 0.1 else f"{value * 1000:.1f}"
