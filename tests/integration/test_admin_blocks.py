"""``GET /admin/replicas/{id}/blocks`` (kvlb) against ``GET /admin/blocks`` (the emulator), over real
sockets: the keys kvlb lists for a replica are the keys of the pages the engine lists, as the fault
rig compares them (:mod:`loadtests.faults.blocks`), for an SGLang and a TRT-LLM replica; and both
views refuse bad input with a 4xx.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kvlb_harness import MODEL, Harness, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer
from loadtests.faults.blocks import engine_keys, index_keys, same_blocks

TOKEN = "blocks-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def get(h: Harness, url: str, status: int = 200) -> Any:
    async with h.session.get(url, headers=AUTH) as response:
        assert response.status == status, await response.text()
        return await response.json()


async def test_kvlb_lists_the_keys_of_the_pages_the_engine_lists(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 2, engines=("sglang", "trtllm"), page_size=4, auth__admin_token=TOKEN) as h:
        for i in range(6):  # 4k + 1 tokens, max_tokens 4: no partial block on either engine
            prompt = [3, i, *range(200 + 40 * i, 227 + 40 * i)]
            answer = await h.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
            assert answer.status == 200, answer.body
        for replica in h.replicas:
            name = replica.config.name
            deadline = time.monotonic() + 10.0
            while True:
                engine = engine_keys(await get(h, replica.url + "/admin/blocks"), MODEL)
                index = index_keys(await get(h, f"{h.url}/admin/replicas/{name}/blocks"))
                if same_blocks(index, engine):
                    break
                assert time.monotonic() < deadline, (name, engine, index)
                await asyncio.sleep(0.05)
            assert engine.blocks and sum(map(len, engine.blocks.values())) == index.count == engine.count


async def test_the_views_cap_their_listing_and_refuse_bad_input(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, auth__admin_token=TOKEN) as h:
        holder = await h.warm([5, *range(300, 332)])
        capped = await get(h, f"{h.url}/admin/replicas/{holder}/blocks?limit=1")
        [rank] = capped["ranks"]
        assert rank["blocks"] >= 8 and rank["truncated"] and len(rank["keys"]) == 1
        assert len(rank["keys"][0]) == 16 and capped["model"] == MODEL and capped["limit"] == 1
        for query in ("limit=-1", "limit=abc", "limit=10001", "limit=1&limit=2", "other=1"):
            answer = await get(h, f"{h.url}/admin/replicas/{holder}/blocks?{query}", 400)
            assert answer["error"]["code"] == 400, query
        assert "known: r0" in (await get(h, f"{h.url}/admin/replicas/nope/blocks", 404))["error"]["message"]
        async with h.session.get(f"{h.url}/admin/replicas/{holder}/blocks") as response:
            assert response.status == 401  # behind auth.admin_token like every /admin path
        engine = h.replicas[0].url + "/admin/blocks"
        listed = await get(h, engine + "?limit=2")
        assert listed["ranks"][0]["truncated"] and len(listed["ranks"][0]["pages"]) == 2
        for query in ("limit=-1", "limit=x", "limit=65537"):
            async with h.session.get(f"{engine}?{query}") as response:
                assert response.status == 400, query
