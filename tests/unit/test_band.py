"""The simulator's spread at a confirmed point and the fleet's verdict against it
(``loadtests/capacity/band.py``)."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest

from loadtests.capacity.band import band_capacity, band_of, draw_rng, hop_rng, jitter_arrivals, verdict
from loadtests.capacity.command import build_stream, register
from loadtests.capacity.report import build_report, markdown
from loadtests.capacity.search import Search, Slo
from loadtests.capacity.simulated import sim_band, sim_decision_rows, sim_measure, sim_rows_of
from loadtests.simulate import SimRequest


def _requests(n: int = 200, gap_s: float = 0.01) -> list[SimRequest]:
    return [SimRequest([i, i + 1], 4, 0.5 + i * gap_s, str(i)) for i in range(n)]


def test_jitter_is_deterministic_per_seed_and_differs_between_seeds() -> None:
    requests = _requests()
    first = jitter_arrivals(requests, 0.001, random.Random(7))
    again = jitter_arrivals(requests, 0.001, random.Random(7))
    other = jitter_arrivals(requests, 0.001, random.Random(8))
    assert [r.arrival_s for r in first] == [r.arrival_s for r in again]
    assert [r.arrival_s for r in first] != [r.arrival_s for r in other]
    # the draw generators: the same per (seed, draw), different across draws and seeds
    assert draw_rng(0, 3).random() == draw_rng(0, 3).random()
    assert len({draw_rng(s, d).random() for s in (0, 1) for d in range(5)}) == 10


def test_jitter_moves_each_arrival_within_the_bound_and_changes_nothing_else() -> None:
    requests = _requests(gap_s=0.0004)  # closer than the jitter: the order changes
    moved = jitter_arrivals(requests, 0.001, random.Random(1))
    by_id = {r.session_id: r for r in requests}
    assert sorted(r.session_id or "" for r in moved) == sorted(r.session_id or "" for r in requests)
    deltas = [r.arrival_s - by_id[r.session_id or ""].arrival_s for r in moved]
    assert all(abs(d) <= 0.001 for d in deltas)
    assert max(deltas) > 0.0005 and min(deltas) < -0.0005  # it does move them, both ways
    for r in moved:
        original = by_id[r.session_id or ""]
        assert (r.token_ids, r.max_tokens) == (original.token_ids, original.max_tokens)
    # the simulator's driver takes arrivals in order: the result is sorted by the new times
    assert [r.arrival_s for r in moved] == sorted(r.arrival_s for r in moved)
    assert [r.session_id for r in moved] != [r.session_id for r in requests]


def test_jitter_keeps_the_order_when_gaps_exceed_twice_the_bound_and_clamps_at_zero() -> None:
    requests = _requests(gap_s=0.01)
    moved = jitter_arrivals(requests, 0.001, random.Random(2))
    assert [r.session_id for r in moved] == [r.session_id for r in requests]
    assert jitter_arrivals(requests, 0.0, random.Random(2)) == requests
    early = [SimRequest([1], 4, 0.0, "a"), SimRequest([2], 4, 0.0, "b")]
    assert all(r.arrival_s >= 0.0 for r in jitter_arrivals(early, 0.5, random.Random(3)))
    # ties keep the input order
    assert [r.session_id for r in jitter_arrivals(early, 0.0, random.Random(3))] == ["a", "b"]
    with pytest.raises(ValueError):
        jitter_arrivals(requests, -0.001, random.Random(2))


def test_band_summarizes_the_draws_and_passes_on_half_of_them() -> None:
    band = band_of([1.5, None, 3.0, 1.0, 2.5], [True, False, False, True, False])
    assert band["draws"] == 5
    assert band["ttft_p90_median_s"] == pytest.approx(2.0)
    assert (band["ttft_p90_min_s"], band["ttft_p90_max_s"]) == (1.0, 3.0)
    assert band["pass_share"] == pytest.approx(0.4) and band["passes"] is False
    assert band_of([1.0, 3.0], [True, False])["passes"] is True
    hits = band_of([1.0, 2.0], [True, True], [0.75, None])
    assert (hits["hit_rate_min"], hits["hit_rate_max"], hits["hit_rate"]) == (0.75, 0.75, [0.75, None])


def test_verdict_checks_the_fleet_median_within_ten_percent_and_each_repeat_inside_the_range() -> None:
    band = band_of([1.0, 2.0, 3.0], [True, True, False])
    near = verdict(band, [2.1, 2.18, 3.5], [False, False, False])
    assert near["fleet_ttft_p90_median_s"] == pytest.approx(2.18)
    assert near["fleet_median_vs_sim_median"] == pytest.approx(1.09)
    assert near["fleet_median_within_tol"] is True
    assert near["fleet_inside_sim_range"] == [True, True, False]
    assert near["fleet_inside_share"] == pytest.approx(2 / 3)
    assert near["fleet_pass_share"] == 0.0 and near["fleet_passes"] is False
    far = verdict(band, [2.25, None], [True, False])
    assert far["fleet_median_vs_sim_median"] == pytest.approx(1.125)
    assert far["fleet_median_within_tol"] is False
    assert far["fleet_inside_sim_range"] == [True, False]  # a repeat with no p90 is outside
    assert far["fleet_passes"] is True  # one of two passes
    assert verdict(band, [0.85], [True])["fleet_median_within_tol"] is False


def test_band_capacity_is_the_highest_pass_below_the_lowest_fail() -> None:
    assert band_capacity([(36.0, True), (36.9, False)]) == 36.0
    assert band_capacity([(36.0, False), (36.9, True)]) is None
    assert band_capacity([(30.0, True), (31.0, True)]) == 31.0
    assert band_capacity([]) is None


def test_the_report_carries_the_band_and_both_capacities() -> None:
    search = Search(points=(), capacity=36.0, first_fail=36.9)
    b36 = {"rate": 36.0, "jitter_ms": 1.0, **band_of([1.5, 1.7, 3.0], [True, True, False])}
    b37 = {"rate": 36.9, "jitter_ms": 1.0, "hop_jitter_ms": 15.0, **band_of([2.5, 2.9], [False, False])}
    b36["sim_single_ttft_p90_s"], b37["sim_single_ttft_p90_s"] = 1.5, 3.0
    bands = {
        "kvlb": [
            {**b36, **verdict(b36, [2.1, 2.3], [False, False])},
            {**b37, **verdict(b37, [2.2, 2.0], [False, True])},
        ]
    }
    report = build_report({}, Slo(), {"kvlb": search}, [], bands=bands)
    (row,) = report["routers"]
    assert [b["rate"] for b in row["band"]] == [36.0, 36.9]
    assert row["band_capacity_sim"] == 36.0
    assert row["band_capacity_fleet"] is None  # fails 36.0, "passes" 36.9 in 1 of 2
    text = markdown(report)
    assert "## Against the simulator's spread" in text
    assert "| kvlb | 36 | 3 (±1 ms) | 1.7 | 1.5–3 | 0.67 | 1.5 | 2.1, 2.3 | 2.2 |" in text
    assert "| kvlb | 36.9 | 2 (±1 ms, hop ±15 ms) | 2.7 |" in text  # the hop's spread named when set


def _args(*more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["capacity", "--smoke", "--routers", "kvlb", *more])
    args.requests, args.replicas = 120, 2
    return args


def test_draws_without_jitter_reproduce_the_single_simulation_and_jittered_draws_repeat() -> None:
    args = _args("--confirm-sim-draws", "3", "--confirm-sim-jitter-ms", "0")
    _, stream = build_stream(args)
    rate = 4.0
    single = sim_measure(args, "kvlb", stream, lambda _: None)(rate, 60)
    still = sim_band(args, "kvlb", stream, rate, 60)
    assert still["ttft_p90_s"] == [single.ttft_p90_s] * 3
    args.confirm_sim_jitter_ms = 50.0
    moved = sim_band(args, "kvlb", stream, rate, 60)
    assert moved == sim_band(args, "kvlb", stream, rate, 60)
    assert moved["draws"] == 3 and moved["jitter_ms"] == 50.0 and moved["hop_jitter_ms"] == 0.0
    assert still["hit_rate"] == [single.hit_rate] * 3


def test_draws_with_a_spread_hop_each_draw_their_own_hops() -> None:
    args = _args("--confirm-sim-draws", "3", "--confirm-sim-jitter-ms", "0", "--sim-forward-delay-ms", "20")
    _, stream = build_stream(args)
    rate = 4.0
    fixed = sim_band(args, "kvlb", stream, rate, 60)
    assert len(set(fixed["ttft_p90_s"])) == 1  # no arrival jitter, one hop for all: the same draw
    args.sim_forward_jitter_ms = 15.0
    spread = sim_band(args, "kvlb", stream, rate, 60)
    assert len(set(spread["ttft_p90_s"])) == 3  # each draw its own hops
    assert spread == sim_band(args, "kvlb", stream, rate, 60)  # and the same ones every time
    # the draws' hop generators are apart from their arrival generators
    assert hop_rng(0, 1).random() == hop_rng(0, 1).random() != draw_rng(0, 1).random()


def test_the_simulations_decisions_are_kept_in_the_fleets_shape() -> None:
    args = _args()
    _, stream = build_stream(args)
    kept: list[Any] = []
    sim_measure(args, "kvlb", stream, lambda _: None, keep=kept, keep_decisions=True)(4.0, 60)
    sim_measure(args, "kvlb", stream, lambda _: None, keep=kept)(4.0, 60)
    result, plain = kept
    assert plain.decisions == []  # kept only when asked
    specs = stream.specs_at(4.0, 60, 1.0)
    fleet = ["sim-a", "sim-b"]
    rows = sim_decision_rows(result, specs, fleet)
    assert len(rows) == 60 and sorted(r["request_id"] for r in rows) == sorted(s.request_id for s in specs)
    # each row's replica is the one the simulation's record went to, under the fleet's name
    by_id = {s.request_id: i for i, s in enumerate(specs)}
    placed = {r.index: r.replica for r in sim_rows_of(result, specs, fleet)}
    assert all(placed[by_id[r["request_id"]]] == r["decision"]["replica"] for r in rows)
    assert {r["decision"]["replica"] for r in rows} == set(fleet)
    first = rows[0]["decision"]
    assert {t["replica"] for t in first["terms"]} == set(fleet) and first["reason"].startswith("argmin")
    assert [r["now_s"] for r in rows] == sorted(r["now_s"] for r in rows)  # routing order
