"""kvlb in front of two emulated vLLM 0.32 replicas: events over ZMQ, prefix hits, the engine agreeing.

The replicas run the emulator's vLLM personality (silent start, u64 ``sha256`` block hashes,
``lora_name``/``extra_keys``/``group_idx``/``kv_cache_spec_kind`` in ``BlockStored``, one
``BlockRemoved`` per block), 32-token blocks (a size the real CPU build accepts). kvlb reads them with
its ``vllm`` engine spec. Speculative entries expire at once, so only the engines' events can explain
the affinity.
"""

from __future__ import annotations

import pytest
from kvlb_harness import MODEL, metric_value, running, shared_deepseek, wait_for

from balancer.tokenizer.tokenizer import Tokenizer

BLOCK = 32
PREFIX = list(range(2000, 2000 + 3 * BLOCK))
"""Three full vLLM blocks."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def completion(suffix: list[int]) -> dict[str, object]:
    return {"model": MODEL, "prompt": PREFIX + suffix, "max_tokens": 2, "temperature": 0}


async def test_prefix_hits_on_the_vllm_replica_that_holds_the_prefix(tokenizer: Tokenizer) -> None:
    async with running(
        tokenizer, 2, engines=("vllm",), page_size=BLOCK, limits__speculative_ttl_s=0.001
    ) as h:
        assert [r.config.engine for r in h.replicas] == ["vllm", "vllm"]
        holder = await h.warm([*PREFIX, 1, 2, 3])  # waits for the holder's 3 blocks in the index
        other = next(r.config.name for r in h.replicas if r.config.name != holder)
        assert int((await h.replica_view(other))["index"]["blocks"]) == 0
        for suffix in ([7, 8, 9], [4, 4], list(range(50, 60))):
            answer = await h.post("/v1/completions", completion(suffix))
            assert answer.status == 200, answer.body
            assert answer.headers["x-kvlb-replica"] == holder
            assert answer.headers["x-kvlb-cached-tokens"] == str(len(PREFIX))
            # vLLM's own report (usage.prompt_tokens_details.cached_tokens) agrees with the prediction.
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        assert metric_value(text, "kvlb_route_predicted_cached_tokens_total", replica=holder) == 3 * len(
            PREFIX
        )
        assert metric_value(text, "kvlb_route_reported_cached_tokens_total", replica=holder) == 3 * len(
            PREFIX
        )
        # Counters have a sample from registration on: "0 errors" reads 0, not "no data".
        assert (
            f'kvlb_events_decode_errors_total{{engine="vllm",reason="frame",replica="{holder}"}} 0.0' in text
        )
        assert metric_value(text, "kvlb_events_decode_errors_total") == 0

        # A reset (vLLM's POST /reset_prefix_cache) publishes AllBlocksCleared: the index forgets.
        async with h.session.post(h.replica(holder).url + "/reset_prefix_cache") as response:
            assert response.status == 200 and (await response.json()) == {"success": True}

        async def cleared() -> bool:
            return int((await h.replica_view(holder))["index"]["blocks"]) == 0

        await wait_for(f"{holder}'s blocks to leave the index after its reset", cleared)
