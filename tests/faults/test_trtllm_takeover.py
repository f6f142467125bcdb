"""A TRT-LLM replica's ingest lease taken over from a SIGKILLed kvlb (real processes: one ``kvlb
emulate`` TRT-LLM replica, two ``kvlb serve`` sharing a private ``redis-server``).

TRT-LLM's ``/kv_cache_events`` drain forgets what it returns, so a new holder cannot replay what the
dead one drained. It need not throw the index away for that: Redis stores, with each batch, the last
``event_id`` per rank, and the new holder's decoder checks that the first event it drains follows on.

* The dead holder had written everything it drained: the survivor keeps the replica's blocks (no
  resync) and its index matches the engine's cache exactly, old blocks included.
* Events were drained and never written (the test drains them itself, as a holder that died between
  its drain and its write): the survivor sees the ``event_id`` gap and resyncs the rank
  (``kvlb_events_resyncs_total{reason="gap"}``), and its index claims nothing the engine lacks.
* The same gap, then the requests of before the kill again: the engine reuses their blocks and, as
  TRT-LLM does, stores nothing new for them, so no event ever names them again. The survivor's
  receipts (``cached_tokens``) teach them back to its mirror's table (without it the replica stayed
  at the few blocks stored after the gap for good, ``docs/reliability.md``, h-fleetfollow). They
  teach once the engine's hashes they compute have matched the index's blocks (16 blocks): the
  same requests sent again before the kill, once their first sending is in the survivor's index.
* Redis holds positions without an ``event_id`` (written by a kvlb from before they were stored; the
  test rewrites them so): nothing to check against, so the survivor resyncs the replica's ranks at
  the takeover (``reason="lease"``), and its index claims nothing the engine lacks.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from kvlb_harness import metric_value
from redis_server import RedisServer, start_server

from loadtests.faults.procs import MODEL
from loadtests.faults.rig import FaultRig, fault_rig
from loadtests.faults.scenarios import FAULT_TIMEOUTS

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TIMING = {"lease_ttl_s": 2.0, "tick_s": 0.5, "socket_timeout_s": 1.0}
WAIT_S = 15.0
"""Bound of every wait below (a takeover needs ``lease_ttl_s + tick_s``, 2.5 s)."""


async def _holder(f: FaultRig, url: str) -> list[str]:
    async with f.session.get(url + "/admin/fleet") as response:
        view = (await response.json())["fleet"] or {}
    return [str(name) for name in view.get("leases", [])]


async def _send(f: FaultRig, url: str, first: int, count: int) -> None:
    """``count`` requests with distinct prompts of 4k + 1 tokens and 4 output tokens: whole blocks
    only (TRT-LLM keys ``(prompt + output)[:-1]``), as in the fault load."""
    for n in range(first, first + count):
        body = {"model": MODEL, "prompt": [7, n, *range(100, 115)], "max_tokens": 4}
        async with f.session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()


async def _until(what: str, check: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, f"{what} not within {WAIT_S} s"
        await asyncio.sleep(0.05)


async def _resyncs(f: FaultRig, url: str) -> float:
    async with f.session.get(url + "/metrics") as response:
        return metric_value(await response.text(), "kvlb_events_resyncs_total", replica="r0")


async def _forget_event_ids(server: RedisServer) -> None:
    """Rewrite r0's stored positions as a kvlb that stored no TRT-LLM ``event_id`` wrote them
    (``-@<writes>``: no rank, the same write count)."""
    client = aioredis.Redis(host="127.0.0.1", port=server.port, decode_responses=True)
    try:
        key = f"kvlb:{{{MODEL}/4/trtllm}}:seq"
        text = await client.hget(key, "r0")
        assert text is not None and text.startswith("0:"), text
        await client.hset(key, "r0", "-@" + text.partition("@")[2])
    finally:
        await client.aclose()


@pytest.mark.parametrize("case", ["all_written", "drained_not_written", "reused_after_gap", "no_event_ids"])
async def test_a_killed_holders_trtllm_replica_is_taken_over(tmp_path: Path, case: str) -> None:
    data_dir = tmp_path / "redis"
    data_dir.mkdir()
    server = await asyncio.to_thread(start_server, None, data_dir)
    redis = {"url": server.url, **TIMING}
    try:
        async with fault_rig(tmp_path, ("trtllm",), kvlbs=2, redis=redis, timeouts=FAULT_TIMEOUTS) as f:
            kvlbs = [f.kvlb, *f.others]
            urls = [child.info["url"] for child in kvlbs]

            async def held() -> bool:
                return any(["r0" in await _holder(f, url) for url in urls])

            await _until("r0's lease taken", held)
            holder = [("r0" in await _holder(f, url)) for url in urls].index(True)
            survivor = urls[1 - holder]
            f.checked = [survivor]
            await _send(f, survivor, 0, 6)  # 30 blocks: the engine keeps all 64 of its pool

            async def equal() -> bool:
                return (await f.compare())[0]

            if case == "reused_after_gap":  # cache hits whose receipts check kvlb's block hashes
                # A receipt checks the hashes only against blocks the survivor's index holds, and
                # receipts teach only once 16 blocks matched (router.HASH_TRUST_BLOCKS). Sent before
                # the holder's drain of the first six reached the survivor's mirror, these matched
                # nothing, and after the gap nothing they name is held: no receipt ever taught.
                await _until("the index to match the engine before the cache hits", equal)
                await _send(f, survivor, 0, 6)  # 6 receipts of 4 blocks each: 24 matched

            await _until("the index to match the engine before the kill", equal)
            before = (await f.engine_blocks() or {})["r0"]
            assert before > 0
            resyncs = await _resyncs(f, survivor)
            await kvlbs[holder].kill()
            if case == "no_event_ids":
                await _forget_event_ids(server)
            if case in ("drained_not_written", "reused_after_gap"):  # drained by the dead holder, not written
                await _send(f, survivor, 100, 2)
                async with f.session.post(f.sims[0].url + "/kv_cache_events") as response:
                    assert response.status == 200 and await response.json(), "nothing drained"

            async def taken_over() -> bool:
                return "r0" in await _holder(f, survivor)

            await _until("the survivor to take r0 over", taken_over)
            await _send(f, survivor, 200, 3)  # new events, drained by the survivor
            if case == "all_written":
                await _until("the index to match the engine after the takeover", equal)
                assert await _resyncs(f, survivor) == resyncs  # the old blocks were kept
                assert (await f.index_blocks(survivor))["r0"] >= before
                return

            async def resynced() -> bool:
                return await _resyncs(f, survivor) > resyncs

            await _until("the resync", resynced)

            async def cleared() -> bool:  # the index held all of `before` until the clear reached it
                return (await f.index_blocks(survivor))["r0"] < before

            # Counted where the survivor writes; its mirror applies the clear from the stream later,
            # and the old blocks, all still cached, pass the checks below until it does.
            await _until("the survivor's mirror to apply the clear", cleared)
            async with f.session.get(survivor + "/metrics") as response:
                text = await response.text()
            reason, other = ("lease", "gap") if case == "no_event_ids" else ("gap", "lease")
            assert metric_value(text, "kvlb_events_resyncs_total", replica="r0", reason=reason) >= 1
            assert metric_value(text, "kvlb_events_resyncs_total", replica="r0", reason=other) == 0

            async def within() -> bool:
                return (await f.compare())[1]

            await _until("the index to claim nothing the engine lacks", within)
            if case == "reused_after_gap":  # blocks the engine holds and announces no more
                await _send(f, survivor, 0, 6)
                await _send(f, survivor, 100, 2)

                async def taught() -> bool:
                    return (await f.index_blocks(survivor))["r0"] >= before

                await _until("the receipts to teach the reused blocks back", taught)
                await _until("the index to claim nothing the engine lacks, taught", within)
    finally:
        await asyncio.to_thread(server.stop)
