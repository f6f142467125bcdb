"""A kvlb started in front of engines with history routes while it replays that history.

The emulated SGLang replicas served a prompt and flushed their caches before the balancer started,
so each one's replay buffer holds ``AllBlocksCleared, BlockStored(prompt), AllBlocksCleared``. The
balancer's catch-up replay is held back (a gate between its DEALER and each replica's ROUTER) until a
request with that prompt has been routed and waits on its (stalled) replica: the replayed store then
confirms the request's speculative entries and the replayed clear follows. A follower with the same
prefix must still find them and go to the same replica (docs/loadtest-history.md, 2026-11-29, items 5-6:
before the fix the clear took them and the follower was sent elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from kvlb_harness import MODEL, Answer, replica_entry, settings_for, shared_deepseek, wait_for, wait_ready

from balancer.app import Balancer
from balancer.tokenizer.tokenizer import Tokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica
from replicas.wire.sglang import REPLAY_END_SEQ

PREFIX = list(range(2000, 2032))
"""32 token ids: 8 full blocks of the emulator's 4-token pages."""
STALL_S = 3.0
"""How long the replicas compute nothing while the leader and the follower are routed (seconds)."""
GATE_MESSAGES = 10_000
"""Most frames relayed per replay request (the replicas' buffers hold a handful of batches)."""


class ReplayGate:
    """A ROUTER on 127.0.0.1 in front of one replica's replay socket: holds each request until
    :attr:`opened`, then relays it to the replica and the answer back (a DEALER per request)."""

    def __init__(self, zctx: zmq.asyncio.Context, upstream: str) -> None:
        self.upstream = upstream
        self.opened = asyncio.Event()
        self.answered = 0
        """Replay requests answered to their end."""
        self._zctx = zctx
        self._front = zctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._task = asyncio.create_task(self._serve(), name="replay-gate")

    async def _serve(self) -> None:
        while True:
            identity, *request = await self._front.recv_multipart()
            await self.opened.wait()
            back = self._zctx.socket(zmq.DEALER)
            back.setsockopt(zmq.LINGER, 0)
            try:
                back.connect(self.upstream)
                await back.send_multipart(request)
                for _ in range(GATE_MESSAGES):
                    async with asyncio.timeout(5.0):
                        reply = await back.recv_multipart()
                    await self._front.send_multipart([identity, *reply])
                    if REPLAY_END_SEQ in reply and not reply[-1]:
                        self.answered += 1
                        break
            finally:
                back.close(linger=0)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._front.close(linger=0)


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def post(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> Answer:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    async with session.post(url + "/v1/completions", data=body) as response:
        return Answer(response.status, response.headers.copy(), await response.read())


@contextlib.asynccontextmanager
async def replicas_with_history(
    tokenizer: Tokenizer, zctx: zmq.asyncio.Context
) -> AsyncIterator[list[Replica]]:
    """Two SGLang replicas that each stored ``PREFIX`` and then flushed their caches."""
    replicas: list[Replica] = []
    try:
        for index in range(2):
            config = ReplicaConfig(name=f"r{index}", engine="sglang", profile=get_profile("cpu-test"))
            replica = Replica(config, tokenizer, zctx)
            await replica.start()
            replicas.append(replica)
        async with aiohttp.ClientSession() as session:
            for replica in replicas:
                answer = await post(session, replica.url, [*PREFIX, 9])
                assert answer.status == 200, answer.body
                async with session.post(replica.url + "/flush_cache") as response:
                    assert response.status == 200, await response.text()
        yield replicas
    finally:
        for replica in reversed(replicas):
            await replica.stop()


def queued(replica: Replica) -> int:
    return sum(len(rank.scheduler.waiting) + len(rank.scheduler.running) for rank in replica.engine.ranks)


async def caught_up(session: aiohttp.ClientSession, balancer: Balancer, replicas: list[Replica]) -> bool:
    """Whether the balancer took every batch the replicas published (their replay included)."""
    token = balancer.settings.auth.admin_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.get(balancer.url + "/admin/replicas", headers=headers) as response:
        views: list[dict[str, Any]] = (await response.json())["replicas"]
    for view, replica in zip(sorted(views, key=lambda v: str(v["id"])), replicas, strict=True):
        events = view["events"]
        published = [p.seq - 1 for p in replica.personality.publishers]  # type: ignore[attr-defined]
        taken = {source["dp_rank"]: source["last_seq"] for source in events["sources"]}
        if events["queued_batches"] or any(
            taken.get(r) is None or taken[r] < s for r, s in enumerate(published)
        ):
            return False
    return True


async def test_a_follower_finds_its_leader_while_the_leaders_replica_replays_history(
    tokenizer: Tokenizer,
) -> None:
    zctx = zmq.asyncio.Context()
    gates: list[ReplayGate] = []
    balancer: Balancer | None = None
    try:
        async with replicas_with_history(tokenizer, zctx) as replicas, aiohttp.ClientSession() as session:
            entries = []
            for replica in replicas:
                entry = replica_entry(replica)
                gates.append(ReplayGate(zctx, entry["replay"]))
                entry["replay"] = gates[-1].endpoint
                entries.append(entry)
            settings = settings_for(replicas, pool={"replicas": entries})
            balancer = Balancer(settings, tokenizers={MODEL: tokenizer})
            await balancer.start()
            await wait_ready(session, balancer.url)
            for replica in replicas:
                replica.engine.stall(STALL_S)
            leader = asyncio.create_task(post(session, balancer.url, [*PREFIX, 1, 2, 3]))
            await wait_for("the leader queued on a replica", lambda: _async(sum(map(queued, replicas)) == 1))
            home = next(r.config.name for r in replicas if queued(r))
            for gate in gates:
                gate.opened.set()
            await wait_for("the replayed history applied", lambda: caught_up(session, balancer, replicas))
            assert all(gate.answered for gate in gates)
            follower = await post(session, balancer.url, [*PREFIX, 4, 5])
            first = await leader
            assert (first.status, follower.status) == (200, 200)
            assert first.headers["x-kvlb-replica"] == home
            assert follower.headers["x-kvlb-replica"] == home  # the leader's entries survived the replay
            assert follower.headers["x-kvlb-cached-tokens"] == "32"  # predicted from them
    finally:
        if balancer is not None:
            await balancer.stop()
        for gate in gates:
            await gate.close()
        zctx.destroy(linger=0)


async def _async(value: bool) -> bool:
    return value
