"""TRT-LLM's load reports (pure: text/JSON in, :class:`~balancer.load.scrape.ScrapedLoad` out).

* ``/metrics`` JSON iteration stats (a drained list; the newest element per attention-DP rank
  counts): ``numActiveRequests``, ``numQueuedRequests``, ``kvCacheStats.usedNumBlocks /
  maxNumBlocks`` (:func:`parse_trtllm_iteration_stats`).
* Prometheus ``/prometheus/metrics`` (``trtllm_`` prefix, or ``trtllm:`` as relabelled by Dynamo)
  (:func:`parse_trtllm_prometheus`).

Built from the generic parts of :mod:`balancer.load.scrape` and :mod:`balancer.load.scrape_json`;
:data:`SCRAPE_TARGETS` is what TRT-LLM's spec (:mod:`balancer.engines.trtllm`) tries, in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from balancer.load.gauge_checks import Kind, Rejection
from balancer.load.scrape import (
    ScrapedLoad,
    ScrapeError,
    ScrapeTarget,
    checked_fraction,
    checked_prometheus,
    count_of,
    json_parser,
    prefixed,
    rank_count,
    rank_mean,
    rank_sum,
    text_parser,
)
from balancer.load.scrape_json import average, present, total

_TRTLLM_GAUGES: dict[str, Kind] = {
    "num_requests_running": "requests",
    "num_requests_waiting": "requests",
    "kv_cache_utilization": "fraction",
    "kv_cache_hit_rate": "fraction",
    "kv_cache_used_blocks": "tokens",
    "kv_cache_max_blocks": "tokens",
    "kv_cache_tokens_per_block": "tokens",
}


def parse_trtllm_prometheus(text: str) -> ScrapedLoad:
    """TRT-LLM ``/prometheus/metrics`` (``trtllm_``, or ``trtllm:`` as relabelled by Dynamo)."""
    prefixes = ("trtllm_", "trtllm:")
    prefix, samples, rejections = checked_prometheus(
        text, prefixed(prefixes, _TRTLLM_GAUGES), prefixes, "num_requests_running"
    )
    per_block = rank_mean(samples, prefix + "kv_cache_tokens_per_block")
    used = rank_sum(samples, prefix + "kv_cache_used_blocks")
    total = rank_sum(samples, prefix + "kv_cache_max_blocks")
    return ScrapedLoad(
        running_reqs=count_of(rank_sum(samples, prefix + "num_requests_running")),
        waiting_reqs=count_of(rank_sum(samples, prefix + "num_requests_waiting")),
        kv_usage=rank_mean(samples, prefix + "kv_cache_utilization"),
        used_tokens=count_of(used * per_block) if used is not None and per_block else None,
        capacity_tokens=count_of(total * per_block) if total is not None and per_block else None,
        cache_hit_rate=rank_mean(samples, prefix + "kv_cache_hit_rate"),
        dp_ranks=rank_count(samples, prefix + "num_requests_running"),
        rejected=tuple(rejections),
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
    if not present(rows, "numActiveRequests"):
        raise ScrapeError("iteration stats lack numActiveRequests")
    out: list[Rejection] = []
    kv_rows = [row["kvCacheStats"] for row in rows if isinstance(row.get("kvCacheStats"), dict)]
    kv = "kvCacheStats."
    used = total(kv_rows, "tokens", out, "usedNumBlocks", where=kv)
    capacity = total(kv_rows, "tokens", out, "maxNumBlocks", where=kv)
    per_block = average(kv_rows, "tokens", out, "tokensPerBlock", where=kv)
    usage = used / capacity if used is not None and capacity else None
    return ScrapedLoad(
        running_reqs=count_of(total(rows, "requests", out, "numActiveRequests")),
        waiting_reqs=count_of(total(rows, "requests", out, "numQueuedRequests")),
        kv_usage=checked_fraction(kv + "usedNumBlocks", usage, out),  # more used blocks than blocks
        used_tokens=count_of(used * per_block) if used is not None and per_block else None,
        capacity_tokens=count_of(capacity * per_block) if capacity is not None and per_block else None,
        cache_hit_rate=average(kv_rows, "fraction", out, "cacheHitRate", where=kv),
        dp_ranks=len(rows),
        rejected=tuple(out),
    )


SCRAPE_TARGETS = (
    ScrapeTarget("/metrics", json_parser(parse_trtllm_iteration_stats)),
    ScrapeTarget("/prometheus/metrics", text_parser(parse_trtllm_prometheus), prometheus=True),
)
"""TRT-LLM's load endpoints in the order they are tried: the JSON iteration stats, else Prometheus."""
