"""Range checks of scraped engine figures (branch h-gauges): every parser, every engine's names, each
bad shape (NaN, ±Inf, negative, a fraction for a count, above a sanity limit, a usage outside 0..1).

A bad figure drops its field (``None``: unknown, as when the engine does not report it) and is
listed in ``ScrapedLoad.rejected``; the report's other fields are kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from balancer.engines.sglang_load import parse_sglang_loads, parse_sglang_prometheus
from balancer.engines.trtllm_load import parse_trtllm_iteration_stats, parse_trtllm_prometheus
from balancer.engines.vllm import parse_vllm_prometheus
from balancer.load.gauge_checks import MAX_REQUESTS, MAX_TOKENS, Rejection, check
from balancer.load.scrape import ScrapedLoad, ScrapeError

BAD_COUNTS = [
    ("-3", "negative"),
    ("NaN", "not_finite"),
    ("+Inf", "not_finite"),
    ("-Inf", "not_finite"),
    ("1e300", "above_limit"),
    ("2.5", "not_integer"),
    ("10000001", "above_limit"),
]
BAD_FRACTIONS = [("1.5", "above_limit"), ("-0.2", "negative"), ("+Inf", "not_finite"), ("-Inf", "not_finite")]

# (parser, prefix, running, waiting, usage gauge): the Prometheus names of each engine
PROMETHEUS = [
    (parse_vllm_prometheus, "vllm:", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"),
    (parse_vllm_prometheus, "vllm:", "num_requests_running", "num_requests_waiting", "gpu_cache_usage_perc"),
    (parse_sglang_prometheus, "sglang:", "num_running_reqs", "num_queue_reqs", "token_usage"),
    (parse_sglang_prometheus, "sglang_", "num_running_reqs", "num_queue_reqs", "token_usage"),
    (
        parse_trtllm_prometheus,
        "trtllm_",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_utilization",
    ),
    (
        parse_trtllm_prometheus,
        "trtllm:",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_utilization",
    ),
]
Prom = Callable[[str], ScrapedLoad]


def exposition(prefix: str, running: str, waiting: str, usage: str, values: tuple[str, str, str]) -> str:
    return "".join(
        f'{prefix}{name}{{dp="{rank}",model_name="m"}} {value if rank == 1 else "1.0"}\n'
        for name, value in zip((running, waiting, usage), values, strict=True)
        for rank in (0, 1)
    )


@pytest.mark.parametrize(("parse", "prefix", "running", "waiting", "usage"), PROMETHEUS)
@pytest.mark.parametrize(("value", "reason"), BAD_COUNTS)
def test_a_bad_queue_is_dropped_and_listed(
    parse: Prom, prefix: str, running: str, waiting: str, usage: str, value: str, reason: str
) -> None:
    load = parse(exposition(prefix, running, waiting, usage, ("2.0", value, "0.5")))
    assert load.waiting_reqs is None  # not -3 + 1, not rounded, not 10**300
    assert load.rejected == (Rejection(prefix + waiting, repr(float(value)), reason),)  # type: ignore[arg-type]
    assert load.running_reqs == 3 and load.kv_usage == 0.75 and load.dp_ranks == 2  # the rest is kept


@pytest.mark.parametrize(("parse", "prefix", "running", "waiting", "usage"), PROMETHEUS)
@pytest.mark.parametrize(("value", "reason"), BAD_COUNTS)
def test_a_bad_running_count_is_dropped_and_the_report_kept(
    parse: Prom, prefix: str, running: str, waiting: str, usage: str, value: str, reason: str
) -> None:
    load = parse(exposition(prefix, running, waiting, usage, (value, "2.0", "0.5")))
    assert load.running_reqs is None and load.waiting_reqs == 3
    assert [r.reason for r in load.rejected] == [reason]


@pytest.mark.parametrize(("parse", "prefix", "running", "waiting", "usage"), PROMETHEUS)
@pytest.mark.parametrize(("value", "reason"), BAD_FRACTIONS)
def test_a_usage_outside_zero_to_one_is_dropped(
    parse: Prom, prefix: str, running: str, waiting: str, usage: str, value: str, reason: str
) -> None:
    load = parse(exposition(prefix, running, waiting, usage, ("2.0", "0", value)))
    assert load.kv_usage is None and load.waiting_reqs == 1
    assert load.rejected == (Rejection(prefix + usage, repr(float(value)), reason),)  # type: ignore[arg-type]


@pytest.mark.parametrize(("parse", "prefix", "running", "waiting", "usage"), PROMETHEUS)
def test_integral_floats_exact_ones_and_nan_fractions_are_accepted(
    parse: Prom, prefix: str, running: str, waiting: str, usage: str
) -> None:
    load = parse(exposition(prefix, running, waiting, usage, ("2.0", "4e0", "1.0")))
    assert (load.running_reqs, load.waiting_reqs, load.kv_usage, load.rejected) == (3, 5, 1.0, ())
    load = parse(exposition(prefix, running, waiting, usage, ("2", "0", "NaN")))  # a 0/0 rate: no sample
    assert load.kv_usage == 1.0 and load.rejected == ()


def test_more_vllm_prefix_hits_than_queries_is_refused() -> None:
    text = (
        "vllm:num_requests_running 1\nvllm:prefix_cache_hits_total 30\nvllm:prefix_cache_queries_total 10\n"
    )
    load = parse_vllm_prometheus(text)
    assert load.cache_hit_rate is None and [r.reason for r in load.rejected] == ["above_limit"]
    text = text.replace("queries_total 10", "queries_total -10")
    assert [r.reason for r in parse_vllm_prometheus(text).rejected] == ["negative"]


def test_a_bad_sglang_token_count_and_trtllm_block_count() -> None:
    sglang = parse_sglang_prometheus("sglang:num_running_reqs 1\nsglang:max_total_num_tokens 1e13\n")
    assert sglang.capacity_tokens is None and sglang.rejected[0].reason == "above_limit"
    trtllm = parse_trtllm_prometheus(
        "trtllm_num_requests_running 1\n"
        "trtllm_kv_cache_max_blocks 100\n"
        "trtllm_kv_cache_tokens_per_block 0.5\n"
    )
    assert trtllm.capacity_tokens is None and trtllm.rejected[0].reason == "not_integer"


def test_a_gauge_that_is_missing_still_fails_the_scrape() -> None:
    with pytest.raises(ScrapeError):
        parse_vllm_prometheus("vllm:num_requests_waiting 1\n")


# --- JSON ----------------------------------------------------------------------------------------

JSON_BAD = [
    (-3, "negative"),
    (float("nan"), "not_finite"),
    (float("inf"), "not_finite"),
    (1e300, "above_limit"),
    (2.5, "not_integer"),
    (10**400, "not_finite"),  # an integer beyond a double
]
JSON_IDS = ["negative", "nan", "inf", "1e300", "fraction", "10**400"]


@pytest.mark.parametrize(("value", "reason"), JSON_BAD, ids=JSON_IDS)
def test_sglang_v1_loads_bad_counts(value: float, reason: str) -> None:
    rows = [
        {"num_running_reqs": 1, "num_waiting_reqs": value, "token_usage": 0.5},
        {"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.25},
    ]
    load = parse_sglang_loads(json.loads(json.dumps({"loads": rows})))
    assert load.waiting_reqs is None and load.running_reqs == 3 and load.kv_usage == 0.375
    assert [(r.gauge, r.reason) for r in load.rejected] == [("num_waiting_reqs", reason)]


@pytest.mark.parametrize(
    ("value", "reason"), [(1.5, "above_limit"), (-0.1, "negative"), (float("inf"), "not_finite")]
)
def test_sglang_v1_loads_bad_usage(value: float, reason: str) -> None:
    load = parse_sglang_loads(
        json.loads(json.dumps({"loads": [{"num_running_reqs": 1, "token_usage": value}]}))
    )
    assert load.kv_usage is None and load.running_reqs == 1 and load.rejected[0].reason == reason


@pytest.mark.parametrize(("value", "reason"), JSON_BAD, ids=JSON_IDS)
def test_sglang_get_load_shapes(value: float, reason: str) -> None:
    load = parse_sglang_loads(json.loads(json.dumps({"load": value})))
    assert load.used_tokens is None and load.rejected[0].reason == reason
    load = parse_sglang_loads(
        json.loads(json.dumps([{"num_reqs": value, "num_waiting_reqs": 1, "num_tokens": 7}]))
    )
    assert load.running_reqs is None and load.waiting_reqs == 1 and load.used_tokens == 7
    assert load.rejected[0].reason == reason


def test_sglang_get_load_more_waiting_than_requests() -> None:
    load = parse_sglang_loads([{"num_reqs": 2, "num_waiting_reqs": 5}])
    assert load.running_reqs is None and load.waiting_reqs == 5
    assert load.rejected == (Rejection("num_reqs - num_waiting_reqs", "-3.0", "negative"),)


@pytest.mark.parametrize(("value", "reason"), JSON_BAD, ids=JSON_IDS)
def test_trtllm_iteration_stats_bad_queue(value: float, reason: str) -> None:
    stats = [
        {
            "numActiveRequests": 1,
            "numQueuedRequests": value,
            "kvCacheStats": {"usedNumBlocks": 5, "maxNumBlocks": 10, "tokensPerBlock": 32},
        }
    ]
    load = parse_trtllm_iteration_stats(json.loads(json.dumps(stats)))
    assert load is not None and load.waiting_reqs is None
    assert load.running_reqs == 1 and load.kv_usage == 0.5 and load.capacity_tokens == 320
    assert [(r.gauge, r.reason) for r in load.rejected] == [("numQueuedRequests", reason)]


def test_trtllm_iteration_stats_bad_blocks() -> None:
    kv = {"usedNumBlocks": 12, "maxNumBlocks": 10, "tokensPerBlock": 32, "cacheHitRate": 1.5}
    load = parse_trtllm_iteration_stats([{"numActiveRequests": 1, "kvCacheStats": kv}])
    assert load is not None and load.kv_usage is None and load.cache_hit_rate is None
    assert {(r.gauge, r.reason) for r in load.rejected} == {
        ("kvCacheStats.usedNumBlocks", "above_limit"),  # more used than there are
        ("kvCacheStats.cacheHitRate", "above_limit"),
    }
    load = parse_trtllm_iteration_stats([{"numActiveRequests": -1, "kvCacheStats": {"maxNumBlocks": -4}}])
    assert load is not None and load.running_reqs is None and load.capacity_tokens is None
    assert [r.reason for r in load.rejected] == ["negative", "negative"]


def test_json_that_is_not_a_number_still_fails_the_scrape() -> None:
    with pytest.raises(ScrapeError):
        parse_sglang_loads({"loads": [{"num_running_reqs": "3"}]})


def test_limits_are_inclusive() -> None:
    assert check(float(MAX_REQUESTS), "requests") is None
    assert check(MAX_REQUESTS + 1.0, "requests") == "above_limit"
    assert check(float(MAX_TOKENS), "tokens") is None
    assert check(1.0 + 1e-12, "fraction") is None  # rounding of used / total
    assert check(1.0 + 1e-6, "fraction") == "above_limit"
    assert check(-0.0, "requests") is None


@pytest.mark.parametrize(
    ("parse", "capture"),
    [(parse_sglang_prometheus, "sglang-0.5.23-cpu.txt"), (parse_vllm_prometheus, "vllm-0.32.0-cpu.txt")],
)
def test_real_engine_captures_have_nothing_refused(parse: Prom, capture: str) -> None:
    """The checks refuse no figure of a real engine's ``/metrics`` (captured from the engines)."""
    text = (Path(__file__).resolve().parents[1] / "fixtures" / "metrics" / capture).read_text()
    load = parse(text)
    assert load.rejected == () and load.running_reqs is not None and load.kv_usage is not None
