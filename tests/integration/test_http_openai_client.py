"""kvlb as an OpenAI client sees it (the client walk of 2026-12-01, branch h-clientwalk): the requests
the official ``openai`` Python SDK sends, written out as raw HTTP (the SDK is not a dependency), to
a real balancer in front of emulated replicas.

What the SDK sends, recorded from ``openai`` 3.57 against ``kvlb serve``: ``POST /v1/chat/completions``
with ``Content-Type: application/json``, ``Accept: application/json`` (for a stream too),
``Accept-Encoding: gzip, deflate``, ``Connection: keep-alive``, ``Authorization: Bearer <key>``,
``User-Agent: OpenAI/Python 3.57.0`` and the ``x-stainless-*`` headers (``lang``,
``package-version``, ``os``, ``arch``, ``runtime``, ``runtime-version``, ``async``, ``retry-count``
0, 1, 2 on its retries, ``read-timeout`` 600); no ``Idempotency-Key``. The body holds only the
arguments given (``"stream": true``, ``"stream_options": {"include_usage": true}``), but an argument
given as ``None`` is sent as ``null``. ``models.retrieve(name)`` is ``GET /v1/models/{name}`` with
the name percent-encoded, ``/`` as ``%2F``. It retries 408, 409, 429 and 5xx after ``Retry-After``
(at most 60 s) and raises with ``error.message`` of the JSON body.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web
from kvlb_harness import MODEL, running, shared_deepseek, wait_ready
from waiting import eventually

from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.tokenizer.tokenizer import TokenIdTokenizer, Tokenizer

SDK_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json",
    "User-Agent": "OpenAI/Python 3.57.0",
    "x-stainless-lang": "python",
    "x-stainless-package-version": "3.57.0",
    "x-stainless-async": "false",
    "x-stainless-retry-count": "0",
    "x-stainless-read-timeout": "600",
}
"""What the SDK adds to every request (no API key: the harness sets none)."""
ERROR_KEYS = {"message", "type", "param", "code"}
"""OpenAI's error object (vLLM and SGLang send the same keys, ``code`` the HTTP status)."""


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_retrieve_a_model_by_name(tokenizer: Tokenizer) -> None:
    """``client.models.retrieve(...)``: was a 404 "no such endpoint" for every name, so a client
    checking its model before use could not start."""
    async with running(tokenizer, 1) as h:
        async with h.session.get(h.url + "/v1/models", headers=SDK_HEADERS) as response:
            listed = (await response.json())["data"]
        async with h.session.get(h.url + f"/v1/models/{MODEL}", headers=SDK_HEADERS) as response:
            assert response.status == 200, await response.text()
            assert [await response.json()] == listed
            assert "x-request-id" in response.headers
        # A name with "/" as the SDK sends it (percent-encoded) and as curl does: the route takes
        # both and answers the pool's 404, naming the model and the ones known.
        for path in ("/v1/models/meta-llama%2FLlama-3.1-8B", "/v1/models/meta-llama/Llama-3.1-8B"):
            async with h.session.get(h.url + path, headers=SDK_HEADERS) as response:
                assert response.status == 404
                error = (await response.json())["error"]
                assert error["type"] == "model_not_found"
                assert "'meta-llama/Llama-3.1-8B' is not served here" in error["message"]
                assert f"known models: {MODEL}" in error["message"]


async def test_stream_null_is_a_whole_answer(tokenizer: Tokenizer) -> None:
    """``"stream": null`` (an SDK call with ``stream=None``; OpenAI's schema and vLLM's take it as
    false) was a 400 "'stream' must be a boolean" from kvlb, for a request the engines serve."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    async with running(tokenizer, 1) as h:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            answer = await h.post(path, {**body, "stream": None}, headers=SDK_HEADERS)
            assert answer.status == 200, answer.body
            assert answer.headers["Content-Type"].startswith("application/json")
            assert answer.json()["usage"]["completion_tokens"] == 2
        # A stream that is neither a boolean nor null is still refused, by kvlb, with the field.
        answer = await h.post("/v1/completions", {**completion, "stream": "yes"}, headers=SDK_HEADERS)
        assert answer.status == 400 and "'stream' must be a boolean" in answer.json()["error"]["message"]


async def test_every_error_kvlb_makes_has_openai_shape(tokenizer: Tokenizer) -> None:
    """Each 4xx kvlb writes itself is ``{"error": {"message", "type", "param", "code"}}``: ``param``
    was missing, where OpenAI's, vLLM's and SGLang's errors all have it."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with running(tokenizer, 1, auth__api_keys=["sk-one"]) as h:
        key = {**SDK_HEADERS, "Authorization": "Bearer sk-one"}
        cases: list[tuple[str, str, Any, dict[str, str], int]] = [
            ("POST", "/v1/chat/completions", chat, SDK_HEADERS, 401),
            ("POST", "/v1/chat/completions", b"{not json", key, 400),
            ("POST", "/v1/chat/completions", {**chat, "messages": []}, key, 400),
            ("POST", "/v1/chat/completions", {**chat, "model": "gpt-9"}, key, 404),
            ("GET", "/v1/models/gpt-9", None, key, 404),
            ("GET", "/v1/chat/completions", None, key, 405),
            ("POST", "/v1/embeddings", chat, key, 404),
            ("POST", "/v1/chat/completions", chat, {**key, "x-kvlb-weights": "{}"}, 403),
        ]
        for method, path, body, headers, status in cases:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            async with h.session.request(method, h.url + path, data=data, headers=headers) as response:
                assert response.status == status, (method, path, await response.text())
                error = (await response.json())["error"]
                assert set(error) == ERROR_KEYS, (method, path, error)
                assert error["param"] is None and error["code"] == status
                assert isinstance(error["message"], str) and isinstance(error["type"], str)


async def test_a_client_leaving_a_whole_answer_stops_the_engine(tokenizer: Tokenizer) -> None:
    """A non-streaming request whose client goes away: kvlb closes the replica's connection, and the
    engine must then stop generating, as vLLM and SGLang do. The emulator ran such a request to its
    ``max_tokens`` (it noticed a gone client only when writing, and a whole answer writes once, at
    the end), so the emulated fleet could not show kvlb's close had any effect."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 200}
    data = json.dumps(body).encode()
    # time_scale 0.05: 200 tokens take about 10 s of wall time.
    async with running(tokenizer, 1, time_scale=0.05) as h:
        replica = h.replicas[0]
        port = urlsplit(h.url).port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in SDK_HEADERS.items())
            + "\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        await eventually(lambda: replica.ctx.open_requests == 1, timeout_s=5.0)
        await asyncio.sleep(0.3)  # generating
        assert replica.ctx.open_requests == 1
        writer.close()
        await writer.wait_closed()
        del reader
        # Well before the ~10 s the answer would take (well under a second on a quiet machine).
        open_requests = lambda: replica.ctx.open_requests  # noqa: E731
        await eventually(lambda: open_requests() == 0, timeout_s=4.0, seen=open_requests)
        scheduler = replica.engine.ranks[0].scheduler
        await eventually(lambda: not scheduler.busy, timeout_s=4.0)
        view = await h.replica_view("r0")
        assert view["inflight"] == 0


async def test_a_whole_answer_longer_than_first_byte_s_is_not_retried(tokenizer: Tokenizer) -> None:
    """A non-streaming request: the engine sends its headers with the whole answer, after its last
    token. kvlb waited ``timeouts.first_byte_s`` for them (60 s by default) and then took the
    engine for failed: it started the request over on the next replica, and the next, and answered
    502 "failed before answering" once every one had timed out (each timeout counting against its
    breaker). So any answer generated for longer than ``first_byte_s`` failed, after costing the
    GPU time of ``max_retries + 1`` answers. The SDK's default is such a request."""
    body = {"model": MODEL, "prompt": "a long answer, not streamed", "max_tokens": 30}
    # time_scale 0.05: 30 tokens take about 1.5 s of wall time, three times first_byte_s.
    async with running(tokenizer, 2, time_scale=0.05, timeouts__first_byte_s=0.5) as h:
        answer = await h.post("/v1/completions", body, headers=SDK_HEADERS)
        assert answer.status == 200, answer.body
        assert answer.json()["usage"]["completion_tokens"] == 30
        served = answer.headers["x-kvlb-replica"]
        # One generation: the other replica never saw the request.
        assert {r.config.name: r.ctx.peak_open_requests for r in h.replicas} == {
            r.config.name: int(r.config.name == served) for r in h.replicas
        }
        view = await h.replica_view(served)
        assert view["inflight"] == 0
        assert view["health"]["consecutive_failures"] == 0
        # A stream still has first_byte_s for its headers (an engine sends them at once).
        answer = await h.post("/v1/completions", {**body, "stream": True}, headers=SDK_HEADERS)
        assert answer.status == 200 and answer.body.endswith(b"data: [DONE]\n\n")


async def test_a_whole_answer_on_a_hung_engine_is_retried_once_its_probes_fail() -> None:
    """What ``first_byte_s`` still did for a whole answer: a replica that accepts connections and
    never answers (a stopped process) had its requests retried elsewhere. Now that a whole answer
    waits until ``timeouts.total_s``, it is retried once the replica fails its health probes."""
    hung_ok = asyncio.Event()
    hung_ok.set()
    asked: list[str] = []

    def replica_app(name: str) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            ok = hung_ok.is_set() if name == "hung" else not hung_ok.is_set()
            return web.Response(status=200 if ok else 503)

        async def complete(request: web.Request) -> web.Response:
            asked.append(name)
            if name == "hung":
                await asyncio.sleep(30)  # never answers (cancelled when kvlb closes)
            return web.json_response({"choices": [{"index": 0, "text": "ok"}], "usage": {}})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", health)
        return app

    runners = [web.AppRunner(replica_app(name), shutdown_timeout=0.1) for name in ("hung", "spare")]
    urls = []
    for runner in runners:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": MODEL,
                "replicas": [
                    {"id": name, "url": url, "engine": "sglang", "block_size": 4}
                    for name, url in zip(("hung", "spare"), urls, strict=True)
                ],
            }
        ],
        "health_interval_s": 0.1,
        "scrape_interval_s": 0,
        "timeouts": {"connect_s": 0.2, "first_byte_s": 0.3},
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
    try:
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 4}
            posting = asyncio.ensure_future(session.post(balancer.url + "/v1/completions", json=body))
            await eventually(lambda: asked == ["hung"], timeout_s=5.0)
            await asyncio.sleep(0.6)  # twice first_byte_s: a whole answer is still waited for
            assert not posting.done()
            hung_ok.clear()  # "hung" stops answering its probes (and "spare" starts)
            started = asyncio.get_running_loop().time()
            async with asyncio.timeout(5.0):
                response = await posting
            async with response:
                assert response.status == 200, await response.text()
                assert response.headers["x-kvlb-replica"] == "spare"
            assert asked == ["hung", "spare"]
            # Within a few probe periods (the probe's own timeout is at least 1 s).
            assert asyncio.get_running_loop().time() - started < 3.0
    finally:
        await balancer.stop()
        for runner in runners:
            await runner.cleanup()


async def test_an_engine_refusing_kvlb_is_not_the_clients_key() -> None:
    """An engine started with ``--api-key`` (vLLM answers ``401 {"error": "Unauthorized"}``; its
    ``/health`` needs no key, so the replica looks healthy) refuses every request kvlb sends, since
    kvlb never forwards the client's credentials. kvlb relayed that 401, and the client was told
    its own key was wrong (the SDK raises ``AuthenticationError``, and does not retry). It is a
    replica failure: retried on another replica, and a 502 naming the cause when none is left."""
    asked: list[str] = []

    def replica_app(name: str) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200)

        async def complete(request: web.Request) -> web.Response:
            asked.append(name)
            if name == "keyed":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return web.json_response({"choices": [{"index": 0, "text": "ok"}], "usage": {}})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", health)
        return app

    async def balancer_over(names: tuple[str, ...], urls: dict[str, str]) -> Balancer:
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [
                {
                    "model": MODEL,
                    "replicas": [
                        {"id": name, "url": urls[name], "engine": "sglang", "block_size": 4} for name in names
                    ],
                }
            ],
            "health_interval_s": 0.1,
            "scrape_interval_s": 0,
            "auth": {"api_keys": ["sk-client"]},
            "policy": {"name": "round_robin"},  # each replica chosen first in turn
        }
        balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        return balancer

    runners = {name: web.AppRunner(replica_app(name), shutdown_timeout=0.1) for name in ("keyed", "open")}
    urls = {}
    for name, runner in runners.items():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 4}
    headers = {**SDK_HEADERS, "Authorization": "Bearer sk-client"}
    try:
        async with aiohttp.ClientSession() as session:
            balancer = await balancer_over(("keyed",), urls)
            try:
                await wait_ready(session, balancer.url)
                url = balancer.url + "/v1/completions"
                async with session.post(url, json=body, headers=headers) as response:
                    assert response.status == 502, await response.text()
                    error = (await response.json())["error"]
                assert "replica answered 401, refusing kvlb, not the client" in error["message"]
                assert "require an API key" in error["message"]
            finally:
                await balancer.stop()
            asked.clear()
            balancer = await balancer_over(("keyed", "open"), urls)
            try:
                await wait_ready(session, balancer.url)
                for _ in range(4):  # whichever replica is chosen first, the answer is the open one's
                    async with session.post(
                        balancer.url + "/v1/completions", json=body, headers=headers
                    ) as response:
                        assert response.status == 200, await response.text()
                        assert response.headers["x-kvlb-replica"] == "open"
                assert "keyed" in asked  # chosen first, and retried elsewhere
            finally:
                await balancer.stop()
    finally:
        for runner in runners.values():
            await runner.cleanup()


async def test_replicas_answering_503_give_the_client_a_503_with_retry_after() -> None:
    """Every replica tried answered 503 (an engine whose waiting queue is full says "unavailable,
    try later"): kvlb answered 502 "failed before answering", without ``Retry-After``, where a
    client of the engines would have had their 503. It is now a 503 with ``Retry-After`` (as a
    replica's 429s give a 429), so the SDK backs off as the server asks; a mix with replicas that
    did not answer at all stays a 502."""
    asked: list[str] = []

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def complete(request: web.Request) -> web.Response:
        asked.append(request.host)
        error = {"message": "the waiting queue is full", "type": "ServiceUnavailableError", "code": 503}
        return web.json_response({"object": "error", "error": error}, status=503)

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": MODEL,
                "replicas": [
                    {"id": f"r{i}", "url": url, "engine": "sglang", "block_size": 4} for i in range(2)
                ],
            }
        ],
        "health_interval_s": 0.1,
        "scrape_interval_s": 0,
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
    try:
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 4}
            async with session.post(
                balancer.url + "/v1/completions", json=body, headers=SDK_HEADERS
            ) as response:
                assert response.status == 503, await response.text()
                assert response.headers["Retry-After"] == "1"
                error = (await response.json())["error"]
            assert error["message"] == "replica(s) r0, r1 answered 503 (unavailable): try again later"
            assert len(asked) == 2  # both tried
    finally:
        await balancer.stop()
        await runner.cleanup()


async def test_a_stream_whose_first_token_comes_after_idle_s_is_not_retried() -> None:
    """An engine sends a stream's headers at once and its first chunk after the request's queueing
    and prefill. kvlb waited ``timeouts.idle_s`` (60 s) for that chunk, then closed the stream and
    started the request over on another replica, at the back of its queue (and 502 once every
    replica had been tried): under a deep queue or for a long prompt, a stream never got its first
    token. It now waits until ``timeouts.total_s`` while the replica passes its probes; a replica
    that stops answering them is still left for another."""
    asked: list[str] = []
    healthy = {"slow": True, "spare": True}

    def replica_app(name: str) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if healthy[name] else 503)

        async def complete(request: web.Request) -> web.StreamResponse:
            asked.append(name)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)  # headers at once, as the engines send them
            await asyncio.sleep(1.0 if name == "slow" else 0.0)  # queueing and prefill
            if not healthy[name]:
                await asyncio.sleep(30)  # hung
            event = {"choices": [{"index": 0, "text": name, "finish_reason": "length"}]}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", health)
        return app

    runners = {name: web.AppRunner(replica_app(name), shutdown_timeout=0.1) for name in ("slow", "spare")}
    urls = {}
    for name, runner in runners.items():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": MODEL,
                "replicas": [
                    {"id": name, "url": urls[name], "engine": "sglang", "block_size": 4} for name in urls
                ],
            }
        ],
        "health_interval_s": 0.1,
        "scrape_interval_s": 0,
        "timeouts": {"connect_s": 0.2, "first_byte_s": 0.3, "idle_s": 0.3},
        "policy": {"name": "round_robin"},
    }
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={MODEL: TokenIdTokenizer()})
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "stream": True}
    try:
        await balancer.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, balancer.url)
            url = balancer.url + "/v1/completions"
            for _ in range(2):  # round robin: each replica is chosen first once
                asked.clear()
                async with session.post(url, json=body, headers=SDK_HEADERS) as response:
                    assert response.status == 200, await response.text()
                    replica = response.headers["x-kvlb-replica"]
                    raw = await response.read()
                assert asked == [replica], asked  # served where it was sent, once
                assert f'"text": "{replica}"'.encode() in raw and raw.endswith(b"data: [DONE]\n\n")
            # A replica that stops answering its probes while its stream is silent: retried.
            asked.clear()
            healthy["slow"] = False
            healthy["spare"] = True
            async with asyncio.timeout(5.0):
                while True:  # send until "slow" is chosen first (its probes not failed yet)
                    async with session.post(url, json=body, headers=SDK_HEADERS) as response:
                        assert response.status == 200, await response.text()
                        assert response.headers["x-kvlb-replica"] == "spare"
                        await response.read()
                    if "slow" in asked:
                        break
                    healthy["slow"] = True
                    await asyncio.sleep(0.3)
                    healthy["slow"] = False
    finally:
        await balancer.stop()
        for runner in runners.values():
            await runner.cleanup()
