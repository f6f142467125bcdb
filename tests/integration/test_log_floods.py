"""Loops that meet the same failure on every turn log it once, then count it (issue #17, defect 7).

Real Redis, real balancer: a policy key overwritten with a string (``WRONGTYPE`` on every poll), then
a policy hash with an out-of-range weight, each give one warning however many polls see them, and
``kvlb_log_suppressed_total{cause="policy_invalid"}`` counts the rest. A replica whose lease is gone
(the real fenced writer refuses every batch) gives one line without a traceback, not one per batch.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis
from kvlb_harness import Harness, metric_value, running, shared_deepseek, wait_for
from redis_server import RedisServer, fresh_settings
from waiting import eventually

from balancer.events import Removed
from balancer.fleet.writer import FencedWriter
from balancer.index.hashing import BlockHasher
from balancer.index.redis.index import RedisIndex
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.pipeline import ReplicaPipeline
from balancer.types import EngineHash, ReplicaId

pytestmark = pytest.mark.redis

POLL_S = 0.05
POLICY_KEY = "kvlb:policy"


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def metrics_text(h: Harness) -> str:
    async with h.session.get(h.url + "/metrics") as response:
        return await response.text()


async def test_a_corrupt_shared_policy_is_repaired_or_logged_once_and_counted(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="balancer.fleet.policy_sync")
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        async with running(
            shared_deepseek(), 1, redis__url=redis_server.url, redis__policy_poll_s=POLL_S
        ) as h:

            async def seeded() -> bool:
                return bool(await client.hget(POLICY_KEY, "version"))

            await wait_for("the policy to be seeded into Redis", seeded)
            policy = await h.admin("GET", "/admin/policy")

            await client.set(POLICY_KEY, "not a hash")  # garbage of another type over the key

            async def repaired() -> bool:
                return await client.type(POLICY_KEY) == "hash" and bool(
                    await client.hget(POLICY_KEY, "version")
                )

            await wait_for("the garbage to be rewritten with the policy in force", repaired)
            await asyncio.sleep(20 * POLL_S)
            rewritten = lines(caplog, "held garbage: rewritten")
            assert len(rewritten) == 1, [r.getMessage() for r in rewritten]  # repaired once, not every poll
            assert not lines(caplog, "ignoring the policy stored in Redis")
            text = await metrics_text(h)
            assert metric_value(text, "kvlb_redis_wrongtype_keys_total") == 1
            assert not lines(caplog, "policy sync: redis error")  # Redis answered: it is not down
            async with h.session.get(h.url + "/readyz") as response:
                ready = await response.json()
            assert response.status == 200 and "degraded" not in ready, ready
            assert await h.admin("GET", "/admin/policy") == policy  # the policy in force is kept

            # a hash of the right type with content that is not a valid policy: reported once, counted
            await client.hset(POLICY_KEY, "weights", '{"prefill_weight": 1e308}')
            await asyncio.sleep(40 * POLL_S)
            warned = lines(caplog, "ignoring the policy stored in Redis")
            assert len(warned) == 1, [r.getMessage() for r in warned]
            assert "policy.prefill_weight must be in [0, 1000], got 1e+308" in warned[0].getMessage()
            suppressed = metric_value(
                await metrics_text(h), "kvlb_log_suppressed_total", cause="policy_invalid"
            )
            assert suppressed >= 10  # about 40 polls saw it; one line was written
            assert (await h.admin("GET", "/admin/policy"))["weights"] == policy["weights"]
    finally:
        await client.aclose()


async def test_a_lost_lease_logs_one_line_and_no_traceback_not_one_per_batch(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="balancer.sources.pipeline")
    replica = ReplicaId("r-lost")
    client = aioredis.Redis.from_url(redis_server.url)
    metrics = Metrics.create()
    lost: list[ReplicaId] = []
    index = RedisIndex(client, BlockHasher("flood", 4), fresh_settings())
    writer = FencedWriter(
        index, metrics=metrics, on_lost=lambda replica, generation: lost.append(replica)
    )  # holds no lease: refuses all
    pipeline = ReplicaPipeline(replica, "sglang", writer, metrics=metrics)
    task = asyncio.create_task(pipeline.run())
    try:
        for n in range(100):
            pipeline.offer(IngestBatch((Removed(0, (EngineHash(n),)),)))
            await asyncio.sleep(0)  # one apply per batch, as when batches trickle in
        await eventually(lambda: pipeline.queued_batches == 0 and pipeline.apply_errors >= 50)
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
    failed = lines(caplog, "index.apply failed")
    assert len(failed) == 1, [r.getMessage() for r in failed]
    assert failed[0].pathname.endswith("pipeline.py")  # the line names its caller, not the limiter
    assert "LeaseLostError" in failed[0].getMessage() and not failed[0].exc_info
    labels = {"cause": "index_apply_failed"}
    suppressed = metrics.registry.get_sample_value("kvlb_log_suppressed_total", labels)
    assert suppressed == pipeline.apply_errors - 1
