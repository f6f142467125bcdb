"""An engine whose ``/metrics`` reports figures out of range does not poison routing (branch
h-gauges): two vLLM replicas on 127.0.0.1 (aiohttp servers answering ``/health``, ``/v1/models``,
``/v1/completions`` and a ``/metrics`` of our choosing) behind a real balancer.

``r0`` reports a queue of ``-3``, ``NaN``, ``+Inf``, ``1e300`` or ``2.5`` requests (and a KV usage
of 1.5); ``r1`` an honest queue of 2. With the cost policy's ``queue_weight`` at 1, ``r0``'s queue
term must be 0 (its queue unknown, as when an engine does not report one) and finite, not
``1e300`` (which sent every request elsewhere) nor a dead scraper (``+Inf`` raised
``OverflowError`` out of the scrape loop); the refusal is counted in
``kvlb_scrape_rejected_values_total`` and shown in ``GET /admin/replicas``' ``scrape``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from google.protobuf import json_format
from kvlb_harness import MODEL, metric_value, wait_for, wait_ready

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.tokenizer.tokenizer import TokenIdTokenizer

COMPLETION = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 1}


def vllm_metrics(waiting: str, usage: str) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
    )


@asynccontextmanager
async def vllm_replica(metrics: str) -> AsyncIterator[str]:
    """A vLLM-like replica on 127.0.0.1 (its URL yielded) whose ``/metrics`` answers ``metrics``."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        choice = {"index": 0, "text": "a", "finish_reason": "length"}
        return web.json_response({"id": "c", "object": "text_completion", "choices": [choice]})

    async def scrape(request: web.Request) -> web.Response:
        return web.Response(text=metrics, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def admin(session: aiohttp.ClientSession, url: str, method: str, path: str, body: Any = None) -> Any:
    async with session.request(method, url + path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def bad_and_good(
    stack: AsyncExitStack, bad_metrics: str, *, scrape_interval_s: float, grpc: bool = False
) -> tuple[Balancer, aiohttp.ClientSession]:
    """A ready balancer over ``r0`` (a vLLM replica serving ``bad_metrics``) and ``r1`` (an honest one),
    with a session to it; both stopped with ``stack``."""
    bad = await stack.enter_async_context(vllm_replica(bad_metrics))
    good = await stack.enter_async_context(vllm_replica(vllm_metrics("2.0", "0.25")))
    replicas = [
        {"id": name, "url": url, "engine": "vllm", "block_size": 16}
        for name, url in (("r0", bad), ("r1", good))
    ]
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0, **({"grpc_port": 0} if grpc else {})},
        "pools": [{"model": MODEL, "replicas": replicas}],
        "health_interval_s": 0.2,
        "scrape_interval_s": scrape_interval_s,
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
    await balancer.start()
    stack.push_async_callback(balancer.stop)
    session = await stack.enter_async_context(aiohttp.ClientSession())
    await wait_ready(session, balancer.url)
    return balancer, session


async def replica_views(session: aiohttp.ClientSession, balancer: Balancer) -> dict[str, Any]:
    """``GET /admin/replicas``' views by replica id."""
    listed = (await admin(session, balancer.url, "GET", "/admin/replicas"))["replicas"]
    return {view["id"]: view for view in listed}


@pytest.mark.parametrize(
    ("waiting", "reason"),
    [
        ("-3", "negative"),
        ("NaN", "not_finite"),
        ("+Inf", "not_finite"),
        ("1e300", "above_limit"),
        ("2.5", "not_integer"),
    ],
)
async def test_an_engine_reporting_a_bad_queue_does_not_poison_routing(waiting: str, reason: str) -> None:
    async with AsyncExitStack() as stack:
        balancer, session = await bad_and_good(stack, vllm_metrics(waiting, "1.5"), scrape_interval_s=0.1)

        async def views() -> dict[str, Any]:
            return await replica_views(session, balancer)

        async def scraped_twice() -> bool:
            return all(
                view["scrape"]["scrapes"] - view["scrape"]["errors"] >= 2 for view in (await views()).values()
            )

        await wait_for("two scrapes of each replica", scraped_twice)
        await admin(
            session, balancer.url, "PUT", "/admin/policy", {"name": "cost", "weights": {"queue_weight": 1}}
        )
        explained = await admin(session, balancer.url, "POST", "/admin/explain", COMPLETION)
        terms = {term["replica"]: term for term in explained["decision"]["terms"]}
        assert terms["r1"]["queue_term"] == 2.0  # the honest queue counts
        assert terms["r0"]["queue_term"] == 0.0 and terms["r0"]["waiting_requests"] == 0.0
        assert all(math.isfinite(term["cost"]) for term in terms.values())

        view = (await views())["r0"]
        assert view["load"]["waiting_reqs"] is None and view["load"]["kv_usage"] is None
        assert view["load"]["running_reqs"] == 1  # the rest of the report is kept
        rejection = view["scrape"]["last_rejection"]
        assert rejection["gauge"] in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        assert view["scrape"]["rejected_values"] >= 4  # both figures, twice
        async with session.get(balancer.url + "/metrics") as response:
            text = await response.text()
        for gauge_reason in (reason, "above_limit"):  # the queue's, and the usage of 1.5
            labels = {"replica": "r0", "reason": gauge_reason}
            assert metric_value(text, "kvlb_scrape_rejected_values_total", **labels) >= 2
        assert metric_value(text, "kvlb_scrape_rejected_values_total", replica="r1", reason=reason) == 0

        async with session.post(balancer.url + "/v1/completions", json=COMPLETION) as response:
            assert response.status == 200  # routing goes on


async def test_grpc_list_replicas_types_the_refused_figures_as_http_shows_them() -> None:
    """``ScrapeStatus.rejected_values``, ``last_rejection`` and ``last_rejection_age_s`` (branch
    h-grpclist) say what ``GET /admin/replicas``' ``scrape`` says, and what the same answer's
    ``details`` holds; a replica with nothing refused has them unset."""
    async with AsyncExitStack() as stack:
        balancer, session = await bad_and_good(
            stack, vllm_metrics("-3", "0.25"), scrape_interval_s=0.2, grpc=True
        )

        async def views() -> dict[str, Any]:
            return await replica_views(session, balancer)

        async def refused_twice() -> bool:
            return (await views())["r0"]["scrape"]["rejected_values"] >= 2

        await wait_for("two refused figures of r0", refused_twice)
        channel = await stack.enter_async_context(
            grpc.aio.insecure_channel(f"127.0.0.1:{balancer.grpc_port}")
        )
        before = await views()
        listed = await pb_grpc.AdminStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=10)
        after = await views()
        typed = {replica.id: replica for replica in listed.replicas}

        scrape = typed["r0"].scrape
        assert scrape.HasField("last_rejection") and scrape.HasField("last_rejection_age_s")
        http = after["r0"]["scrape"]
        assert before["r0"]["scrape"]["rejected_values"] <= scrape.rejected_values <= http["rejected_values"]
        rejection = json_format.MessageToDict(scrape.last_rejection, preserving_proto_field_name=True)
        assert rejection == http["last_rejection"] == before["r0"]["scrape"]["last_rejection"]
        assert rejection == {"gauge": "vllm:num_requests_waiting", "value": "-3.0", "reason": "negative"}
        assert 0 <= scrape.last_rejection_age_s <= http["last_rejection_age_s"]
        details = json_format.MessageToDict(typed["r0"].details)["scrape"]
        assert scrape.rejected_values == details["rejected_values"]
        assert rejection == details["last_rejection"]
        assert scrape.last_rejection_age_s == details["last_rejection_age_s"]

        honest = typed["r1"].scrape
        assert (
            after["r1"]["scrape"]["rejected_values"] == 0 and after["r1"]["scrape"]["last_rejection"] is None
        )
        assert honest.rejected_values == 0 and honest.scrapes >= 2
        assert not honest.HasField("last_rejection") and not honest.HasField("last_rejection_age_s")
