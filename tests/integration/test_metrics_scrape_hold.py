"""A ``/metrics`` scrape at 200 replicas lets the event loop run: requests are not held behind it.

A real :class:`balancer.app.Balancer` on 127.0.0.1 over 200 replica entries of one emulated vLLM
replica (``loadtests.bench.metrics_scrape``'s fleet), scraped over HTTP while a loop-lag probe runs
on the same loop. Before 2026-12-01 (h-metrics200) the handler rendered the whole registry in one
go: the first scrape (which builds the kept texts) held the loop 0.12–0.64 s (108–159 ms of CPU),
the later ones 41–288 ms (median; 36–63 ms of CPU), at load 5–12 on 2 shared cores. Now it renders
in steps of a few ms. A hold is counted in the loop thread's
CPU time (``time.thread_time`` between two turns of the probe: what the loop ran, not the time the
process waited for a core, which on a loaded machine can be longer than any bound); the bound is
generous: 100 ms for any one hold, against the old first scrape's hundreds.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.bench.metrics_scrape import LoopLag, fleet, scrape

REPLICAS = 200
HOLD_BOUND_MS = 100.0


@pytest.mark.faults_long  # make faults: 4-6 s (a balancer of 200 replicas on a loaded machine)
async def test_a_scrape_of_200_replicas_never_holds_the_loop_long() -> None:
    async with fleet(REPLICAS) as (balancer, session), LoopLag().running() as lag:
        first = await scrape(session, balancer.url, lag)
        later = [await scrape(session, balancer.url, lag) for _ in range(2)]
        async with session.get(balancer.url + "/metrics") as response:
            text = await response.text()
    assert first["hold_cpu_ms"] < HOLD_BOUND_MS, first
    assert max(row["hold_cpu_ms"] for row in later) < HOLD_BOUND_MS, later
    families = {family.name: family for family in text_string_to_metric_families(text)}
    healthy = families["kvlb_replica_healthy"].samples
    assert len({sample.labels["replica"] for sample in healthy}) == REPLICAS  # every replica's gauges
    gaps = families["kvlb_events_seq_gaps"].samples
    assert len([s for s in gaps if s.name == "kvlb_events_seq_gaps_total"]) == REPLICAS
    assert first["bytes"] > 1_000_000
