"""A fleet run's requests simulated at the fleet's own times, and the run's verdict (pure: no I/O, no clock).

The draws of :mod:`loadtests.capacity.band` move the schedule's arrivals by a millisecond or so at a
fixed hop; near a knee they can repeat one trajectory where the fleet, a few milliseconds off the
schedule, takes another (docs/policy-studies.md, Part 36). So ``kvlb capacity --confirm`` also
simulates each fleet run's requests once per hop of ``--confirm-retimed-hops-ms`` with every
request arriving when that run routed it (*retimed*; "replay" is ``--confirm-replay``'s word, the
fleet running the simulation's assignment):

* :func:`run_times` takes the run's times by request: the fleet kvlb's decision times (``ts`` of
  the saved decisions, ``--confirm-save-decisions``) when every request has one, else the client's
  send times (``start_s`` of its records, which every run has);
* :func:`arrivals_of` turns those wall seconds into model arrivals: ``first + (t − t_min) ×
  time_scale``, anchored at the schedule's first arrival (a shift of every arrival alike changes
  nothing on a fleet that starts idle); :func:`retime` puts them on the requests;
* with ``--confirm-retimed-hop-ranges-ms`` the same retimed requests are also simulated with a
  **spread hop**: each request's hop its own uniform draw in ``[lo, hi]`` (``SimConfig``'s
  ``forward_delay_s`` and ``forward_jitter_s``, :func:`spread_config`), ``--confirm-retimed-draws``
  times per range, draw ``k``'s hops from the band's hop generator ``hop_rng(seed, k)``
  (:func:`parse_hop_ranges_ms`): the fleet's hop is not the same for every request (Part 37);
* :func:`verdict_of` says whether the run agrees with the draws, with its retimed simulations
  (timing) or with neither (a modelling difference), by the band's own rule: a verdict passes when
  at least half of its simulations pass (:func:`loadtests.capacity.band.band_of`), and a run agrees
  when its pass or fail at the SLO is the same. The fixed hops are one side, each hop range
  another; the run is timing when any of them agrees with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from loadtests.simulate.simulation import SimConfig
from loadtests.simulate.sources import SimRequest
from loadtests.stats import percentile

DEFAULT_HOPS_MS = (5.0, 10.0, 20.0)
"""The hops of the retimed simulations, model ms: the fleet's hop on idle replicas at
``--time-scale`` 0.25 is about 5–12 ms, up to about 35 ms under load (Part 19)."""

MAX_HOPS = 8
"""At most this many hops per fleet run (``--confirm-retimed-hops-ms``): each is one simulation."""

DEFAULT_HOP_RANGES_MS = ((5.0, 15.0),)
"""The spread hops of the retimed simulations, model ms (each request's hop uniform in ``[lo, hi]``):
the fleet's hop on idle replicas at ``--time-scale`` 0.25, measured per request as its TTFT minus the
simulator's without a hop, is 4.5–13.3 ms from p10 to p90, median 5–12 ms (Part 19)."""

DEFAULT_SPREAD_DRAWS = 5
"""Simulations per hop range (``--confirm-retimed-draws``), each with its own hop draws."""

MAX_SPREAD_SIMULATIONS = 40
"""At most this many spread simulations per fleet run (hop ranges × draws)."""

AGREES = "agrees with the draws"
TIMING = "disagrees with the draws, agrees with its retimed simulations (timing)"
MODELLING = "disagrees with both (a modelling difference worth a study)"
UNJUDGED = "not judged (no draws or no retimed simulation)"
INVALID = "not judged (no measurement: the client fell behind its schedule)"

DECISION_TIMES = "kvlb_decisions"
"""Times taken from the fleet kvlb's saved decisions (its routing times)."""
SEND_TIMES = "client_sends"
"""Times taken from the client's records (when it sent each request)."""

R = TypeVar("R", bound=SimRequest)


def parse_hops_ms(text: str) -> tuple[float, ...]:
    """``--confirm-retimed-hops-ms``: comma-separated model ms (``""`` or ``none``: no retimed
    simulation); each finite and ≥ 0, at most :data:`MAX_HOPS`; ``ValueError`` otherwise."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        hops = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--confirm-retimed-hops-ms: not a list of numbers: {text!r}") from None
    if any(not 0.0 <= h < float("inf") for h in hops):
        raise ValueError(f"--confirm-retimed-hops-ms: every hop must be finite and >= 0, got {text!r}")
    if len(hops) > MAX_HOPS:
        raise ValueError(f"--confirm-retimed-hops-ms: at most {MAX_HOPS} hops, got {len(hops)}")
    return hops


def parse_hop_ranges_ms(text: str, draws: int) -> tuple[tuple[float, float], ...]:
    """``--confirm-retimed-hop-ranges-ms``: comma-separated ``lo-hi`` model ms (``""`` or ``none``:
    no spread hop), each ``0 <= lo <= hi`` and finite; with ``draws`` (``--confirm-retimed-draws``,
    >= 1 when a range is given) at most :data:`MAX_SPREAD_SIMULATIONS` simulations in all;
    ``ValueError`` otherwise."""
    flag = "--confirm-retimed-hop-ranges-ms"
    if text.strip().lower() in ("", "none"):
        return ()
    ranges: list[tuple[float, float]] = []
    for part in text.split(","):
        bounds = part.split("-")
        try:
            if len(bounds) != 2:
                raise ValueError
            lo, hi = float(bounds[0]), float(bounds[1])
        except ValueError:
            raise ValueError(f"{flag}: not a list of lo-hi ranges: {text!r}") from None
        if not (math.isfinite(hi) and 0.0 <= lo <= hi):
            raise ValueError(f"{flag}: each range needs 0 <= lo <= hi, finite, got {part!r}")
        ranges.append((lo, hi))
    if draws < 1:
        raise ValueError(f"--confirm-retimed-draws must be >= 1 with {flag}, got {draws}")
    if len(ranges) * draws > MAX_SPREAD_SIMULATIONS:
        raise ValueError(
            f"{flag} × --confirm-retimed-draws: at most {MAX_SPREAD_SIMULATIONS} simulations, "
            f"got {len(ranges)} × {draws}"
        )
    return tuple(ranges)


def spread_config(config: SimConfig, lo_ms: float, hi_ms: float) -> SimConfig:
    """``config`` with each request's hop a uniform draw in ``[lo_ms, hi_ms]`` model ms: the
    simulator's ``forward_delay_s`` at the middle and ``forward_jitter_s`` the half-width (0 when
    ``lo_ms == hi_ms``: every hop exactly ``lo_ms``, and no generator is read)."""
    return dataclasses.replace(
        config, forward_delay_s=(lo_ms + hi_ms) / 2000.0, forward_jitter_s=(hi_ms - lo_ms) / 2000.0
    )


def run_times(
    request_ids: Sequence[str],
    send_times_s: Mapping[str, float],
    decision_times_s: Mapping[str, float] | None,
) -> tuple[str, list[float]] | None:
    """Each request's time in one fleet run (wall seconds, any origin), in ``request_ids``' order,
    and where it came from: the kvlb's decision times (:data:`DECISION_TIMES`) when they cover every
    request, else the client's send times (:data:`SEND_TIMES`) when those do; ``None`` otherwise."""
    for source, times in ((DECISION_TIMES, decision_times_s), (SEND_TIMES, send_times_s)):
        if times is not None and all(rid in times for rid in request_ids):
            return source, [times[rid] for rid in request_ids]
    return None


def decision_times(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The time of each request's first decision (``request_id`` → ``ts``) in the saved decisions."""
    times: dict[str, float] = {}
    for row in rows:
        rid, ts = row.get("request_id"), row.get("ts")
        if isinstance(rid, str) and isinstance(ts, (int, float)) and rid not in times:
            times[rid] = float(ts)
    return times


def arrivals_of(times_s: Sequence[float], time_scale: float, first_arrival_s: float) -> list[float]:
    """Wall times → model arrivals: ``first_arrival_s + (t − min(times_s)) × time_scale``, in order.
    ``time_scale`` is model seconds per wall second (``--time-scale``)."""
    if not times_s:
        return []
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    start = min(times_s)
    return [first_arrival_s + (t - start) * time_scale for t in times_s]


def retime(requests: Sequence[R], arrivals_s: Sequence[float]) -> list[R]:
    """``requests`` with request ``i`` arriving at ``arrivals_s[i]`` (model s), sorted by the new
    arrival (ties keep the input order). Nothing else of a request changes."""
    moved = [dataclasses.replace(r, arrival_s=a) for r, a in zip(requests, arrivals_s, strict=True)]
    return sorted(moved, key=lambda r: r.arrival_s)


def offsets_ms(scheduled_s: Sequence[float], arrivals_s: Sequence[float]) -> dict[str, float | None]:
    """How far the retimed arrivals are from the schedule's (model ms, arrival − scheduled): p10,
    p50, p90 and the largest in absolute value."""
    diffs = sorted((a - s) * 1000.0 for s, a in zip(scheduled_s, arrivals_s, strict=True))
    return {
        "p10": percentile(diffs, 10),
        "p50": percentile(diffs, 50),
        "p90": percentile(diffs, 90),
        "max_abs": max((abs(d) for d in diffs), default=None),
    }


def routing_lag_ms(
    request_ids: Sequence[str],
    send_times_s: Mapping[str, float],
    decision_times_s: Mapping[str, float],
    time_scale: float,
) -> dict[str, float | None]:
    """How much later than its send each request was routed, beyond the first request's lag (model
    ms: ``((decided − first decided) − (sent − first sent)) × time_scale × 1000``; the two clocks
    differ, so only the change from the first request is known): p10, p50, p90 and the largest in
    absolute value, over the requests with both times. What the decision times add to the sends."""
    both = [rid for rid in request_ids if rid in send_times_s and rid in decision_times_s]
    if not both:
        return {"p10": None, "p50": None, "p90": None, "max_abs": None}
    first = min(both, key=lambda rid: send_times_s[rid])
    sent0, decided0 = send_times_s[first], decision_times_s[first]
    lags = [
        ((decision_times_s[rid] - decided0) - (send_times_s[rid] - sent0)) * time_scale * 1000.0
        for rid in both
    ]
    return {
        "p10": percentile(lags, 10),
        "p50": percentile(lags, 50),
        "p90": percentile(lags, 90),
        "max_abs": max(abs(x) for x in lags),
    }


def verdict_of(
    fleet_passes: bool,
    draws_pass: bool | None,
    retimed_pass: bool | None,
    *,
    invalid: bool = False,
    spread_passes: Sequence[bool] = (),
) -> str:
    """One fleet run's verdict: it agrees with the draws when its pass or fail at the SLO is the
    draws' (``draws_pass``: at least half of them pass, the band's ``passes``); else it is timing
    when it is its retimed simulations' at the fixed hops (``retimed_pass``: at least half pass, the
    same rule) or at any hop range (``spread_passes``: one per range, the same rule over its draws),
    and a modelling difference when it is none of them. :data:`UNJUDGED` without draws or retimed
    simulations, :data:`INVALID` for a run that is no measurement at its rate (``invalid``)."""
    if invalid:
        return INVALID
    if draws_pass is None:
        return UNJUDGED
    if fleet_passes == draws_pass:
        return AGREES
    sides = ([] if retimed_pass is None else [retimed_pass]) + list(spread_passes)
    if not sides:
        return UNJUDGED
    return TIMING if fleet_passes in sides else MODELLING
