"""Parsers of the engines' JSON load reports (pure: JSON documents in, :class:`ScrapedLoad` out).

SGLang's ``/v1/loads`` (``loads[]`` per DP rank) and the three ``/get_load`` shapes (``{"load": n}``;
a list per rank of ``num_reqs`` = running + waiting, ``num_waiting_reqs``, ``num_tokens``), and
TRT-LLM's ``/metrics`` iteration stats (a drained list; the newest element per attention-DP rank
counts): ``numActiveRequests``, ``numQueuedRequests``, ``kvCacheStats``. Ranks are summed for counts
and averaged for fractions, as in :mod:`balancer.load.scrape`, whose range checks apply: a field
with a value out of its kind's range is ``None`` and listed in ``ScrapedLoad.rejected``; a value
that is not a number at all fails the scrape (:class:`ScrapeError`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from balancer.load.gauge_checks import Kind, Rejection, rejected
from balancer.load.scrape import ScrapedLoad, ScrapeError, checked_fraction, count_of


def _num(obj: Mapping[str, Any], *keys: str) -> tuple[str, float] | None:
    """The first of ``keys`` present in ``obj`` and its value as a float (NaN, ±Inf and huge
    integers included, for :func:`_column` to refuse). A value that is not a number (bools are not)
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


def _column(
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


def _total(
    rows: list[Mapping[str, Any]], kind: Kind, rejections: list[Rejection], *keys: str, where: str = ""
) -> float | None:
    values = _column(rows, kind, rejections, *keys, where=where)
    return sum(values) if values else None


def _average(
    rows: list[Mapping[str, Any]], kind: Kind, rejections: list[Rejection], *keys: str, where: str = ""
) -> float | None:
    values = _column(rows, kind, rejections, *keys, where=where)
    return sum(values) / len(values) if values else None


def _present(rows: list[Mapping[str, Any]], key: str) -> bool:
    return any(row.get(key) is not None for row in rows)


def _rows(value: object, what: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list) or not value or not all(isinstance(row, dict) for row in value):
        raise ScrapeError(f"{what} is not a non-empty list of objects")
    return value


def parse_sglang_loads(body: object) -> ScrapedLoad:
    """SGLang ``/v1/loads`` (``{"loads": [...]}``) or any of the three ``/get_load`` shapes."""
    if isinstance(body, dict) and "loads" in body:
        return _sglang_v1_loads(_rows(body["loads"], "loads"))
    if isinstance(body, dict) and "load" in body:
        rejections: list[Rejection] = []
        used = _total([body], "tokens", rejections, "load")
        return ScrapedLoad(used_tokens=count_of(used), rejected=tuple(rejections))
    if isinstance(body, list):
        return _sglang_get_load(_rows(body, "get_load"))
    raise ScrapeError(f"unknown SGLang load shape: {type(body).__name__}")


def _sglang_v1_loads(rows: list[Mapping[str, Any]]) -> ScrapedLoad:
    if not _present(rows, "num_running_reqs"):
        raise ScrapeError("/v1/loads rows lack num_running_reqs")
    out: list[Rejection] = []
    return ScrapedLoad(
        running_reqs=count_of(_total(rows, "requests", out, "num_running_reqs")),
        waiting_reqs=count_of(_total(rows, "requests", out, "num_waiting_reqs")),
        kv_usage=_average(rows, "fraction", out, "token_usage"),
        used_tokens=count_of(_total(rows, "tokens", out, "num_used_tokens")),
        capacity_tokens=count_of(_total(rows, "tokens", out, "max_total_num_tokens", "num_total_tokens")),
        cache_hit_rate=_average(rows, "fraction", out, "cache_hit_rate"),
        dp_ranks=len(rows),
        rejected=tuple(out),
    )


def _sglang_get_load(rows: list[Mapping[str, Any]]) -> ScrapedLoad:
    """``/get_load`` per-rank list: ``num_reqs`` counts running + waiting."""
    if not _present(rows, "num_reqs"):
        raise ScrapeError("/get_load rows lack num_reqs")
    out: list[Rejection] = []
    total = _total(rows, "requests", out, "num_reqs")
    waiting = _total(rows, "requests", out, "num_waiting_reqs")
    running = total - waiting if total is not None and waiting is not None else None
    if running is not None and running < 0:  # more waiting than requests
        out.append(Rejection("num_reqs - num_waiting_reqs", repr(running), "negative"))
        running = None
    return ScrapedLoad(
        running_reqs=count_of(running),
        waiting_reqs=count_of(waiting),
        used_tokens=count_of(_total(rows, "tokens", out, "num_tokens")),
        dp_ranks=len(rows),
        rejected=tuple(out),
    )


def parse_trtllm_iteration_stats(body: object) -> ScrapedLoad | None:
    """TRT-LLM ``/metrics`` JSON: the newest iteration of each attention-DP rank, summed.

    Returns ``None`` for an empty list (no iteration ran since the last drain: the engine is idle).
    """
    if not isinstance(body, list):
        raise ScrapeError(f"iteration stats must be a list, got {type(body).__name__}")
    if not body:
        return None
    newest: dict[object, Mapping[str, Any]] = {}
    for item in body:
        if not isinstance(item, dict):
            raise ScrapeError("iteration stats hold a non-object")
        newest[item.get("attentionDpRank", 0)] = item  # later iterations overwrite earlier ones
    rows = list(newest.values())
    if not _present(rows, "numActiveRequests"):
        raise ScrapeError("iteration stats lack numActiveRequests")
    out: list[Rejection] = []
    kv_rows = [row["kvCacheStats"] for row in rows if isinstance(row.get("kvCacheStats"), dict)]
    kv = "kvCacheStats."
    used = _total(kv_rows, "tokens", out, "usedNumBlocks", where=kv)
    capacity = _total(kv_rows, "tokens", out, "maxNumBlocks", where=kv)
    per_block = _average(kv_rows, "tokens", out, "tokensPerBlock", where=kv)
    usage = used / capacity if used is not None and capacity else None
    return ScrapedLoad(
        running_reqs=count_of(_total(rows, "requests", out, "numActiveRequests")),
        waiting_reqs=count_of(_total(rows, "requests", out, "numQueuedRequests")),
        kv_usage=checked_fraction(kv + "usedNumBlocks", usage, out),  # more used blocks than blocks
        used_tokens=count_of(used * per_block) if used is not None and per_block else None,
        capacity_tokens=count_of(capacity * per_block) if capacity is not None and per_block else None,
        cache_hit_rate=_average(kv_rows, "fraction", out, "cacheHitRate", where=kv),
        dp_ranks=len(rows),
        rejected=tuple(out),
    )
