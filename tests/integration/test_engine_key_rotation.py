"""An engine key that rotates (``api_key_file`` rewritten while kvlb runs), on real sockets: an
emulated engine restarted with a new ``--api-key``, a real balancer in front of it.

* the file rotated as Kubernetes does it (the ``..data`` symlink swapped) or by a rename, then the
  engine restarted with the new key: requests succeed again within the poll period, and the scrape
  and probes use the new key too;
* with polling off, an engine's 401 alone makes kvlb re-read the file at once, also when the file
  is updated after the engine (the reads of an unchanged file back off, the checks do not);
* a bad new key (empty) is refused, counted once, and the old key is kept;
* the key is in no log line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
import zmq.asyncio
from emulated_replica import started
from key_dir import KeyDir
from kvlb_harness import MODEL, metric_value, replica_entry, wait_ready

from balancer.app import Balancer
from balancer.config import load
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

OLD = "sk-engine-old-3c1d"
NEW = "sk-engine-new-9a7e"
BODY = {"model": MODEL, "prompt": list(range(1, 65)), "max_tokens": 2, "temperature": 0}
RECOVERY_TIMEOUT_S = 8.0


def engine(kind: str, api_key: str) -> ReplicaConfig:
    return ReplicaConfig(
        name="keyed",
        engine=kind,  # type: ignore[arg-type]
        profile=get_profile("cpu-test"),
        time_scale=20.0,
        api_key=api_key,
    )


async def restarted(
    replica: Replica,
    api_key: str,
    zctx: zmq.asyncio.Context,
    while_down: Callable[[], Awaitable[None]] | None = None,
) -> Replica:
    """``replica`` stopped and a new one started on the same ports with ``api_key`` (after
    ``while_down``, when given)."""
    await replica.stop()
    if while_down is not None:
        await while_down()
    for attempt in range(40):  # ZMQ closes the old sockets in its own thread: their ports free soon
        fresh = Replica(dataclasses.replace(replica.config, api_key=api_key), TokenIdTokenizer(), zctx)
        try:
            await fresh.start()
            return fresh
        except zmq.ZMQError:
            await fresh.stop()
            if attempt == 39:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("unreachable")


async def post_status(session: aiohttp.ClientSession, url: str) -> int:
    async with session.post(url + "/v1/completions", json=BODY) as response:
        await response.read()
        return response.status


async def seconds_until_ok(session: aiohttp.ClientSession, url: str) -> float:
    """Seconds until a request succeeds (bounded), polling every 50 ms."""
    start = time.monotonic()
    async with asyncio.timeout(RECOVERY_TIMEOUT_S):
        while await post_status(session, url) != 200:  # noqa: ASYNC110 - polls another process
            await asyncio.sleep(0.05)
    return time.monotonic() - start


async def balancer_for(
    tmp_path: Path,
    entry: dict[str, Any],
    poll_s: float,
    health_interval_s: float = 0.1,
    scrape_interval_s: float = 0.1,
) -> Balancer:
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": [entry]}],
        "health_interval_s": health_interval_s,
        "scrape_interval_s": scrape_interval_s,
        "policy": {"name": "round_robin"},
        "upstream": {"api_key_poll_s": poll_s},
    }
    path = tmp_path / "kvlb.yaml"
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    balancer = Balancer(load(path, env={}), tokenizers={MODEL: TokenIdTokenizer()})
    await balancer.start()
    return balancer


async def metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as response:
        return await response.text()


async def until_view(
    session: aiohttp.ClientSession, url: str, holds: Callable[[dict[str, Any]], bool]
) -> None:
    """Wait (bounded) until the balancer's ``/admin/replicas`` view of its replica ``holds``."""
    async with asyncio.timeout(RECOVERY_TIMEOUT_S):
        while True:
            async with session.get(url + "/admin/replicas") as response:
                if holds((await response.json())["replicas"][0]):
                    return
            await asyncio.sleep(0.05)


async def until_metric(
    session: aiohttp.ClientSession, url: str, name: str, at_least: float, **labels: str
) -> None:
    """Wait (bounded) until the balancer's ``name`` sample reaches ``at_least``."""
    async with asyncio.timeout(RECOVERY_TIMEOUT_S):
        while metric_value(await metrics_text(session, url), name, **labels) < at_least:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(("kind", "how"), [("sglang", "swap"), ("sglang", "rename"), ("trtllm", "swap")])
async def test_a_rotated_key_file_is_taken_without_a_restart(
    tmp_path: Path, kind: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    keys = KeyDir(tmp_path, OLD)
    zctx = zmq.asyncio.Context()
    try:
        async with started(engine(kind, OLD), zctx) as first, aiohttp.ClientSession() as session:
            entry = {**replica_entry(first), "api_key_file": str(keys.path)}
            balancer = await balancer_for(tmp_path, entry, poll_s=0.2)
            replica = first
            try:
                await wait_ready(session, balancer.url)
                assert await post_status(session, balancer.url) == 200
                getattr(keys, how)(NEW)  # the Secret is updated first, the engine restarted after
                # the poll takes the new key
                await until_metric(session, balancer.url, "kvlb_upstream_api_key_rotations_total", 1)
                replica = await restarted(first, NEW, zctx)
                assert await seconds_until_ok(session, balancer.url) < RECOVERY_TIMEOUT_S
                for _ in range(3):
                    assert await post_status(session, balancer.url) == 200
                async with session.get(balancer.url + "/admin/replicas") as response:
                    view = (await response.json())["replicas"][0]
                scrapes = view["scrape"]["scrapes"]
                async with asyncio.timeout(RECOVERY_TIMEOUT_S):  # the scrape, with the new key, succeeds
                    while True:
                        async with session.get(balancer.url + "/admin/replicas") as response:
                            view = (await response.json())["replicas"][0]
                        if view["scrape"]["scrapes"] > scrapes + 1 and view["scrape"]["last_error"] is None:
                            break
                        await asyncio.sleep(0.05)
                assert view["health"]["probe_ok"]
                if kind == "trtllm":  # the drain carries the new key: new blocks reach the index
                    assert view["index"]["blocks"] > 0
            finally:
                await balancer.stop()
                if replica is not first:
                    await replica.stop()
    finally:
        zctx.destroy(linger=0)
    assert OLD not in caplog.text and NEW not in caplog.text
    assert "engine key from api_key_file" in caplog.text


async def test_an_engines_401_rereads_the_key_at_once_without_polling(tmp_path: Path) -> None:
    keys = KeyDir(tmp_path, OLD)
    zctx = zmq.asyncio.Context()
    try:
        async with started(engine("sglang", OLD), zctx) as first, aiohttp.ClientSession() as session:
            entry = {**replica_entry(first), "api_key_file": str(keys.path)}
            balancer = await balancer_for(tmp_path, entry, poll_s=0)  # no poll: only a refusal re-reads
            replica = first
            try:
                await wait_ready(session, balancer.url)
                assert await post_status(session, balancer.url) == 200
                keys.swap(NEW)
                await asyncio.sleep(0.3)
                replica = await restarted(first, NEW, zctx)
                took = await seconds_until_ok(session, balancer.url)
                assert took < 6.0, took  # well under a second here; without the re-read, never
                text = await metrics_text(session, balancer.url)
                assert metric_value(text, "kvlb_upstream_api_key_rereads_total", trigger="refused") >= 1
                assert metric_value(text, "kvlb_upstream_api_key_rotations_total") == 1
            finally:
                await balancer.stop()
                if replica is not first:
                    await replica.stop()
    finally:
        zctx.destroy(linger=0)


async def test_a_file_updated_after_the_engine_is_seen_at_the_next_refusal(tmp_path: Path) -> None:
    """The engine restarted with the new key first: refusals for 4 s find the file unchanged (its
    reads back off: the next one 4 s after the third), then the file is updated: the next refusal's
    check (a second at most) sees the new stamp and reads it, whatever the back-off of the reads,
    and the replica's breaker, opened by the refusals, lets a trial through at once. About 8 s: the
    back-off has to grow past the bound for the test to tell the two apart.

    The replica stays in routing through the restart (its refusals are the requests' and the
    scrapes'): the prober probes once, at start. A probe that saw the engine down would, at its
    next good probe, read ``/v1/models`` with the old key, get 401 and take the replica out at once
    as refusing kvlb's key (every request a 503, no breaker); on a loaded machine the restart spans a
    0.1 s probe period often enough. That path is the next test's."""
    keys = KeyDir(tmp_path, OLD)
    zctx = zmq.asyncio.Context()
    try:
        async with started(engine("sglang", OLD), zctx) as first, aiohttp.ClientSession() as session:
            entry = {**replica_entry(first), "api_key_file": str(keys.path)}
            # no poll: only refusals check; one probe, at start (see above)
            balancer = await balancer_for(tmp_path, entry, poll_s=0, health_interval_s=60.0)
            replica = first
            try:
                await wait_ready(session, balancer.url)
                replica = await restarted(first, NEW, zctx)
                await asyncio.sleep(4.0)  # 4 s of refusals (the scrapes' every 0.1 s): reads 1, 2, 4 s apart
                for _ in range(3):  # refused: 502, and the replica's breaker opens (for 5 s)
                    assert await post_status(session, balancer.url) == 502
                assert await post_status(session, balancer.url) == 503
                keys.swap(NEW)
                start = time.monotonic()
                await until_metric(session, balancer.url, "kvlb_upstream_api_key_rotations_total", 1)
                took = time.monotonic() - start
                assert took < 2.0, took  # a check at most a second after the swap, not the reads' 2 s+
                # the breaker the old key's refusals opened tries at once, not 5 s after it opened
                assert await seconds_until_ok(session, balancer.url) < 2.5  # at once here; the wait was 5 s
            finally:
                await balancer.stop()
                if replica is not first:
                    await replica.stop()
    finally:
        zctx.destroy(linger=0)


async def test_a_replica_out_for_refusing_the_key_rereads_the_file_updated_later(tmp_path: Path) -> None:
    """A probe saw the engine down, and it came back with a new key: the next good probe reads
    ``/v1/models`` with the old key, gets 401 and takes the replica out as refusing kvlb's key (503 at
    once, no request reaches it). With no poll and no scrape, the prober's reads of the list (one
    per probe while it refuses) are the only refusals left: the file updated a while after the
    take-out is still read at the next one's check (a second at most), and the next probe, with the
    new key, puts the replica back."""
    keys = KeyDir(tmp_path, OLD)
    zctx = zmq.asyncio.Context()
    try:
        async with started(engine("sglang", OLD), zctx) as first, aiohttp.ClientSession() as session:
            entry = {**replica_entry(first), "api_key_file": str(keys.path)}
            balancer = await balancer_for(tmp_path, entry, poll_s=0, scrape_interval_s=0)
            replica = first
            url = balancer.url
            try:
                await wait_ready(session, url)

                async def seen_down() -> None:
                    await until_view(session, url, lambda view: not view["health"]["probe_ok"])

                replica = await restarted(first, NEW, zctx, while_down=seen_down)
                await until_view(session, url, lambda view: view["health"]["key_refused"] is not None)
                assert await post_status(session, url) == 503
                await asyncio.sleep(1.5)  # the take-out's refusal had its check and read; the file unchanged
                keys.swap(NEW)
                start = time.monotonic()
                await until_metric(session, url, "kvlb_upstream_api_key_rotations_total", 1)
                took = time.monotonic() - start
                assert took < 2.0, took  # a check at most a second after the swap
                assert await seconds_until_ok(session, url) < 2.5  # the next probe (0.1 s) checks the new key
                await until_view(session, url, lambda view: view["health"]["key_refused"] is None)
            finally:
                await balancer.stop()
                if replica is not first:
                    await replica.stop()
    finally:
        zctx.destroy(linger=0)


async def test_a_bad_new_key_is_refused_once_and_the_old_one_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = KeyDir(tmp_path, OLD)
    zctx = zmq.asyncio.Context()
    try:
        async with started(engine("sglang", OLD), zctx) as replica, aiohttp.ClientSession() as session:
            entry = {**replica_entry(replica), "api_key_file": str(keys.path)}
            balancer = await balancer_for(tmp_path, entry, poll_s=0.1)
            try:
                await wait_ready(session, balancer.url)
                keys.swap("   ")  # an empty key: refused
                await until_metric(
                    session, balancer.url, "kvlb_upstream_api_key_rejected_total", 1, reason="invalid"
                )
                await asyncio.sleep(0.5)  # five more polls of the same bad file
                text = await metrics_text(session, balancer.url)
                assert metric_value(text, "kvlb_upstream_api_key_rejected_total", reason="invalid") == 1
                for _ in range(3):
                    assert await post_status(session, balancer.url) == 200  # the old key, kept
                keys.rename(NEW + "\x07")  # not printable ASCII: refused too, said again
                await until_metric(
                    session, balancer.url, "kvlb_upstream_api_key_rejected_total", 2, reason="invalid"
                )
                assert await post_status(session, balancer.url) == 200
            finally:
                await balancer.stop()
    finally:
        zctx.destroy(linger=0)
    refusals = [r.getMessage() for r in caplog.records if "the new key is refused" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert "is empty" in refusals[0] and "printable ASCII" in refusals[1]
    assert OLD not in caplog.text and NEW not in caplog.text
