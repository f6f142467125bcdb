"""The admin views made the cheaper way (branch h-grpclist) are the ones made before, on real replica
states: ``plain_dict`` gives what ``dataclasses.asdict`` gave for every status ``GET /admin/replicas``
reads (load, events, scrape), and ``struct_of`` the ``details`` the strict-JSON round trip gave, the
same bytes. Two real balancers on 127.0.0.1: one over emulated SGLang engines that served requests
and published events, one drained; one over the bench's static vLLM entries, one of which reports a
queue of ``-3`` (a refused figure in its ``scrape``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from google.protobuf import json_format, struct_pb2
from kvlb_harness import MODEL, running, wait_for

from balancer import strict_json
from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.admin_replicas import replicas_answer
from balancer.api.grpc.messages import struct_of
from balancer.api.grpc.replica_messages import replica_message
from balancer.api.plain import plain_dict
from balancer.service.state import ServiceState
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from loadtests.bench.admin_list import running as bench_fleet


def json_way(data: Any) -> struct_pb2.Struct:
    """``struct_of`` before h-grpclist."""
    struct = struct_pb2.Struct()
    json_format.ParseDict(json.loads(strict_json.dumps(data)), struct)
    return struct


def assert_converted_as_before(state: ServiceState) -> int:
    """Every status and view of ``state`` made both ways; how many replicas were compared."""
    now = state.monotonic()
    statuses: list[Any] = [scraper.status() for scraper in state.scrapers.values()]
    statuses += list(state.ingest_status().values())
    for pool in state.pools.values():
        snapshot = pool.router.load_snapshot(now)
        statuses += [snapshot.of(replica) for replica in pool.replicas]
    for status in statuses:
        plain, before = plain_dict(status), dataclasses.asdict(status)
        assert plain == before and strict_json.dumps(plain) == strict_json.dumps(before)
    answer = replicas_answer(state)
    for view in answer["replicas"] + answer["kept_drains"]:
        made, before = struct_of(view), json_way(view)
        assert made == before
        assert made.SerializeToString(deterministic=True) == before.SerializeToString(deterministic=True)
    for view in answer["replicas"]:  # details as ListReplicas makes it: in place, in the answer
        made = replica_message(view, pb.ListReplicasResponse().replicas.add()).details
        assert made == json_way(view)
        assert made.SerializeToString(deterministic=True) == json_way(view).SerializeToString(
            deterministic=True
        )
    return len(answer["replicas"])


async def test_emulated_engines_that_served_and_published_convert_as_before() -> None:
    async with running(TokenIdTokenizer(), 3) as h:
        for start in range(4):
            prompt = list(range(start * 100, start * 100 + 64))
            answer = await h.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert answer.status == 200, answer.body
        await h.admin("POST", "/admin/replicas/r1/drain", {"reason": "conversion test"})

        async def published() -> bool:
            views = (await h.admin("GET", "/admin/replicas"))["replicas"]
            return sum(view["index"]["blocks"] for view in views) > 0

        await wait_for("events in the index", published)
        state = h.balancer.state
        assert state is not None
        views = replicas_answer(state)["replicas"]
        assert any(view["health"]["drain"] is not None for view in views)
        assert any(view["events"]["sources"][0]["messages"] > 0 for view in views)
        assert assert_converted_as_before(state) == 3


async def test_static_replicas_with_a_refused_figure_convert_as_before() -> None:
    async with bench_fleet(11, interval_s=0.1) as balancer:
        state = balancer.state

        async def refused() -> bool:
            return all(
                view["scrape"]["last_rejection"] is not None
                for view in replicas_answer(state)["replicas"]
                if view["id"] in ("r000", "r010")
            )

        await wait_for("the refused figures of r000 and r010", refused)
        assert assert_converted_as_before(state) == 11
