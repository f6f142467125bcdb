"""The ingestion limits an operator sets (``limits.event_ingest_cpu_share``,
``limits.event_ingest_cpu_burst_s``, ``limits.event_max_behind_s``) reach a running balancer's
replica budgets and ZMQ sources (an emulated SGLang replica on 127.0.0.1, a real balancer), in the
embedded mode and in fleet mode (a real redis-server on 127.0.0.1)."""

from __future__ import annotations

from kvlb_harness import running, shared_deepseek, wait_for
from redis_server import RedisServer

from balancer.config import LimitConfig
from balancer.sources.build import ingest_settings_for, zmq_settings_for
from balancer.sources.pipeline import EventIngest
from balancer.sources.zmq_sub import ZmqEventSource

OVERRIDES = {
    "limits__event_ingest_cpu_share": 0.5,
    "limits__event_ingest_cpu_burst_s": 2.0,
    "limits__event_max_behind_s": 3.0,
}


async def test_the_ingest_limits_reach_each_replica_s_budget_and_sources() -> None:
    async with running(shared_deepseek(), 1, **OVERRIDES) as h:
        assert h.balancer.replicas is not None
        (threaded,) = h.balancer.replicas.ingests.values()
        _the_limits_reached(threaded.ingest)


async def test_the_ingest_limits_reach_a_fleet_balancer_s_budget_and_sources(
    redis_server: RedisServer,
) -> None:
    async with running(shared_deepseek(), 1, redis__url=redis_server.url, **OVERRIDES) as h:
        fleet = h.balancer.fleet
        assert fleet is not None and fleet.leases is not None
        leases = fleet.leases

        async def held() -> bool:
            return len(leases.held) == 1

        await wait_for("the replica's lease held", held)
        (entry,) = leases.replicas.values()
        _the_limits_reached(entry.ingest._ingest.ingest)


def _the_limits_reached(ingest: EventIngest) -> None:
    (entry,) = ingest._replicas.values()
    budget = entry.pipeline.budget
    assert budget is not None and (budget.share, budget.burst_s) == (0.5, 2.0)
    sources = [getattr(source, "source", source) for source in entry.sources]
    assert sources and all(isinstance(source, ZmqEventSource) for source in sources)
    assert all(source.settings.max_behind_s == 3.0 for source in sources)  # type: ignore[union-attr]


def test_the_ingest_limits_build_the_settings() -> None:
    limits = LimitConfig(event_ingest_cpu_share=float("inf"), event_max_behind_s=0.5)
    assert ingest_settings_for(limits).cpu_share == float("inf")  # the budget off
    assert zmq_settings_for(limits).max_behind_s == 0.5
