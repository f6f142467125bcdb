"""docs/policies.md's weights at their ranges' ends, through ``POST /admin/explain`` on a real
balancer over emulated replicas: each weight moves the cost terms and the choice as the weights
table says (``x-kvlb-weights`` lays the weight over the defaults for one dry run).

One replica holds the prompt (warmed), another decodes a long stream (decode load, one request
decoding, a KV usage above 0), the third is idle.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvlb_harness import MODEL, Harness, running, shared_deepseek, wait_for

from balancer.tokenizer.tokenizer import Tokenizer

TOKEN = "weights-token"
PROMPT = list(range(200, 240))
"""40 token ids: 10 full blocks of the emulator's 4-token pages."""
BLOCKS = 10


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def explain(h: Harness, **weights: float | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}", "x-kvlb-weights": json.dumps(weights)}
    body = {"model": MODEL, "prompt": PROMPT}
    async with h.session.post(h.url + "/admin/explain", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        decision: dict[str, Any] = (await response.json())["decision"]
        return decision


def terms(decision: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["replica"]: row for row in decision["terms"]}


async def test_each_weight_at_its_ends_moves_the_terms_as_documented(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 3, time_scale=0.1, auth__admin_token=TOKEN) as h:
        holder = await h.warm(PROMPT)
        busy = next(r.config.name for r in h.replicas if r.config.name != holder)
        idle = next(r.config.name for r in h.replicas if r.config.name not in (holder, busy))
        # a long stream on `busy` (drained from routing meanwhile: the stream must land there)
        for other in (holder, idle):
            await h.admin("POST", f"/admin/replicas/{other}/drain")
        stream = {"model": MODEL, "prompt": [900, 901, 902, 903, 904], "max_tokens": 200, "stream": True}
        response = await h.session.post(h.url + "/v1/completions", json=stream)
        try:
            assert response.status == 200, await response.text()
            assert response.headers["x-kvlb-replica"] == busy
            assert (await response.content.readline()).startswith(b"data: ")
            for other in (holder, idle):
                await h.admin("POST", f"/admin/replicas/{other}/undrain")

            async def busy_scraped() -> bool:
                row = terms(await explain(h))[busy]
                return bool(row["active_decode_blocks"]) and bool(row["kv_usage"])

            await wait_for("the stream decoding and scraped", busy_scraped)
            base = terms(await explain(h))
            assert base[holder]["overlap_blocks"] == BLOCKS and base[idle]["overlap_blocks"] == 0

            # prefill_weight 0 "ignores prefill and with it cache affinity"
            decision = await explain(h, prefill_weight=0.0)
            for row in decision["terms"]:
                assert row["prefill_term"] == row["interference_term"] == row["root_term"] == 0.0, row
            assert terms(decision)[holder]["cost"] == terms(decision)[idle]["cost"] == 0.0
            # prefill_weight at its top multiplies the prefill term
            assert terms(await explain(h, prefill_weight=1000.0))[idle]["prefill_term"] == 1000.0 * BLOCKS

            # overlap_credit 0 "ignores the cache": the holder pays the whole prompt as the others do
            decision = await explain(h, overlap_credit=0.0)
            assert terms(decision)[holder]["prefill_term"] == terms(decision)[idle]["prefill_term"] == BLOCKS
            assert "credit" not in decision["reason"]  # no ramp from credit 0 (overlap_credit_loaded's row)
            # overlap_credit 4 (ramp off): the holder's prefill term goes below zero, and it wins
            decision = await explain(h, overlap_credit=4.0, overlap_credit_loaded=None)
            assert terms(decision)[holder]["prefill_term"] == BLOCKS - 4 * BLOCKS
            assert decision["replica"] == holder

            # decode_weight: 0 ignores decode load; at its top the decoding replica is never chosen
            assert all(row["decode_term"] == 0.0 for row in (await explain(h, decode_weight=0.0))["terms"])
            decision = await explain(h, decode_weight=1000.0, overlap_credit=0.0)
            assert terms(decision)[busy]["decode_term"] == 1000.0 * base[busy]["active_decode_blocks"]
            assert decision["replica"] != busy

            # interference_weight: 0 off; at 1 each block inserted on `busy` costs one per request decoding
            assert terms(await explain(h, interference_weight=0.0))[busy]["interference_term"] == 0.0
            assert terms(await explain(h, interference_weight=1.0))[busy]["interference_term"] == 1.0 * BLOCKS

            # root_cap_prompts 0 caps the held-roots charge at nothing
            assert all(row["root_term"] == 0.0 for row in (await explain(h, root_cap_prompts=0.0))["terms"])

            # temperature at its top: a uniform draw
            decision = await explain(h, temperature=1e6)
            assert decision["reason"].startswith("softmax")
            assert all(row["probability"] == pytest.approx(1 / 3, abs=1e-3) for row in decision["terms"])

            # kv_usage_ceiling near its low end excludes the replica using KV, "kv_usage>=..."
            decision = await explain(h, kv_usage_ceiling=1e-9)
            assert terms(decision)[busy]["excluded"] == "kv_usage>=1e-09" and decision["replica"] != busy
        finally:
            response.close()
