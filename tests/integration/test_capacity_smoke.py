"""Smoke test of ``kvlb capacity``: the simulator search at a tiny size, and (slow) the fleet confirmation.

Runs the real command as a process and checks the report's structure and its internal consistency.
No timing assertions: which rate passes depends only on the simulator here, but the test checks the
search's invariants, not the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from balancer.tokenizer.default import deepseek_tokenizer_file
from loadtests.capacity.retimed import DECISION_TIMES, INVALID, SEND_TIMES, UNJUDGED, verdict_of
from loadtests.client_lag import FIELDS as CLIENT_FIELDS

CONFIRM_REQUESTS = 20
"""Requests per fleet run of the confirmation tests (40 until 2026-12-01): each run still starts its own
kvlb serve, routes every request and is simulated beside; the assertions hold for any count."""


def _capacity(out: Path, *more: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "balancer", "capacity", "--smoke", "--out", str(out), "--json", *more]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def _check(report: dict[str, Any], routers: list[str]) -> None:
    assert report["kind"] == "kvlb-capacity"
    assert [r["name"] for r in report["routers"]] == routers
    rows = {r["name"]: r for r in report["routers"]}
    for row in report["routers"]:
        points = row["points"]
        assert points and all(p["source"] == "sim" for p in points)
        capacity, first_fail = row["capacity_rate"], row["first_failing_rate"]
        passing = [p["rate"] for p in points if p["meets_slo"]]
        failing = [p["rate"] for p in points if not p["meets_slo"]]
        if capacity is not None:
            assert capacity in passing
        if first_fail is not None:
            assert first_fail in failing and (capacity is None or first_fail > capacity)
        assert all(p["requests"] == report["meta"]["requests"] for p in points)
    rr = rows["round_robin"]["capacity_rate"]
    for row in report["routers"]:
        if row["capacity_rate"] is not None and rr:
            assert row["vs_round_robin"] == pytest.approx(row["capacity_rate"] / rr)
    bound = report["oracle_bound"]
    assert 0 <= bound["hit_rate"] <= bound["unbounded_hit_rate"] <= 1


def test_capacity_smoke_in_the_simulator(tmp_path: Path) -> None:
    routers = ["kvlb", "round_robin", "least_load", "sglang_cache_aware", "oracle"]
    done = _capacity(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    _check(report, routers)
    assert report["meta"]["confirmed_on_fleet"] is False
    assert report["best_peer"] == "sglang_cache_aware"
    assert all(r["confirmed"] == [] for r in report["routers"])
    oracle = next(r for r in report["routers"] if r["name"] == "oracle")
    assert all("planned_hit_rate" in p for p in oracle["points"])
    for name in ("capacity.json", "capacity.md", "ttft_vs_rate.svg"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "ttft_vs_rate.svg").read_text().count("<polyline") == len(routers)


@pytest.mark.slow
@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
def test_capacity_smoke_confirms_the_bracket_on_the_emulated_fleet(tmp_path: Path) -> None:
    # at half speed, the fleet's kvlb (one worker) gets its routing timers on model time, but the TTL
    # the user set; a value the real `kvlb serve` refused would stop the run
    done = _capacity(
        tmp_path,
        "--routers", "kvlb,round_robin", "--confirm", "--confirm-requests", str(CONFIRM_REQUESTS),
        "--confirm-sim-draws", "2", "--time-scale", "0.5", "--kvlb-set", "limits.speculative_ttl_s=3",
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    _check(report, ["kvlb", "round_robin"])
    assert report["meta"]["confirmed_on_fleet"] is True
    assert report["meta"]["confirm_sim_draws"] == 2
    assert report["meta"]["kvlb_sets"] == ["limits.speculative_ttl_s=3"]
    assert report["meta"]["kvlb_model_time_sets"] == [
        "timeouts.first_byte_s=120", "scrape_interval_s=2", "limits.gap_hold_s=1", "limits.gap_keep_s=4",
        "limits.queue_timeout_s=4",
    ]  # fmt: skip
    assert report["meta"]["kvlb_workers"] == 1
    text = (tmp_path / "capacity.md").read_text()
    assert "its routing timers on model time (`timeouts.first_byte_s=120`" in text
    lag_slo_s = min(b for b in (report["slo"]["ttft_p90_s"], report["slo"]["ttft_p99_s"]) if b is not None)
    any_behind = False
    for row in report["routers"]:
        rates = [p["rate"] for p in row["confirmed"]]
        assert rates == [r for r in (row["capacity_rate"], row["first_failing_rate"]) if r is not None]
        # the simulator's spread at each confirmed rate, and the fleet's one run against it
        assert [b["rate"] for b in row["band"]] == rates
        for band, point in zip(row["band"], row["confirmed"], strict=True):
            assert band["draws"] == 2 and len(band["ttft_p90_s"]) == 2
            assert band["fleet_ttft_p90_s"] == [point["ttft_p90_s"]]
            assert band["sim_single_ttft_p90_s"] == point["sim_same_requests_ttft_p90_s"]
            assert {"fleet_median_within_tol", "fleet_inside_sim_range", "pass_share"} <= band.keys()
            # the run's requests simulated at its own send times, once per default hop, and its verdict
            retimed = point["retimed"]
            assert retimed["times"] == SEND_TIMES and retimed["hops_ms"] == [5.0, 10.0, 20.0]
            assert retimed["routing_lag_ms"] is None  # no decisions saved
            assert retimed["simulations"] == 3 and len(retimed["ttft_p90_s"]) == 3
            assert retimed["passes"] == (retimed["pass_share"] >= 0.5)
            assert retimed["fleet_passes"] == point["meets_slo"] and retimed["draws_pass"] == band["passes"]
            # and with a spread hop, the default range's draws
            [spread] = retimed["spread"]
            assert spread["hop_ms"] == [5.0, 15.0] and spread["draws"] == 5 and len(spread["ttft_p90_s"]) == 5
            invalid = "invalid" in point
            judged = verdict_of(
                point["meets_slo"], band["passes"], retimed["passes"], invalid=invalid,
                spread_passes=[spread["passes"]],
            )  # fmt: skip
            assert retimed["verdict"] == judged
        assert "band_capacity_sim" in row and "band_capacity_fleet" in row
        for point in row["confirmed"]:
            assert (
                point["source"] == "fleet" and point["requests"] == CONFIRM_REQUESTS and point["errors"] == 0
            )
            assert point["sim_same_requests_ttft_p90_s"] is not None
            # the client judged as in `kvlb loadtest` (loadtests/client_lag.py), in model time: the
            # lag bounded by a tenth of the TTFT SLO. Whether this run kept its schedule is the
            # machine's doing (at --time-scale 0.5 the bound is 60 wall ms; a 2-core machine at
            # load 4-5 lagged 1-3 model ms on 2026-11-30): the verdict and the point must agree.
            assert set(CLIENT_FIELDS) <= point.keys() and "sent_rate" not in point
            assert point["client_lag_bound_s"] == pytest.approx(0.1 * lag_slo_s)
            behind = point["client_behind"]
            assert isinstance(behind, bool) and bool(point["client_behind_reasons"]) == behind
            assert point["client_slot_waits"] == 0  # the point's cap holds all its requests
            assert ("invalid" in point) == behind, (point["client_behind_reasons"], point["load_1m"])
            any_behind = any_behind or behind
        assert row["invalid"] is None
    assert ("no measurement at their rate" in text) == any_behind
    assert all(p["exit_code"] is not None for p in report["meta"]["processes"])
    assert "## Against the simulator's spread" in (tmp_path / "capacity.md").read_text()
    assert "## At the fleet's own times" in (tmp_path / "capacity.md").read_text()
    assert report["meta"]["confirm_retimed_hops_ms"] == [5.0, 10.0, 20.0]
    assert report["meta"]["confirm_retimed_hop_ranges_ms"] == [[5.0, 15.0]]
    assert report["meta"]["confirm_retimed_draws"] == 5


REPLAY_REPEATS = 1
"""Fleet runs per rate and router of :func:`replay_run` (2 until 2026-12-01)."""


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One ``kvlb`` confirmation with the replay beside it and every decision saved, shared by the two
    tests below: each asserts its own facts of the run (the replay's replicas; the saved decisions),
    and neither writes to it. Until 2026-12-01 each had its own run (8 + 4 fleet runs, a kvlb serve
    each); the decisions test confirmed 40 req/s where this one confirms the search's bracket. One
    repeat per rate since the same day's later pass (2 before: 8 fleet runs, now 4): each kvlb run
    still has its own router and its replay; the repeats are the interleave test's."""
    out = tmp_path_factory.mktemp("capacity-replay")
    done = _capacity(
        out,
        "--routers", "kvlb", "--confirm", "--confirm-replay", "--confirm-repeats", str(REPLAY_REPEATS),
        "--confirm-requests", str(CONFIRM_REQUESTS), "--confirm-sim-draws", "0", "--confirm-save-decisions",
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
def test_capacity_replay_sends_each_request_to_the_replica_the_simulator_chose(
    replay_run: tuple[Path, dict[str, Any]],
) -> None:
    tmp_path, report = replay_run
    (row,) = report["routers"]
    rates = [r for r in (row["capacity_rate"], row["first_failing_rate"]) if r is not None]
    assert rates
    # per rate: the router and the replay alternate, at each repeat
    runs = [(p["rate"], p["fleet_router"], p["repeat"]) for p in row["confirmed"]]
    assert runs == [
        (rate, router, n)
        for rate in rates
        for n in range(REPLAY_REPEATS)
        for router in ("kvlb", "replay:kvlb")
    ]
    for point in row["confirmed"]:
        assert point["source"] == "fleet" and point["requests"] == CONFIRM_REQUESTS and point["errors"] == 0
        agreement = point["vs_sim"]
        assert agreement["requests"] == CONFIRM_REQUESTS
        if point["fleet_router"] == "replay:kvlb":
            # the emulator's own x-sim-replica header names the replica the simulation chose, every time
            assert agreement["same_replica_share_as_labelled"] == 1.0
            assert agreement["first_divergence"] is None
    # no router process for a replay; one per kvlb run
    routers = [p["name"] for p in report["meta"]["processes"] if not p["name"].startswith("fleet-")]
    assert routers == ["kvlb"] * REPLAY_REPEATS * len(rates)
    for rate in rates:
        sim = _rows(tmp_path / "requests" / f"kvlb-{rate:g}-sim.jsonl")
        replay = _rows(tmp_path / "requests" / f"replay-kvlb-{rate:g}-fleet-{REPLAY_REPEATS - 1}.jsonl")
        assert [r["index"] for r in sim] == list(range(CONFIRM_REQUESTS)) == [r["index"] for r in replay]
        assert [r["replica"] for r in sim] == [r["replica"] for r in replay]
    assert "| fleet (replay:kvlb) |" in (tmp_path / "capacity.md").read_text()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.faults_long
@pytest.mark.slow
@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
def test_capacity_interleave_alternates_the_routers_at_each_fixed_rate(tmp_path: Path) -> None:
    # the default before 2026-11-29 (a router other than ``kvlb``; its null reaches the fleet's config).
    # One rate (two until 2026-12-01, 8 fleet runs): the order rate by rate is confirm_order's, which
    # tests/unit/test_capacity.py checks over two rates; here the fleet runs it, d r r d.
    previous = "kvlb:cost+overlap_credit_loaded=null+root_weight=0"
    done = _capacity(
        tmp_path,
        "--routers", f"kvlb,{previous}", "--confirm", "--confirm-rates", "40", "--confirm-repeats", "2",
        "--confirm-interleave", "--confirm-requests", str(CONFIRM_REQUESTS), "--confirm-sim-draws", "2",
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # one router process per run, in the order they ran: d r r d at each rate
    routers = [p["name"] for p in report["meta"]["processes"] if not p["name"].startswith("fleet-")]
    assert routers == ["kvlb", previous, previous, "kvlb"]
    for row in report["routers"]:
        runs = [(p["rate"], p["repeat"]) for p in row["confirmed"]]
        assert runs == [(40.0, 0), (40.0, 1)]
        assert all(p["fleet_router"] == row["name"] and p["errors"] == 0 for p in row["confirmed"])
        starts = [p["utc"].split("-")[0] for p in row["confirmed"]]
        assert starts == sorted(starts)
        # each point's band is judged against that router's two runs there
        assert [b["rate"] for b in row["band"]] == [40.0]
        assert all(len(b["fleet_ttft_p90_s"]) == 2 for b in row["band"])


@pytest.mark.slow
@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
def test_capacity_saves_every_decision_of_each_kvlb_run(replay_run: tuple[Path, dict[str, Any]]) -> None:
    tmp_path, report = replay_run
    (row,) = report["routers"]
    assert [p["fleet_router"] for p in row["confirmed"]].count("kvlb") >= 2
    for point in row["confirmed"]:
        if point["fleet_router"] == "replay:kvlb":
            assert "decisions" not in point  # no router, no ring
            assert "retimed" not in point  # nothing routed it
            continue
        assert point["decisions"] == {"saved": CONFIRM_REQUESTS, "missing": 0, "error": None}
        # the retimed simulations take the kvlb's own decision times; no draws, no verdict. A run
        # whose client fell behind its schedule is no measurement whatever the draws, and says so
        # instead (the machine's doing: under two CPU burners at load 5-6 a run lagged past its bound).
        behind = point["client_behind"]
        assert ("invalid" in point) == behind, (point["client_behind_reasons"], point["load_1m"])
        assert point["retimed"]["times"] == DECISION_TIMES
        assert point["retimed"]["verdict"] == (INVALID if behind else UNJUDGED)
        assert point["retimed"]["routing_lag_ms"]["p50"] is not None
        rows = _rows(tmp_path / "requests" / f"kvlb-{point['rate']:g}-fleet-{point['repeat']}.jsonl")
        decisions = _rows(tmp_path / "decisions" / f"kvlb-{point['rate']:g}-fleet-{point['repeat']}.jsonl")
        # a fresh router per run: its decisions 1..N, one per request, in the order they were made
        assert [d["id"] for d in decisions] == list(range(1, CONFIRM_REQUESTS + 1))
        assert len({d["request_id"] for d in decisions}) == CONFIRM_REQUESTS
        # each names the replica that served its request, with every candidate's cost terms
        served = sorted(r["replica"] for r in rows)
        assert sorted(d["decision"]["replica"] for d in decisions) == served
        for decision in decisions:
            terms = {t["replica"]: t for t in decision["decision"]["terms"]}
            assert decision["decision"]["replica"] in terms
            assert terms[decision["decision"]["replica"]]["cost"] is not None
            assert set(decision["inputs"]["candidates"]) == set(terms)
    assert not list((tmp_path / "decisions").glob("replay-*"))
