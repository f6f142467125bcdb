"""``kvlb capacity``: the search, the report, the plot, the invalid-run rule of the load-test report, and
the configuration of the kvlb the fleet confirmation starts."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import yaml

from balancer import config
from loadtests.capacity.confirm import confirm_order
from loadtests.capacity.report import build_report, markdown, svg_plot
from loadtests.capacity.search import RatePoint, Search, Slo, parse_seconds, search, searches_from_report
from loadtests.capacity.simulated import Stream, sim_config, sim_measure, sim_only, sim_router
from loadtests.driver import RunResult
from loadtests.fleet.processes import EmulatorHandle, kvlb_config
from loadtests.peers import parse_router
from loadtests.report import invalid_reason, router_entry
from loadtests.runs import RouterRun
from loadtests.simulate import SimResult, workload_requests
from loadtests.simulate.oracle import BeladySimulation, simulate_oracle
from loadtests.stats import RequestRecord, summarize


def _point(
    rate: float, p90: float, *, p99: float | None = None, errors: int = 0, cached: int = 0
) -> RatePoint:
    return RatePoint(rate, "sim", 1000, errors, p90 / 2, p90, p99 or p90 * 2, 0.5, 10_000, cached)


def test_search_brackets_then_bisects_to_the_knee() -> None:
    calls: list[float] = []

    def measure(rate: float) -> RatePoint:
        calls.append(rate)
        return _point(rate, 0.5 if rate <= 30.0 else 5.0)  # a hard knee at 30 req/s

    found = search(measure, Slo(), 10.0, growth=1.5, rel_tol=0.02)
    assert found.capacity is not None and found.first_fail is not None
    assert found.capacity <= 30.0 < found.first_fail
    assert found.first_fail / found.capacity <= 1.02
    assert len(calls) == len(set(calls)) == len(found.points)  # no rate run twice
    assert [p.rate for p in found.points] == sorted(calls)


def test_search_steps_down_when_the_first_rate_fails_and_reports_none_below_everything() -> None:
    found = search(lambda r: _point(r, 0.5 if r <= 3.0 else 9.0), Slo(), 100.0, rel_tol=0.05)
    assert found.capacity is not None and found.capacity <= 3.0 < (found.first_fail or 0)
    never = search(lambda r: _point(r, 9.0), Slo(), 10.0, max_points=5)
    assert never.capacity is None and len(never.points) == 5
    always = search(lambda r: _point(r, 0.1), Slo(), 10.0, max_points=4)
    assert always.first_fail is None and always.capacity == pytest.approx(10.0 * 1.5**3)


def test_slo_checks_p90_p99_and_errors() -> None:
    slo = Slo(ttft_p90_s=2.0, ttft_p99_s=4.0, max_error_rate=0.001)
    assert _point(1, 1.9, p99=3.9).meets(slo)
    assert not _point(1, 2.1, p99=3.0).meets(slo)
    assert not _point(1, 1.0, p99=4.5).meets(slo)
    assert _point(1, 1.0, errors=1).meets(slo)  # 1 of 1000 = 0.1 %
    assert not _point(1, 1.0, errors=2).meets(slo)
    assert _point(1, 1.0, p99=10.0).meets(Slo())  # no p99 bound by default
    with pytest.raises(ValueError):
        Slo(ttft_p90_s=0)
    assert parse_seconds("2s") == 2.0 and parse_seconds("500ms") == 0.5 and parse_seconds("3") == 3.0


def _search(knee: float) -> Search:
    return search(lambda r: _point(r, 0.5 if r <= knee else 5.0, cached=int(r)), Slo(), 8.0)


def test_report_ratios_to_round_robin_and_the_best_peer_and_saved_prefill() -> None:
    searches = {
        "kvlb": _search(40.0),
        "round_robin": _search(20.0),
        "sglang_cache_aware": _search(32.0),
    }
    saved = {name: 2 * int(s.capacity or 0) for name, s in searches.items()}
    report = build_report({}, Slo(), searches, ["sglang_cache_aware"], oracle_saved=saved)
    rows = {r["name"]: r for r in report["routers"]}
    assert report["best_peer"] == "sglang_cache_aware"
    kvlb = rows["kvlb"]
    rr = rows["round_robin"]["capacity_rate"]
    assert kvlb["vs_round_robin"] == pytest.approx(kvlb["capacity_rate"] / rr)
    assert kvlb["vs_best_peer"] == pytest.approx(
        kvlb["capacity_rate"] / rows["sglang_cache_aware"]["capacity_rate"]
    )
    assert rows["round_robin"]["vs_round_robin"] == 1.0
    assert kvlb["prefill_saved_tokens"] == int(kvlb["capacity_rate"])
    assert kvlb["saved_vs_oracle"] == pytest.approx(0.5, rel=0.05)
    assert all(p["meets_slo"] == (p["ttft_p90_s"] <= 2.0) for p in kvlb["points"])
    text = markdown(report)
    assert "| kvlb |" in text and "## Every point" in text
    svg = svg_plot(report)
    assert svg.startswith("<svg") and svg.count("<polyline") == 3 and "SLO 2 s" in svg


def test_invalid_router_is_a_row_with_the_reason_not_a_figure() -> None:
    report = build_report(
        {}, Slo(), {"kvlb": _search(10.0)}, [], invalid={"sglang_cache_aware": "invalid run: HTTP 422 x400"}
    )
    text = markdown(report)
    assert "| sglang_cache_aware | invalid: invalid run: HTTP 422 x400 |" in text


def _run(name: str, failed: int, total: int = 200) -> RouterRun:
    records = [
        RequestRecord(f"r{i}", "ok", start_s=i * 0.01, ttft_s=0.1, e2e_s=0.2, prompt_tokens=10, replica="a")
        for i in range(total - failed)
    ]
    records += [
        RequestRecord(f"e{i}", "http_error", start_s=1.0, status=422, error="HTTP 422", e2e_s=0.01)
        for i in range(failed)
    ]
    result = RunResult("open", tuple(records), 3.0, "done")  # type: ignore[arg-type]
    return RouterRun(parse_router(name), "ok", result=result, summary=summarize(records, 3.0))


def test_a_router_with_more_than_one_percent_errors_is_invalid_with_the_reason() -> None:
    assert invalid_reason(_run("kvlb", 2)) is None  # exactly 1 %
    reason = invalid_reason(_run("sglang_cache_aware", 200))
    assert reason is not None and "200 of 200" in reason and "HTTP 422 x200" in reason
    entry = router_entry(_run("sglang_cache_aware", 3), None)
    assert entry["status"] == "invalid" and "3 of 200" in entry["note"]
    assert math.isclose(entry["error_rate"], 3 / 200)


def test_searches_round_trip_through_a_saved_report() -> None:
    searches = {"kvlb": _search(40.0), "round_robin": _search(20.0)}
    report = build_report({}, Slo(), searches, [])
    again = searches_from_report(json.loads(json.dumps(report)))
    assert again == searches


def test_a_named_kvlb_variant_reaches_the_fleets_kvlb_serve_with_its_weights(tmp_path: Path) -> None:
    """``--confirm`` (and ``kvlb loadtest``) start ``kvlb serve`` for ``kvlb:<policy>+w=v`` with the
    configuration of :func:`kvlb_config`; the real loader reads the variant's weight from it."""
    spec = parse_router("kvlb:cost+admission_weight=1")
    replica = {
        "name": "sim-0",
        "url": "http://127.0.0.1:9",
        "engine": "sglang",
        "block_size": 16,
        "model": "m",
        "events": ["tcp://127.0.0.1:10"],
        "replay": ["tcp://127.0.0.1:11"],
    }
    settings = kvlb_config(EmulatorHandle(replicas=[replica]), spec.policy, 1, dict(spec.weights))
    path = tmp_path / "kvlb.yaml"
    path.write_text(yaml.safe_dump(settings))
    loaded = config.load(path, env={})
    assert (loaded.policy.name, dict(loaded.policy.weights)) == ("cost", {"admission_weight": 1.0})
    plain = kvlb_config(EmulatorHandle(replicas=[replica]), "cost", 1)
    assert plain["policy"]["weights"] == {}


def _sim_args() -> argparse.Namespace:
    return argparse.Namespace(
        replicas=4,
        profile="h100-llama3-8b",
        kv_capacity_tokens=4096,
        seed=1,
        oracle_load_bound_s=2.0,
        sim_forward_delay_ms=0.0,
        sim_no_prune=False,
        sim_forward_jitter_ms=0.0,
    )


def _overflowing_stream() -> Stream:
    """16 contexts of 1.5k tokens, 3 users each, on 4 replicas of 4k tokens: the pools overflow."""
    params = {"prompt_format": "tokens", "tenants": 16, "users_per_tenant": 3, "context_tokens": 1536,
              "question_tokens": 128, "max_tokens": 16}  # fmt: skip
    requests = list(workload_requests("tenants", params, requests=240, rate_per_s=16.0, seed=1))
    return Stream(requests, 16.0)


def test_sim_router_names_the_oracle_replays_and_min_engine_variants() -> None:
    assert sim_router("oracle") == (None, True)
    assert sim_router("oracle_lru") == (None, False)
    spec, on_min = sim_router("kvlb:cost+overlap_credit=2@min")
    assert (
        spec is not None and on_min and spec.policy == "cost" and spec.weights == (("overlap_credit", 2.0),)
    )
    assert sim_router("kvlb") == (parse_router("kvlb"), False)
    assert sim_router("round_robin@min") == (parse_router("round_robin"), True)  # kvlb runs it
    assert sim_only("oracle_lru") and sim_only("kvlb@min") and not sim_only("kvlb")
    for bad in ("sglang_cache_aware@min", "vllm_kv_aware@min", "oracle@min", "@min"):
        with pytest.raises(ValueError):
            sim_router(bad)


def test_capacity_measures_the_oracle_plan_on_lru_engines_and_kvlb_on_min_engines() -> None:
    """``oracle_lru`` is the oracle's plan on the engines' LRU caches, ``kvlb@min`` kvlb's policy on
    MIN engines: each point is that simulation's, and differs from its LRU / MIN counterpart."""
    args, stream = _sim_args(), _overflowing_stream()
    requests = stream.at(24.0)
    config = sim_config(args, parse_router("kvlb"))
    points = {name: sim_measure(args, name, stream, lambda _: None)(24.0) for name in
              ("kvlb", "kvlb@min", "oracle", "oracle_lru")}  # fmt: skip
    kvlb_min = BeladySimulation(config, requests).run().summary
    assert points["kvlb@min"].cached_tokens == kvlb_min.cached_tokens
    assert points["kvlb@min"].cached_tokens > (points["kvlb"].cached_tokens or 0)
    plan, lru = simulate_oracle(sim_config(args, None), requests, lru_engines=True)
    assert points["oracle_lru"].cached_tokens == lru.summary.cached_tokens
    assert points["oracle_lru"].extra["planned_hit_tokens"] == plan.hit_tokens
    assert points["oracle_lru"].cached_tokens < (points["oracle"].cached_tokens or 0)


def test_sim_no_prune_gives_the_cost_policy_every_replica() -> None:
    """``--sim-no-prune``: every decision of a kvlb router is made over the full candidate list, as
    with ``root_weight`` > 0 (the default); without both the simulator prunes the cost policy's
    candidates."""
    stream = _overflowing_stream()
    for no_prune in (False, True):
        args = _sim_args()
        args.sim_no_prune, args.replicas = no_prune, 8  # more replicas than the pruned set keeps (4)
        results: list[SimResult] = []
        ramp = "kvlb:cost+overlap_credit_loaded=4+root_weight=0"  # the default without its held-roots charge
        point = sim_measure(args, ramp, stream, lambda _: None, results)(24.0)
        stats = results[0].stats
        assert point.requests == 240
        if no_prune:
            assert (stats["routed_pruned"], stats["routed_full"]) == (0, 240)
            assert stats["mean_candidates"] == 8
        else:
            assert stats["routed_pruned"] > 0
            assert stats["mean_candidates"] < 8


def test_confirm_order_interleaves_routers_a_b_b_a_at_each_rate() -> None:
    """``--confirm-interleave``: rate by rate, the routers alternate forwards and backwards, so two
    routers with three repeats run d r r d d r; without it, one router's points after the other's."""
    rates = {"d": [33.0, 36.0], "r": [33.0, 36.0]}
    order = confirm_order(["d", "r"], rates, 3, interleave=True)
    assert [(n, k) for n, rate, k in order if rate == 33.0] == [
        ("d", 0), ("r", 0), ("r", 1), ("d", 1), ("d", 2), ("r", 2)
    ]  # fmt: skip
    assert [rate for _, rate, _ in order] == [33.0] * 6 + [36.0] * 6
    assert confirm_order(["d", "r"], rates, 2, interleave=False) == [
        ("d", 33.0, 0), ("d", 33.0, 1), ("d", 36.0, 0), ("d", 36.0, 1),
        ("r", 33.0, 0), ("r", 33.0, 1), ("r", 36.0, 0), ("r", 36.0, 1),
    ]  # fmt: skip
    three = confirm_order(["a", "b", "c"], {"a": [1.0], "b": [1.0], "c": [1.0]}, 2, interleave=True)
    assert [n for n, _, _ in three] == ["a", "b", "c", "c", "b", "a"]
    with pytest.raises(ValueError, match="same rates"):
        confirm_order(["d", "r"], {"d": [30.0, 31.0], "r": [36.0, 37.0]}, 3, interleave=True)


def test_confirm_interleave_without_fixed_rates_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from balancer.cli.main import build_parser

    argv = ["capacity", "--smoke", "--routers", "kvlb,round_robin", "--confirm", "--confirm-interleave",
            "--out", str(tmp_path / "out")]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.handler(args) == 2
    assert "--confirm-interleave needs --confirm-rates" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _capacity_args(*argv: str) -> argparse.Namespace:
    from loadtests.capacity.command import register

    parser = argparse.ArgumentParser(prog="kvlb")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["capacity", *argv])


def test_smoke_tightens_the_slo_for_its_short_workload_but_not_for_a_trace() -> None:
    from loadtests.capacity.command import apply_presets

    workload = _capacity_args("--smoke")
    apply_presets(workload)
    assert (workload.slo_ttft_p90, workload.replicas, workload.requests) == ("0.3s", 2, 120)
    # the README's `kvlb capacity --trace ... --smoke`: 0.3 s was missed at every rate by every router
    trace = _capacity_args("--trace", "loadtests/traces/mooncake_synthetic_trace.jsonl", "--smoke")
    apply_presets(trace)
    assert (trace.slo_ttft_p90, trace.replicas, trace.requests) == ("2s", 2, 120)
    chosen = _capacity_args("--smoke", "--slo-ttft-p90", "1s")
    apply_presets(chosen)
    assert chosen.slo_ttft_p90 == "1s"


def test_a_flag_given_explicitly_wins_over_the_smoke_preset() -> None:
    """Before (2026-12-01, h-capfollow) ``--smoke`` put 2, 8, 0.25 and 3 in place of whatever
    ``--replicas``, ``--max-points``, ``--rel-tol`` and ``--growth`` said (and 0.3 s in place of an
    explicit ``--slo-ttft-p90 2s``)."""
    from loadtests.capacity.command import apply_presets

    preset = _capacity_args("--smoke")
    apply_presets(preset)
    assert (preset.replicas, preset.max_points, preset.rel_tol, preset.growth) == (2, 8, 0.25, 3.0)
    given = _capacity_args("--smoke", "--replicas", "4", "--max-points", "3", "--rel-tol", "0.1",
                           "--growth", "2", "--slo-ttft-p90", "2s")  # fmt: skip
    apply_presets(given)
    assert (given.replicas, given.max_points, given.rel_tol, given.growth) == (4, 3, 0.1, 2.0)
    assert given.slo_ttft_p90 == "2s"
    plain = _capacity_args()
    apply_presets(plain)
    assert (plain.replicas, plain.max_points, plain.rel_tol, plain.growth) == (8, 14, 0.05, 1.5)
    assert (plain.slo_ttft_p90, plain.requests) == ("2s", 600)


def test_the_stream_holds_each_prompt_once_as_4_byte_ids_and_regenerates_the_specs() -> None:
    """Before (2026-12-01, h-capfollow) the stream held every spec (its prompt a tuple of ints) and
    a list copy of each prompt: 1.03 GB of peak RSS for the repo's trace, 0.42-0.44 GB after."""
    from array import array

    from loadtests.capacity.command import apply_presets, build_stream

    args = _capacity_args("--smoke", "--requests", "30")
    apply_presets(args)
    _, stream = build_stream(args)
    assert len(stream.requests) == 30
    assert all(isinstance(r.token_ids, array) and r.token_ids.itemsize == 4 for r in stream.requests)
    specs = stream.specs_at(stream.base_rate, 12, 1.0)
    assert [s.prompt_token_ids for s in specs] == [tuple(r.token_ids) for r in stream.requests[:12]]
    assert [s.arrival_s for s in specs] == pytest.approx([r.arrival_s for r in stream.requests[:12]])
    assert stream.specs_at(2 * stream.base_rate, 12, 1.0) == stream.specs_at(2 * stream.base_rate, 12, 1.0)
    assert [r.arrival_s for r in stream.each_at(4.0, 5)] == [r.arrival_s for r in stream.at(4.0, 5)]


def test_capacity_target_without_a_capacity_misses_the_slo_with_or_without_the_gate() -> None:
    """Before (2026-12-01, h-capfollow) ``--target`` without ``--slo-gate`` exited 0 when no rate met
    the SLO; now 3, as the simulator's search and as the gate, and 4 when the client made the miss."""
    from loadtests.capacity.target import gate
    from loadtests.target import EXIT_CLIENT_BEHIND, EXIT_SLO_MISSED

    def failing(rate: float, invalid: str | None = None) -> RatePoint:
        return RatePoint(rate, "target", 10, 10, None, None, None, None, 0, 0, invalid=invalid)

    passing = RatePoint(1.0, "target", 10, 0, 0.1, 0.2, 0.3, 0.5, 100, 50)
    lines: list[str] = []
    no_gate, gated = argparse.Namespace(slo_gate=None), argparse.Namespace(slo_gate=0.5)
    assert gate(Search((passing, failing(2.0)), 1.0, 2.0), no_gate, lines.append) == 0
    assert gate(Search((failing(0.5),), None, 0.5), no_gate, lines.append) == EXIT_SLO_MISSED
    assert lines[-1] == "kvlb capacity: no rate tried met the SLO: exit 3 (the report is written)"
    assert gate(Search((failing(0.5),), None, 0.5), gated, lines.append) == EXIT_SLO_MISSED
    behind = Search((failing(0.5, "client behind"),), None, 0.5)
    assert gate(behind, no_gate, lines.append) == EXIT_CLIENT_BEHIND
    assert gate(behind, gated, lines.append) == EXIT_CLIENT_BEHIND


def test_a_search_that_met_the_slo_at_no_rate_says_so() -> None:
    from loadtests.capacity.command import capacity_line

    assert capacity_line(None, 0.001828989483310471) == "no rate tried met the SLO (down to 0.00183 req/s)"
    assert capacity_line(4.0, 4.5937) == "capacity 4 req/s (first failing 4.59)"
    assert capacity_line(8.0, None) == "capacity 8 req/s (first failing none)"


def test_a_peer_invalid_on_the_fleet_is_said_so_and_is_not_the_best_peer() -> None:
    # before (kvlb capacity --smoke --confirm, 2026-12-01): sglang-router answered 422 to all 120
    # token-id requests; capacity.json said "invalid", but capacity.md named it the best peer, gave
    # kvlb's ratio to it, and its row showed the simulated capacity with no word of the invalid runs
    searches = {"kvlb": _search(40.0), "round_robin": _search(20.0), "sglang_cache_aware": _search(32.0)}
    reason = "invalid run: 120 of 120 requests failed (> 1%): HTTP 422 x120"
    report = build_report(
        {}, Slo(), searches, ["round_robin", "sglang_cache_aware"], invalid={"sglang_cache_aware": reason}
    )
    rows = {r["name"]: r for r in report["routers"]}
    assert report["best_peer"] == "round_robin"
    assert rows["kvlb"]["vs_best_peer"] == pytest.approx(
        rows["kvlb"]["capacity_rate"] / rows["round_robin"]["capacity_rate"]
    )
    assert rows["sglang_cache_aware"]["invalid"] == reason
    row = next(line for line in markdown(report).splitlines() if line.startswith("| sglang_cache_aware |"))
    assert f"invalid on the fleet: {reason}" in row
