"""An engine configured differently from its replica entry, on real sockets: the emulated engines
(``replicas.sim``) and the test publisher (:mod:`zmq_rig`) in front of the real sources. Each mistake
an operator makes on the engine side must be said once in the log (then once a minute at most), and
in the source's ``last_error`` (``/admin/replicas``) with the fix, not only counted.

* the engine's page size differs from the replica's ``block_size`` (SGLang larger, TRT-LLM smaller:
  until 2026-12-01 a TRT-LLM engine with smaller blocks had every block taken as a partial one and
  dropped without a word);
* the events endpoint is the engine's replay ROUTER (the two endpoints swapped);
* nothing listens on the events endpoint (a wrong port, events off), then the engine comes;
* ``GET /admin/replicas`` of a real balancer names the block size fix on the one replica whose
  entry is wrong;
* two replicas given one engine's events endpoint: ``kvlb serve`` refuses the config;
* a vLLM engine serving another model name than its pool's leaves routing, and comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import waiting
import zmq.asyncio
from emulated_replica import started
from kvlb_harness import MODEL, metric_value, replica_entry, wait_ready
from procs_free import free_port
from recording_index import RecordingIndex
from settings_tree import settings_from
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    REPLICA,
    Publisher,
    ctx_fixture,
    page,
    publisher_fixture,
    running,
)

from balancer.app import Balancer
from balancer.cli.command import replicas_table
from balancer.engines.registry import engine_spec
from balancer.engines.sglang import SglangDecoder
from balancer.engines.trtllm import SPEC as TRTLLM_SPEC
from balancer.engines.trtllm import TrtllmDecoder
from balancer.events import Stored
from balancer.health.book import HealthBook
from balancer.health.prober import HealthProber, ProbeSettings
from balancer.load.scraper import MetricsScraper
from balancer.metrics import Metrics
from balancer.sources.base import EventSource
from balancer.sources.pipeline import EventIngest
from balancer.sources.trtllm_poll import PollSettings, TrtllmPoller
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.faults import FaultSettings
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

TRTLLM_DRAIN_PATH = TRTLLM_SPEC.drain_path or ""

LOGGER = "balancer.sources"
eventually = functools.partial(waiting.eventually, timeout_s=10.0, poll_s=0.01)


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(LOGGER) and r.levelno == logging.WARNING and text in r.getMessage()
    ]


@contextlib.asynccontextmanager
async def ingesting(source: EventSource, engine: str) -> AsyncIterator[RecordingIndex]:
    index = RecordingIndex(REPLICA)
    ingest = EventIngest(index, metrics=Metrics.create())  # type: ignore[arg-type]
    ingest.add_replica(REPLICA, engine, [source])
    await ingest.start()
    try:
        yield index
    finally:
        await ingest.aclose()


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def test_an_sglang_page_size_other_than_the_replicas_block_size_is_said_with_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    http, events, replay = free_port(), free_port(), free_port()
    zctx = zmq.asyncio.Context()
    config = ReplicaConfig(
        name="sgl",
        engine="sglang",
        profile=get_profile("cpu-test"),
        time_scale=20.0,
        page_size=8,  # the engine's page size; the replica entry below says 4
        http_port=http,
        event_port=events,
        replay_port=replay,
    )
    source = ZmqEventSource(
        REPLICA,
        f"tcp://127.0.0.1:{events}",
        ctx=zctx,
        decoder=SglangDecoder(block_size=4),
        metrics=Metrics.create(),
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
    )
    try:
        async with started(config, zctx) as replica, ingesting(source, "sglang") as index:
            async with aiohttp.ClientSession() as session:
                for start in (100, 300, 500):
                    await complete(session, replica.url, list(range(start, start + 33)))
                await eventually(lambda: source.status().decode_errors >= 3)
            status = source.status()
            assert status.connected is True
            assert status.last_error is not None
            assert "block_size 8 != this replica's block_size 4" in status.last_error, status.last_error
            assert "set the replica's block_size to 8" in status.last_error
            assert not any(isinstance(event, Stored) for event in index.events)
            said = warnings_of(caplog, "set the replica's block_size to 8")
            assert len(said) == 1, said  # once, then once a minute at most
            assert "replica sgl-0" in said[0]
    finally:
        zctx.destroy(linger=0)


async def test_a_trtllm_engine_with_smaller_blocks_is_not_silently_all_partial(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    port = free_port()
    zctx = zmq.asyncio.Context()
    config = ReplicaConfig(
        name="trt",
        engine="trtllm",
        profile=get_profile("cpu-test"),
        time_scale=20.0,
        page_size=8,  # the engine's tokens_per_block; the replica entry below says 16
        http_port=port,
    )
    settings = PollSettings(min_interval_s=0.005, max_interval_s=0.05)
    try:
        async with started(config, zctx) as replica, aiohttp.ClientSession() as session:
            source = TrtllmPoller(
                REPLICA,
                replica.url,
                path=TRTLLM_DRAIN_PATH,
                session=session,
                decoder=TrtllmDecoder(tokens_per_block=16),
                metrics=Metrics.create(),
                settings=settings,
            )
            async with ingesting(source, "trtllm") as index:
                await complete(session, replica.url, list(range(100, 133)))
                await eventually(lambda: source.status().decode_errors >= 1, seen=source.status)
                status = source.status()
                assert status.last_error is not None
                assert "tokens_per_block 16" in status.last_error, status.last_error
                assert "set the replica's block_size to the engine's" in status.last_error
                assert not any(isinstance(event, Stored) for event in index.events)
                assert len(warnings_of(caplog, "tokens_per_block 16")) == 1
    finally:
        zctx.destroy(linger=0)


async def test_events_and_replay_swapped_is_said_and_retried_with_backoff(
    ctx: zmq.asyncio.Context, publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    async with running(ctx, publisher.replay_endpoint, publisher.endpoint) as rig:
        await eventually(lambda: rig.source.status().last_error is not None)
        await asyncio.sleep(0.5)
        status = rig.source.status()
        assert status.connected is False
        assert status.last_error is not None and "refused the ZMQ handshake" in status.last_error
        assert "swapped" in status.last_error
        # the rig's backoff is 0.01 s doubling to 0.1 s: a few attempts, not a hot loop
        assert 1 <= status.transport_errors <= 20, status.transport_errors
        assert status.replays == 0  # no catch-up asked of a peer that is no publisher
        assert len(warnings_of(caplog, "refused the ZMQ handshake")) == 1
        assert not warnings_of(caplog, "disconnected")


async def test_nothing_on_the_events_port_is_said_once_then_the_engine_comes(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    port, replay_port = free_port(), free_port()
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    async with running(ctx, endpoint, replay) as rig:
        await eventually(lambda: rig.source.status().last_error is not None)
        await asyncio.sleep(0.5)  # ZMQ retries every 0.1 s meanwhile
        status = rig.source.status()
        assert status.connected is False
        assert status.last_error is not None
        assert f"nothing accepts connections at {endpoint}" in status.last_error
        said = warnings_of(caplog, "nothing accepts connections")
        assert len(said) == 1, said
        publisher = Publisher(ctx, port=port, replay_port=replay_port)  # the engine starts
        try:
            await publisher.wait_subscribed()
            await eventually(lambda: rig.source.status().connected is True)
            await publisher.pages(3)
            await rig.settle(2)
            assert rig.index.pages() == [1, 2, 3]
            assert any("connected to the publisher" in r.getMessage() for r in caplog.records)
        finally:
            await publisher.aclose()


async def test_admin_replicas_names_the_block_size_fix_of_the_one_replica_misconfigured() -> None:
    """Two emulated SGLang engines with pages of 8 behind a real balancer; the operator wrote
    ``block_size: 4`` for one of them: ``GET /admin/replicas`` says so on that replica only."""
    zctx = zmq.asyncio.Context()
    replicas: list[Replica] = []
    balancer: Balancer | None = None
    try:
        for name in ("r0", "r1"):
            config = ReplicaConfig(name=name, engine="sglang", profile=get_profile("cpu-test"), page_size=8)
            replica = Replica(config, TokenIdTokenizer(), zctx)
            await replica.start()
            replicas.append(replica)
        entries = [replica_entry(r) for r in replicas]
        entries[0]["block_size"] = 4
        tree = {"listen": {"host": "127.0.0.1", "port": 0}, "pools": [{"model": MODEL, "replicas": entries}]}
        balancer = Balancer(settings_from(tree, {}), tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            for replica in replicas:  # straight to each engine: both caches get the same prompt
                await complete(session, replica.url, list(range(100, 133)))

            async def views() -> dict[str, dict[str, object]]:
                async with session.get(balancer.url + "/admin/replicas") as response:
                    assert response.status == 200
                    return {v["id"]: v["events"]["sources"][0] for v in (await response.json())["replicas"]}

            seen: dict[str, dict[str, object]] = {}
            for _ in range(500):
                seen = await views()
                if seen["r0"]["last_error"] and seen["r1"]["last_event_wall_ts"]:
                    break
                await asyncio.sleep(0.02)
            assert "set the replica's block_size to 8" in str(seen["r0"]["last_error"]), seen
            assert isinstance(seen["r0"]["last_error_age_s"], float)
            assert seen["r1"]["last_error"] is None and seen["r1"]["connected"] is True
    finally:
        if balancer is not None:
            await balancer.stop()
        for replica in reversed(replicas):
            await replica.stop()
        zctx.destroy(linger=0)


def test_kvlb_serve_refuses_two_replicas_on_one_engines_events(tmp_path: Path) -> None:
    """A copied replica entry that kept the first one's events endpoint: before 2026-12-01 both
    replicas subscribed to the one engine and each was credited its blocks (the second then chosen
    for hits its engine never had). ``kvlb serve`` now refuses the config in one line, exit 2."""
    path = tmp_path / "kvlb.yaml"
    path.write_text(
        "listen: {host: 127.0.0.1, port: 0}\n"
        "pools:\n"
        "  - model: m\n"
        "    replicas:\n"
        "      - {id: sgl-0, url: 'http://127.0.0.1:9', events: 'tcp://127.0.0.1:5557'}\n"
        "      - {id: sgl-1, url: 'http://127.0.0.1:9', events: 'tcp://127.0.0.1:5557'}\n"
    )
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVLB_")}
    done = subprocess.run(
        [sys.executable, "-m", "balancer", "serve", "--workers", "1", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "kvlb serve: replica sgl-1 rank 0 events endpoint tcp://127.0.0.1:5557 is also replica sgl-0 "
        "rank 0 events's: each engine rank publishes on its own ports (rank r on port + r), so one "
        "engine's events would be credited to two replicas; check the replicas' events, replay and dp_size"
    ]


async def test_an_engine_of_another_kind_than_configured_is_named_as_the_suspect() -> None:
    """An SGLang engine entered as ``engine: trtllm`` and a TRT-LLM one as ``engine: sglang``: the
    drain's 404 said only *KV events are off on the engine* and the load scrape *body is not JSON*
    or *no sglang:num_running_reqs*; both now say the replica's engine may be the wrong kind."""
    zctx = zmq.asyncio.Context()
    sglang = ReplicaConfig(name="sgl", engine="sglang", profile=get_profile("cpu-test"), page_size=16)
    trtllm = ReplicaConfig(name="trt", engine="trtllm", profile=get_profile("cpu-test"), page_size=16)
    try:
        async with (
            started(sglang, zctx) as sgl,
            started(trtllm, zctx) as trt,
            aiohttp.ClientSession() as session,
        ):
            poller = TrtllmPoller(
                REPLICA,
                sgl.url,
                path=TRTLLM_DRAIN_PATH,
                session=session,
                decoder=TrtllmDecoder(16),
                metrics=Metrics.create(),
            )
            await poller.poll_once(lambda batch: None)
            assert poller.status().disabled
            assert "or it is not a TRT-LLM server (check the replica's engine)" in str(
                poller.status().last_error
            )
            for engine, replica in (("trtllm", sgl), ("sglang", trt)):
                scraper = MetricsScraper(
                    REPLICA,
                    replica.url,
                    engine,
                    engine_spec(engine).scrape_targets,
                    session=session,
                    observe=lambda *args: None,
                    metrics=Metrics.create(),
                )
                assert await scraper.scrape_and_observe() is None
                error = str(scraper.status().last_error)
                assert f"is the replica's engine {engine}?" in error, error
    finally:
        zctx.destroy(linger=0)


async def test_an_engine_that_publishes_nothing_while_it_serves_gets_a_hint() -> None:
    """An engine publishing on another topic than the replica's (a SUB drops those silently; no
    replay socket to poll): connected, no error, no batch. Before 2026-12-01 ``/admin/replicas``
    showed ``messages: 0`` and nothing else; once the replica has answered 8 requests it now says
    the engine publishes nothing, and why that happens (prefix cache off, another topic). The same
    engine behind a replica with the right topic (another pool) gets no hint."""
    zctx = zmq.asyncio.Context()
    replicas: list[Replica] = []
    balancer: Balancer | None = None
    try:
        for name in ("r0", "r1"):
            config = ReplicaConfig(
                name=name, engine="sglang", profile=get_profile("cpu-test"), page_size=8, topic="kv-events"
            )
            replica = Replica(config, TokenIdTokenizer(), zctx)
            await replica.start()
            replicas.append(replica)
        entries = [replica_entry(r) for r in replicas]
        for entry in entries:
            del entry["replay"]  # nothing to poll: the live stream is all there is
        entries[0]["topic"] = "kv_events"  # the operator's typo
        entries[1]["topic"] = "kv-events"
        pools = [{"model": "typo", "replicas": [entries[0]]}, {"model": "right", "replicas": [entries[1]]}]
        tree = {"listen": {"host": "127.0.0.1", "port": 0}, "pools": pools}
        tokenizers = {"typo": TokenIdTokenizer(), "right": TokenIdTokenizer()}
        balancer = Balancer(settings_from(tree, {}), tokenizers=tokenizers)
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            for model in ("typo", "right"):
                for start in range(0, 8 * 40, 40):
                    body = {"model": model, "prompt": list(range(start, start + 33)), "max_tokens": 1}
                    async with session.post(balancer.url + "/v1/completions", json=body) as response:
                        assert response.status == 200, await response.text()
            views: dict[str, dict[str, Any]] = {}
            for _ in range(250):  # the right one's batches may still be on their way
                async with session.get(balancer.url + "/admin/replicas") as response:
                    views = {v["id"]: v for v in (await response.json())["replicas"]}
                if views["r1"]["events"]["sources"][0]["last_event_wall_ts"] is not None:
                    break
                await asyncio.sleep(0.02)
            silent = views["r0"]["events"]
            assert views["r0"]["prediction"]["receipts"] == 8
            assert silent["sources"][0]["connected"] is True and silent["sources"][0]["last_error"] is None
            assert "no KV event batch from the engine since kvlb connected" in str(silent["hint"]), silent
            assert "another topic" in str(silent["hint"])
            assert views["r1"]["prediction"]["receipts"] == 8
            assert views["r1"]["events"]["hint"] is None, views["r1"]["events"]
    finally:
        if balancer is not None:
            await balancer.stop()
        for replica in reversed(replicas):
            await replica.stop()
        zctx.destroy(linger=0)


async def test_a_publisher_of_another_dp_rank_than_its_port_says_is_in_last_error(
    ctx: zmq.asyncio.Context, publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    """The source of rank 1 (port + 1) hears a publisher whose envelope says rank 0 (the replica's
    ``events`` port one too low, or ``dp_size`` unlike the engine's): its events go to rank 0. It
    was one warning per source's life; ``last_error`` now keeps it for ``/admin/replicas``."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, dp_rank=1) as rig:
        await publisher.wait_subscribed()
        await publisher.pages(3)
        await rig.settle(2)
        status = rig.source.status()
        assert status.last_error is not None
        assert "says data_parallel_rank 0, this source is rank 1" in status.last_error, status.last_error
        assert len(warnings_of(caplog, "says data_parallel_rank 0")) == 1


async def test_an_engine_clock_ahead_of_kvlbs_is_said_once(
    ctx: zmq.asyncio.Context, publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    """Batches stamped 30 s in kvlb's future (the engine's clock ahead): the lag gauge goes negative
    and would hide up to 30 s of real lag from ``KvlbIndexLagging``; the console showed 0. It is now
    a warning (once, then once a minute) naming the skew."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint) as rig:
        await publisher.wait_subscribed()
        for seq in range(3):
            payload = msgpack.packb([time.time() + 30.0, [page(seq)], 0])
            publisher.buffer.append((seq, payload))
            await publisher.pub.send_multipart([publisher.topic, seq.to_bytes(8, "big"), payload])
        await rig.settle(2)
        lag = rig.ingest.status()[REPLICA].last_lag_s
        assert lag is not None and -31.0 < lag < -29.0, lag
        said = warnings_of(caplog, "in kvlb's future")
        assert len(said) == 1, said
        assert "the engine's clock is ahead of kvlb's" in said[0], said


async def test_an_engine_serving_another_model_name_than_its_pool_leaves_routing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two emulated vLLM engines behind a real balancer, pool ``sim-test``; r0 serves ``llama-3``
    (its ``--served-model-name``): vLLM answers every request for ``sim-test`` 404 while its probes
    pass. Until 2026-12-01 it was a warning and r0 stayed routable (its share of the requests got
    404). It is now out of routing with its reason in ``/admin/replicas``, ``POST /admin/explain``'s
    ``left_out`` and ``kvlb admin replicas --table``; every request is served by r1; once the engine
    serves the pool's model (the fault cleared, no failed probe in between) it comes back."""
    caplog.set_level(logging.INFO, logger="balancer.health")
    zctx = zmq.asyncio.Context()
    replicas: list[Replica] = []
    balancer: Balancer | None = None
    try:
        for name, faults in (("r0", FaultSettings(served_model="llama-3")), ("r1", FaultSettings())):
            config = ReplicaConfig(
                name=name, engine="vllm", profile=get_profile("cpu-test"), page_size=16, faults=faults
            )
            replica = Replica(config, TokenIdTokenizer(), zctx)
            await replica.start()
            replicas.append(replica)
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [{"model": MODEL, "replicas": [replica_entry(r) for r in replicas]}],
            "health_interval_s": 0.2,
        }
        balancer = Balancer(settings_from(tree, {}), tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            body = {"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 1}
            async with session.post(replicas[0].url + "/v1/completions", json=body) as response:
                assert response.status == 404  # the engine itself refuses the pool's name

            async def views() -> dict[str, dict[str, Any]]:
                async with session.get(balancer.url + "/admin/replicas") as response:
                    assert response.status == 200
                    return {v["id"]: v for v in (await response.json())["replicas"]}

            seen = await views()
            assert seen["r0"]["routable"] is False and seen["r0"]["unroutable"] == "serves another model"
            mismatch = str(seen["r0"]["health"]["model_mismatch"])
            assert "['llama-3']" in mismatch and "--served-model-name" in mismatch, mismatch
            assert seen["r1"]["routable"] is True and seen["r1"]["unroutable"] is None
            table = replicas_table(list(seen.values()))
            assert "no:wrong-model" in table and f"r0: {mismatch}" in table, table
            async with session.post(balancer.url + "/admin/explain", json=body) as response:
                assert response.status == 200
                assert (await response.json())["left_out"] == {"r0": "serves another model"}
            async with session.get(balancer.url + "/metrics") as response:
                text = await response.text()
            assert metric_value(text, "kvlb_replica_model_mismatch", replica="r0") == 1
            assert metric_value(text, "kvlb_replica_model_mismatch", replica="r1") == 0
            assert metric_value(text, "kvlb_replica_healthy", replica="r0") == 0
            for start in range(0, 400, 40):
                body = {"model": MODEL, "prompt": list(range(start, start + 39)), "max_tokens": 1}
                async with session.post(balancer.url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
            said = [r.getMessage() for r in caplog.records if "is out of routing" in r.getMessage()]
            assert len(said) == 1, said
            assert said[0].startswith("replica r0 is out of routing: the engine serves"), said
            lines = [r.getMessage() for r in caplog.records]  # its passing probe: not "healthy"
            assert "replica r0 is healthy" not in lines and "replica r1 is healthy" in lines, lines
            probe = f"replica r0 answers its health probe but stays out of routing: {mismatch}"
            assert lines.count(probe) == 1, lines

            async with session.post(
                replicas[0].url + "/admin/faults", json={"served_model": None}
            ) as response:
                assert response.status == 200
            for _ in range(100):  # a probe period is 0.2 s
                seen = await views()
                if seen["r0"]["routable"]:
                    break
                await asyncio.sleep(0.05)
            assert seen["r0"]["routable"] is True, seen["r0"]
            assert seen["r0"]["health"]["model_mismatch"] is None, seen["r0"]
            assert any("back in routing" in r.getMessage() for r in caplog.records)
            async with session.post(balancer.url + "/admin/explain", json=body) as response:
                assert (await response.json())["left_out"] == {}
            async with session.get(balancer.url + "/metrics") as response:
                assert metric_value(await response.text(), "kvlb_replica_model_mismatch", replica="r0") == 0
    finally:
        if balancer is not None:
            await balancer.stop()
        for replica in reversed(replicas):
            await replica.stop()
        zctx.destroy(linger=0)


async def test_an_engine_renamed_without_failing_a_probe_leaves_routing_at_the_next_recheck() -> None:
    """The engine's list is read again every ``models_recheck_s`` while it serves the pool's model:
    renamed between two probes (no failed probe, no turn to healthy), it leaves routing at the first
    good probe past that period, and comes back at the first one after it serves the name again."""
    zctx = zmq.asyncio.Context()
    config = ReplicaConfig(name="vllm", engine="vllm", profile=get_profile("cpu-test"), page_size=16)
    clock = [100.0]
    try:
        async with started(config, zctx) as replica, aiohttp.ClientSession() as session:
            book = HealthBook()
            book.add(REPLICA)
            prober = HealthProber(
                REPLICA,
                replica.url,
                session=session,
                health=book,
                settings=ProbeSettings(models_recheck_s=30.0),
                model=MODEL,
                monotonic=lambda: clock[0],
            )
            assert await prober.probe_once() and book.routable(clock[0]) == [REPLICA]

            async def rename(name: str | None) -> None:
                async with session.post(replica.url + "/admin/faults", json={"served_model": name}) as r:
                    assert r.status == 200

            await rename("llama-3")
            clock[0] += 20.0  # not due yet: still routable (its requests would get 404)
            assert await prober.probe_once() and book.routable(clock[0]) == [REPLICA]
            clock[0] += 15.0  # 35 s since the last read
            assert await prober.probe_once()
            assert book.routable(clock[0]) == []
            assert book.unroutable_reason(REPLICA, clock[0]) == "serves another model"
            await rename(None)
            clock[0] += 2.0  # read at every probe while it serves another model
            assert await prober.probe_once() and book.routable(clock[0]) == [REPLICA]
    finally:
        zctx.destroy(linger=0)


async def test_the_models_recheck_period_is_the_setting() -> None:
    """``health_models_recheck_s`` reaches the balancer's probers: with 1 s, a vLLM engine renamed
    without failing a probe leaves routing within a few seconds (its requests would get 404), and
    comes back once it serves the pool's name again. Until 2026-12-01 the period was the prober's
    constant 30 s whatever the settings said."""
    zctx = zmq.asyncio.Context()
    balancer: Balancer | None = None
    config = ReplicaConfig(name="r0", engine="vllm", profile=get_profile("cpu-test"), page_size=16)
    replica = Replica(config, TokenIdTokenizer(), zctx)
    try:
        await replica.start()
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [{"model": MODEL, "replicas": [replica_entry(replica)]}],
            "health_interval_s": 0.2,
            "health_models_recheck_s": 1.0,
        }
        balancer = Balancer(settings_from(tree, {}), tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)

            async def routable() -> bool:
                async with session.get(balancer.url + "/admin/replicas") as response:
                    assert response.status == 200
                    return bool((await response.json())["replicas"][0]["routable"])

            async def rename(name: str | None) -> None:
                async with session.post(replica.url + "/admin/faults", json={"served_model": name}) as r:
                    assert r.status == 200

            async def settled(want: bool, within_s: float) -> None:
                started_at = time.monotonic()
                while time.monotonic() - started_at < within_s:
                    if await routable() is want:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"routable is not {want} within {within_s} s")

            assert await routable()
            await rename("llama-3")
            await settled(False, 6.0)  # 1 s + a probe period (+ a loaded machine's slack); 30 s before
            await rename(None)
            await settled(True, 6.0)
    finally:
        if balancer is not None:
            await balancer.stop()
        await replica.stop()
        zctx.destroy(linger=0)


async def test_only_the_vllm_emulator_refuses_a_model_it_does_not_serve() -> None:
    """The emulator models each engine's name check: vLLM answers a request for another model than
    it serves 404 (``The model `x` does not exist.``), SGLang and trtllm-serve answer any name."""
    zctx = zmq.asyncio.Context()
    try:
        for engine, refused in (("vllm", True), ("sglang", False), ("trtllm", False)):
            faults = FaultSettings(served_model="llama-3")
            config = ReplicaConfig(name=engine, engine=engine, profile=get_profile("cpu-test"), faults=faults)
            async with started(config, zctx) as replica, aiohttp.ClientSession() as session:
                async with session.get(replica.url + "/v1/models") as response:
                    assert [m["id"] for m in (await response.json())["data"]] == ["llama-3"]
                for model, status in ((MODEL, 404 if refused else 200), ("llama-3", 200)):
                    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 1}
                    async with session.post(replica.url + "/v1/completions", json=body) as response:
                        answer = await response.json()
                        assert response.status == status, (engine, model, answer)
                    if status == 404:
                        assert answer["error"]["message"] == f"The model `{MODEL}` does not exist."
    finally:
        zctx.destroy(linger=0)
