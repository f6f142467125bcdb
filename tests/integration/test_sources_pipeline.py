"""ReplicaPipeline, EventIngest and the ingest thread: ordered apply, overflow → resync, failing index,
task ownership."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
from waiting import eventually

from balancer.events import Cleared, KvEvent, Removed, Resync, Stored
from balancer.index.base import ApplyResult, IndexStats
from balancer.metrics import Metrics
from balancer.sources.base import Emit, IngestBatch, SourceStatus
from balancer.sources.ingest_thread import IngestThread
from balancer.sources.pipeline import EventIngest, IngestSettings, ReplicaPipeline, batch_bytes
from balancer.types import EngineHash, ReplicaId

R1 = ReplicaId("r1")
R2 = ReplicaId("r2")


class RecordingIndex:
    """Test double of the sink: records ``apply`` calls; can be told to fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[ReplicaId, list[KvEvent], float]] = []
        self.fail_next = 0
        self.dropped: list[ReplicaId] = []
        self.gate: asyncio.Event | None = None
        """When set, each ``apply`` waits for it (a slow backend)."""

    async def apply(self, replica: ReplicaId, events: Sequence[KvEvent], now: float) -> ApplyResult:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("backend down")
        self.calls.append((replica, list(events), now))
        return ApplyResult(
            removed_blocks=sum(len(e.engine_hashes) for e in events if isinstance(e, Removed)),
            cleared_caches=sum(isinstance(e, Cleared) for e in events),
            resyncs=sum(isinstance(e, Resync) for e in events),
            unknown_removals=1,
        )

    async def drop_replica(self, replica: ReplicaId) -> int:
        self.dropped.append(replica)
        return 0

    async def stats(self) -> IndexStats:
        return IndexStats(0, 0)

    async def aclose(self) -> None:
        return None

    def events(self, replica: ReplicaId | None = None) -> list[KvEvent]:
        return [e for r, events, _ in self.calls if replica in (None, r) for e in events]


def removed(n: int, rank: int = 0) -> IngestBatch:
    return IngestBatch((Removed(rank, (EngineHash(n),)),), engine_ts=time.time() - 0.5)


def sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def run_until_applied(pipeline: ReplicaPipeline, batches: int) -> None:
    """Run ``pipeline`` until it has applied ``batches`` batches, then stop it."""
    task = asyncio.create_task(pipeline.run())
    try:
        await eventually(lambda: pipeline.applied_batches == batches)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_batches_apply_in_order_with_monotonic_now_and_metrics() -> None:
    index, metrics = RecordingIndex(), Metrics.create()
    pipeline = ReplicaPipeline(R1, "sglang", index, metrics=metrics)  # type: ignore[arg-type]
    for n in range(50):
        pipeline.offer(removed(n))
    pipeline.offer(IngestBatch(()))  # empty batches are not queued
    assert pipeline.queued_batches == 50
    before = time.monotonic()
    await run_until_applied(pipeline, 50)
    assert [e.engine_hashes[0] for e in index.events() if isinstance(e, Removed)] == list(range(50))
    assert len(index.calls) < 50  # queued batches were coalesced into fewer apply calls
    assert all(before <= now <= time.monotonic() for _, _, now in index.calls)
    labels = {"engine": "sglang", "type": "removed", "status": "applied"}
    assert sample(metrics, "kvlb_events_applied_total", labels) == 50
    assert sample(metrics, "kvlb_index_skipped_total", {"reason": "unknown_removal"}) == len(index.calls)
    lag = sample(metrics, "kvlb_events_lag_seconds", {"replica": R1})
    assert 0.5 <= lag < 5.0


async def test_overflow_drops_the_backlog_and_resyncs_each_rank() -> None:
    index, metrics = RecordingIndex(), Metrics.create()
    settings = IngestSettings(queue_max_batches=3)
    pipeline = ReplicaPipeline(R1, "sglang", index, metrics=metrics, settings=settings)  # type: ignore[arg-type]
    pipeline.offer(removed(1, rank=0))
    pipeline.offer(removed(2, rank=2))
    pipeline.offer(removed(3, rank=0))
    pipeline.offer(removed(4, rank=1))  # full: everything queued so far and this batch go
    assert pipeline.queued_batches == 1
    pipeline.offer(removed(5, rank=0))  # after the overflow, batches queue normally
    await run_until_applied(pipeline, 2)
    assert index.events() == [
        Resync(0, "overflow"),
        Resync(1, "overflow"),
        Resync(2, "overflow"),
        Removed(0, (EngineHash(5),)),
    ]
    assert pipeline.overflows == 1
    assert sample(metrics, "kvlb_events_queue_overflow_total", {"replica": R1}) == 1
    assert sample(metrics, "kvlb_events_resyncs_total", {"replica": R1, "reason": "overflow"}) == 3


async def test_an_event_over_max_event_blocks_is_dropped_and_its_rank_resyncs() -> None:
    """Issue #17 defect 1: one huge ``Stored`` (or ``Removed``) never reaches the index."""
    index, metrics = RecordingIndex(), Metrics.create()
    settings = IngestSettings(max_event_blocks=4)
    pipeline = ReplicaPipeline(R1, "sglang", index, metrics=metrics, settings=settings)  # type: ignore[arg-type]
    fits = Stored(0, None, tuple(EngineHash(h) for h in range(4)), bytes(4 * 16 * 4), 16)
    too_long = Stored(1, None, tuple(EngineHash(h) for h in range(5)), bytes(5 * 16 * 4), 16)
    padded = Stored(2, None, (EngineHash(9),), bytes(5 * 16 * 4), 16)  # few hashes, many tokens
    pipeline.offer(IngestBatch((fits, too_long, padded, Removed(3, tuple(map(EngineHash, range(5)))))))
    await run_until_applied(pipeline, 1)
    assert index.events() == [fits, Resync(1, "oversize"), Resync(2, "oversize"), Resync(3, "oversize")]
    assert sample(metrics, "kvlb_events_oversize_total", {"replica": R1}) == 3
    assert sample(metrics, "kvlb_events_resyncs_total", {"replica": R1, "reason": "oversize"}) == 3


def stored(rank: int, tokens: int) -> IngestBatch:
    return IngestBatch((Stored(rank, None, (EngineHash(tokens),), bytes(4 * tokens), tokens),))


async def test_the_queue_is_bounded_in_bytes_too() -> None:
    """Three batches of ~40 kB fit 100 kB of queue; the fourth overflows it (backlog → resyncs),
    and the bytes counted go back to the resync's size, then to 0 once applied."""
    index, metrics = RecordingIndex(), Metrics.create()
    settings = IngestSettings(queue_max_batches=1000, queue_max_bytes=100_000)
    pipeline = ReplicaPipeline(R1, "sglang", index, metrics=metrics, settings=settings)  # type: ignore[arg-type]
    one = batch_bytes(stored(0, 8000).events)
    assert 32_000 < one < 33_000
    pipeline.offer(stored(0, 8000))
    pipeline.offer(stored(1, 8000))
    pipeline.offer(stored(0, 8000))
    assert pipeline.queued_batches == 3 and pipeline.queued_bytes == 3 * one
    pipeline.offer(stored(2, 8000))  # 4 × 32 kB > 100 kB: overflow
    assert pipeline.queued_batches == 1 and pipeline.overflows == 1
    assert pipeline.queued_bytes == batch_bytes([Resync(0, "overflow")] * 3)
    pipeline.offer(stored(0, 200_000))  # one batch over the bound on its own: resync at once
    assert pipeline.overflows == 2 and pipeline.queued_batches == 1
    await run_until_applied(pipeline, 1)
    assert index.events() == [Resync(0, "overflow"), Resync(1, "overflow"), Resync(2, "overflow")]
    assert pipeline.queued_bytes == 0


def test_the_ingest_status_shows_the_queued_bytes() -> None:
    """``/admin/replicas`` shows each replica's queued bytes (``events.queued_bytes``)."""
    ingest = EventIngest(RecordingIndex(), metrics=Metrics.create())  # type: ignore[arg-type]
    pipeline = ingest.add_replica(R1, "sglang", [])
    assert ingest.status()[R1].queued_bytes == 0
    pipeline.offer(stored(0, 8000))
    pipeline.offer(stored(1, 100))
    expected = batch_bytes(stored(0, 8000).events) + batch_bytes(stored(1, 100).events)
    assert ingest.status()[R1].queued_bytes == pipeline.queued_bytes == expected
    assert ingest.status()[R1].queued_batches == 2


async def test_failed_apply_is_survived_and_its_ranks_resync() -> None:
    index, metrics = RecordingIndex(), Metrics.create()
    index.fail_next = 1
    pipeline = ReplicaPipeline(R1, "trtllm", index, metrics=metrics)  # type: ignore[arg-type]
    task = asyncio.create_task(pipeline.run())
    try:
        pipeline.offer(removed(1, rank=3))
        await eventually(lambda: pipeline.apply_errors == 1)
        pipeline.offer(removed(2, rank=0))
        await eventually(lambda: pipeline.applied_batches == 1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert index.events() == [Resync(3, "stale"), Removed(0, (EngineHash(2),))]
    labels = {"engine": "trtllm", "type": "batch", "status": "error"}
    assert sample(metrics, "kvlb_events_applied_total", labels) == 1


class ScriptedSource:
    """Test double of an EventSource: emits its batches, then waits to be cancelled."""

    def __init__(self, replica: ReplicaId, batches: list[IngestBatch]) -> None:
        self.replica = replica
        self.batches = batches
        self.cancelled = False

    async def run(self, emit: Emit) -> None:
        for batch in self.batches:
            emit(batch)
            await asyncio.sleep(0)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def status(self) -> SourceStatus:
        return SourceStatus(
            "scripted", self.replica, "-", 0, None, None, len(self.batches), 0, 0, 0, 0, 0, 0, 0
        )


async def test_ingest_owns_and_cancels_every_task() -> None:
    index, metrics = RecordingIndex(), Metrics.create()
    ingest = EventIngest(index, metrics=metrics)  # type: ignore[arg-type]
    first = ScriptedSource(R1, [removed(n) for n in range(3)])
    ingest.add_replica(R1, "sglang", [first])
    with pytest.raises(ValueError, match="already"):
        ingest.add_replica(R1, "sglang", [])
    await ingest.start()
    second = ScriptedSource(R2, [removed(7, rank=1)])
    ingest.add_replica(R2, "vllm", [second])  # added while running: starts at once
    await eventually(lambda: len(index.events(R1)) == 3 and len(index.events(R2)) == 1)
    status = ingest.status()
    assert status[R1].applied_batches >= 1 and status[R1].sources[0].messages == 3
    assert status[R2].engine == "vllm"

    await ingest.remove_replica(R2)
    assert second.cancelled and index.dropped == [R2]
    assert set(ingest.status()) == {R1}

    tasks_before = {t for t in asyncio.all_tasks() if t.get_name().startswith("kvlb-")}
    assert len(tasks_before) == 2
    await ingest.aclose()
    assert first.cancelled
    assert all(t.done() for t in tasks_before)
    assert not {t for t in asyncio.all_tasks() if t.get_name().startswith("kvlb-") and not t.done()}


async def test_a_drain_cancelled_midway_still_cancels_the_applier() -> None:
    """A lease hand-over that times out cancels ``remove_replica`` while it drains. The replica has
    left the ingest's table by then, so nothing else would ever cancel its applier."""
    index = RecordingIndex()
    index.gate = asyncio.Event()  # every apply waits: the drain cannot finish
    ingest = EventIngest(index, metrics=Metrics.create())  # type: ignore[arg-type]
    ingest.add_replica(R1, "sglang", [ScriptedSource(R1, [removed(n) for n in range(3)])])
    await ingest.start()
    (applier,) = [t for t in asyncio.all_tasks() if t.get_name() == f"kvlb-apply-{R1}"]
    pipeline = ingest.pipeline(R1)
    assert pipeline is not None
    await eventually(lambda: pipeline.queued_batches > 0 or pipeline._busy)
    removing = asyncio.create_task(ingest.remove_replica(R1, drain_s=30.0))
    await asyncio.sleep(0.05)
    assert not removing.done()  # draining
    removing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await removing
    assert applier.done()
    await ingest.aclose()


async def test_the_ingest_thread_cancels_what_is_left_on_its_loop_at_stop() -> None:
    """A task an owner failed to end (its cancelled call returned on the caller's loop before the
    cleanup on the ingest loop ran) is cancelled and awaited when the thread stops, not destroyed
    pending with the loop."""
    thread = IngestThread("kvlb-test-leftovers")
    await thread.start()
    left: list[asyncio.Task[None]] = []

    async def leave_one() -> None:
        left.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600), name="kvlb-left"))

    await thread.call(leave_one)
    await thread.stop()
    (task,) = left
    assert task.done() and task.cancelled()


def test_settings_validation() -> None:
    from balancer.errors import ConfigError

    with pytest.raises(ConfigError):
        IngestSettings(queue_max_batches=0).validate()
    with pytest.raises(ConfigError):
        IngestSettings(coalesce_max_batches=0).validate()


async def test_build_sources_per_engine() -> None:
    import aiohttp
    import zmq.asyncio

    from balancer.config import LimitConfig, ReplicaConfig
    from balancer.errors import ConfigError
    from balancer.sources.build import build_sources, poll_settings_for, zmq_settings_for
    from balancer.sources.trtllm_poll import TrtllmPoller
    from balancer.sources.zmq_settings import ZmqSourceSettings
    from balancer.sources.zmq_sub import ZmqEventSource

    ctx = zmq.asyncio.Context()
    try:
        async with aiohttp.ClientSession() as session:
            common = {"zmq_ctx": ctx, "session": session, "metrics": Metrics.create()}
            sgl = ReplicaConfig(
                id="s", url="http://h:1", events="tcp://h:5557", replay="tcp://h:6000", dp_size=3, topic="kv"
            )
            sources = build_sources(sgl, **common)  # type: ignore[arg-type]
            assert all(isinstance(s, ZmqEventSource) for s in sources)
            zmq_sources = [s for s in sources if isinstance(s, ZmqEventSource)]
            assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic) for s in zmq_sources] == [
                (0, "tcp://h:5557", "tcp://h:6000", b"kv"),
                (1, "tcp://h:5558", "tcp://h:6001", b"kv"),
                (2, "tcp://h:5559", "tcp://h:6002", b"kv"),
            ]
            assert build_sources(ReplicaConfig(id="v", url="http://h:1", engine="vllm"), **common) == []  # type: ignore[arg-type]
            trt = build_sources(ReplicaConfig(id="t", url="http://h:2/", engine="trtllm"), **common)  # type: ignore[arg-type]
            assert len(trt) == 1 and isinstance(trt[0], TrtllmPoller)
            assert trt[0].url == "http://h:2/kv_cache_events"
            # limits.event_message_bytes caps a ZMQ message and a TRT-LLM drain body alike
            limits = LimitConfig(event_message_bytes=4096)
            sized = {
                **common,
                "zmq_settings": zmq_settings_for(limits),
                "poll_settings": poll_settings_for(limits),
            }
            (sub,) = build_sources(ReplicaConfig(id="s1", url="http://h:1", events="tcp://h:5557"), **sized)  # type: ignore[arg-type]
            (poller,) = build_sources(ReplicaConfig(id="t1", url="http://h:2/", engine="trtllm"), **sized)  # type: ignore[arg-type]
            assert isinstance(sub, ZmqEventSource) and sub.settings.max_message_bytes == 4096
            assert isinstance(poller, TrtllmPoller) and poller.settings.max_body_bytes == 4096
            assert sub.settings.max_backlog_bytes == 32 * 1024 * 1024  # the default read-ahead bound
            # a message bound above the read-ahead's default raises the read-ahead's with it
            big = zmq_settings_for(LimitConfig(event_message_bytes=64 * 1024 * 1024))
            assert big.max_backlog_bytes == big.max_message_bytes == 64 * 1024 * 1024
            big.validate()
            with pytest.raises(ConfigError, match="max_backlog_bytes"):
                ZmqSourceSettings(max_message_bytes=4096, max_backlog_bytes=4095).validate()
    finally:
        ctx.destroy(linger=0)
