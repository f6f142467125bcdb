"""A fleet run's requests simulated at the fleet's own times, and the run's verdict
(``loadtests/capacity/retimed.py``, ``sim_retimed``)."""

from __future__ import annotations

import argparse
import statistics

import pytest

from loadtests.capacity.band import hop_rng
from loadtests.capacity.command import build_stream, register
from loadtests.capacity.report import build_report, markdown
from loadtests.capacity.retimed import (
    AGREES,
    DECISION_TIMES,
    INVALID,
    MODELLING,
    SEND_TIMES,
    TIMING,
    UNJUDGED,
    arrivals_of,
    decision_times,
    offsets_ms,
    parse_hop_ranges_ms,
    parse_hops_ms,
    retime,
    routing_lag_ms,
    run_times,
    spread_config,
    verdict_of,
)
from loadtests.capacity.search import RatePoint, Search, Slo
from loadtests.capacity.simulated import sim_measure, sim_retimed
from loadtests.simulate import SimConfig, SimRequest, simulate
from replicas.sim.profiles import get_profile
from replicas.sim.timing import isolated_ttft_s


def test_wall_times_become_model_arrivals_by_the_time_scale_from_the_first_arrival() -> None:
    # the client sent at 100.0, 100.2, 100.1 wall s; at --time-scale 0.25 a wall second is 0.25 model s
    arrivals = arrivals_of([100.0, 100.2, 100.1], 0.25, 0.5)
    assert arrivals == pytest.approx([0.5, 0.55, 0.525])
    # at time scale 1 the wall offsets are model offsets as they are
    assert arrivals_of([100.0, 100.2], 1.0, 0.0) == pytest.approx([0.0, 0.2])
    # the earliest time anchors, wherever it is in the list
    assert arrivals_of([3.0, 2.0], 0.5, 1.0) == pytest.approx([1.5, 1.0])
    assert arrivals_of([], 0.25, 0.0) == []
    with pytest.raises(ValueError, match="time_scale"):
        arrivals_of([1.0], 0.0, 0.0)


def test_a_run_on_its_schedule_gives_back_the_schedules_arrivals() -> None:
    # the fleet's wall schedule is the model schedule / time_scale; sent on time, it maps back exactly
    model = [0.2, 0.25, 0.4, 1.0]
    scale = 0.25
    wall = [7.0 + a / scale for a in model]
    assert arrivals_of(wall, scale, model[0]) == pytest.approx(model)
    offsets = offsets_ms(model, arrivals_of(wall, scale, model[0]))
    assert offsets["max_abs"] == pytest.approx(0.0, abs=1e-9)
    # 4 wall ms late on one request is 1 model ms at this scale
    wall[2] += 0.004
    late = arrivals_of(wall, scale, model[0])
    assert late[2] - model[2] == pytest.approx(0.001)
    assert offsets_ms(model, late)["max_abs"] == pytest.approx(1.0)


def test_retime_moves_each_request_to_its_arrival_and_sorts() -> None:
    requests = [SimRequest([i], 4, 0.1 * i, str(i)) for i in range(3)]
    moved = retime(requests, [0.3, 0.05, 0.2])
    assert [(r.session_id, r.arrival_s) for r in moved] == [("1", 0.05), ("2", 0.2), ("0", 0.3)]
    assert [r.token_ids for r in moved] == [[1], [2], [0]]
    with pytest.raises(ValueError):
        retime(requests, [0.1])


def test_run_times_prefer_the_kvlbs_decisions_when_they_cover_every_request() -> None:
    ids = ["a", "b"]
    sends = {"a": 1.0, "b": 1.5}
    rows = [{"request_id": "b", "ts": 20.4}, {"request_id": "a", "ts": 20.0}, {"request_id": "a", "ts": 25.0}]
    decided = decision_times(rows)
    assert decided == {"a": 20.0, "b": 20.4}  # a request's first decision
    assert run_times(ids, sends, decided) == (DECISION_TIMES, [20.0, 20.4])
    assert run_times(ids, sends, {"a": 20.0}) == (SEND_TIMES, [1.0, 1.5])
    assert run_times(ids, sends, None) == (SEND_TIMES, [1.0, 1.5])
    assert run_times(ids, {"a": 1.0}, None) is None


def test_routing_lag_is_the_decisions_delay_beyond_the_first_requests_in_model_ms() -> None:
    ids = ["a", "b", "c"]
    sends = {"a": 10.0, "b": 10.1, "c": 10.2}
    # another clock; b routed 4 wall ms later than its send relative to a, c on time
    decided = {"a": 500.0, "b": 500.104, "c": 500.2}
    lag = routing_lag_ms(ids, sends, decided, 0.25)
    assert lag["max_abs"] == pytest.approx(1.0)  # 4 wall ms at time scale 0.25
    assert lag["p50"] == pytest.approx(0.0, abs=1e-9)
    assert routing_lag_ms(ids, sends, {}, 0.25)["p50"] is None


def test_the_verdict_is_the_bands_pass_rule_on_each_side() -> None:
    assert verdict_of(True, True, False) == AGREES
    assert verdict_of(False, False, True) == AGREES
    assert verdict_of(True, False, True) == TIMING
    assert verdict_of(False, True, False) == TIMING
    assert verdict_of(True, False, False) == MODELLING
    assert verdict_of(False, True, True) == MODELLING
    assert verdict_of(True, None, True) == UNJUDGED
    assert verdict_of(True, False, None) == UNJUDGED
    assert verdict_of(True, True, True, invalid=True) == INVALID


def test_a_hop_range_agreeing_with_the_run_makes_it_timing() -> None:
    # the fixed hops disagree with the passing run; one of two ranges agrees: timing
    assert verdict_of(True, False, False, spread_passes=[False, True]) == TIMING
    assert verdict_of(True, False, False, spread_passes=[False, False]) == MODELLING
    # no fixed hops (none), ranges only
    assert verdict_of(False, True, None, spread_passes=[False]) == TIMING
    assert verdict_of(False, True, None, spread_passes=[True]) == MODELLING
    assert verdict_of(False, True, None, spread_passes=[]) == UNJUDGED
    # agreeing with the draws wins, whatever the ranges say
    assert verdict_of(True, True, False, spread_passes=[False]) == AGREES


def test_hop_ranges_are_parsed_and_bounded() -> None:
    assert parse_hop_ranges_ms("5-15", 5) == ((5.0, 15.0),)
    assert parse_hop_ranges_ms("7.5-7.5,0-40", 20) == ((7.5, 7.5), (0.0, 40.0))
    assert parse_hop_ranges_ms("none", 0) == () == parse_hop_ranges_ms("", 5)
    for bad in ("5", "5-x", "15-5", "-5-10", "5-inf", "5-10-15"):
        with pytest.raises(ValueError, match="--confirm-retimed-hop-ranges-ms"):
            parse_hop_ranges_ms(bad, 5)
    with pytest.raises(ValueError, match="--confirm-retimed-draws"):
        parse_hop_ranges_ms("5-15", 0)
    with pytest.raises(ValueError, match="at most 40"):
        parse_hop_ranges_ms("5-15,5-10,10-20", 14)


def _isolated_hops_ms(lo_ms: float, hi_ms: float, seed: int, count: int) -> list[float]:
    """Each request's hop in a simulation with the hop range, one request at a time on an idle fleet
    (TTFT = hop + the isolated TTFT), draws from the band's hop generator of draw 0 of ``seed``."""
    profile = get_profile("h100-llama3-8b")
    requests = [SimRequest(tuple(range(300 * k, 300 * k + 256)), 2, 0.5 * k) for k in range(count)]
    ttft = isolated_ttft_s(profile, prompt_tokens=256, cached_tokens=0)
    config = spread_config(SimConfig(replicas=2, profile="h100-llama3-8b"), lo_ms, hi_ms)
    result = simulate(config, requests, hop_rng(seed, 0))
    return [(r.ttft_s - ttft) * 1000.0 for r in result.records]


def test_a_hop_range_draws_each_requests_hop_uniformly_with_the_mean_set() -> None:
    hops = _isolated_hops_ms(5.0, 15.0, 1, 400)
    assert all(5.0 - 1e-6 <= h <= 15.0 + 1e-6 for h in hops)
    # uniform in [5, 15]: mean 10, sd 10 / sqrt(12) = 2.9 ms, so the mean of 400 is within 0.6 ms
    # (4 standard errors) and the quartiles near 7.5 and 12.5
    assert statistics.fmean(hops) == pytest.approx(10.0, abs=0.6)
    quartiles = statistics.quantiles(hops, n=4)
    assert quartiles[0] == pytest.approx(7.5, abs=0.8) and quartiles[2] == pytest.approx(12.5, abs=0.8)
    # deterministic for a seed; another seed draws other hops
    assert _isolated_hops_ms(5.0, 15.0, 1, 400) == hops
    assert _isolated_hops_ms(5.0, 15.0, 2, 400) != pytest.approx(hops)
    # an empty range is the fixed hop
    assert _isolated_hops_ms(10.0, 10.0, 1, 4) == pytest.approx([10.0] * 4)
    fixed = spread_config(SimConfig(replicas=1, profile="cpu-test"), 10.0, 10.0)
    assert fixed.forward_delay_s == 10.0 / 1000.0 and fixed.forward_jitter_s == 0.0


def test_hops_are_parsed_and_bounded() -> None:
    assert parse_hops_ms("5,10,20") == (5.0, 10.0, 20.0)
    assert parse_hops_ms("none") == () == parse_hops_ms("")
    for bad in ("5,x", "-1", "inf", ",".join(["5"] * 9)):
        with pytest.raises(ValueError, match="--confirm-retimed-hops-ms"):
            parse_hops_ms(bad)


def _args(*more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["capacity", "--smoke", "--routers", "kvlb", *more])
    args.requests, args.replicas = 120, 2
    return args


def test_a_run_on_its_schedule_simulates_as_the_simulation_of_the_same_requests() -> None:
    args = _args("--time-scale", "0.25", "--sim-forward-delay-ms", "10")
    _, stream = build_stream(args)
    rate, limit = 4.0, 60
    single = sim_measure(args, "kvlb", stream, lambda _: None)(rate, limit)
    # the client's sends exactly on the fleet's wall schedule, 3 wall s after its start
    specs = stream.specs_at(rate, limit, 1.0 / args.time_scale)
    wall = [3.0 + (s.arrival_s or 0.0) for s in specs]
    retimed = sim_retimed(args, "kvlb", stream, rate, (SEND_TIMES, wall), (10.0, 0.0))
    assert retimed["ttft_p90_s"][0] == pytest.approx(single.ttft_p90_s)
    assert retimed["simulations"] == 2 and retimed["hops_ms"] == [10.0, 0.0]
    assert retimed["times"] == SEND_TIMES and abs(retimed["offset_ms"]["max_abs"]) < 1e-6
    assert retimed["passes"] == (retimed["pass_share"] >= 0.5)
    assert retimed["spread"] == []  # no hop range asked
    # a range of no width gives exactly the fixed hop's simulation, in every draw
    same = sim_retimed(args, "kvlb", stream, rate, (SEND_TIMES, wall), (10.0,), ((10.0, 10.0),), 2)
    assert same["ttft_p90_s"] == retimed["ttft_p90_s"][:1]
    assert same["spread"][0]["ttft_p90_s"] == retimed["ttft_p90_s"][:1] * 2
    assert same["spread"][0]["hit_rate"] == retimed["hit_rate"][:1] * 2
    # a spread range: one simulation per draw, each its own hops, the same for the same --seed
    ranges = ((5.0, 35.0),)
    spread = sim_retimed(args, "kvlb", stream, rate, (SEND_TIMES, wall), (), ranges, 3)["spread"]
    assert spread == sim_retimed(args, "kvlb", stream, rate, (SEND_TIMES, wall), (), ranges, 3)["spread"]
    assert spread[0]["hop_ms"] == [5.0, 35.0] and spread[0]["draws"] == 3
    assert spread[0]["passes"] == (spread[0]["pass_share"] >= 0.5)
    retimed["spread"] = spread
    # the report shows the run's retimed simulations and its verdict
    retimed |= {"fleet_passes": True, "draws_pass": True, "verdict": AGREES}
    extra = {"retimed": retimed, "repeat": 0}
    point = RatePoint(rate, "fleet", limit, 0, 0.1, single.ttft_p90_s, 0.2, 0.5, 100, 50, extra)
    report = build_report({}, Slo(2.0), {"kvlb": Search((), None, None)}, [], confirmed={"kvlb": [point]})
    text = markdown(report)
    assert "## At the fleet's own times" in text and f"| {AGREES} |" in text
    assert f"5–35 ms: {round(spread[0]['pass_share'] * 3)} of 3" in text
