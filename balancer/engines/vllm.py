"""vLLM: its :data:`SPEC` and its load report parser (pure). vLLM's ZMQ KV events share SGLang's
framing and event schema, so its decoder is :class:`balancer.engines.sglang.SglangDecoder` (which
knows vLLM's own fields: u64 and ``bytes`` hashes, ``lora_name``, ``extra_keys``, KV-cache groups).

vLLM's spec: plain alignment, 16 tokens per block by default, ZMQ events per DP rank with replay, and
load from Prometheus ``/metrics`` only (:func:`parse_vllm_prometheus`: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (older ``vllm:gpu_cache_usage_perc``),
the prefix-cache hit counters, the pool size from ``vllm:cache_config_info``'s ``num_gpu_blocks``
and ``block_size`` labels); it answers a request for a model it does not serve with 404, so its
model list is checked.
"""

from __future__ import annotations

from collections.abc import Iterable

from balancer.engines.sglang import SglangDecoder, chain_decoder
from balancer.engines.spec import EngineSpec
from balancer.load.gauge_checks import Kind
from balancer.load.scrape import (
    Labels,
    ScrapedLoad,
    ScrapeTarget,
    checked_fraction,
    checked_prometheus,
    count_of,
    parse_prometheus,
    prefixed,
    rank_count,
    rank_mean,
    rank_sum,
    text_parser,
)

_VLLM_GAUGES: dict[str, Kind] = {
    "num_requests_running": "requests",
    "num_requests_waiting": "requests",
    "kv_cache_usage_perc": "fraction",  # despite its name a fraction: "1 means 100 percent usage"
    "gpu_cache_usage_perc": "fraction",
    "prefix_cache_hits_total": "counter",
    "prefix_cache_queries_total": "counter",
    "gpu_prefix_cache_hit_rate": "fraction",
}
"""vLLM's gauges (``vllm:`` prefix); ``vllm:cache_config_info`` is read for its labels only."""


def parse_vllm_prometheus(text: str) -> ScrapedLoad:
    """vLLM ``/metrics``. Raises :class:`ScrapeError` without ``vllm:num_requests_running``."""
    kinds = prefixed(("vllm:",), _VLLM_GAUGES)
    _, samples, rejections = checked_prometheus(text, kinds, ("vllm:",), "num_requests_running")
    info = parse_prometheus(text, ("vllm:cache_config_info",))
    usage = rank_mean(samples, "vllm:kv_cache_usage_perc")
    if usage is None:
        usage = rank_mean(samples, "vllm:gpu_cache_usage_perc")
    hits = rank_sum(samples, "vllm:prefix_cache_hits_total")
    queries = rank_sum(samples, "vllm:prefix_cache_queries_total")
    hit_rate = hits / queries if hits is not None and queries else None
    hit_rate = checked_fraction(
        "vllm:prefix_cache_hits_total", hit_rate, rejections
    )  # more hits than queries
    if hit_rate is None:
        hit_rate = rank_mean(samples, "vllm:gpu_prefix_cache_hit_rate")
    return ScrapedLoad(
        running_reqs=count_of(rank_sum(samples, "vllm:num_requests_running")),
        waiting_reqs=count_of(rank_sum(samples, "vllm:num_requests_waiting")),
        kv_usage=usage,
        capacity_tokens=_vllm_capacity_tokens(info.get("vllm:cache_config_info", ())),
        cache_hit_rate=hit_rate,
        dp_ranks=rank_count(samples, "vllm:num_requests_running"),
        rejected=tuple(rejections),
    )


def _vllm_capacity_tokens(series: Iterable[tuple[Labels, float]]) -> int | None:
    """Pool size from ``vllm:cache_config_info``'s ``num_gpu_blocks`` × ``block_size`` labels, summed
    over engines (DP ranks); ``None`` when a label is missing or not a positive integer."""
    per_engine: dict[str, int] = {}
    for labels, _ in series:
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if not (blocks.isdigit() and size.isdigit()) or int(blocks) * int(size) <= 0:
            return None
        per_engine[labels.get("engine", "")] = int(blocks) * int(size)
    return sum(per_engine.values()) or None


SPEC = EngineSpec(
    name="vllm",
    decoder=SglangDecoder,
    chain_decoder=chain_decoder,
    align_mode="plain",
    bigram_align_mode="bigram",
    default_block_size=16,
    transport="zmq",
    scrape_targets=(ScrapeTarget("/metrics", text_parser(parse_vllm_prometheus), prometheus=True),),
    resync_on_unclean_takeover=False,
    checks_model_name=True,
)
