"""Scrapes over an idle fleet: virtual time jumps a quiet gap instead of scraping through it, with the
same results (docs/simulate.md, "Time is virtual"); and the summary's duration, which the last scrape
no longer stretches."""

from __future__ import annotations

from array import array

import pytest

from loadtests.simulate import SimConfig, SimRequest, Simulation


def _requests(gap_s: float) -> list[SimRequest]:
    shared = list(range(1000, 1000 + 512))
    return [
        SimRequest(array("I", [*shared, 7, *range(2000, 2100)]), 8, 0.0),
        SimRequest(array("I", [*shared, 8, *range(3000, 3100)]), 8, 0.5),
        SimRequest(array("I", [*shared, 9, *range(4000, 4100)]), 8, gap_s),
        SimRequest(array("I", [*shared, 9, *range(4000, 4100)]), 8, gap_s + 0.001),
    ]


def test_an_idle_gap_costs_a_few_events_not_one_per_scrape_interval() -> None:
    # before: 200,000 virtual seconds of quiet were 200,000 scrapes (each observing every replica):
    # 200,049 events; 100 replicas at --rate 0.01 over 200 trace rows took 16.7 s instead of 0.86 s
    config = SimConfig(replicas=4, scrape_interval_s=1.0)
    near = Simulation(config, _requests(5.0)).run()
    far = Simulation(config, _requests(200_000.0)).run()
    assert far.events < near.events + 20, (near.events, far.events)
    assert far.virtual_s > 200_000
    # the requests after the gap see what they saw after a short one: the same cache hits and TTFTs
    assert far.summary.ok == near.summary.ok == 4
    assert far.summary.cached_tokens == near.summary.cached_tokens
    assert list(far.records.ttft_s) == pytest.approx(list(near.records.ttft_s), abs=1e-9)
    assert far.summary.replica_requests == near.summary.replica_requests


def test_a_rate_near_zero_finishes() -> None:
    # before: arrivals 1e300 virtual seconds apart never finished (one scrape event per second)
    config = SimConfig(replicas=2, scrape_interval_s=1.0)
    result = Simulation(config, [SimRequest(array("I", range(1000, 1300)), 4, t) for t in (0.0, 1e300)]).run()
    assert result.summary.ok == 2 and result.events < 100


def test_throughput_runs_from_the_first_arrival_to_the_last_end_not_to_the_last_scrape() -> None:
    # before: duration_s was the loop's last event, the scrape after the last end: one request of
    # 0.08 s reported duration_s 1.0 (req_per_s 1.0), and duration moved with --scrape-interval-s
    requests = [SimRequest(array("I", range(1000, 1600)), 16, t) for t in (0.25, 0.5)]
    for interval in (1.0, 0.3, 0.0):
        result = Simulation(SimConfig(replicas=2, scrape_interval_s=interval), requests).run()
        last_end = max(s + e for s, e in zip(result.records.start_s, result.records.e2e_s, strict=True))
        assert result.summary.duration_s == pytest.approx(last_end - 0.25)
        assert result.summary.req_per_s == pytest.approx(2 / (last_end - 0.25))
