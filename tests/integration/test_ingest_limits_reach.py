"""The ingestion limits an operator sets (``limits.event_ingest_cpu_share``,
``limits.event_ingest_cpu_burst_s``, ``limits.event_max_behind_s``) reach a running balancer's
replica budgets and ZMQ sources (an emulated SGLang replica on 127.0.0.1, a real balancer); the
fleet mode builds its ingests with the same ``ingest_settings_for``."""

from __future__ import annotations

from kvlb_harness import running, shared_deepseek

from balancer.config import LimitConfig
from balancer.sources.build import ingest_settings_for, zmq_settings_for
from balancer.sources.zmq_sub import ZmqEventSource


async def test_the_ingest_limits_reach_each_replica_s_budget_and_sources() -> None:
    overrides = {
        "limits__event_ingest_cpu_share": 0.5,
        "limits__event_ingest_cpu_burst_s": 2.0,
        "limits__event_max_behind_s": 3.0,
    }
    async with running(shared_deepseek(), 1, **overrides) as h:
        assert h.balancer.replicas is not None
        (threaded,) = h.balancer.replicas.ingests.values()
        (entry,) = threaded.ingest._replicas.values()
        budget = entry.pipeline.budget
        assert budget is not None and (budget.share, budget.burst_s) == (0.5, 2.0)
        sources = [getattr(source, "source", source) for source in entry.sources]
        assert sources and all(isinstance(source, ZmqEventSource) for source in sources)
        assert all(source.settings.max_behind_s == 3.0 for source in sources)  # type: ignore[union-attr]


def test_the_ingest_limits_build_the_settings() -> None:
    limits = LimitConfig(event_ingest_cpu_share=float("inf"), event_max_behind_s=0.5)
    assert ingest_settings_for(limits).cpu_share == float("inf")  # the budget off
    assert zmq_settings_for(limits).max_behind_s == 0.5
