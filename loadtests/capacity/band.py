"""The simulator's own spread at a confirmed point, and the fleet against it (pure: no I/O, no clock).

Near a router's knee one simulation is one draw of a chaotic process: moving every arrival by a
millisecond can double TTFT p90 (docs/loadtest-history.md, "Where the fleet and the simulator part"). So
``kvlb capacity --confirm --confirm-sim-draws N`` simulates each confirmed point ``N`` times, each
draw the same requests with every arrival moved by a uniform ``±jitter_s`` (:func:`jitter_arrivals`,
randomness only through the passed ``random.Random``), and compares the fleet's repeats with the
draws' spread (:func:`band_of`, :func:`verdict`):

* the draws' TTFT p90 median, range and pass share at the SLO;
* the fleet's p90 per repeat and median; whether the fleet median is within ``rel_tol`` (10%) of the
  draws' median, and whether each fleet p90 falls inside the draws' range;
* a rate passes for the ensemble when at least half of the draws pass, for the fleet when at least
  half of its repeats pass; :func:`band_capacity` is the highest confirmed rate that passes below the
  lowest that fails, in each view.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from loadtests.simulate.sources import SimRequest

DEFAULT_REL_TOL = 0.10
"""The agreement target: fleet median p90 within 10% of the draws' median."""

R = TypeVar("R", bound=SimRequest)


def jitter_arrivals(requests: Sequence[R], jitter_s: float, rng: random.Random) -> list[R]:
    """``requests`` with each arrival moved by a uniform draw in ``[-jitter_s, +jitter_s]`` (model
    seconds, clamped at 0), one ``rng.uniform`` per request in input order, returned sorted by the new
    arrival time (ties keep the input order). Nothing else of a request changes."""
    if jitter_s < 0:
        raise ValueError(f"jitter_s must be >= 0, got {jitter_s}")
    moved = [
        dataclasses.replace(r, arrival_s=max(0.0, r.arrival_s + rng.uniform(-jitter_s, jitter_s)))
        for r in requests
    ]
    return sorted(moved, key=lambda r: r.arrival_s)


def draw_rng(seed: int, draw: int) -> random.Random:
    """The generator of draw ``draw`` of a run with ``--seed seed``: the same for every rate and
    router, so each draw moves the same requests the same way wherever it is simulated."""
    return random.Random(f"kvlb-band:{seed}:{draw}")


def hop_rng(seed: int, draw: int) -> random.Random:
    """The generator of draw ``draw``'s hops (``SimConfig.forward_jitter_s``), apart from
    :func:`draw_rng` so that spreading the hop leaves each draw's arrivals as they were."""
    return random.Random(f"kvlb-band-hop:{seed}:{draw}")


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def band_of(
    p90s: Sequence[float | None], passes: Sequence[bool], hit_rates: Sequence[float | None] = ()
) -> dict[str, Any]:
    """The draws' spread: each draw's TTFT p90 (``None``: no first token), the median and range of
    those measured, the share of draws that meet the SLO, and the range of their hit rates."""
    measured = sorted(p for p in p90s if p is not None)
    share = sum(passes) / len(passes) if passes else None
    hits = sorted(h for h in hit_rates if h is not None)
    return {
        "hit_rate": list(hit_rates),
        "hit_rate_min": hits[0] if hits else None,
        "hit_rate_max": hits[-1] if hits else None,
        "draws": len(p90s),
        "ttft_p90_s": list(p90s),
        "ttft_p90_median_s": _median(measured),
        "ttft_p90_min_s": measured[0] if measured else None,
        "ttft_p90_max_s": measured[-1] if measured else None,
        "pass_share": share,
        "passes": share is not None and share >= 0.5,
    }


def passing(band: Mapping[str, Any]) -> int:
    """How many of :func:`band_of`'s simulations met the SLO (its pass share × its draws)."""
    share: float = band["pass_share"] or 0.0
    draws: int = band["draws"]
    return round(share * draws)


def verdict(
    band: dict[str, Any],
    fleet_p90s: Sequence[float | None],
    fleet_passes: Sequence[bool],
    *,
    rel_tol: float = DEFAULT_REL_TOL,
) -> dict[str, Any]:
    """The fleet's repeats at one point against the draws' ``band``: the fleet median p90, its ratio to
    the draws' median and whether it is within ``rel_tol``; whether each fleet p90 is inside the draws'
    ``[min, max]`` (a repeat with no p90 is outside); the fleet's pass share and pass (≥ half)."""
    measured = [p for p in fleet_p90s if p is not None]
    median = _median(measured)
    sim_median, low, high = band["ttft_p90_median_s"], band["ttft_p90_min_s"], band["ttft_p90_max_s"]
    ratio = median / sim_median if median is not None and sim_median else None
    inside = [p is not None and low is not None and low <= p <= high for p in fleet_p90s]
    share = sum(fleet_passes) / len(fleet_passes) if fleet_passes else None
    return {
        "fleet_ttft_p90_s": list(fleet_p90s),
        "fleet_ttft_p90_median_s": median,
        "fleet_median_vs_sim_median": ratio,
        "fleet_median_within_tol": ratio is not None and abs(ratio - 1.0) <= rel_tol,
        "rel_tol": rel_tol,
        "fleet_inside_sim_range": inside,
        "fleet_inside_share": sum(inside) / len(inside) if inside else None,
        "fleet_pass_share": share,
        "fleet_passes": share is not None and share >= 0.5,
    }


def band_capacity(passes_at: Sequence[tuple[float, bool]]) -> float | None:
    """The highest rate that passes below the lowest that fails (``None``: none passes below it)."""
    failing = [rate for rate, ok in passes_at if not ok]
    ceiling = min(failing) if failing else float("inf")
    passing = [rate for rate, ok in passes_at if ok and rate < ceiling]
    return max(passing) if passing else None
