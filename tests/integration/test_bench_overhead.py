"""``kvlb bench overhead`` at smoke size: real processes (fake upstream, plain proxy, ``kvlb serve``),
every field of the report present and consistent. No timing assertions; the pure figure helpers are
checked against hand-computed values.
"""

from __future__ import annotations

import json
import math

import pytest

from balancer.tokenizer.default import deepseek_tokenizer_file
from loadtests.bench.overhead.report import (
    MODES,
    PROXIES,
    added,
    format_report,
    histogram_delta,
    histogram_quantile,
    metric_value,
    own_ratios,
    parse_histogram,
    peer_ratios,
    percentile,
)
from loadtests.bench.overhead.run import SMOKE, OverheadShape, bench_tokenizers, build_prompts, measure
from loadtests.bench.overhead.servers import PEER_PATHS
from loadtests.peers import peer_available

LATENCY_FIELDS = ("n", "mean_ms", "p50_ms", "p90_ms", "p99_ms")
CPU_FIELDS = ("requests", "cpu_s", "cpu_ms_per_request", "req_per_cpu_s", "cpu_utilisation")


@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
async def test_smoke_run_reports_every_field() -> None:
    report = await measure(SMOKE)
    kinds = ["chat_shared", "chat", "chat_cold", "tokens", "tokens_shared", "grpc_tokens"]
    assert report["shape"]["kinds"] == kinds
    installed = [spec.name for spec in PEER_PATHS if peer_available(spec)]
    assert report["peers"]["measured"] == installed
    assert sorted(report["peers"]["skipped"]) == sorted({s.name for s in PEER_PATHS} - set(installed))
    assert report["prompt_tokens"]["min"] > 0
    penalty = report["machine"]["idle_penalty"]
    assert penalty["gap_ms"] == SMOKE.spaced_gap_ms and penalty["samples"] == 40
    assert penalty["back_to_back_us_p50"] > 0 and penalty["after_idle_us_p50"] > 0
    ratio = penalty["after_idle_us_p50"] / penalty["back_to_back_us_p50"]
    assert penalty["factor"] == pytest.approx(ratio, 0.02)
    assert report["tokenize_ms"]["p50_ms"] > 0
    inline = report["tokenize_shared_inline_ms"]
    assert inline["p50_ms"] > 0 and "encode_chat_if_cached" in inline["description"]
    assert inline["samples"] == 3 * SMOKE.prompts and inline["refused"] == 0
    assert report["tokenize_cpu_ms"]["p50_ms"] > 0
    assert sorted(report["own_ratios"]) == ["chat_cold", "grpc_tokens", "tokens", "tokens_shared"]
    for figures in report["own_ratios"].values():
        assert "cpu_ratio" in figures["concurrent"]  # None when a CPU figure rounds to 0 (smoke)
    threads = report["tokenize_threads"]
    assert threads["rounds"] == 10 and threads["threads"] == 4
    assert threads["chats_per_s_p50"] > 0 and threads["max_loop_lag_ms_max"] >= threads["max_loop_lag_ms_p50"]
    for kind in kinds:
        run = report["runs"][kind]
        seq, spaced, conc = run["sequential"], run["spaced"], run["concurrent"]
        peers = [] if "tokens" in kind else installed  # sglang-router rejects token-id prompts
        paths = [*MODES, "kvlb_w2", *peers]  # kvlb: --workers 1; kvlb_w2: --workers 2
        assert list(seq["latency"]) == list(spaced["latency"]) == list(conc["latency"]) == paths
        assert spaced["gap_ms"] == SMOKE.spaced_gap_ms
        for mode in paths:
            assert set(LATENCY_FIELDS) <= set(seq["latency"][mode])
            assert seq["latency"][mode]["n"] == SMOKE.sequential_rounds
            assert spaced["latency"][mode]["n"] == SMOKE.spaced_rounds
            expected = SMOKE.concurrent_rounds * SMOKE.burst_requests
            assert conc["latency"][mode]["n"] == expected
            assert conc["req_per_s"][mode] > 0
        # the bench's own tokenizer takes chat_cold's one-at-a-time turns beside the paths
        local = ["tokenizer"] if kind == "chat_cold" else []
        assert list(seq["cpu"]) == list(spaced["cpu"]) == [*PROXIES, "kvlb_w2", *peers, *local]
        for proxy in [*PROXIES, "kvlb_w2", *peers]:
            assert set(CPU_FIELDS) <= set(conc["cpu"][proxy])
            assert set(CPU_FIELDS) <= set(seq["cpu"][proxy]) and set(CPU_FIELDS) <= set(spaced["cpu"][proxy])
            direct_p50 = seq["latency"]["direct"]["p50_ms"]
            assert seq["added"][proxy]["p50_ms"] == pytest.approx(
                seq["latency"][proxy]["p50_ms"] - direct_p50
            )
        # every kvlb request of this kind made exactly one routing decision (grpc_tokens: Generate calls)
        routed = SMOKE.warmup + SMOKE.sequential_rounds + SMOKE.spaced_rounds + SMOKE.concurrency
        routed += SMOKE.concurrent_rounds * SMOKE.burst_requests
        assert run["route_decision"]["count"] == routed
        assert run["route_decision"]["mean_us"] > 0
        assert set(run["token_id_memo"]) == {"hits", "misses", "evictions"}
        assert set(run["body_memo"]) == {"hits", "misses", "evictions"}
    # the memos: shared id prompts decode their tails;
    # gRPC token ids come packed from the message, their runs of packed varints found as well
    for kind in ("chat_shared", "chat", "chat_cold"):
        assert report["runs"][kind]["token_id_memo"] == {"hits": 0, "misses": 0, "evictions": 0}
    shared, grpc_ids = (
        report["runs"]["tokens_shared"]["token_id_memo"],
        report["runs"]["grpc_tokens"]["token_id_memo"],
    )
    # repeated bodies are found whole by the body memo from their second sight (their runs decoded,
    # then kept, before it), so the runs memo's hits come from the shared kinds
    assert shared["hits"] > 0 and shared["misses"] > 0
    for kind in ("tokens", "chat"):
        assert report["runs"][kind]["body_memo"]["hits"] > 0
    assert report["runs"]["chat_shared"]["body_memo"]["hits"] == 0
    assert grpc_ids["hits"] > 0 and grpc_ids["evictions"] == 0
    assert report["shape"]["workers"] == [1, 2]
    for kind in kinds:
        ratios = report["workers_ratios"][kind]
        assert ratios["kvlb_w1_req_per_s"] > 0 and ratios["kvlb_w2_req_per_s"] > 0
        assert ratios["w2_over_w1"] == pytest.approx(
            ratios["kvlb_w2_req_per_s"] / ratios["kvlb_w1_req_per_s"], 0.01
        )
    if "sglang_cache_aware" in installed:
        assert sorted(report["peer_ratios"]) == ["chat", "chat_shared"]
        for figures in report["peer_ratios"].values():
            assert set(figures) == {"sequential", "spaced", "concurrent"}
            assert "cpu_ratio" in figures["concurrent"] and "kvlb_added_p50_ms" in figures["concurrent"]
    else:
        assert report["peer_ratios"] == {}
    table = format_report(report)
    assert ("kvlb vs sglang_cache_aware (chat_shared)" in table) == ("sglang_cache_aware" in installed)
    for name in report["peers"]["skipped"]:
        assert f"peer path skipped: {name}" in table
    for text in (
        "[chat_shared]",
        "[chat]",
        "[tokens]",
        "[tokens_shared]",
        "[grpc_tokens]",
        "kvlb vs forward (grpc_tokens)",
        "kvlb token-id memo runs",
        "kvlb vs forward (tokens_shared)",
        "added p50",
        "kvlb route decision",
        "targets (chat_shared)",
        "kvlb vs forward (tokens)",
        "kvlb vs the tokenizer's own CPU (chat_cold)",
        "ms idle: a fixed Python workload took",
        "--workers sweep (chat_cold, concurrent req/s)",
    ):
        assert text in table


def test_warmup_covers_every_distinct_prompt() -> None:
    assert OverheadShape(prompts=32, warmup_rounds=20).warmup == 96  # three sights fill the memo
    assert OverheadShape(prompts=4, warmup_rounds=20).warmup == 20


def test_phases_take_bodies_no_earlier_phase_took() -> None:
    """Sequential rounds (warm-up included), the concurrent warm-up burst and each concurrent round
    take disjoint runs of body indices that together are every index of a unique kind's bodies."""
    shape = OverheadShape(prompts=3, warmup_rounds=2, sequential_rounds=5, concurrency=4,
                          concurrent_rounds=3, burst_requests=7)  # fmt: skip
    taken = list(range(shape.warmup + shape.sequential_rounds))
    taken += range(shape.spaced_start, shape.spaced_start + shape.spaced_rounds)
    taken += range(shape.concurrent_warmup_start, shape.concurrent_warmup_start + shape.concurrency)
    for round_index in range(shape.concurrent_rounds):
        start = shape.burst_start(round_index)
        taken += range(start, start + shape.burst_requests)
    assert taken == list(range(shape.requests_per_path))


@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
def test_prompts_of_each_kind() -> None:
    cold, warm = bench_tokenizers()
    assert cold.segment_cache is None  # the from-scratch timings never time a cache hit
    assert warm.segment_cache is not None
    prompts = build_prompts(SMOKE, cold, warm)
    for unique in (prompts.chat_cold, prompts.chat_shared, prompts.tokens_shared):
        assert len(unique) == len(set(unique)) == SMOKE.requests_per_path
    cold_messages = [json.loads(body)["messages"] for body in prompts.chat_cold]
    for position in (0, 1):  # neither the system prompt nor the user message repeats
        assert len({m[position]["content"] for m in cold_messages}) == SMOKE.requests_per_path
    systems = [json.loads(body)["messages"][0]["content"] for body in prompts.chat]
    shared = [json.loads(body)["messages"] for body in prompts.chat_shared]
    assert [m[0]["content"] for m in shared[: SMOKE.prompts]] == systems  # the warm-up sends each
    assert {m[0]["content"] for m in shared} == set(systems)
    assert len({m[1]["content"] for m in shared}) == SMOKE.requests_per_path
    assert len(prompts.tokenize_s) == 3 * SMOKE.prompts
    assert len(prompts.tokenize_shared_s) == 3 * SMOKE.prompts
    assert prompts.tokenize_shared_fallbacks == 0  # every timed sample took the inline path
    # tokens_shared: each chat_shared body as the ids a plain (uncached) encode gives, nothing else changed
    for chat_raw, ids_raw in zip(prompts.chat_shared, prompts.tokens_shared, strict=True):
        chat_body, ids_body = json.loads(chat_raw), json.loads(ids_raw)
        assert ids_body.pop("prompt") == cold.encode_chat(chat_body.pop("messages"))
        assert ids_body == chat_body
    by_system: dict[int, list[list[int]]] = {}
    for index, raw in enumerate(prompts.tokens_shared):
        by_system.setdefault(index % SMOKE.prompts, []).append(json.loads(raw)["prompt"])
    for same_system in by_system.values():  # one system prompt: a common prefix, tails that differ
        common = next(
            (i for i, column in enumerate(zip(*same_system, strict=False)) if len(set(column)) > 1),
            min(map(len, same_system)),
        )
        assert common > SMOKE.prompt_tokens // 2
        assert len({tuple(ids[common:]) for ids in same_system}) == len(same_system)


def test_shape_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        OverheadShape(concurrency=0)
    with pytest.raises(ValueError, match="kinds"):
        OverheadShape(kinds=("images",))
    with pytest.raises(ValueError, match="sequential_block"):
        OverheadShape(sequential_block=0)
    with pytest.raises(ValueError, match="spaced_gap_ms"):
        OverheadShape(spaced_gap_ms=-1.0)


def test_added_latency_is_the_difference_of_percentiles() -> None:
    by_mode = {
        "direct": {"p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0},
        "forward": {"p50_ms": 1.5, "p90_ms": 2.5, "p99_ms": 5.0},
        "kvlb": {"p50_ms": 2.0, "p90_ms": None, "p99_ms": 4.0},
    }
    out = added(by_mode)
    assert out["forward"] == {"p50_ms": 0.5, "p90_ms": 0.5, "p99_ms": 2.0}
    assert out["kvlb"] == {"p50_ms": 1.0, "p90_ms": None, "p99_ms": 1.0}
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([], 50) is None


METRICS_BEFORE = """\
# TYPE kvlb_route_decision_seconds histogram
kvlb_route_decision_seconds_bucket{le="0.0001"} 1.0
kvlb_route_decision_seconds_bucket{le="0.001"} 1.0
kvlb_route_decision_seconds_bucket{le="0.01"} 2.0
kvlb_route_decision_seconds_bucket{le="+Inf"} 2.0
kvlb_route_decision_seconds_count 2.0
kvlb_route_decision_seconds_sum 0.006
kvlb_route_decisions_total{policy="cost",replica="a"} 2.0
"""
METRICS_AFTER = """\
kvlb_route_decision_seconds_bucket{le="0.0001"} 1.0
kvlb_route_decision_seconds_bucket{le="0.001"} 81.0
kvlb_route_decision_seconds_bucket{le="0.01"} 102.0
kvlb_route_decision_seconds_bucket{le="+Inf"} 102.0
kvlb_route_decision_seconds_count 102.0
kvlb_route_decision_seconds_sum 0.056
"""


def test_histogram_quantiles_interpolate_inside_buckets() -> None:
    before = parse_histogram(METRICS_BEFORE, "kvlb_route_decision_seconds")
    after = parse_histogram(METRICS_AFTER, "kvlb_route_decision_seconds")
    assert before["count"] == 2 and before["buckets"][-1] == (math.inf, 2.0)
    delta = histogram_delta(after, before)
    assert delta["count"] == 100 and delta["sum"] == pytest.approx(0.05)
    assert [n for _, n in delta["buckets"]] == [0.0, 80.0, 100.0, 100.0]
    # rank 50 of 100 falls in (0.0001, 0.001], which holds ranks 1..80: 50/80 of the way.
    assert histogram_quantile(0.5, delta) == pytest.approx(0.0001 + 0.0009 * 50 / 80)
    # rank 99 falls in (0.001, 0.01], which holds ranks 81..100: 19/20 of the way.
    assert histogram_quantile(0.99, delta) == pytest.approx(0.001 + 0.009 * 19 / 20)
    assert histogram_quantile(0.5, {"buckets": []}) is None


def test_counters_add_up_their_label_sets() -> None:
    text = (
        "# TYPE kvlb_tokenizer_token_id_memo_hits_total counter\n"
        "kvlb_tokenizer_token_id_memo_hits_total 12.0\n"
        'kvlb_tokenizer_token_id_memo_hits_total{pool="b"} 3.0\n'
        "kvlb_tokenizer_token_id_memo_hits_total_extra 100.0\n"
    )
    assert metric_value(text, "kvlb_tokenizer_token_id_memo_hits_total") == 15.0
    assert metric_value(text, "kvlb_tokenizer_token_id_memo_misses_total") == 0.0


def test_peer_ratios_divide_kvlb_cpu_by_sglang_cache_aware() -> None:
    def phase(kvlb_ms: float, peer_ms: float | None) -> dict[str, object]:
        return {
            "cpu": {
                "kvlb": {"cpu_ms_per_request": kvlb_ms},
                "sglang_cache_aware": {"cpu_ms_per_request": peer_ms},
            },
            "added": {"kvlb": {"p50_ms": 1.5}, "sglang_cache_aware": {"p50_ms": 0.25}},
        }

    runs = {
        "chat_shared": {"sequential": phase(0.6, 0.2), "concurrent": phase(0.3, 0.1)},
        "chat": {"sequential": phase(0.6, None), "concurrent": phase(0.3, 0.0)},
        "tokens": {"sequential": phase(1.0, 1.0), "concurrent": phase(1.0, 1.0)},
    }
    out = peer_ratios(runs)
    assert sorted(out) == ["chat", "chat_shared"]  # the two kinds only
    assert out["chat_shared"]["sequential"]["cpu_ratio"] == 3.0
    assert out["chat_shared"]["concurrent"]["cpu_ratio"] == 3.0
    assert out["chat_shared"]["concurrent"]["kvlb_added_p50_ms"] == 1.5
    assert out["chat_shared"]["concurrent"]["sglang_cache_aware_added_p50_ms"] == 0.25
    assert out["chat"]["sequential"]["cpu_ratio"] is None and out["chat"]["concurrent"]["cpu_ratio"] is None
    no_peer = {"chat": {"concurrent": {"cpu": {"kvlb": {}}}}}
    assert peer_ratios(no_peer) == {}


def test_own_ratios_divide_kvlb_cpu_by_forward_and_by_the_tokenizer() -> None:
    def phase(kvlb_ms: float, forward_ms: float) -> dict[str, object]:
        return {
            "cpu": {"kvlb": {"cpu_ms_per_request": kvlb_ms}, "forward": {"cpu_ms_per_request": forward_ms}}
        }

    runs = {
        "tokens": {"sequential": phase(1.0, 0.5), "concurrent": phase(0.9, 0.3)},
        "chat_cold": {"sequential": phase(12.0, 0.5), "concurrent": phase(11.0, 0.3)},
        "tokens_shared": {"sequential": phase(0.8, 0.4), "concurrent": phase(1.2, 0.3)},
    }
    out = own_ratios(runs, 10.0)
    assert out["tokens_shared"]["sequential"]["cpu_ratio"] == 2.0
    assert out["tokens_shared"]["concurrent"]["cpu_ratio"] == 4.0
    assert out["tokens"]["sequential"]["cpu_ratio"] == 2.0
    assert out["tokens"]["concurrent"]["cpu_ratio"] == 3.0
    assert out["chat_cold"]["sequential"]["cpu_ratio"] == 1.2
    assert out["chat_cold"]["concurrent"]["cpu_ratio"] == 1.1
    assert own_ratios({"chat_cold": runs["chat_cold"]}, None)["chat_cold"]["concurrent"]["cpu_ratio"] is None
    assert own_ratios({}, 10.0) == {}
    # a phase where the bench's tokenizer took its own turns is divided by that phase's tokenizer CPU
    spaced = phase(30.0, 1.0)
    spaced["cpu"]["tokenizer"] = {"cpu_ms_per_request": 25.0}  # type: ignore[index]
    cold = own_ratios({"chat_cold": {**runs["chat_cold"], "spaced": spaced}}, 10.0)["chat_cold"]
    assert list(cold) == ["sequential", "spaced", "concurrent"]
    assert cold["spaced"] == {"kvlb_cpu_ms_per_request": 30.0, "tokenizer_cpu_ms": 25.0, "cpu_ratio": 1.2}
    assert cold["sequential"]["tokenizer_cpu_ms"] == 10.0
