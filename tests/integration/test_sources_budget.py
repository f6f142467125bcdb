"""The per-replica ingestion CPU budget against a real publisher: once it is spent the ZMQ source
reads each message off the socket and drops it undecoded (counted), resyncs its rank once, and keeps
the stream in order (no replay, no gap); ``CpuBudget`` itself refills at its share."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence

import pytest
import zmq.asyncio
from recording_index import RecordingIndex
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    BLOCK,
    FAST,
    POLLING,
    REPLICA,
    TOPIC,
    Publisher,
    Rig,
    ctx_fixture,
    eventually,
    page,
    publisher_fixture,
    running,
)

from balancer.engines.sglang import SglangDecoder
from balancer.errors import ConfigError
from balancer.events import KvEvent, Resync
from balancer.index.base import ApplyResult
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.budget import CpuBudget
from balancer.sources.pipeline import EventIngest, IngestSettings, OwnCpu
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId


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
    ctx: zmq.asyncio.Context, publisher: Publisher, caplog: pytest.LogCaptureFixture
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
        runs = [
            metrics.registry.get_sample_value("kvlb_events_shed_runs_total", {"replica": REPLICA, "cause": c})
            or 0.0
            for c in ("budget", "behind")
        ]
        assert runs == [1.0, 0.0]  # one run, started by the budget
        # the warning names the cause with the budget's figures (since 2026-12-01)
        (warning,) = [r.getMessage() for r in caplog.records if "shedding events" in r.getMessage()]
        assert "(cause budget: its ingestion CPU budget is spent (" in warning
        assert "s left of a 1e-09 s burst at 1e-09 CPU s/s)" in warning
    finally:
        await ingest.aclose()


class Switch:
    """A gate the test opens and closes (a budget spent or not), charging nothing."""

    def __init__(self) -> None:
        self.open = True

    def admits(self) -> bool:
        return self.open

    def charge(self, cpu_s: float) -> None:
        return None

    def spent(self) -> str:
        return "the test closed it"


async def test_shed_messages_keep_restart_detection_by_seq(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """A publisher that restarts while its messages are shed: the seq regression of a shed message
    is still a restart (the rank forgotten, seq 0 taken as its start), and its run resyncs after it."""
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        gate = Switch()
        rig.source.gate = gate
        await publisher.wait_subscribed()
        await asyncio.wait_for(publisher.replay_served.wait(), 5)
        await publisher.pages(10)
        await rig.settle(9)
        gate.open = False
        publisher.restart()
        await publisher.pages(5)
        await rig.settle(4)
        assert rig.index.pages() == list(range(1, 11))
        assert rig.index.resyncs() == [(0, "restart"), (0, "overflow")]
        assert publisher.replay_requests == [0]  # no gap: shed messages advance the seq
        assert rig.source.shed == 5
        gate.open = True
        await publisher.pages(3)
        await rig.settle(7)
        assert rig.index.pages()[10:] == [6, 7, 8]  # decoded again, in order, no new resync
        assert rig.index.resyncs() == [(0, "restart"), (0, "overflow")]


async def test_a_shed_live_copy_of_a_replayed_batch_resyncs(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """The catch-up's replay brings seqs 0..4 while their live copies queue on the SUB. A decoded live
    copy is compared by payload (the same: a duplicate); a shed one cannot be, as it might be a
    restarted publisher's batch at that seq, so it resyncs the rank (once for its run)."""
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        gate = Switch()
        gate.open = False
        rig.source.gate = gate
        publisher.replay_gate = asyncio.Event()
        await publisher.wait_subscribed()
        await eventually(lambda: publisher.replay_requests == [0])
        await publisher.pages(5)  # live, queued on the SUB while the replay is held
        publisher.replay_gate.set()
        await rig.settle(4)
        await eventually(lambda: rig.source.shed == 5)
        await eventually(lambda: rig.ingest.status()[REPLICA].queued_batches == 0)
        assert rig.index.timeline() == [1, 2, 3, 4, 5, "overflow"]
        assert rig.source.status().duplicates == 5
        assert publisher.replay_requests == [0]


async def test_decoded_live_copies_of_replayed_batches_are_duplicates(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        rig.source.gate = Switch()
        publisher.replay_gate = asyncio.Event()
        await publisher.wait_subscribed()
        await eventually(lambda: publisher.replay_requests == [0])
        await publisher.pages(5)
        publisher.replay_gate.set()
        await rig.settle(4)
        await eventually(lambda: rig.source.status().duplicates == 5)
        assert rig.index.timeline() == [1, 2, 3, 4, 5]
        assert rig.source.shed == 0


class WaitingIndex(RecordingIndex):
    """An index whose apply waits (as the Redis writer does on a round trip or a backoff) and spends
    ``cpu_s`` of its own CPU before returning."""

    def __init__(self, replica: ReplicaId, wait_s: float, cpu_s: float) -> None:
        super().__init__(replica)
        self.wait_s, self.cpu_s = wait_s, cpu_s

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        await asyncio.sleep(self.wait_s)
        _burn(self.cpu_s)
        return await super().apply(replica, events, now)


def _burn(cpu_s: float) -> None:
    started = time.thread_time()
    while time.thread_time() - started < cpu_s:
        pass


async def test_an_apply_is_charged_its_own_cpu_not_what_the_loop_ran_while_it_waited() -> None:
    """Regression: the applier charged ``thread_time`` around the whole ``await``, so a Redis apply
    waiting on an outage was charged every request the loop served meanwhile; the budget was spent
    and healthy engines were shed and resynced (the Redis-restart fault converged in 4-8 s)."""
    index = WaitingIndex(REPLICA, wait_s=0.4, cpu_s=0.05)
    settings = IngestSettings(cpu_share=1e-9, cpu_burst_s=1.0)  # no refill during the test
    ingest = EventIngest(index, metrics=Metrics.create(), settings=settings)  # type: ignore[arg-type]
    pipeline = ingest.add_replica(REPLICA, "sglang", [])
    await ingest.start()
    try:
        pipeline.offer(IngestBatch((Resync(0, "gap"),)))
        await asyncio.sleep(0.05)
        _burn(0.3)  # the loop's other work while the apply waits
        assert await pipeline.wait_applied(5.0)
        assert pipeline.budget is not None
        spent_s = 1.0 - pipeline.budget._tokens_s
        assert 0.04 <= spent_s < 0.15, spent_s  # its own 0.05 s, not the 0.3 s burnt beside it
    finally:
        await ingest.aclose()


async def test_own_cpu_passes_results_exceptions_and_cancellation_through() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        _burn(0.02)
        return 42

    timed = OwnCpu(answer())
    assert await timed == 42 and timed.cpu_s >= 0.02

    async def failing() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await OwnCpu(failing())

    cleaned: list[bool] = []

    async def waiting() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cleaned.append(True)

    task = asyncio.create_task(_await(OwnCpu(waiting())))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


async def _await(awaitable: OwnCpu[None]) -> None:
    await awaitable


def _queue_on_the_sub(seconds: float) -> None:
    """Block the loop (the source with it) while libzmq moves what was published onto the SUB."""
    time.sleep(seconds)


async def _publish_until_taken(publisher: Publisher, rig: Rig) -> int:
    """After a flood was dropped with the SUB: publish one page at a time until the source takes one
    (those sent before the fresh SUB subscribed are lost, as they would be to any late joiner);
    returns the seq it took."""
    for _ in range(100):
        seq = await publisher.publish([page(publisher.seq)])
        with contextlib.suppress(AssertionError):
            await eventually(lambda s=seq: (rig.source.status().last_seq or -1) >= s, timeout_s=0.05)
            return seq
    raise AssertionError("no page was taken after the flood")


def _runs(rig: Rig) -> dict[str, float]:
    return {cause: rig.metric("kvlb_events_shed_runs_total", {"replica": REPLICA, "cause": cause})
            for cause in ("behind", "budget", "backlog")}  # fmt: skip


async def test_a_backlog_read_past_max_behind_s_is_dropped_counted_as_behind_and_converges(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """A backlog the source cannot read to the end within ``max_behind_s``: the message at hand is
    shed and resyncs the rank (once), the rest goes with the SUB, which is reopened; the run is
    counted with its cause; the SUB stays away ``flood_pause_s`` (what is published meanwhile is
    lost); the next message taken is decoded, in order, without a replay, and its seq counts what
    was dropped as shed."""
    settings = dataclasses.replace(FAST, max_behind_s=0.002, flood_pause_s=0.5)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
        await publisher.wait_subscribed()
        await asyncio.wait_for(publisher.replay_served.wait(), 5)
        await publisher.pages(400)
        _queue_on_the_sub(0.3)
        await eventually(lambda: rig.source.shed > 0)
        decoded = len(rig.index.pages())
        assert 0 < decoded < 400
        await asyncio.sleep(0.1)
        assert rig.source.status().messages == decoded + 1  # the rest was never handled: dropped
        away_from = time.monotonic()
        seq = await _publish_until_taken(publisher, rig)
        assert time.monotonic() - away_from >= 0.3 and seq >= 400 + 3  # pages sent in the pause: lost
        await rig.settle(seq)
        assert rig.index.pages() == [*range(1, decoded + 1), seq + 1]  # in order, then the new one
        assert rig.source.shed == seq - decoded  # every seq before it that was not decoded
        shed = rig.metric("kvlb_events_shed_total", {"replica": REPLICA})
        assert shed == rig.source.shed
        assert rig.index.resyncs() == [(0, "overflow")]
        assert _runs(rig) == {"behind": 1.0, "budget": 0.0, "backlog": 0.0}
        assert rig.source.status().gaps == 0
        assert publisher.replay_requests == [0]  # the connection's catch-up only


async def test_a_backlog_over_max_backlog_bytes_is_dropped_at_once_and_not_polled_for(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """More than ``max_backlog_bytes`` queued: a flood before anything of it is decoded; it goes
    with the SUB (the rank resyncs once, a ``backlog`` run), no replay poll asks for the dropped
    batches while the stream is silent (the publisher still holds them), and the next message is
    decoded in order."""
    settings = dataclasses.replace(POLLING, max_message_bytes=4096, max_backlog_bytes=8192, flood_pause_s=0.1)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
        await publisher.wait_subscribed()
        await asyncio.wait_for(publisher.replay_served.wait(), 5)
        await publisher.pages(3)  # before the flood: decoded as they come
        await rig.settle(2)
        await publisher.pages(400)  # about 40 kB
        _queue_on_the_sub(0.3)
        await eventually(lambda: rig.source.shed > 0)
        await asyncio.sleep(0.5)  # silent for ten times replay_poll_min_s
        assert publisher.replay_requests == [0], "a poll asked for the dropped flood"
        assert rig.index.pages() == [1, 2, 3]  # nothing of the flood decoded
        assert rig.source.status().messages == 3 + 1  # its first message shed, the rest dropped
        seq = await _publish_until_taken(publisher, rig)
        await rig.settle(seq)
        assert rig.index.pages() == [1, 2, 3, seq + 1]
        assert rig.source.shed == seq - 3
        assert rig.index.resyncs() == [(0, "overflow")]
        assert _runs(rig) == {"behind": 0.0, "budget": 0.0, "backlog": 1.0}
        assert rig.source.status().gaps == 0 and publisher.replay_requests == [0]


async def test_a_drain_that_ends_at_its_limit_does_not_carry_the_behind_clock_into_the_next_burst(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """Regression: a drain that read exactly its limit (1,000 messages) returned without looking
    at the socket again, so the source never saw it empty; the next burst, seconds later, found the
    clock of the old one running and was shed at once (a resync for nothing)."""
    publisher.pub.setsockopt(zmq.SNDHWM, 0)  # every page reaches the SUB (the pipe is made at connect)
    # The 1,000 pages must be read within max_behind_s of wall time, or they are a flood and shed:
    # 5 s, not 0.5 s. On a loaded machine (CPU burners, load 8-12) reading them took 1.6-3.0 s, and
    # with 0.5 s they were shed and the rest of the flood dropped. The idle spell that follows is
    # longer than max_behind_s, so the old burst's clock, had it carried over, would shed the page.
    max_behind_s = 5.0
    settings = dataclasses.replace(FAST, max_behind_s=max_behind_s)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
        await publisher.wait_subscribed()
        await asyncio.wait_for(publisher.replay_served.wait(), 5)
        await publisher.pages(1000)  # one drain's limit, all queued before the source reads any
        _queue_on_the_sub(0.3)
        await rig.settle(999, timeout_s=max_behind_s + 2.0)
        assert rig.source.shed == 0 and len(rig.index.pages()) == 1000
        await asyncio.sleep(max_behind_s + 0.5)  # idle for longer than max_behind_s
        await publisher.pages(1)
        await rig.settle(1000)
        assert rig.source.shed == 0, "a message after an idle spell was shed"
        assert rig.index.pages()[-1] == 1001 and rig.index.resyncs() == []


async def test_after_a_dropped_flood_a_lost_publisher_is_caught_up_and_its_silence_polled_again(
    ctx: zmq.asyncio.Context,
) -> None:
    """A dropped flood stops the replay polls until the stream shows its next message. If instead the
    publisher's process goes (a disconnect: the rank is forgotten) and a new one starts, the new
    stream owes nothing to the flood: after its catch-up a silent stream is polled again, so a batch
    only the new publisher's replay buffer holds (a PUB HWM drop) is taken."""
    settings = dataclasses.replace(POLLING, max_message_bytes=4096, max_backlog_bytes=8192, flood_pause_s=0.1)
    old = Publisher(ctx)
    async with running(ctx, old.endpoint, old.replay_endpoint, settings=settings) as rig:
        await old.wait_subscribed()
        await asyncio.wait_for(old.replay_served.wait(), 5)
        await old.pages(400)  # about 40 kB: over max_backlog_bytes
        _queue_on_the_sub(0.3)
        await eventually(lambda: rig.source.shed > 0)
        await asyncio.sleep(0.4)  # the pause, then the fresh SUB connects to the same process
        await old.aclose()  # the process dies before it sends anything more
        await eventually(lambda: rig.index.resyncs() == [(0, "overflow"), (0, "disconnect")])
        new = Publisher(ctx, port=old.port, replay_port=old.replay_port)
        try:
            await new.pages(2)  # before kvlb reconnects: its catch-up brings them
            await rig.settle(1)
            await new.publish([page(new.seq)], drop=True)  # only a poll of the replay socket finds it
            await rig.settle(2)
            assert rig.index.pages()[-3:] == [1, 2, 3]
            assert new.replay_requests[0] == 0 and len(new.replay_requests) >= 2  # catch-up, then polls
        finally:
            await new.aclose()
