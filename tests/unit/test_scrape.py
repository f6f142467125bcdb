"""Engine load-report parsers, on real captured ``/metrics`` text and on documented JSON shapes.

Expected values from the captures are read independently with ``prometheus_client``'s parser, so a
change in the capture (or a parser bug) fails the test rather than matching a hard-coded number.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from balancer.engines.sglang_load import parse_sglang_loads, parse_sglang_prometheus
from balancer.engines.trtllm_load import parse_trtllm_iteration_stats, parse_trtllm_prometheus
from balancer.engines.vllm import parse_vllm_prometheus
from balancer.load.scrape import ScrapedLoad, ScrapeError, parse_prometheus
from balancer.load.tracker import EngineStats

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
SGLANG_TEXT = (FIXTURES / "sglang-0.5.23-cpu.txt").read_text()
VLLM_TEXT = (FIXTURES / "vllm-0.32.0-cpu.txt").read_text()


def oracle(text: str, name: str) -> list[float]:
    """Every sample value of ``name`` as ``prometheus_client`` reads it."""
    return [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def only(text: str, name: str) -> float:
    values = oracle(text, name)
    assert len(values) == 1, (name, values)
    return values[0]


# --- real captures ------------------------------------------------------------------------------


def test_sglang_capture_matches_independent_parse() -> None:
    load = parse_sglang_prometheus(SGLANG_TEXT)
    assert load.running_reqs == round(only(SGLANG_TEXT, "sglang:num_running_reqs"))
    assert load.waiting_reqs == round(only(SGLANG_TEXT, "sglang:num_queue_reqs"))
    assert load.kv_usage == only(SGLANG_TEXT, "sglang:token_usage")
    assert load.cache_hit_rate == only(SGLANG_TEXT, "sglang:cache_hit_rate")
    assert load.used_tokens == round(only(SGLANG_TEXT, "sglang:num_used_tokens"))
    assert load.capacity_tokens == round(only(SGLANG_TEXT, "sglang:max_total_num_tokens"))
    assert load.dp_ranks == 1
    # The capture was taken between requests: a non-trivial hit rate, an idle queue.
    assert load.cache_hit_rate is not None and 0.0 < load.cache_hit_rate < 1.0
    assert load.capacity_tokens and load.capacity_tokens > 0


def test_sglang_underscore_prefix_reads_the_same() -> None:
    """SGLang ≥ 0.5.4 builds may name the metrics ``sglang_*``; the parse must not change."""
    renamed = SGLANG_TEXT.replace("sglang:", "sglang_")
    assert parse_sglang_prometheus(renamed) == parse_sglang_prometheus(SGLANG_TEXT)


def test_vllm_capture_matches_independent_parse() -> None:
    load = parse_vllm_prometheus(VLLM_TEXT)
    assert load.running_reqs == round(only(VLLM_TEXT, "vllm:num_requests_running"))
    assert load.waiting_reqs == round(only(VLLM_TEXT, "vllm:num_requests_waiting"))
    assert load.kv_usage == only(VLLM_TEXT, "vllm:kv_cache_usage_perc")
    hits = only(VLLM_TEXT, "vllm:prefix_cache_hits_total")
    queries = only(VLLM_TEXT, "vllm:prefix_cache_queries_total")
    assert queries > 0
    assert load.cache_hit_rate == pytest.approx(hits / queries)
    # ``vllm:num_requests_waiting_by_reason`` shares the prefix and must not be summed in.
    assert len(oracle(VLLM_TEXT, "vllm:num_requests_waiting_by_reason")) > 1
    assert load.capacity_tokens == 6144  # the capture's own kv_cache_size_tokens label: 48 blocks x 128


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ('engine="0",num_gpu_blocks="10",block_size="16"', 160),
        ('engine="0",num_gpu_blocks="None",block_size="16"', None),
        ('engine="0",block_size="16"', None),
        ('engine="0",num_gpu_blocks="0",block_size="16"', None),
    ],
)
def test_vllm_pool_size_from_cache_config_labels(labels: str, expected: int | None) -> None:
    text = f"vllm:num_requests_running 1\nvllm:cache_config_info{{{labels}}} 1.0\n"
    assert parse_vllm_prometheus(text).capacity_tokens == expected
    two_engines = text + 'vllm:cache_config_info{engine="1",num_gpu_blocks="10",block_size="16"} 1.0\n'
    assert parse_vllm_prometheus(two_engines).capacity_tokens == (None if expected is None else 320)


def test_parse_prometheus_reads_every_capture_sample_like_prometheus_client() -> None:
    for text in (SGLANG_TEXT, VLLM_TEXT):
        expected: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):
                    expected.setdefault(sample.name, []).append((sample.labels, sample.value))
        assert len(expected) > 100
        assert parse_prometheus(text, expected.keys()) == expected


def test_wrong_engine_text_is_an_error() -> None:
    with pytest.raises(ScrapeError):
        parse_vllm_prometheus(SGLANG_TEXT)
    with pytest.raises(ScrapeError):
        parse_sglang_prometheus(VLLM_TEXT)
    with pytest.raises(ScrapeError):
        parse_trtllm_prometheus(VLLM_TEXT)


# --- aggregation and text edge cases ------------------------------------------------------------

MULTI_DP = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp="0",tp_rank="0",model_name="m"} 3.0
sglang:num_running_reqs{dp="0",tp_rank="1",model_name="m"} 3.0
sglang:num_running_reqs{dp="1",tp_rank="0",model_name="m"} 5.0
sglang:num_queue_reqs{dp="0",tp_rank="0"} 1
sglang:num_queue_reqs{dp="1",tp_rank="0"} 2
sglang:token_usage{dp="0"} 0.25
sglang:token_usage{dp="1"} 0.75
sglang:cache_hit_rate{dp="0"} NaN
sglang:cache_hit_rate{dp="1"} 0.5
"""


def test_dp_ranks_sum_counts_and_average_fractions() -> None:
    load = parse_sglang_prometheus(MULTI_DP)
    assert load.running_reqs == 3 + 5  # tp_rank 1 repeats dp 0's scheduler: not counted twice
    assert load.waiting_reqs == 1 + 2
    assert load.kv_usage == pytest.approx((0.25 + 0.75) / 2)
    assert load.cache_hit_rate == 0.5  # NaN samples are skipped
    assert load.dp_ranks == 2
    assert load.used_tokens is None and load.capacity_tokens is None


def test_label_values_with_escapes_commas_and_braces() -> None:
    text = 'x{a="1,2",b="say \\"hi\\"",c="}{",d="back\\\\slash"} 7 1700000000000\nx 8\n# x{} 9\nxy 10\n'
    samples = parse_prometheus(text, {"x"})
    assert samples["x"] == [({"a": "1,2", "b": 'say "hi"', "c": "}{", "d": "back\\slash"}, 7.0), ({}, 8.0)]


@pytest.mark.parametrize(
    "line",
    ['x{a="1"', "x{a=1} 3", "x", 'x{a="1"} notanumber', 'x{a="unterminated} 1'],
)
def test_malformed_wanted_lines_raise(line: str) -> None:
    with pytest.raises(ScrapeError):
        parse_prometheus(line + "\n", {"x"})
    assert parse_prometheus(line + "\n", {"other"}) == {}


def test_trtllm_prometheus() -> None:
    text = """\
trtllm_num_requests_running{model_name="m",engine_type="trtllm"} 4.0
trtllm_num_requests_waiting{model_name="m",engine_type="trtllm"} 6.0
trtllm_kv_cache_utilization{model_name="m",engine_type="trtllm"} 0.4
trtllm_kv_cache_hit_rate{model_name="m",engine_type="trtllm"} 0.9
trtllm_kv_cache_used_blocks{model_name="m",engine_type="trtllm"} 40.0
trtllm_kv_cache_max_blocks{model_name="m",engine_type="trtllm"} 100.0
trtllm_kv_cache_tokens_per_block{model_name="m",engine_type="trtllm"} 32.0
"""
    load = parse_trtllm_prometheus(text)
    assert (load.running_reqs, load.waiting_reqs, load.kv_usage) == (4, 6, 0.4)
    assert (load.used_tokens, load.capacity_tokens, load.cache_hit_rate) == (40 * 32, 100 * 32, 0.9)
    assert parse_trtllm_prometheus(text.replace("trtllm_", "trtllm:")) == load


# --- JSON shapes --------------------------------------------------------------------------------


def test_sglang_v1_loads() -> None:
    body = {
        "timestamp": "2024-01-15T10:30:00+00:00",
        "dp_rank_count": 2,
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 5, "num_waiting_reqs": 2, "num_used_tokens": 5000,
             "max_total_num_tokens": 100000, "token_usage": 0.05, "cache_hit_rate": 0.5},
            {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 1000,
             "num_total_tokens": 100000, "token_usage": 0.15, "cache_hit_rate": 0.7},
        ],
        "aggregate": {"total_running_reqs": 6},
    }  # fmt: skip
    load = parse_sglang_loads(body)
    assert load == ScrapedLoad(
        running_reqs=6,
        waiting_reqs=2,
        kv_usage=pytest.approx(0.10),  # type: ignore[arg-type]
        used_tokens=6000,
        capacity_tokens=200000,
        cache_hit_rate=pytest.approx(0.6),  # type: ignore[arg-type]
        dp_ranks=2,
    )


def test_sglang_get_load_three_shapes() -> None:
    assert parse_sglang_loads({"load": 1234}) == ScrapedLoad(used_tokens=1234)
    listed = [
        {"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 3, "num_tokens": 900},
        {"dp_rank": 1, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 100},
    ]
    expected = ScrapedLoad(running_reqs=4 + 2, waiting_reqs=3, used_tokens=1000, dp_ranks=2)
    assert parse_sglang_loads(listed) == expected
    shim = [dict(row, num_pending_tokens=5, ts_tic=1.5) for row in listed]
    assert parse_sglang_loads(shim) == expected


@pytest.mark.parametrize(
    "body",
    [{}, [], {"loads": []}, {"loads": [{"num_waiting_reqs": 1}]}, [{"num_tokens": 1}], "x",
     {"load": "many"}, {"loads": [{"num_running_reqs": True}]}],
)  # fmt: skip
def test_sglang_loads_malformed(body: object) -> None:
    with pytest.raises(ScrapeError):
        parse_sglang_loads(body)


def iteration(it: int, active: int, queued: int, used: int, rank: int | None = None) -> dict[str, object]:
    stats: dict[str, object] = {
        "iter": it,
        "iterLatencyMS": 12.5,
        "numActiveRequests": active,
        "numQueuedRequests": queued,
        "numCompletedRequests": 0,
        "maxNumActiveRequests": 64,
        "kvCacheStats": {"maxNumBlocks": 200, "freeNumBlocks": 200 - used, "usedNumBlocks": used,
                         "tokensPerBlock": 32, "cacheHitRate": 0.25},
    }  # fmt: skip
    if rank is not None:
        stats["attentionDpRank"] = rank
    return stats


def test_trtllm_iteration_stats_take_the_newest() -> None:
    body = [iteration(1, 9, 9, 190), iteration(2, 3, 1, 50)]
    load = parse_trtllm_iteration_stats(body)
    assert load == ScrapedLoad(
        running_reqs=3,
        waiting_reqs=1,
        kv_usage=50 / 200,
        used_tokens=50 * 32,
        capacity_tokens=200 * 32,
        cache_hit_rate=0.25,
    )


def test_trtllm_iteration_stats_sum_attention_dp_ranks() -> None:
    body = [iteration(1, 1, 0, 10, rank=0), iteration(1, 2, 1, 30, rank=1), iteration(2, 4, 2, 20, rank=0)]
    load = parse_trtllm_iteration_stats(body)
    assert load is not None
    assert (load.running_reqs, load.waiting_reqs, load.dp_ranks) == (4 + 2, 2 + 1, 2)
    assert load.kv_usage == pytest.approx((20 + 30) / 400)


def test_trtllm_iteration_stats_empty_and_malformed() -> None:
    assert parse_trtllm_iteration_stats([]) is None
    bodies: list[object] = [{}, [1], [{"iter": 1}], [{"numActiveRequests": "x"}]]
    for body in bodies:
        with pytest.raises(ScrapeError):
            parse_trtllm_iteration_stats(body)
    no_kv = parse_trtllm_iteration_stats([{"numActiveRequests": 2}])
    assert no_kv == ScrapedLoad(running_reqs=2)


def test_engine_stats_view() -> None:
    load = ScrapedLoad(
        running_reqs=1, waiting_reqs=2, kv_usage=0.5, used_tokens=3, capacity_tokens=64, cache_hit_rate=0.1
    )
    assert load.engine_stats() == EngineStats(
        running_reqs=1, waiting_reqs=2, kv_usage=0.5, capacity_tokens=64
    )
