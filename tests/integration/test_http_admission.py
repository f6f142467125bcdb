"""Admission and lifecycle over real sockets: in-flight caps, draining, readiness, client disconnects."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kvlb_harness import MODEL, Harness, metric_value, running, shared_deepseek, wait_for, wait_ready
from procs_free import free_port

from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.tokenizer.tokenizer import TokenIdTokenizer, Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def long_stream(first: int) -> dict[str, Any]:
    """A streaming request that generates for a while (hundreds of tokens at a slowed time scale)."""
    return {"model": MODEL, "prompt": [first, 2, 3, 4, 5], "max_tokens": 200, "stream": True}


async def open_streams(h: Harness, count: int) -> list[aiohttp.ClientResponse]:
    """Start ``count`` streams and wait for each one's first chunk (so all are in flight)."""
    responses = []
    for index in range(count):
        response = await h.session.post(h.url + "/v1/completions", json=long_stream(10 + index))
        responses.append(response)
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"data: ")
    return responses


async def close_streams(responses: list[aiohttp.ClientResponse]) -> None:
    for response in responses:
        response.close()


async def test_over_the_inflight_cap_the_balancer_answers_429_with_retry_after(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 2, time_scale=0.25, limits__max_inflight=1, limits__max_queued=0) as h:
        streams = await open_streams(h, 1)
        try:
            answer = await h.post("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 1})
            assert answer.status == 429 and answer.headers["Retry-After"] == "1"
            assert "in flight" in answer.json()["error"]["message"]
        finally:
            await close_streams(streams)
        async with h.session.get(h.url + "/metrics") as response:
            assert (
                metric_value(await response.text(), "kvlb_admission_shed_total", reason="max_inflight") == 1
            )


async def test_with_every_replica_full_the_balancer_answers_429(tokenizer: Tokenizer) -> None:
    async with running(
        tokenizer, 2, time_scale=0.25, limits__max_inflight_per_replica=1, limits__max_queued=0
    ) as h:
        streams = await open_streams(h, 2)
        try:
            views = (await h.admin("GET", "/admin/replicas"))["replicas"]
            assert [v["inflight"] for v in views] == [1, 1]
            answer = await h.post("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 1})
            assert answer.status == 429 and "Retry-After" in answer.headers
            assert "every replica" in answer.json()["error"]["message"]
        finally:
            await close_streams(streams)


async def test_draining_every_replica_gives_503_and_stays_ready(tokenizer: Tokenizer) -> None:
    """Drained by an operator, a pool's requests get 503 with Retry-After; the balancer stays ready
    (``degraded`` says why). The SRE walk of 2026-12-01: it turned unready, and since a drain is the
    same on every balancer, Kubernetes took every pod out of the Service and every model's clients
    lost their connections instead of the pool's clients getting the 503."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    async with running(tokenizer, 2) as h:
        for name in ("r0", "r1"):
            answer = await h.admin("POST", f"/admin/replicas/{name}/drain")
            assert (answer["replica"], answer["draining"], answer["drain"]["by"]) == (name, True, "admin")
        answer = await h.post("/v1/completions", body)
        assert answer.status == 503 and answer.headers["Retry-After"] == "1"
        # the answer says why (the SRE walk of 2026-12-01: it said "no healthy replica" only)
        assert answer.json()["error"]["message"] == f"no healthy replica serves model '{MODEL}' (2 draining)"
        async with h.session.get(h.url + "/readyz") as response:
            assert response.status == 200
            assert await response.json() == {
                "ready": True,
                "degraded": [f"pool '{MODEL}' has every healthy replica drained"],
            }
        await h.admin("POST", "/admin/replicas/r1/undrain")
        for _ in range(3):
            answer = await h.post("/v1/completions", body)
            assert answer.status == 200 and answer.headers["x-kvlb-replica"] == "r1"
        async with h.session.post(h.url + "/admin/replicas/r9/drain") as response:
            assert response.status == 404
        # A drain's body is its reason: anything else is a clear 400, and nothing is drained.
        for bad in (b"[1]", b"{", b'{"reason": 5}', b'{"caller": "x"}', b'{"reason": "' + b"x" * 501 + b'"}'):
            async with h.session.post(h.url + "/admin/replicas/r1/drain", data=bad) as response:
                assert response.status == 400, (bad, await response.text())
                assert "error" in await response.json()
        assert (await h.replica_view("r1"))["health"]["draining"] is False


async def test_explain_and_the_503_say_why_replicas_are_left_out(tokenizer: Tokenizer) -> None:
    """The SRE walk of 2026-12-01: an explanation had no row for a drained or dead replica and did
    not say it left one out, and the 503 of a pool with none left said "no healthy replica" only."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    down = {"failing health probes", "breaker open"}
    async with running(tokenizer, 3) as h:
        await h.admin("POST", "/admin/replicas/r0/drain")
        await h.kill("r1")

        async def r1_left_out() -> bool:
            await h.post("/v1/completions", body)  # requests, or the probes, take r1 out
            return "r1" in (await h.admin("POST", "/admin/explain", body))["left_out"]

        await wait_for("the dead replica to be left out", r1_left_out)
        explained = await h.admin("POST", "/admin/explain", body)
        assert [t["replica"] for t in explained["decision"]["terms"]] == ["r2"]
        assert explained["left_out"]["r0"] == "draining" and explained["left_out"]["r1"] in down
        assert set(explained["left_out"]) == {"r0", "r1"}

        await h.kill("r2")

        async def refused() -> bool:
            return (await h.post("/v1/completions", body)).status == 503

        await wait_for("the pool to have no routable replica", refused)
        answer = await h.post("/v1/completions", body)
        assert answer.status == 503 and answer.headers["Retry-After"] == "1"
        message = answer.json()["error"]["message"]
        prefix = f"no healthy replica serves model '{MODEL}' ("
        assert message.startswith(prefix) and message.endswith(")"), message
        counts: dict[str, int] = {}
        for part in message[len(prefix) : -1].split(", "):
            count, reason = part.split(" ", 1)
            counts[reason] = int(count)
        # the killed ones: refused by their probes, or by the requests that opened their breakers
        assert counts.pop("draining") == 1, message
        assert set(counts) <= down and sum(counts.values()) == 2, message
        async with h.session.get(h.url + "/readyz") as response:  # r0 is healthy, only drained
            assert response.status == 200 and (await response.json())["degraded"]


async def test_a_client_going_away_stops_the_replica_and_frees_the_load(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, time_scale=0.25) as h:
        streams = await open_streams(h, 1)
        await close_streams(streams)  # the client vanishes mid-stream

        async def freed() -> bool:
            view = await h.replica_view("r0")
            async with h.session.get(h.replicas[0].url + "/admin/stats") as stats:
                running_reqs = (await stats.json())["ranks"][0]["num_running_reqs"]
            return bool(view["inflight"] == 0 and running_reqs == 0)

        await wait_for("the replica to stop and the load to be released", freed, timeout_s=3.0)
        async with h.session.get(h.replicas[0].url + "/admin/stats") as stats:
            generated = (await stats.json())["ranks"][0]["generation_tokens_total"]
        assert generated < 200  # it stopped long before max_tokens
        async with h.session.get(h.url + "/metrics") as response:
            assert metric_value(await response.text(), "kvlb_http_requests_total", status="499") == 1


async def test_operational_endpoints(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 2) as h:
        async with h.session.get(h.url + "/healthz") as response:
            assert response.status == 200
        async with h.session.get(h.url + "/readyz") as response:
            assert response.status == 200 and (await response.json()) == {"ready": True}
        async with h.session.get(h.url + "/v1/models") as response:
            models = await response.json()
        assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["replicas"] == 2
        async with h.session.get(h.url + "/openapi.json") as response:
            document = await response.json()
        assert document["openapi"].startswith("3.") and "/admin/explain" in document["paths"]
        assert (
            await h.post("/v1/completions", {"model": MODEL, "prompt": [3, 4, 5, 6], "max_tokens": 2})
        ).status == 200
        async with h.session.get(h.url + "/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
        assert metric_value(text, "kvlb_http_requests_total", endpoint="/v1/completions", status="200") == 1
        assert metric_value(text, "kvlb_route_decision_seconds_count") == 1
        assert metric_value(text, "kvlb_replica_healthy") == 2
        assert metric_value(text, "kvlb_http_inflight_requests") == 0
        views = (await h.admin("GET", "/admin/replicas"))["replicas"]
        assert {v["id"] for v in views} == {"r0", "r1"}
        for view in views:
            assert view["routable"] and view["health"]["breaker"] == "closed"
            assert view["events"]["sources"][0]["kind"] == "zmq"
            assert view["events"]["queued_bytes"] >= 0 and isinstance(view["events"]["queued_bytes"], int)


async def chunked(parts: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(parts):
        yield b" " * size
        await asyncio.sleep(0)


async def test_an_oversized_chunked_body_is_refused_while_reading(tokenizer: Tokenizer) -> None:
    async with (
        running(tokenizer, 1, limits__max_body_bytes=4096) as h,
        h.session.post(h.url + "/v1/completions", data=chunked(4, 2048)) as response,
    ):
        assert response.status == 413
        assert "max_body_bytes" in (await response.json())["error"]["message"]


async def test_a_pool_that_goes_down_after_start_is_degraded_not_unready(tokenizer: Tokenizer) -> None:
    """The SRE walk of 2026-12-01 left it open: a pool whose replicas all went down made every
    balancer unready at once (the same outage is seen by all), so Kubernetes took every pod out of
    the Service and every other model's clients lost the balancer too. Once ready, the balancer
    stays ready: the pool is listed under ``degraded`` and its requests get 503 with Retry-After."""
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    async with running(tokenizer, 2, health_interval_s=0.1) as h:
        for name in ("r0", "r1"):
            await h.kill(name)

        async def down() -> bool:
            answer = await h.post("/v1/completions", body)
            return answer.status == 503

        await wait_for("the pool to have no healthy replica", down)
        answer = await h.post("/v1/completions", body)
        assert answer.headers["Retry-After"] == "1"
        async with h.session.get(h.url + "/readyz") as response:
            assert response.status == 200
            answer_json = await response.json()
        # why, counted: their probes fail, or their breakers opened first (the requests' failures)
        (degraded,) = answer_json.pop("degraded")
        assert answer_json == {"ready": True}
        assert re.fullmatch(
            rf"pool '{MODEL}' has no healthy replica \((2|1) (failing health probes|breaker open)"
            r"(, 1 (failing health probes|breaker open))?\)",
            degraded,
        ), degraded


async def test_at_start_a_pool_with_no_healthy_replica_waits_at_most_health_ready_wait_s() -> None:
    """A new pod is not ready until every pool has a healthy replica (its replicas probed), but a
    pool that stays down does not hold it unready for ever (a rolling update would stall): after
    ``health_ready_wait_s`` it is ready, with the pool under ``degraded``."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": [{"id": "r0", "url": dead, "engine": "sglang"}]}],
        "health_interval_s": 0.1,
        "health_ready_wait_s": 1.0,
        "scrape_interval_s": 0,
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
    await balancer.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(balancer.url + "/readyz") as response:
                assert response.status == 503
                reasons = (await response.json())["reasons"]
                assert f"pool '{MODEL}' has no healthy replica (1 failing health probes)" in reasons
            started = time.monotonic()
            await wait_ready(session, balancer.url)
            assert 0.5 < time.monotonic() - started < 3.0
            async with session.get(balancer.url + "/readyz") as response:
                degraded = (await response.json())["degraded"]
                assert degraded == [f"pool '{MODEL}' has no healthy replica (1 failing health probes)"]
    finally:
        await balancer.stop()
