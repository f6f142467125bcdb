"""CORS (``listen.cors_allow_origins``) on real sockets: a real balancer in front of an emulated SGLang
engine, asked as a browser asks (``OPTIONS`` preflight with ``Origin`` and
``Access-Control-Request-*``, then the call with ``Origin``).

* a listed origin's preflight of ``/v1/*`` gets 204 with the methods and the headers it asked for
  that kvlb accepts (``Authorization``, ``Content-Type``, ``x-stainless-*``, ``x-kvlb-*``), without
  an API key (a preflight carries none);
* its calls' answers (a whole answer, a stream, a 401) carry ``Access-Control-Allow-Origin`` and
  expose kvlb's headers;
* another origin gets 403 to its preflight and no CORS header on its calls;
* ``/openapi.json`` (public, no key) is readable by a listed origin as ``/v1/*`` is, not by another;
* ``/admin``, the console and ``/metrics`` never get CORS headers; with no origin listed (the
  default) nothing changes; ``*`` answers ``*``; the loader refuses ``*`` with credentials and a
  malformed origin.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from emulated_replica import started
from kvlb_harness import MODEL, replica_entry, wait_ready
from settings_tree import settings_from

from balancer.app import Balancer
from balancer.errors import ConfigError
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile

PAGE = "http://127.0.0.1:5173"
OTHER = "http://127.0.0.1:5174"
CLIENT_KEY = "sk-client-cors"
BODY = {"model": MODEL, "prompt": list(range(1, 33)), "max_tokens": 2, "temperature": 0}
ASKED = "authorization, content-type, x-stainless-os, x-stainless-retry-count, x-kvlb-tenant, x-evil"


@asynccontextmanager
async def balancer_with(listen: dict[str, Any]) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    zctx = zmq.asyncio.Context()
    config = ReplicaConfig(name="r0", engine="sglang", profile=get_profile("cpu-test"), time_scale=20.0)
    try:
        async with started(config, zctx) as replica, aiohttp.ClientSession() as session:
            tree = {
                "listen": {"host": "127.0.0.1", "port": 0, **listen},
                "pools": [{"model": MODEL, "replicas": [replica_entry(replica)]}],
                "health_interval_s": 0.1,
                "auth": {"api_keys": [CLIENT_KEY], "admin_token": "admin-cors"},
            }
            balancer = Balancer(settings_from(tree, {}), tokenizers={MODEL: TokenIdTokenizer()})
            await balancer.start()
            try:
                await wait_ready(session, balancer.url)
                yield session, balancer.url
            finally:
                await balancer.stop()
    finally:
        zctx.destroy(linger=0)


def preflight_headers(origin: str, method: str = "POST") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": ASKED,
    }


async def test_a_listed_origin_preflights_and_reads_every_answer() -> None:
    async with balancer_with({"cors_allow_origins": [PAGE]}) as (session, url):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
            async with session.options(url + path, headers=preflight_headers(PAGE)) as response:
                assert response.status == 204, (path, await response.text())
                assert response.headers["Access-Control-Allow-Origin"] == PAGE
                assert "POST" in response.headers["Access-Control-Allow-Methods"]
                allowed = {h.strip() for h in response.headers["Access-Control-Allow-Headers"].split(",")}
                assert allowed == {  # x-evil is not one kvlb accepts
                    "authorization",
                    "content-type",
                    "x-stainless-os",
                    "x-stainless-retry-count",
                    "x-kvlb-tenant",
                }
                assert "Origin" in response.headers["Vary"]
                assert "Access-Control-Allow-Credentials" not in response.headers
        headers = {"Origin": PAGE, "Authorization": f"Bearer {CLIENT_KEY}"}
        async with session.post(url + "/v1/completions", json=BODY, headers=headers) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
            exposed = response.headers["Access-Control-Expose-Headers"]
            assert "x-kvlb-replica" in exposed and "x-request-id" in exposed
        streamed = {**BODY, "stream": True}
        async with session.post(url + "/v1/completions", json=streamed, headers=headers) as response:
            assert response.status == 200
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
            await response.read()
        async with session.post(url + "/v1/completions", json=BODY, headers={"Origin": PAGE}) as response:
            assert response.status == 401  # no key: the page can read why
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
        async with session.post(
            url + "/v1/completions", json=BODY, headers=headers | {"Origin": OTHER}
        ) as response:
            assert response.status == 200
            assert "Access-Control-Allow-Origin" not in response.headers
        async with session.options(url + "/v1/completions", headers=preflight_headers(OTHER)) as response:
            assert response.status == 403
            assert "Access-Control-Allow-Origin" not in response.headers
            assert "not in listen.cors_allow_origins" in (await response.json())["error"]["message"]
        async with session.options(url + "/openapi.json", headers=preflight_headers(PAGE, "GET")) as response:
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
        for origin, readable in ((PAGE, True), (OTHER, False)):
            async with session.get(url + "/openapi.json", headers={"Origin": origin}) as response:
                assert response.status == 200  # public: no key
                assert ("openapi" in await response.json()) is True
                assert (response.headers.get("Access-Control-Allow-Origin") == PAGE) is readable
        for path in ("/admin/replicas", "/admin/policy", "/ui/", "/metrics", "/healthz"):
            async with session.options(url + path, headers=preflight_headers(PAGE, "GET")) as response:
                assert response.status in (401, 404, 405), (path, response.status)
                assert "Access-Control-Allow-Origin" not in response.headers, path
            async with session.get(url + path, headers={"Origin": PAGE}) as response:
                assert "Access-Control-Allow-Origin" not in response.headers, path


async def test_without_origins_listed_nothing_answers_cors() -> None:
    async with balancer_with({}) as (session, url):
        async with session.options(url + "/v1/chat/completions", headers=preflight_headers(PAGE)) as response:
            assert response.status == 401  # as before: the preflight has no key
            assert "Access-Control-Allow-Origin" not in response.headers
        headers = {"Origin": PAGE, "Authorization": f"Bearer {CLIENT_KEY}"}
        async with session.post(url + "/v1/completions", json=BODY, headers=headers) as response:
            assert response.status == 200
            assert "Access-Control-Allow-Origin" not in response.headers


async def test_any_origin_is_answered_with_a_star() -> None:
    async with balancer_with({"cors_allow_origins": ["*"]}) as (session, url):
        async with session.options(url + "/v1/completions", headers=preflight_headers(OTHER)) as response:
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == "*"
        headers = {"Origin": OTHER, "Authorization": f"Bearer {CLIENT_KEY}"}
        async with session.post(url + "/v1/completions", json=BODY, headers=headers) as response:
            assert response.headers["Access-Control-Allow-Origin"] == "*"


@pytest.mark.parametrize(
    ("listen", "said"),
    [
        ({"cors_allow_origins": ["*"], "cors_allow_credentials": True}, "'*' is not allowed"),
        ({"cors_allow_origins": ["https://app.example.com/"]}, "is not an origin"),
        ({"cors_allow_origins": ["app.example.com"]}, "is not an origin"),
        ({"cors_allow_origins": ["ftp://app.example.com"]}, "is not an origin"),
    ],
)
def test_the_loader_refuses_a_bad_origin_list(listen: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        settings_from({"listen": listen}, {})
