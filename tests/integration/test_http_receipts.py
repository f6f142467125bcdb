"""Receipts through a live kvlb and emulated replicas whose cache changes behind kvlb's back."""

from __future__ import annotations

import json

import pytest
from kvlb_harness import (
    MODEL,
    Harness,
    balancer_over,
    metric_value,
    running,
    shared_deepseek,
    stalling_stream_replica,
    wait_for,
)

from balancer.tokenizer.tokenizer import Tokenizer

PREFIX = list(range(1000, 1032))
"""32 token ids: 8 full blocks of the emulator's 4-token pages."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def completion(suffix: list[int]) -> dict[str, object]:
    return {"model": MODEL, "prompt": PREFIX + suffix, "max_tokens": 2, "temperature": 0}


def evict_silently(h: Harness, name: str) -> None:
    """Empty the replica's prefix cache and discard the records it would have published."""
    for rank in h.replica(name).engine.ranks:
        assert rank.scheduler.flush_cache()
        rank.scheduler.take_records()


async def metrics(h: Harness) -> str:
    async with h.session.get(h.url + "/metrics") as response:
        return await response.text()


async def test_a_receipt_drops_blocks_the_engine_evicted_without_saying(tokenizer: Tokenizer) -> None:
    """With ``limits.receipt_drops`` on (off by default: docs/prefix-index.md, "Receipts")."""
    async with running(tokenizer, count=1, limits__receipt_drops=True) as h:
        holder = await h.warm([*PREFIX, 1, 2, 3])
        view = await h.replica_view(holder)
        held = int(view["index"]["blocks"])
        assert held >= 8 and view["prediction"]["accuracy"] == 1.0  # the warm-up: predicted 0, got 0
        # the engine forgets its cache and its next batches are lost: kvlb still believes in them.
        # Lost for good (not kept for replay): kvlb polls a silent stream's replay buffer every
        # 0.05 s, and a loaded machine's poll read the recomputed prefix back into the index between
        # the receipt and the view below (8 or 9 blocks where 0 were left).
        lost = {"drop_events": 1.0, "replay_dropped": False}
        async with h.session.post(h.replica(holder).url + "/admin/faults", json=lost) as r:
            assert r.status == 200
        evict_silently(h, holder)
        answer = await h.post("/v1/completions", completion([7, 8, 9]))
        assert answer.status == 200 and answer.headers["x-kvlb-cached-tokens"] == "32"
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        text = await metrics(h)
        assert metric_value(text, "kvlb_route_receipt_stale_blocks_total", replica=holder) == 8
        assert metric_value(text, "kvlb_index_receipt_drops_blocks_total", replica=holder) == 8
        assert metric_value(text, "kvlb_route_receipts_total", replica=holder) == 2
        assert metric_value(text, "kvlb_route_receipts_exact_total", replica=holder) == 1
        assert metric_value(text, "kvlb_route_prediction_accuracy_ratio", replica=holder) == 0.5  # 1.0, then
        assert metric_value(text, "kvlb_route_prediction_error_blocks_bucket", replica=holder, le="-8.0") == 1
        view = await h.replica_view(holder)
        assert int(view["index"]["blocks"]) == held - 8  # the stale prefix is gone from the index
        assert view["prediction"] == {
            "receipts": 2,
            "accuracy": 0.5,
            "within_one_block": 0.5,
            "mean_error_blocks": -4.0,
        }
        assert view["events"]["last_lag_s"] is not None
        # The engine computed the prefix again and holds it; the request's speculative entries say so
        # while they last, and once they expired a receipt tells kvlb again.
        again = await h.post("/v1/completions", completion([4, 5]))
        assert again.headers["x-kvlb-cached-tokens"] == "32"
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_without_kv_events_routing_and_receipts_teach_the_index(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, count=1, pool={"kv_events": False, "approx_ttl_s": 0.5}) as h:
        first = await h.post("/v1/completions", completion([1, 2, 3]))
        assert first.status == 200 and first.headers["x-kvlb-cached-tokens"] == "0"
        replica = first.headers["x-kvlb-replica"]
        view = await h.replica_view(replica)
        assert view["events"] == {**view["events"], "sources": [], "applied_batches": 0}
        # routed blocks count as held for approx_ttl_s: the next request is predicted exactly
        second = await h.post("/v1/completions", completion([4, 5]))
        assert second.headers["x-kvlb-cached-tokens"] == "32"
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

        async def expired() -> bool:
            explained = await h.admin("POST", "/admin/explain", completion([6]))
            return bool(explained["cached_tokens"] == 0)

        await wait_for("the routed blocks to expire", expired)
        third = await h.post("/v1/completions", completion([6]))  # predicted 0, the engine has 8 blocks
        assert third.headers["x-kvlb-cached-tokens"] == "0"
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        text = await metrics(h)
        assert metric_value(text, "kvlb_index_receipt_learned_blocks_total", replica=replica) == 8
        assert (await h.replica_view(replica))["prediction"]["receipts"] == 3


async def test_a_client_that_leaves_on_the_last_event_still_leaves_a_receipt() -> None:
    """A streaming client may close as soon as it reads ``data: [DONE]``, before kvlb has read the
    end of the replica's body (its last chunk, which may come in a later read). The handler is then
    cancelled; the usage before ``[DONE]`` is the engine's last word all the same, so it still counts
    as a receipt. (Seen in the loadtest smoke run: 29 receipts for 30 answers, now and then.) The
    replica here holds the end of its body for 30 s after ``[DONE]``; kvlb closes that connection
    when the client leaves, so without the usage read at ``[DONE]`` no receipt would ever come."""
    usage = {"prompt_tokens": 8, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}
    event = {"id": "c1", "object": "text_completion", "choices": [], "usage": usage}

    first = b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
    async with stalling_stream_replica(first) as url, balancer_over(url) as (balancer, session):
        body = {"model": MODEL, "prompt": list(range(8)), "max_tokens": 1, "stream": True}
        async with session.post(balancer.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            read = b""
            while b"[DONE]" not in read:
                read += await response.content.readany()
            response.close()  # gone, without waiting for the end of the body

        async def counted() -> bool:
            async with session.get(balancer.url + "/metrics") as answer:
                text = await answer.text()
            return metric_value(text, "kvlb_route_receipts_total", replica="r0") == 1

        await wait_for("the receipt", counted, timeout_s=2.0)  # long before the body's end
        async with session.get(balancer.url + "/metrics") as answer:
            text = await answer.text()
        assert metric_value(text, "kvlb_route_reported_cached_tokens_total", replica="r0") == 4
