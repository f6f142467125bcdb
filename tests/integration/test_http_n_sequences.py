"""OpenAI's ``n`` (several sequences for one prompt) on real sockets: a real balancer in front of an
emulated SGLang engine, which now generates ``n`` sequences as the engines do (one choice per
sequence, ``index`` 0..n-1, streamed chunks naming theirs, usage adding their completions).

* kvlb forwards ``n`` untouched and relays every choice, whole and streamed;
* the decision counts the decode load of every sequence: ``/admin/explain`` and the decision ring
  (``/admin/decisions/{id}``) say ``sequences`` and ``decode_blocks`` (uncached prompt +
  ``n × max_tokens``);
* a bad ``n`` is a 400 naming it, and so is one over ``limits.max_n``;
* ``POST /admin/whatif`` moves a changed decision's load as its ``n`` sequences
  (``model.load_moved_seqs``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import zmq.asyncio
from emulated_replica import started
from kvlb_harness import MODEL, replica_entry, running, sse_payloads, wait_ready
from settings_tree import settings_from

from balancer.app import Balancer
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile

PROMPT = list(range(1, 33))
BLOCK = 4


@asynccontextmanager
async def balancer(**limits: int) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    zctx = zmq.asyncio.Context()
    config = ReplicaConfig(
        name="r0", engine="sglang", profile=get_profile("cpu-test"), time_scale=20.0, page_size=BLOCK
    )
    try:
        async with started(config, zctx) as replica, aiohttp.ClientSession() as session:
            tree = {
                "listen": {"host": "127.0.0.1", "port": 0},
                "pools": [{"model": MODEL, "replicas": [replica_entry(replica)]}],
                "health_interval_s": 0.1,
                "limits": limits,
            }
            service = Balancer(settings_from(tree, {}), tokenizers={MODEL: TokenIdTokenizer()})
            await service.start()
            try:
                await wait_ready(session, service.url)
                yield session, service.url
            finally:
                await service.stop()
    finally:
        zctx.destroy(linger=0)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with session.post(url, json=body) as response:
        return response.status, await response.read()


async def test_n_sequences_are_relayed_and_counted_in_the_decode_load() -> None:
    async with balancer() as (session, url):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "n": 3}
        status, raw = await post(session, url + "/v1/completions", body)
        assert status == 200, raw
        answer = json.loads(raw)
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
        assert answer["usage"]["completion_tokens"] == 18
        status, raw = await post(session, url + "/v1/completions", {**body, "stream": True})
        assert status == 200, raw
        chunks = [p for p in sse_payloads(raw) if p != "[DONE]"]
        assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
        assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 3

        explained: dict[int, dict[str, Any]] = {}
        for n in (1, 8):
            status, raw = await post(session, url + "/admin/explain", {**body, "max_tokens": 16, "n": n})
            assert status == 200, raw
            explained[n] = json.loads(raw)
        assert explained[1]["sequences"] == 1 and explained[8]["sequences"] == 8
        uncached = len(PROMPT) - explained[8]["cached_tokens"]
        assert explained[8]["decode_blocks"] == -(-(uncached + 8 * 16) // BLOCK)
        assert explained[1]["decode_blocks"] == -(
            -(len(PROMPT) - explained[1]["cached_tokens"] + 16) // BLOCK
        )

        async with session.get(url + "/admin/decisions", params={"limit": "1"}) as response:
            newest = (await response.json())["decisions"][0]
        async with session.get(url + f"/admin/decisions/{newest['id']}") as response:
            detail = await response.json()
        assert detail["sequences"] == 3  # the streamed n = 3 request
        assert detail["decode_blocks"] == -(-(len(PROMPT) - detail["cached_tokens"] + 3 * 6) // BLOCK)


async def test_a_bad_n_is_a_400_naming_it() -> None:
    async with balancer() as (session, url):
        for n in (0, -1, 1.5, "2", True):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": n}
            status, raw = await post(session, url + "/v1/completions", body)
            assert status == 400, (n, raw)
            assert "'n' must be a positive integer" in json.loads(raw)["error"]["message"]
        status, raw = await post(
            session, url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": None}
        )
        assert status == 200, raw


async def test_an_n_over_limits_max_n_is_a_400_naming_it() -> None:
    async with balancer(max_n=4) as (session, url):
        chat = [{"role": "user", "content": "x"}]
        for path, body in (
            ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 5}),
            ("/v1/chat/completions", {"model": MODEL, "messages": chat, "n": 5}),
        ):
            status, raw = await post(session, url + path, body)
            assert status == 400, raw
            assert json.loads(raw)["error"]["message"] == "'n' must be at most 4 (limits.max_n), got 5"
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 4}
        status, raw = await post(session, url + "/v1/completions", body)
        assert status == 200, raw
        assert len(json.loads(raw)["choices"]) == 4


async def test_the_whatif_moves_a_changed_decision_as_its_n_sequences() -> None:
    """Six ``n = 4`` requests of one prompt on two emulated engines, replayed with round robin: the
    decisions it changes (or resizes) move their load as 4 sequences each, not 1."""
    async with running(TokenIdTokenizer(), 2, time_scale=20.0, page_size=BLOCK) as h:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 4}
        for _ in range(6):
            answer = await h.post("/v1/completions", body)
            assert answer.status == 200, answer.body
        listed = (await h.admin("GET", "/admin/decisions?limit=10"))["decisions"]
        assert len(listed) == 6
        detail = await h.admin("GET", f"/admin/decisions/{listed[0]['id']}")
        assert detail["sequences"] == 4 and detail["held_s"] is not None
        result = await h.admin("POST", "/admin/whatif", {"policy": "round_robin", "sample": 10})
        assert result["decisions"] == 6 and result["model"]["load_moved"] >= 1, result
        assert result["model"]["load_moved_seqs"] == 4 * result["model"]["load_moved"], result["model"]
