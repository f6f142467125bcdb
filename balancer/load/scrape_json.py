"""Generic helpers of JSON load reports (pure: JSON documents in, checked figures out).

An engine's JSON report (SGLang's ``/v1/loads`` and ``/get_load``, TRT-LLM's iteration stats: their
parsers live in :mod:`balancer.engines.sglang_load` and :mod:`balancer.engines.trtllm_load`) is a
list of rows, one per DP rank. :func:`column` reads one field over the rows with the range checks of
:mod:`balancer.load.gauge_checks`; :func:`total` sums it (counts), :func:`average` averages it
(fractions), as :mod:`balancer.load.scrape` does for Prometheus gauges. A field with a value out of
its kind's range is ``None`` and listed in the rejections (``ScrapedLoad.rejected``); a value that
is not a number at all fails the scrape (:class:`ScrapeError`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from balancer.load.gauge_checks import Kind, Rejection, rejected
from balancer.load.scrape import ScrapeError


def _num(obj: Mapping[str, Any], *keys: str) -> tuple[str, float] | None:
    """The first of ``keys`` present in ``obj`` and its value as a float (NaN, ±Inf and huge
    integers included, for :func:`column` to refuse). A value that is not a number (bools are not)
    raises :class:`ScrapeError`: the report is not of the shape expected."""
    for key in keys:
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ScrapeError(f"{key} is not a number: {value!r:.40}")
        try:
            return key, float(value)
        except OverflowError:  # an integer beyond a double's range
            return key, math.inf if value > 0 else -math.inf
    return None


def column(
    rows: list[Mapping[str, Any]], kind: Kind, rejections: list[Rejection], *keys: str, where: str = ""
) -> list[float] | None:
    """The values of ``keys`` over ``rows`` (rows without any of them left out); ``None`` when one
    is out of ``kind``'s range (the first such one is appended to ``rejections`` as
    ``where + key``)."""
    values: list[float] = []
    for row in rows:
        found = _num(row, *keys)
        if found is None or (kind == "fraction" and math.isnan(found[1])):  # NaN rate: none (0/0)
            continue
        bad = rejected(where + found[0], found[1], kind)
        if bad is not None:
            rejections.append(bad)
            return None
        values.append(found[1])
    return values


def total(
    rows: list[Mapping[str, Any]], kind: Kind, rejections: list[Rejection], *keys: str, where: str = ""
) -> float | None:
    """The sum of :func:`column` (a count over DP ranks); ``None`` when no row has it or one is
    out of range."""
    values = column(rows, kind, rejections, *keys, where=where)
    return sum(values) if values else None


def average(
    rows: list[Mapping[str, Any]], kind: Kind, rejections: list[Rejection], *keys: str, where: str = ""
) -> float | None:
    """The mean of :func:`column` (a fraction over DP ranks); ``None`` when no row has it or one is
    out of range."""
    values = column(rows, kind, rejections, *keys, where=where)
    return sum(values) / len(values) if values else None


def present(rows: list[Mapping[str, Any]], key: str) -> bool:
    """Whether some row of ``rows`` holds ``key`` (not as ``null``)."""
    return any(row.get(key) is not None for row in rows)


def rows_of(value: object, what: str) -> list[Mapping[str, Any]]:
    """``value`` as a non-empty list of objects (one per DP rank); else :class:`ScrapeError` naming
    it as ``what``."""
    if not isinstance(value, list) or not value or not all(isinstance(row, dict) for row in value):
        raise ScrapeError(f"{what} is not a non-empty list of objects")
    return value
