"""``kvlb.v1.Balancer`` over a real grpc.aio channel: Generate, Route, Release (emulated replicas)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_harness import failure, grpc_running, token_request
from kvlb_harness import MODEL, metric_value, shared_deepseek, wait_for

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.tokenizer.tokenizer import Tokenizer

PREFIX = list(range(1000, 1032))
"""32 token ids: 8 full blocks of the emulator's 4-token pages."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_generate_streams_the_replicas_chunks_in_order_then_usage(tokenizer: Tokenizer) -> None:
    messages = [pb.ChatMessage(role="user", content="Explain prefix caching in one sentence.")]
    request = pb.GenerateRequest(
        model=MODEL,
        chat_messages=pb.ChatMessages(messages=messages),
        max_tokens=12,
        temperature=0.0,
        extra_json='{"seed": 3}',
    )
    async with grpc_running(tokenizer) as g:
        call = g.balancer.Generate(request, metadata=(("x-request-id", "grpc-1"),))
        chunks = [chunk async for chunk in call]
        metadata = dict(await call.initial_metadata())
        assert await call.code() == grpc.StatusCode.OK
        assert [c.index for c in chunks] == list(range(len(chunks)))
        *relayed, last = chunks
        done = last.done
        assert last.HasField("done") and not last.raw_json
        assert not any(c.HasField("done") for c in relayed)
        assert done.request_id == "grpc-1" == metadata["x-request-id"]
        assert done.replica_id == metadata["x-kvlb-replica"] and done.replica_id in ("r0", "r1")
        assert done.finish_reason == "length"
        assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens > 0
        assert done.usage.HasField("cached_tokens")
        payloads = [json.loads(c.raw_json) for c in relayed]
        assert all(p["model"] == MODEL for p in payloads)
        assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
        assert payloads[-1]["usage"]["completion_tokens"] == 12  # the replica's own usage chunk
        text = "".join(c.text for c in relayed)
        # The same greedy request sent straight to that replica gives the same words in the same order.
        direct = {
            "model": MODEL,
            "messages": [{"role": "user", "content": messages[0].content}],
            "max_tokens": 12,
            "temperature": 0,
            "seed": 3,
        }
        replica_url = g.http.replica(done.replica_id).url
        async with g.http.session.post(replica_url + "/v1/chat/completions", json=direct) as answer:
            expected = (await answer.json())["choices"][0]["message"]["content"]
        assert text == expected and len(text.split()) == 12

        # A second request on the same prompt goes to the same replica, whose cache the engine reports.
        again = [chunk async for chunk in g.balancer.Generate(request)]
        assert again[-1].done.replica_id == done.replica_id
        assert again[-1].done.usage.cached_tokens == again[-1].done.predicted_cached_tokens > 0
        async with g.http.session.get(g.http.url + "/metrics") as response:
            text = await response.text()
        endpoint = "/kvlb.v1.Balancer/Generate"
        assert metric_value(text, "kvlb_http_requests_total", endpoint=endpoint, status="OK") == 2
        assert metric_value(text, "kvlb_http_inflight_requests") == 0


async def test_route_names_the_holder_of_a_hot_prefix_and_reserves_only_when_asked(
    tokenizer: Tokenizer,
) -> None:
    # Speculative entries expire at once: only the engine's events can explain the affinity.
    async with grpc_running(tokenizer, limits__speculative_ttl_s=0.001) as g:
        holder = await g.http.warm([*PREFIX, 1, 2, 3])
        for suffix in ([7, 8, 9], [4, 4]):
            routed = await g.balancer.Route(pb.RouteRequest(request=token_request(PREFIX + suffix)))
            assert routed.replica_id == holder and routed.decision.replica == holder
            assert routed.replica_url == g.http.replica(holder).url
            assert routed.predicted_cached_tokens == 32 and not routed.reserved
            terms = {t.replica: t for t in routed.decision.terms}
            assert sorted(terms) == ["r0", "r1"]
            assert terms[holder].overlap_blocks == 8 and terms[holder].cost < terms[_other(holder)].cost
        assert (await g.http.replica_view(holder))["inflight"] == 0  # nothing was committed
        assert dict(routed.left_out) == {}  # every replica was a candidate

        reserve = pb.RouteRequest(request=token_request(PREFIX, request_id="sidecar-1"), reserve=True)
        routed = await g.balancer.Route(reserve)
        assert routed.reserved and routed.request_id == "sidecar-1" and routed.replica_id == holder
        view = await g.http.replica_view(holder)
        assert view["inflight"] == 1 and view["load"]["pending_prefill_seqs"] == 1
        duplicate = await failure(g.balancer.Route(reserve))
        assert duplicate.code() == grpc.StatusCode.ALREADY_EXISTS
        released = await g.balancer.Release(pb.ReleaseRequest(request_id="sidecar-1"))
        assert released.replica_id == holder
        view = await g.http.replica_view(holder)
        assert view["inflight"] == 0 and view["load"]["pending_prefill_seqs"] == 0
        again = await failure(g.balancer.Release(pb.ReleaseRequest(request_id="sidecar-1")))
        assert again.code() == grpc.StatusCode.NOT_FOUND and "sidecar-1" in again.details()


async def test_grpc_token_ids_are_routed_from_the_message_without_decoding_json(tokenizer: Tokenizer) -> None:
    """gRPC token-id prompts are packed straight from the message (no JSON decoded) and routed to the
    holder of their blocks, ids up to ``2**32 - 1`` included; their packed varints go through the
    memo the HTTP face keeps runs of id text in (its counters): the first sight notes the leading
    ids, the second and third read the one run (1,000 bytes of 5-byte varints) and remember it, the
    fourth finds it; over Route (the message serialized again) and Generate (the bytes received)."""
    prompt = [4_000_000_000 + i * 7919 for i in range(199)] + [2**32 - 1]
    async with grpc_running(tokenizer, limits__speculative_ttl_s=0.001) as g:
        holder = await g.http.warm(prompt)

        async def memo_counts() -> list[float]:
            async with g.http.session.get(g.http.url + "/metrics") as response:
                text = await response.text()
            return [metric_value(text, f"kvlb_tokenizer_token_id_memo_{n}_total") for n in ("hits", "misses")]

        hits, misses = await memo_counts()
        for _ in range(4):
            routed = await g.balancer.Route(pb.RouteRequest(request=token_request(prompt)))
            assert routed.replica_id == holder and routed.predicted_cached_tokens >= 180
            assert routed.prompt_tokens == len(prompt)
        assert await memo_counts() == [hits + 1, misses + 2]
        # Generate looks its ids up as the bytes it received: the same counts, the same answers
        streamed = [[c async for c in g.balancer.Generate(token_request(prompt[1:]))] for _ in range(4)]
        assert await memo_counts() == [hits + 2, misses + 4]
        assert {chunks[-1].done.usage.prompt_tokens for chunks in streamed} == {len(prompt) - 1}
        assert len({"".join(c.text for c in chunks) for chunks in streamed}) == 1  # greedy: one answer
        # the same ids as a lax encoder writes them (each varint a byte longer): as received, runs
        # the memo never saw (misses); serialized again they would be the runs it holds (a hit)
        lax = b"".join(_longer_varint(i) for i in prompt[1:])
        sent = pb.GenerateRequest(model=MODEL, max_tokens=2, temperature=0.0).SerializeToString()
        sent += b"\x1a" + _varint(len(lax) + 1 + len(_varint(len(lax)))) + b"\x0a" + _varint(len(lax)) + lax
        generate = g.channel.unary_stream(
            "/kvlb.v1.Balancer/Generate", response_deserializer=pb.GenerateChunk.FromString
        )
        chunks = [c async for c in generate(sent)]
        assert chunks[-1].done.usage.prompt_tokens == len(prompt) - 1
        assert "".join(c.text for c in chunks) == "".join(c.text for c in streamed[0])
        now_hits, now_misses = await memo_counts()
        assert now_hits == hits + 2 and now_misses > misses + 4


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _longer_varint(value: int) -> bytes:
    """``value`` as a varint one byte longer than needed (a continuation, then a 0 byte)."""
    short = _varint(value)
    return short[:-1] + bytes([short[-1] | 0x80, 0])


async def test_a_replica_crash_mid_stream_ends_the_call_unavailable_and_frees_its_load(
    tokenizer: Tokenizer,
) -> None:
    async with grpc_running(tokenizer) as g:
        holder = await g.http.warm(PREFIX)
        async with g.http.session.post(
            g.http.replica(holder).url + "/admin/faults", json={"crash_after_chunks": 3}
        ) as response:
            assert response.status == 200
        call = g.balancer.Generate(token_request([*PREFIX, 1], max_tokens=30))
        chunks = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for chunk in call:
                chunks.append(chunk)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"replica {holder} failed mid-stream" in info.value.details()
        assert [c.index for c in chunks] == [0, 1, 2] and all(c.text for c in chunks)
        view = await g.http.replica_view(holder)
        assert view["inflight"] == 0 and view["load"]["active_decode_seqs"] == 0


async def test_a_client_going_away_stops_the_replica_and_releases_the_load(tokenizer: Tokenizer) -> None:
    async with grpc_running(tokenizer, 1, time_scale=0.05) as g:  # 20x slower replica: a long stream
        call = g.balancer.Generate(token_request(PREFIX, max_tokens=200))
        first = await call.read()
        assert isinstance(first, pb.GenerateChunk) and first.index == 0
        call.cancel()
        await asyncio.sleep(0)

        async def released() -> bool:
            view = await g.http.replica_view("r0")
            return bool(view["inflight"] == 0 and view["load"]["active_decode_seqs"] == 0)

        await wait_for("the cancelled call's load to be released", released)

        async def stopped() -> bool:
            async with g.http.session.get(g.http.replica("r0").url + "/v1/loads") as response:
                loads = await response.json()
            return bool(loads["loads"][0]["num_running_reqs"] == 0)

        await wait_for("the replica to stop generating", stopped)


def _other(replica: str) -> str:
    return "r1" if replica == "r0" else "r0"


async def test_dry_runs_leave_round_robins_rotation_where_it_is(tokenizer: Tokenizer) -> None:
    """``POST /admin/explain`` "answers the decision it would get now" and gRPC ``Route`` without
    ``reserve`` "commits nothing" (docs/http-api.md): under ``round_robin`` the replica either names
    is where the next request goes, however many dry runs came first, and a reserved ``Route``
    (a commitment) moves the rotation as a forwarded request does."""
    async with grpc_running(tokenizer, 3, policy__name="round_robin") as g:
        prompt = [5, 6, 7, 8, 9]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        went = []
        for turn in range(4):
            explained = [
                (await g.http.admin("POST", "/admin/explain", body))["decision"]["replica"] for _ in range(3)
            ]
            routed = [
                (await g.balancer.Route(pb.RouteRequest(request=token_request(prompt)))).replica_id
                for _ in range(3)
            ]
            assert len({*explained, *routed}) == 1, (turn, explained, routed)
            answer = await g.http.post("/v1/completions", body)
            assert answer.status == 200 and answer.headers["x-kvlb-replica"] == explained[0], turn
            went.append(explained[0])
        assert went[:3] == sorted(went[:3]) and went[3] == went[0]  # the rotation, one step a request
        reserved = await g.balancer.Route(pb.RouteRequest(request=token_request(prompt), reserve=True))
        assert reserved.replica_id == went[1]
        assert (await g.http.admin("POST", "/admin/explain", body))["decision"]["replica"] == went[2]
        await g.balancer.Release(pb.ReleaseRequest(request_id=reserved.request_id))


async def test_route_says_why_a_replica_was_not_a_candidate(tokenizer: Tokenizer) -> None:
    """``RouteResponse.left_out`` (since 2026-12-01, h-srefollow), as the recorded decision's."""
    async with grpc_running(tokenizer) as g:
        await g.http.admin("POST", "/admin/replicas/r1/drain", {"reason": "maintenance"})
        routed = await g.balancer.Route(pb.RouteRequest(request=token_request(PREFIX)))
        assert routed.replica_id == "r0" and dict(routed.left_out) == {"r1": "draining"}
