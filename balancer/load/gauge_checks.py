"""Range checks of the figures an engine's load report holds (pure: no I/O, no clock, no state).

An engine's ``/metrics`` is input from outside: a bug, a half-written exposition or a proxy in the
way can report a queue of ``-3``, ``NaN`` or ``+Inf`` requests, ``1e300`` of them, ``2.5`` of them,
or a KV usage of ``1.7``. Each scraped figure has a :data:`Kind`; :func:`check` says why a value is
out of its kind's range (``None``: in range). The engines' parsers (:mod:`balancer.engines`, built
on :mod:`balancer.load.scrape`) drop a gauge with any bad sample (its field of
:class:`~balancer.load.scrape.ScrapedLoad` is then ``None``: unknown, as when the engine does not
report it) and list a :class:`Rejection`; the scraper counts it in
``kvlb_scrape_rejected_values_total{replica, reason}`` and logs it.

The limits are sanity bounds far above any real engine, not tuning: a replica running 10 million
requests, or holding 10^12 tokens of KV cache, is a wrong figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Kind = Literal["requests", "tokens", "fraction", "counter"]
"""What a figure counts: ``requests`` (running or queued requests: an integer, 0..
:data:`MAX_REQUESTS`), ``tokens`` (tokens or KV blocks: an integer, 0..:data:`MAX_TOKENS`),
``fraction`` (a usage or hit rate, 0..1) or ``counter`` (a lifetime Prometheus counter: 0..
:data:`MAX_COUNTER`, fractions allowed)."""

Reason = Literal["not_finite", "negative", "not_integer", "above_limit"]
"""Why a value was refused (the ``reason`` label: a fixed set)."""

REASONS: tuple[Reason, ...] = ("not_finite", "negative", "not_integer", "above_limit")

MAX_REQUESTS = 10_000_000
"""Largest request count believed (requests, per sample: one DP rank)."""
MAX_TOKENS = 10**12
"""Largest token or block count believed (per sample)."""
MAX_COUNTER = 1e18
"""Largest lifetime counter believed (per sample)."""
FRACTION_SLACK = 1e-9
"""A fraction up to ``1 + FRACTION_SLACK`` is rounding (an engine dividing used by total) and read
as at most 1; above it the value is refused."""

_LIMITS: dict[Kind, float] = {
    "requests": MAX_REQUESTS,
    "tokens": MAX_TOKENS,
    "fraction": 1.0 + FRACTION_SLACK,
    "counter": MAX_COUNTER,
}


@dataclass(frozen=True, slots=True)
class Rejection:
    """One refused figure of a load report."""

    gauge: str
    """The metric (Prometheus name) or JSON field (``kvCacheStats.usedNumBlocks``) it came from."""
    value: str
    """The value as read (``repr`` of the float: ``-3.0``, ``nan``, ``inf``, ``1e+300``)."""
    reason: Reason


def check(value: float, kind: Kind) -> Reason | None:
    """Why ``value`` is out of range for a figure of ``kind``; ``None`` when it is in range.
    Counts take integral floats (engines export ``2.0``) and refuse other fractions."""
    if not math.isfinite(value):
        return "not_finite"
    if value < 0:
        return "negative"
    if value > _LIMITS[kind]:
        return "above_limit"
    if kind in ("requests", "tokens") and not value.is_integer():
        return "not_integer"
    return None


def rejected(gauge: str, value: float, kind: Kind) -> Rejection | None:
    """A :class:`Rejection` of ``value`` read from ``gauge``, or ``None`` when it is in range."""
    reason = check(float(value), kind)
    return None if reason is None else Rejection(gauge, repr(float(value)), reason)
