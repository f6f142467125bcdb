"""A non-streaming answer's bytes in ``limits.max_inflight_body_bytes`` (branch h-answerbudget), over
real sockets: replicas on 127.0.0.1 that answer large JSON bodies in parts, pausing between them
while the test looks at the balancer's ``/metrics``, and a real balancer.

Before, a non-streaming answer was buffered whole (up to 64 MiB) outside the budget: N large answers
held N times their size with ``kvlb_admission_body_bytes`` at the size of their requests. Now each
chunk is held while the budget has room for it and given back once written, or however the request
ends; an answer that does not fit is relayed as it arrives (``kvlb_admission_answer_overflow_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from kvlb_harness import MODEL, balancer_over, completion_replica, metric_value, wait_for

from balancer.app import Balancer

PART_BYTES = 256 * 1024
LARGE_PARTS = 8  # 2 MiB before the pause
HEAD = b'{"id":"c1","object":"text_completion","pad":"'
TAIL = b'","usage":{"prompt_tokens":4,"completion_tokens":1}}'
BODY = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}


class PausingReplica:
    """Answers ``/v1/completions`` with a JSON body of ``parts`` parts of :data:`PART_BYTES`, then
    waits for :attr:`go` (set by the test) and either ends it (``then="end"``) or cuts the connection
    (``then="cut"``). :attr:`paused` counts the answers waiting."""

    def __init__(self, parts: int = LARGE_PARTS, then: str = "end") -> None:
        self.parts = parts
        self.then = then
        self.go = asyncio.Event()
        self.paused = 0

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        head, tail = HEAD, TAIL
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(head) + 2 * self.parts * PART_BYTES + len(tail)
        await response.prepare(request)
        await response.write(head)
        for _ in range(self.parts):
            await response.write(b"x" * PART_BYTES)
        self.paused += 1
        await self.go.wait()
        if self.then == "cut":
            assert request.transport is not None
            request.transport.close()
            return response
        for _ in range(self.parts):
            await response.write(b"y" * PART_BYTES)
        await response.write_eof(tail)
        return response


async def metrics_text(balancer: Balancer, session: aiohttp.ClientSession) -> str:
    async with session.get(balancer.url + "/metrics") as response:
        return await response.text()


async def held_bytes(balancer: Balancer, session: aiohttp.ClientSession) -> float:
    return metric_value(await metrics_text(balancer, session), "kvlb_admission_body_bytes")


async def nothing_held(balancer: Balancer, session: aiohttp.ClientSession) -> None:
    async def check() -> bool:
        text = await metrics_text(balancer, session)
        return (
            metric_value(text, "kvlb_admission_body_bytes") == 0
            and metric_value(text, "kvlb_http_inflight_requests") == 0
        )

    await wait_for("every byte given back", check)


async def held_at_pause(
    replica: PausingReplica, balancer: Balancer, session: aiohttp.ClientSession, answers: int = 1
) -> float:
    """The bytes held once ``answers`` answers are paused and their first half is in the balancer."""

    async def paused() -> bool:
        return replica.paused >= answers

    await wait_for("the replica to pause", paused)
    half = answers * replica.parts * PART_BYTES

    async def read() -> bool:
        return await held_bytes(balancer, session) >= half

    with contextlib.suppress(AssertionError):  # reported with the figure below
        await wait_for("the first half of the answer held", read, timeout_s=3.0)
    return await held_bytes(balancer, session)


async def test_a_large_answer_is_held_while_buffered_and_given_back_once_written() -> None:
    replica = PausingReplica()
    async with (
        completion_replica(replica.complete) as url,
        balancer_over(url) as (balancer, session),
    ):
        post = asyncio.create_task(session.post(balancer.url + "/v1/completions", json=BODY))
        held = await held_at_pause(replica, balancer, session)
        assert held >= LARGE_PARTS * PART_BYTES, f"the answer's first half is not counted: {held} bytes held"
        replica.go.set()
        async with await post as response:
            assert response.status == 200
            assert response.headers["Content-Length"] == str(
                len(HEAD) + 2 * LARGE_PARTS * PART_BYTES + len(TAIL)
            )
            answer = json.loads(await response.read())
        assert len(answer["pad"]) == 2 * LARGE_PARTS * PART_BYTES
        await nothing_held(balancer, session)
        text = await metrics_text(balancer, session)
        assert metric_value(text, "kvlb_admission_answer_overflow_total") == 0


async def _ending(
    then: str,
    timeouts: dict[str, float] | None,
    end: Callable[[PausingReplica, asyncio.Task[int]], Awaitable[None]],
) -> tuple[int | None, str]:
    """Start a large answer, check it is held at the pause, end it with ``end``; the client's status
    (``None``: the client left) and the balancer's metrics once every byte is back."""
    replica = PausingReplica(then=then)
    overrides = {} if timeouts is None else {"timeouts": timeouts}
    async with (
        completion_replica(replica.complete) as url,
        balancer_over(url, **overrides) as (balancer, session),
    ):

        async def status() -> int:
            async with session.post(balancer.url + "/v1/completions", json=BODY) as response:
                await response.read()
                return response.status

        post = asyncio.create_task(status())
        held = await held_at_pause(replica, balancer, session)
        assert held >= LARGE_PARTS * PART_BYTES, f"the answer's first half is not counted: {held} bytes held"
        await end(replica, post)
        code: int | None = None
        with contextlib.suppress(asyncio.CancelledError):
            code = await post
        await nothing_held(balancer, session)
        return code, await metrics_text(balancer, session)


async def test_a_replica_failing_mid_answer_gives_every_byte_back() -> None:
    async def cut(replica: PausingReplica, post: asyncio.Task[int]) -> None:
        replica.go.set()

    code, _ = await _ending("cut", None, cut)
    assert code == 502


async def test_a_client_leaving_mid_answer_gives_every_byte_back() -> None:
    async def leave(replica: PausingReplica, post: asyncio.Task[int]) -> None:
        post.cancel()

    code, text = await _ending("end", None, leave)
    assert code is None
    assert metric_value(text, "kvlb_http_requests_total", status="499", endpoint="/v1/completions") == 1


async def test_an_answer_past_the_deadline_gives_every_byte_back() -> None:
    async def wait(replica: PausingReplica, post: asyncio.Task[int]) -> None:
        await asyncio.sleep(0)  # the replica stays paused past timeouts.total_s

    code, _ = await _ending("end", {"total_s": 1.5}, wait)
    assert code == 502


async def test_concurrent_large_answers_beyond_the_budget_are_relayed_whole_and_bounded() -> None:
    budget = 3 * 1024 * 1024
    answers = 5  # 5 × 4 MiB answers, paused at 2 MiB each, under a 3 MiB budget
    replica = PausingReplica()
    limits = {"max_inflight_body_bytes": budget, "max_body_bytes": 1024 * 1024}
    async with (
        completion_replica(replica.complete) as url,
        balancer_over(url, limits=limits) as (balancer, session),
    ):

        async def answer() -> tuple[int, bytes, str | None]:
            async with session.post(balancer.url + "/v1/completions", json=BODY) as response:
                return response.status, await response.read(), response.headers.get("Content-Length")

        posts = [asyncio.create_task(answer()) for _ in range(answers)]
        peak = 0.0

        async def all_paused() -> bool:
            nonlocal peak
            peak = max(peak, await held_bytes(balancer, session))
            return replica.paused >= answers

        await wait_for("every answer paused", all_paused)
        for _ in range(10):  # the balancer has read what the replicas sent before the pause
            peak = max(peak, await held_bytes(balancer, session))
            await asyncio.sleep(0.02)
        replica.go.set()
        results = await asyncio.gather(*posts)
        for status, body, _ in results:
            assert status == 200
            assert len(json.loads(body)["pad"]) == 2 * LARGE_PARTS * PART_BYTES
        # beyond the budget by at most one replica chunk (256 kB read-ahead + one read) an answer
        assert peak <= budget + answers * 512 * 1024, f"peak {peak} bytes held under a {budget}-byte budget"
        await nothing_held(balancer, session)
        text = await metrics_text(balancer, session)
        relayed = metric_value(text, "kvlb_admission_answer_overflow_total")
        assert relayed >= answers - 1, f"only {relayed} answers relayed as they arrived"
        assert sum(1 for _, _, length in results if length is None) == relayed  # chunked, not buffered


async def test_a_small_answer_is_unchanged() -> None:
    async def small(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"id": "c1", "object": "text_completion", "choices": [{"text": "hi"}]})

    async with (
        completion_replica(small) as url,
        balancer_over(
            url, limits={"max_inflight_body_bytes": 1024 * 1024, "max_body_bytes": 1024 * 1024}
        ) as (
            balancer,
            session,
        ),
    ):
        async with session.post(balancer.url + "/v1/completions", json=BODY) as response:
            assert response.status == 200
            body = await response.read()
            assert response.headers["Content-Length"] == str(len(body))
            assert response.headers["Content-Type"].startswith("application/json")
        assert json.loads(body)["choices"][0]["text"] == "hi"
        await nothing_held(balancer, session)
        text = await metrics_text(balancer, session)
        assert metric_value(text, "kvlb_admission_answer_overflow_total") == 0
        assert metric_value(text, "kvlb_http_requests_total", status="200", endpoint="/v1/completions") == 1


async def test_a_replica_failing_after_the_answer_is_relayed_cuts_the_client_connection() -> None:
    replica = PausingReplica(then="cut")
    limits = {"max_inflight_body_bytes": 1024 * 1024, "max_body_bytes": 512 * 1024}
    async with (
        completion_replica(replica.complete) as url,
        balancer_over(url, limits=limits) as (balancer, session),
    ):
        async with session.post(balancer.url + "/v1/completions", json=BODY) as response:
            assert response.status == 200  # relayed from the chunk that did not fit: the head is out
            assert "Content-Length" not in response.headers
            first = await response.content.readexactly(len(HEAD) + LARGE_PARTS * PART_BYTES)
            assert first.startswith(HEAD)
            replica.go.set()
            try:
                await response.read()
            except aiohttp.ClientPayloadError:
                pass  # the chunked body never ends: the client knows the answer is not whole
            else:
                raise AssertionError("a cut answer ended as if whole")
        await nothing_held(balancer, session)
        text = await metrics_text(balancer, session)
        assert metric_value(text, "kvlb_admission_answer_overflow_total") == 1
        assert metric_value(text, "kvlb_http_requests_total", status="stream_error") == 1


async def test_a_relayed_answer_the_client_stops_reading_gives_every_byte_back_at_the_deadline() -> None:
    replica = PausingReplica(parts=48)  # 24 MiB: more than the kernel buffers of both ends take
    replica.go.set()
    limits = {"max_inflight_body_bytes": 1024 * 1024, "max_body_bytes": 512 * 1024}
    async with (
        completion_replica(replica.complete) as url,
        balancer_over(url, limits=limits, timeouts={"total_s": 1.0}) as (balancer, session),
        aiohttp.ClientSession() as reader,
        reader.post(balancer.url + "/v1/completions", json=BODY) as response,
    ):
        assert response.status == 200
        await asyncio.sleep(0.5)  # not reading: the relay waits on the client
        text = await metrics_text(balancer, session)
        assert metric_value(text, "kvlb_http_inflight_requests") == 1
        await nothing_held(balancer, session)  # the deadline passed: the connection dropped
        text = await metrics_text(balancer, session)
        assert metric_value(text, "kvlb_admission_answer_overflow_total") == 1
        assert metric_value(text, "kvlb_http_requests_total", status="499", endpoint="/v1/completions") == 1
        response.release()
