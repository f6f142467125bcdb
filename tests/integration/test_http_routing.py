"""Routing over real sockets: cache affinity from engine events, restarts, failures, runtime policy."""

from __future__ import annotations

import itertools
import logging

import pytest
from kvlb_harness import MODEL, metric_value, running, shared_deepseek, sse_payloads, wait_for

from balancer.tokenizer.tokenizer import Tokenizer

PREFIX = list(range(1000, 1032))
"""32 token ids: 8 full blocks of the emulator's 4-token pages."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def completion(suffix: list[int], **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": PREFIX + suffix, "max_tokens": 2, "temperature": 0, **extra}


async def test_hot_prefix_goes_to_its_holder_and_an_engine_restart_clears_it(tokenizer: Tokenizer) -> None:
    # Speculative entries expire at once: only the engine's events can explain the affinity.
    async with running(tokenizer, limits__speculative_ttl_s=0.001) as h:
        holder = await h.warm([*PREFIX, 1, 2, 3])
        for suffix in ([7, 8, 9], [4, 4], [5, 6, 7, 8, 9]):
            answer = await h.post("/v1/completions", completion(suffix))
            assert answer.status == 200
            assert answer.headers["x-kvlb-replica"] == holder
            assert answer.headers["x-kvlb-cached-tokens"] == "32"
            # The engine's own report agrees with the prediction.
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        assert metric_value(text, "kvlb_route_predicted_cached_tokens_total", replica=holder) == 96
        assert metric_value(text, "kvlb_route_reported_cached_tokens_total", replica=holder) == 96

        async with h.session.post(
            h.replica(holder).url + "/admin/faults", json={"restart": True}
        ) as response:
            assert response.status == 200

        async def cleared() -> bool:
            return int((await h.replica_view(holder))["index"]["blocks"]) == 0

        await wait_for(f"{holder}'s blocks to be cleared after its restart", cleared)
        explained = await h.admin("POST", "/admin/explain", completion([7, 8, 9]))
        assert all(term["overlap_blocks"] == 0 for term in explained["decision"]["terms"])
        answer = await h.post("/v1/completions", completion([7, 8, 9]))
        assert answer.headers["x-kvlb-cached-tokens"] == "0"


async def test_replica_crash_mid_stream_ends_with_an_error_event_and_frees_its_load(
    tokenizer: Tokenizer,
) -> None:
    async with running(tokenizer) as h:
        holder = await h.warm(PREFIX)
        async with h.session.post(
            h.replica(holder).url + "/admin/faults", json={"crash_after_chunks": 3}
        ) as r:
            assert r.status == 200
        answer = await h.post("/v1/completions", completion([1], stream=True, max_tokens=30))
        assert answer.status == 200 and answer.headers["x-kvlb-replica"] == holder
        payloads = sse_payloads(answer.body)
        assert len(payloads) == 4 and "[DONE]" not in payloads
        assert [p["choices"][0]["index"] for p in payloads[:3]] == [0, 0, 0]
        error = payloads[-1]["error"]
        assert error["code"] == 502 and holder in error["message"]
        view = await h.replica_view(holder)
        assert view["inflight"] == 0
        assert view["load"]["pending_prefill_seqs"] == 0 and view["load"]["active_decode_seqs"] == 0
        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        assert metric_value(text, "kvlb_http_requests_total", status="stream_error", replica=holder) == 1


async def test_replica_dead_before_the_first_byte_is_retried_on_another(tokenizer: Tokenizer) -> None:
    # Probes are slow here, so the balancer still believes the dead replica is healthy. Only its HTTP
    # listener goes (a killed process would also close its event socket, which resyncs its blocks
    # away, so the prefix would no longer draw the request to it).
    async with running(tokenizer, health_interval_s=60.0) as h:
        holder = await h.warm(PREFIX)
        other = "r1" if holder == "r0" else "r0"
        await h.replica(holder).refuse_connections(30.0)
        answer = await h.post("/v1/completions", completion([9, 9], stream=True))
        assert answer.status == 200
        assert answer.headers["x-kvlb-replica"] == other
        assert sse_payloads(answer.body)[-1] == "[DONE]"
        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        assert metric_value(text, "kvlb_upstream_retries_total") == 1
        view = await h.replica_view(holder)
        assert view["health"]["consecutive_failures"] == 1 and view["inflight"] == 0


async def test_put_policy_changes_decisions_at_once(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="balancer.api")
    caplog.set_level(logging.DEBUG, logger="balancer.service.dispatch")
    async with running(tokenizer) as h:
        holder = await h.warm(PREFIX)
        before = [
            (await h.post("/v1/completions", completion([i]))).headers["x-kvlb-replica"] for i in range(3)
        ]
        assert before == [holder] * 3
        policy = await h.admin("PUT", "/admin/policy", {"name": "round_robin"})
        assert policy["name"] == "round_robin" and policy["version"] == 2
        audit = [r.getMessage() for r in caplog.records if r.name == "balancer.api.admin"]
        assert audit == [
            "policy v2 set by anonymous@127.0.0.1: name: cost -> round_robin; actor: admin; reason: -"
        ]
        decisions = [r.getMessage() for r in caplog.records if r.name == "balancer.service.dispatch"]
        assert len(decisions) == 4 and f"-> {holder}" in decisions[-1] and "cost=" in decisions[-1]
        after = [
            (await h.post("/v1/completions", completion([i]))).headers["x-kvlb-replica"] for i in range(4)
        ]
        assert sorted(set(after)) == ["r0", "r1"]

        policy = await h.admin("PUT", "/admin/policy", {"name": "cost", "weights": {"overlap_credit": 0.25}})
        assert policy["version"] == 3 and policy["weights"]["overlap_credit"] == 0.25
        assert policy["changed"] == {"name": ["round_robin", "cost"], "overlap_credit": [1.0, 0.25]}
        explained = await h.admin("POST", "/admin/explain", completion([5]))
        terms = {t["replica"]: t for t in explained["decision"]["terms"]}
        # prefill = pending + request_blocks - credit * overlap = 0 + 8 - 0.25 * 8 on the holder.
        assert terms[holder]["prefill_term"] == pytest.approx(6.0)

        async with h.session.put(
            h.url + "/admin/policy", json={"weights": {"overlap_credit": 5}}
        ) as response:
            assert response.status == 400
            assert "overlap_credit" in (await response.json())["error"]["message"]
        assert (await h.admin("GET", "/admin/policy"))["version"] == 3


async def test_a_trtllm_replica_gets_affinity_from_its_drained_events(tokenizer: Tokenizer) -> None:
    prompt = list(range(2000, 2070))  # TRT-LLM caches prompt[:-1]: 2 full blocks of 32 tokens
    async with running(tokenizer, 2, engines=("sglang", "trtllm"), limits__speculative_ttl_s=0.001) as h:
        await h.admin("POST", "/admin/replicas/r0/drain")
        first = await h.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert first.headers["x-kvlb-replica"] == "r1"

        async def indexed() -> bool:
            view = await h.replica_view("r1")
            return bool(view["index"]["blocks"] >= 2 and view["events"]["sources"][0]["kind"] == "trtllm")

        await wait_for("r1's polled TRT-LLM events in the index", indexed)
        await h.admin("POST", "/admin/replicas/r0/undrain")
        for suffix in ([1], [2, 3], [4, 5, 6]):
            answer = await h.post(
                "/v1/completions", {"model": MODEL, "prompt": prompt + suffix, "max_tokens": 1}
            )
            assert answer.headers["x-kvlb-replica"] == "r1"
            assert answer.headers["x-kvlb-cached-tokens"] == "64"
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


async def test_the_held_roots_charge_is_set_at_runtime_and_explained(tokenizer: Tokenizer) -> None:
    """``root_weight`` and ``root_cap_prompts`` through ``PUT /admin/policy`` (400 out of range);
    with the charge on (the default since 2026-11-29), ``/admin/explain`` shows each replica's held
    roots and its root term; with ``root_weight`` 0 it reads none."""
    async with running(tokenizer) as h:
        holder = await h.warm(PREFIX)
        assert (await h.admin("GET", "/admin/policy"))["weights"]["root_weight"] == 1.0  # on by default
        off = await h.admin("PUT", "/admin/policy", {"weights": {"root_weight": 0}})
        assert off["changed"] == {"root_weight": [1.0, 0.0]}
        before = await h.admin("POST", "/admin/explain", completion([5]))
        assert all(t["held_roots"] is None and t["root_term"] == 0.0 for t in before["decision"]["terms"])
        policy = await h.admin("PUT", "/admin/policy", {"weights": {"root_weight": 1, "root_cap_prompts": 2}})
        assert (policy["weights"]["root_weight"], policy["weights"]["root_cap_prompts"]) == (1.0, 2.0)
        assert policy["changed"] == {"root_weight": [0.0, 1.0], "root_cap_prompts": [1.0, 2.0]}
        # a prompt nobody holds: the holder of PREFIX homes one root more than the other replica
        fresh = {"model": MODEL, "prompt": list(range(3000, 3032)), "max_tokens": 2, "temperature": 0}
        explained = await h.admin("POST", "/admin/explain", fresh)
        terms = {t["replica"]: t for t in explained["decision"]["terms"]}
        other = "r1" if holder == "r0" else "r0"
        assert terms[holder]["held_roots"] == terms[other]["held_roots"] + 1
        assert terms[holder]["root_term"] == pytest.approx(8.0)  # min(2, 1 · 1) prompt of 8 blocks
        assert terms[other]["root_term"] == 0.0 and explained["decision"]["replica"] == other
        for bad in ({"root_weight": 5}, {"root_cap_prompts": 9}, {"root_weight": -1}):
            async with h.session.put(h.url + "/admin/policy", json={"weights": bad}) as response:
                assert response.status == 400
                assert next(iter(bad)) in (await response.json())["error"]["message"]
        assert (await h.admin("GET", "/admin/policy"))["weights"]["root_weight"] == 1.0


async def test_the_ramps_memory_in_seconds_is_set_at_runtime_kept_by_committed_decisions_and_recorded(
    tokenizer: Tokenizer,
) -> None:
    """``ramp_memory_s`` through ``PUT /admin/policy`` (400 out of range, null turns it off);
    ``/admin/explain`` plans without storing the average; each routed request's recorded inputs
    carry the average its predecessor committed and that decision's time, and the note names τ."""
    async with running(tokenizer) as h:
        assert (await h.admin("GET", "/admin/policy"))["weights"]["ramp_memory_s"] == 0.2  # the default
        on = await h.admin("PUT", "/admin/policy", {"weights": {"ramp_memory_s": 0.3}})
        assert on["changed"] == {"ramp_memory_s": [0.2, 0.3]}
        first = await h.admin("POST", "/admin/explain", completion([7]))
        again = await h.admin("POST", "/admin/explain", completion([7]))
        assert "replicas prefilling, averaged 0.00 over 0.3 s)" in first["decision"]["reason"]
        assert first["decision"]["ramp_share"] == again["decision"]["ramp_share"] == 0.0
        for k in range(3):
            answer = await h.post("/v1/completions", completion([8, k]))
            assert answer.status == 200, answer.body
        listed = (await h.admin("GET", "/admin/decisions?limit=3"))["decisions"]
        details = [await h.admin("GET", f"/admin/decisions/{d['id']}") for d in reversed(listed)]
        assert details[0]["inputs"]["ramp_share"] is None and details[0]["inputs"]["ramp_at_s"] is None
        for before, after in itertools.pairwise(details):
            assert after["inputs"]["ramp_share"] == before["decision"]["ramp_share"] is not None
            assert after["inputs"]["ramp_at_s"] is not None
            assert after["inputs"]["ramp_last_share"] == before["decision"]["busy_share"] is not None
        assert all("over 0.3 s" in d["decision"]["reason"] for d in details)
        for bad in ({"ramp_memory_s": -1}, {"ramp_memory_s": 61}, {"ramp_memory_s": "0.3"}):
            async with h.session.put(h.url + "/admin/policy", json={"weights": bad}) as response:
                assert response.status == 400
                assert "ramp_memory_s" in (await response.json())["error"]["message"]
        async with h.session.put(  # the memory in decisions it replaced is an unknown weight
            h.url + "/admin/policy", json={"weights": {"ramp_memory_decisions": 10}}
        ) as response:
            assert response.status == 400
            assert (
                "unknown policy weight(s): ramp_memory_decisions"
                in (await response.json())["error"]["message"]
            )
        off = await h.admin("PUT", "/admin/policy", {"weights": {"ramp_memory_s": None}})
        assert off["changed"] == {"ramp_memory_s": [0.3, None]}
        plain = await h.admin("POST", "/admin/explain", completion([9]))
        assert "averaged" not in plain["decision"]["reason"] and plain["decision"]["ramp_share"] is None
