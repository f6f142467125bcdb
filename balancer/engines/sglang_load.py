"""SGLang's load reports (pure: text/JSON in, :class:`~balancer.load.scrape.ScrapedLoad` out).

* Prometheus ``/metrics`` (prefix ``sglang:`` through v0.5.3, ``sglang_`` later):
  ``num_running_reqs``, ``num_queue_reqs``, ``token_usage`` (0..1), ``cache_hit_rate``,
  ``num_used_tokens``, ``max_total_num_tokens`` (:func:`parse_sglang_prometheus`).
* ``/v1/loads`` JSON (``loads[]`` per DP rank) and the three ``/get_load`` shapes (``{"load": n}``;
  a list per rank of ``num_reqs`` = running + waiting, ``num_waiting_reqs``, ``num_tokens``)
  (:func:`parse_sglang_loads`).

Built from the generic parts of :mod:`balancer.load.scrape` and :mod:`balancer.load.scrape_json`
(the Prometheus text parser, the range checks, the sums over DP ranks); :data:`SCRAPE_TARGETS` is
what SGLang's spec (:mod:`balancer.engines.sglang`) tries, in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from balancer.load.gauge_checks import Kind, Rejection
from balancer.load.scrape import (
    ScrapedLoad,
    ScrapeError,
    ScrapeTarget,
    checked_prometheus,
    count_of,
    json_parser,
    prefixed,
    rank_count,
    rank_mean,
    rank_sum,
    text_parser,
)
from balancer.load.scrape_json import average, present, rows_of, total

_SGLANG_GAUGES: dict[str, Kind] = {
    "num_running_reqs": "requests",
    "num_queue_reqs": "requests",
    "token_usage": "fraction",
    "cache_hit_rate": "fraction",
    "num_used_tokens": "tokens",
    "max_total_num_tokens": "tokens",
}


def parse_sglang_prometheus(text: str) -> ScrapedLoad:
    """SGLang ``/metrics`` (either prefix). Raises :class:`ScrapeError` without ``num_running_reqs``."""
    prefixes = ("sglang:", "sglang_")
    prefix, samples, rejections = checked_prometheus(
        text, prefixed(prefixes, _SGLANG_GAUGES), prefixes, "num_running_reqs"
    )
    return ScrapedLoad(
        running_reqs=count_of(rank_sum(samples, prefix + "num_running_reqs")),
        waiting_reqs=count_of(rank_sum(samples, prefix + "num_queue_reqs")),
        kv_usage=rank_mean(samples, prefix + "token_usage"),
        used_tokens=count_of(rank_sum(samples, prefix + "num_used_tokens")),
        capacity_tokens=count_of(rank_sum(samples, prefix + "max_total_num_tokens")),
        cache_hit_rate=rank_mean(samples, prefix + "cache_hit_rate"),
        dp_ranks=rank_count(samples, prefix + "num_running_reqs"),
        rejected=tuple(rejections),
    )


def parse_sglang_loads(body: object) -> ScrapedLoad:
    """SGLang ``/v1/loads`` (``{"loads": [...]}``) or any of the three ``/get_load`` shapes."""
    if isinstance(body, dict) and "loads" in body:
        return _sglang_v1_loads(rows_of(body["loads"], "loads"))
    if isinstance(body, dict) and "load" in body:
        rejections: list[Rejection] = []
        used = total([body], "tokens", rejections, "load")
        return ScrapedLoad(used_tokens=count_of(used), rejected=tuple(rejections))
    if isinstance(body, list):
        return _sglang_get_load(rows_of(body, "get_load"))
    raise ScrapeError(f"unknown SGLang load shape: {type(body).__name__}")


def _sglang_v1_loads(rows: list[Mapping[str, Any]]) -> ScrapedLoad:
    if not present(rows, "num_running_reqs"):
        raise ScrapeError("/v1/loads rows lack num_running_reqs")
    out: list[Rejection] = []
    return ScrapedLoad(
        running_reqs=count_of(total(rows, "requests", out, "num_running_reqs")),
        waiting_reqs=count_of(total(rows, "requests", out, "num_waiting_reqs")),
        kv_usage=average(rows, "fraction", out, "token_usage"),
        used_tokens=count_of(total(rows, "tokens", out, "num_used_tokens")),
        capacity_tokens=count_of(total(rows, "tokens", out, "max_total_num_tokens", "num_total_tokens")),
        cache_hit_rate=average(rows, "fraction", out, "cache_hit_rate"),
        dp_ranks=len(rows),
        rejected=tuple(out),
    )


def _sglang_get_load(rows: list[Mapping[str, Any]]) -> ScrapedLoad:
    """``/get_load`` per-rank list: ``num_reqs`` counts running + waiting."""
    if not present(rows, "num_reqs"):
        raise ScrapeError("/get_load rows lack num_reqs")
    out: list[Rejection] = []
    requests = total(rows, "requests", out, "num_reqs")
    waiting = total(rows, "requests", out, "num_waiting_reqs")
    running = requests - waiting if requests is not None and waiting is not None else None
    if running is not None and running < 0:  # more waiting than requests
        out.append(Rejection("num_reqs - num_waiting_reqs", repr(running), "negative"))
        running = None
    return ScrapedLoad(
        running_reqs=count_of(running),
        waiting_reqs=count_of(waiting),
        used_tokens=count_of(total(rows, "tokens", out, "num_tokens")),
        dp_ranks=len(rows),
        rejected=tuple(out),
    )


SCRAPE_TARGETS = (
    ScrapeTarget("/v1/loads?include=core,memory", json_parser(parse_sglang_loads)),
    ScrapeTarget("/metrics", text_parser(parse_sglang_prometheus), prometheus=True),
    ScrapeTarget("/get_load", json_parser(parse_sglang_loads)),
)
"""SGLang's load endpoints in the order they are tried: ``/v1/loads`` (newer builds), else
Prometheus ``/metrics``, else ``/get_load``."""
