"""A noisy tenant's long prompts against a quiet tenant's small ones, over real sockets: one
emulated SGLang replica (:mod:`replicas.sim`, prefill first come first served in chunks, as the
engines run it) behind a real balancer on 127.0.0.1. The noisy tenant's loops send prompts of random
token ids (they miss every cache); the quiet tenant sends one short prompt at a time. With
``limits.max_inflight_prompt_tokens_per_tenant`` at one noisy prompt, at most one of them is at the
engine at a time, so a quiet request waits behind one prefill at most; without it (the default) it
waits behind all of them (docs/reliability.md, "Tenant isolation"). The gRPC face counts a call's
prompt tokens against the same cap."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace

import aiohttp
import grpc
import pytest
import zmq.asyncio
from grpc_harness import failure, grpc_running, token_request
from kvlb_harness import MODEL, metric_value, settings_for, shared_deepseek, wait_ready
from waiting import eventually

from balancer.app import Balancer
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

NOISY_TOKENS = 2_000
"""Prompt tokens of one noisy request (about 0.2 s of prefill on the profile below)."""
NOISY_LOOPS = 8
QUIET_REQUESTS = 6
HEADER = "x-kvlb-tenant"
BOUND_S = 0.8
"""The slowest quiet answer allowed with the cap: one noisy prefill ahead (~0.2 s) and its own, with
room for a loaded machine; without the cap 8 noisy prefills are ahead (~1.7 s)."""
PROFILE = replace(
    get_profile("cpu-test"),
    kv_capacity_tokens=65_536,
    max_running_requests=64,
    chunk_prefill_tokens=256,
    prefill_s_per_token=0.0001,
    max_context_tokens=8_192,
)


async def quiet_latencies(cap: int | None) -> tuple[list[float], list[int], str]:
    """The quiet tenant's latencies (seconds) while the noisy one sends, the noisy statuses and the
    balancer's metrics text."""
    zctx = zmq.asyncio.Context()
    replica = Replica(ReplicaConfig(name="r0", engine="sglang", profile=PROFILE), TokenIdTokenizer(), zctx)
    balancer: Balancer | None = None
    try:
        await replica.start()
        limits = {"max_inflight": 64, "max_queued": 64, "queue_timeout_s": 10.0}
        if cap is not None:
            limits["max_inflight_prompt_tokens_per_tenant"] = cap
        balancer = Balancer(
            settings_for([replica], **{f"limits__{k}": v for k, v in limits.items()}),
            tokenizers={MODEL: TokenIdTokenizer()},
        )
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            url = balancer.url + "/v1/completions"
            done = asyncio.Event()
            noisy_statuses: list[int] = []

            async def noisy(index: int) -> None:
                rng = random.Random(index)
                for _ in range(50):  # bounded: stops once the quiet tenant is done
                    if done.is_set():
                        return
                    prompt = [rng.randrange(1, 1000) for _ in range(NOISY_TOKENS)]
                    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
                    headers = {HEADER: "noisy", "content-type": "application/json"}
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        noisy_statuses.append(response.status)

            loops = [asyncio.create_task(noisy(i)) for i in range(NOISY_LOOPS)]
            latencies: list[float] = []
            try:
                async with asyncio.timeout(60):
                    await asyncio.sleep(0.3)  # the noisy prompts are queued at the engine
                    for sent in range(QUIET_REQUESTS):
                        body = json.dumps({"model": MODEL, "prompt": [5, 6, 7, sent + 8], "max_tokens": 1})
                        headers = {HEADER: "quiet", "content-type": "application/json"}
                        started = time.monotonic()
                        async with session.post(url, data=body, headers=headers) as response:
                            await response.read()
                            assert response.status == 200
                        latencies.append(time.monotonic() - started)
                        await asyncio.sleep(0.05)
            finally:
                done.set()
                await asyncio.gather(*loops)
            async with session.get(balancer.url + "/metrics") as response:
                metrics = await response.text()
            return latencies, noisy_statuses, metrics
    finally:
        if balancer is not None:
            await balancer.stop()
        await replica.stop()
        zctx.destroy(linger=0)


async def test_with_the_cap_the_quiet_tenant_waits_behind_one_noisy_prefill_at_most() -> None:
    latencies, noisy_statuses, metrics = await quiet_latencies(NOISY_TOKENS)
    assert max(latencies) < BOUND_S, latencies
    assert noisy_statuses and set(noisy_statuses) == {200}  # waited their turn within the timeout
    assert metric_value(metrics, "kvlb_admission_shed_total", reason="tenant_prompt_tokens") == 0
    assert metric_value(metrics, "kvlb_admission_prompt_token_waits_total") >= 1


@pytest.mark.faults_long
async def test_without_the_cap_the_quiet_tenant_waits_behind_every_noisy_prefill() -> None:
    """What the cap prevents (the default, off): the same load puts quiet answers past the bound."""
    latencies, _, metrics = await quiet_latencies(None)
    assert max(latencies) > BOUND_S, latencies
    assert metric_value(metrics, "kvlb_admission_prompt_token_waits_total") == 0


async def test_grpc_calls_count_their_prompt_tokens_until_their_first_token() -> None:
    """Over gRPC: tenant A's call of 200 prompt tokens, in prefill (slowed: ``time_scale``), holds
    the cap (200); A's next call of 3 waits and gets RESOURCE_EXHAUSTED with retry-after after
    ``queue_timeout_s``, while tenant B's call is answered. Once A's first call has its first token
    its tokens pass on: A's next call is answered."""
    async with grpc_running(
        shared_deepseek(),
        1,
        time_scale=0.02,
        limits__max_inflight=8,
        limits__queue_timeout_s=0.3,
        limits__max_inflight_prompt_tokens_per_tenant=200,
    ) as g:
        a = ((HEADER, "tenant-a"),)
        first = g.balancer.Generate(token_request(list(range(1, 201)), max_tokens=40), metadata=a)
        try:
            # at the replica: tokenized and admitted, its 200 tokens held; its prefill takes ~1.3 s
            replica = g.http.replicas[0]
            await eventually(lambda: replica.ctx.open_requests == 1, timeout_s=10.0)
            second = g.balancer.Generate(token_request([11, 12, 13], max_tokens=1), metadata=a)
            error = await failure(second.read())
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limits.max_inflight_prompt_tokens_per_tenant = 200" in (error.details() or "")
            assert ("retry-after", "1") in tuple(error.trailing_metadata() or ())
            other = g.balancer.Generate(
                token_request([21, 22, 23], max_tokens=1), metadata=((HEADER, "tenant-b"),)
            )
            assert [chunk async for chunk in other]
            assert (await first.read()).index == 0  # its first token: its tokens given back
            third = g.balancer.Generate(token_request([31, 32, 33], max_tokens=1), metadata=a)
            assert [chunk async for chunk in third]  # while the first still decodes
            assert not first.done()
        finally:
            first.cancel()
        async with g.http.session.get(g.http.url + "/metrics") as response:
            metrics = await response.text()
        assert metric_value(metrics, "kvlb_admission_shed_total", reason="tenant_prompt_tokens") == 1
        assert metric_value(metrics, "kvlb_admission_prompt_token_waits_total") == 1
