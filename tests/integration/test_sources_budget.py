"""The per-replica ingestion CPU budget against a real publisher: once it is spent the ZMQ source
reads each message off the socket and drops it undecoded (counted), resyncs its rank once, and keeps
the stream in order (no replay, no gap); ``CpuBudget`` itself refills at its share."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio
from recording_index import RecordingIndex
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    BLOCK,
    FAST,
    REPLICA,
    TOPIC,
    Publisher,
    ctx_fixture,
    eventually,
    publisher_fixture,
)

from balancer.engines.sglang import SglangDecoder
from balancer.errors import ConfigError
from balancer.metrics import Metrics
from balancer.sources.budget import CpuBudget
from balancer.sources.pipeline import EventIngest, IngestSettings
from balancer.sources.zmq_sub import ZmqEventSource


def test_the_budget_refills_at_its_share_up_to_its_burst() -> None:
    budget = CpuBudget(share=0.25, burst_s=0.1)
    assert budget.allows(0.0)
    budget.charge(0.3, 0.0)  # 0.1 - 0.3 = -0.2 s in debt
    assert not budget.allows(0.5)  # +0.125
    assert budget.allows(0.9)  # +0.225 > 0.2
    assert budget.allows(100.0)
    budget.charge(0.1, 100.0)  # capped at the burst: 0.1 - 0.1 = 0
    assert not budget.allows(100.0)
    with pytest.raises(ConfigError):
        CpuBudget(share=0.0, burst_s=1.0)


async def test_a_spent_budget_sheds_messages_undecoded_and_resyncs_once(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    metrics = Metrics.create()
    index = RecordingIndex(REPLICA)
    source = ZmqEventSource(
        REPLICA,
        publisher.endpoint,
        ctx=ctx,
        decoder=SglangDecoder(block_size=BLOCK),
        metrics=metrics,
        topic=TOPIC,
        replay_endpoint=publisher.replay_endpoint,
        settings=FAST,
    )
    # a budget so small that the first decode spends it and nothing refills it during the test
    settings = IngestSettings(cpu_share=1e-9, cpu_burst_s=1e-9)
    ingest = EventIngest(index, metrics=metrics, settings=settings)  # type: ignore[arg-type]
    ingest.add_replica(REPLICA, "sglang", [source])
    await ingest.start()
    try:
        await publisher.wait_subscribed()
        await asyncio.wait_for(publisher.replay_served.wait(), 5)  # the connection's catch-up: empty
        await publisher.pages(40)
        await eventually(lambda: source.status().last_seq == 39)
        assert source.shed >= 38  # the first message was decoded (and spent the budget)
        assert index.pages()[:1] == [1] and len(index.pages()) == 40 - source.shed
        assert index.resyncs() == [(0, "overflow")]  # once, at the start of the run of shed messages
        # the connection's catch-up only, no gap replay: the shed messages kept the stream in order
        assert publisher.replay_requests == [0]
        shed = metrics.registry.get_sample_value("kvlb_events_shed_total", {"replica": REPLICA})
        assert shed == source.shed
    finally:
        await ingest.aclose()
