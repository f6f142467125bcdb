"""Request-path security: who may call what, what reaches a replica, where requests may go, and how
every refusal reads. A real balancer in front of recording replicas (:mod:`upstream_stub`).

* Auth matrix: every operation of the OpenAPI document × {no token, a client key, the admin token,
  a wrong token}: ``/v1/*`` needs a client key, ``/admin/*`` the admin token, the operational
  endpoints need nothing; every 401 is JSON with ``WWW-Authenticate: Bearer``; a valid client key
  on ``/admin`` is a 403 (authenticated, not allowed), without it.
* Header allow-list: of the client's headers only ``content-type``, ``accept``, ``x-request-id``,
  ``traceparent`` and ``tracestate`` reach the replica; credentials, cookies, hop-by-hop and
  forwarding headers never do.
* Replica URLs come only from the configuration: no header, body field or path trick makes the
  balancer connect anywhere else (a trap listener counts connections: it must see none).
* Every rejection is a JSON ``{"error": {"message", "type", "param", "code"}}`` with the status in
  ``code``, an ``x-request-id``, and ``Retry-After`` when retrying may help.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from upstream_stub import MODEL, StubRun, Trap, balancer_over

from balancer.api.openapi import openapi_document

KEY, ADMIN = "sk-client-1", "admin-secret-1"
BODY = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1}
ALLOWED_FORWARD = {"content-type", "accept", "x-request-id", "traceparent", "tracestate"}
CLIENT_ADDED = {"host", "content-length", "user-agent", "accept-encoding"}
"""Headers the balancer's own HTTP client writes (with its own values)."""


async def call(
    run: StubRun, method: str, path: str, token: str | None, body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None if body is None else json.dumps(body).encode()
    async with run.session.request(method, run.balancer.url + path, data=data, headers=headers) as response:
        return response.status, lower(response.headers), await response.read()


def body_for(path: str) -> Any:
    if path == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if path in ("/v1/completions", "/admin/explain"):
        return BODY
    if path == "/admin/policy":
        return {"weights": {}}
    return None


def lower(headers: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def check_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict[str, Any]:
    assert status == expected, (status, body)
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["code"] == expected and isinstance(error["type"], str) and error["type"]
    assert headers.get("content-type", "").startswith("application/json")
    assert headers.get("x-request-id")
    if expected in (429, 503):
        assert int(headers["retry-after"]) >= 1
    return error  # type: ignore[no-any-return]


async def test_auth_matrix_over_every_documented_operation() -> None:
    async with balancer_over(1, auth__api_keys=[KEY, "sk-client-2"], auth__admin_token=ADMIN) as run:
        for path, methods in openapi_document()["paths"].items():
            concrete = path.replace("{replica}", "stub-0")
            for method in methods:
                body = body_for(path)
                needs = (
                    "admin" if path.startswith("/admin") else "client" if path.startswith("/v1/") else None
                )
                for who, token in (("none", None), ("client", KEY), ("admin", ADMIN), ("wrong", "sk-nope")):
                    status, headers, raw = await call(run, method.upper(), concrete, token, body)
                    allowed = needs is None or who == needs
                    where = f"{method.upper()} {path} as {who}"
                    if allowed:
                        assert status not in (401, 403), where
                        assert status < 500, (where, status, raw)
                    elif who == "client" and needs == "admin":  # authenticated, not allowed
                        error = check_error(status, headers, raw, 403)
                        assert "www-authenticate" not in headers, where
                        assert error["type"] == "permission_error", where
                        assert "needs the admin token" in error["message"], where
                    else:
                        check_error(status, headers, raw, 401)
                        assert headers["www-authenticate"] == "Bearer", where


async def test_only_allow_listed_headers_reach_the_replica() -> None:
    hostile = {
        "Authorization": f"Bearer {KEY}",
        "Cookie": "session=s3cr3t-cookie",
        "X-Api-Key": "s3cr3t-x-api-key",
        "Proxy-Authorization": "Basic s3cr3t-proxy",
        "X-Forwarded-For": "10.6.6.6",
        "X-Forwarded-Host": "evil.example",
        "Forwarded": "for=10.6.6.6;host=evil.example",
        "X-Real-IP": "10.6.6.6",
        "Upgrade": "h2c",
        "Te": "trailers",
        "X-Kvlb-Replica": "http://evil.example",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=1",
        "X-Request-ID": "req-allow-list-1",
        "Accept": "application/json",
    }
    async with balancer_over(1, auth__api_keys=[KEY]) as run:
        url = run.balancer.url + "/v1/completions"
        async with run.session.post(
            url, data=json.dumps(BODY), headers={**hostile, "Content-Type": "application/json"}
        ) as response:
            assert response.status == 200, await response.text()
        seen = run.replicas[0].seen[-1]
        forwarded = {name.lower() for name in seen.headers}
        assert forwarded <= ALLOWED_FORWARD | CLIENT_ADDED, forwarded - ALLOWED_FORWARD - CLIENT_ADDED
        assert seen.headers["traceparent"] == hostile["traceparent"]
        assert seen.headers["x-request-id"] == "req-allow-list-1"
        everything = json.dumps(seen.headers)
        for secret in ("s3cr3t", KEY, "10.6.6.6", "evil.example"):
            assert secret not in everything, secret
        assert seen.headers["host"] == run.replicas[0].url.removeprefix("http://")
        names = [name for name, _ in seen.raw]
        assert len(names) == len(set(names)), f"a header was sent twice: {seen.raw}"


async def test_no_request_can_make_the_balancer_connect_to_another_address() -> None:
    trap = Trap()
    await trap.start()
    evil = f"127.0.0.1:{trap.port}"
    try:
        async with balancer_over(2) as run:
            attempts: list[tuple[str, dict[str, str], Any]] = [
                ("/v1/completions", {"Host": evil}, BODY),
                ("/v1/completions", {"X-Forwarded-Host": evil, "Forwarded": f"host={evil}"}, BODY),
                ("/v1/completions", {"x-kvlb-replica": f"http://{evil}"}, BODY),
                (
                    "/v1/completions",
                    {},
                    {**BODY, "replica_url": f"http://{evil}", "base_url": f"http://{evil}"},
                ),
                ("/v1/completions", {}, {**BODY, "model": f"http://{evil}/v1"}),
                (f"/v1/completions?url=http://{evil}", {}, BODY),
                ("//" + evil + "/v1/completions", {}, BODY),
                ("/v1/../" + evil + "/v1/completions", {}, BODY),
                ("/admin/replicas/stub-0/drain?url=http://" + evil, {}, None),
                ("/admin/explain", {"Host": evil}, {**BODY, "replica_url": f"http://{evil}"}),
            ]
            statuses = []
            for path, headers, body in attempts:
                data = None if body is None else json.dumps(body)
                async with run.session.post(run.balancer.url + path, data=data, headers=headers) as response:
                    statuses.append(response.status)
                    await response.read()
            await asyncio.sleep(0.3)  # any connection attempt would have landed by now
            assert trap.connections == 0, statuses
            assert statuses.count(200) >= 6, statuses
            served = sum(len(r.seen) for r in run.replicas)
            assert served == statuses[:6].count(200)
    finally:
        await trap.stop()


async def test_every_rejection_is_a_clear_json_error() -> None:
    overrides = {
        "auth__api_keys": [KEY],
        "limits__max_body_bytes": 2048,
        "limits__max_prompt_tokens": 64,
        "limits__max_inflight": 1,
        "limits__max_queued": 0,
        "timeouts__body_read_s": 0.3,
    }
    auth = {"Authorization": f"Bearer {KEY}"}
    async with balancer_over(1, **overrides) as run:
        url = run.balancer.url

        async def post(
            path: str, data: bytes, headers: dict[str, str] | None = None
        ) -> tuple[int, dict[str, str], bytes]:
            async with run.session.post(
                url + path, data=data, headers={**auth, **(headers or {})}
            ) as response:
                return response.status, lower(response.headers), await response.read()

        cases: list[tuple[str, int, tuple[int, dict[str, str], bytes]]] = [
            ("no key", 401, await post("/v1/completions", json.dumps(BODY).encode(), {"Authorization": ""})),
            ("bad json", 400, await post("/v1/completions", b"{not json")),
            ("not an object", 400, await post("/v1/completions", b"[1, 2]")),
            ("missing prompt", 400, await post("/v1/completions", json.dumps({"model": MODEL}).encode())),
            (
                "bad field type",
                400,
                await post("/v1/completions", json.dumps({**BODY, "stream": "yes"}).encode()),
            ),
            (
                "long prompt",
                400,
                await post("/v1/completions", json.dumps({**BODY, "prompt": list(range(100))}).encode()),
            ),
            (
                "weights header",
                403,
                await post("/v1/completions", json.dumps(BODY).encode(), {"x-kvlb-weights": "{}"}),
            ),
            (
                "unknown model",
                404,
                await post("/v1/completions", json.dumps({**BODY, "model": "gpt-x"}).encode()),
            ),
            ("unknown route", 404, await post("/v1/nope", b"{}")),
            ("too large", 413, await post("/v1/completions", b"{" + b" " * 4096 + b"}")),
        ]
        async with run.session.get(url + "/v1/completions", headers=auth) as response:
            cases.append(
                ("wrong method", 405, (response.status, lower(response.headers), await response.read()))
            )
        cases.append(("slow body", 408, await _slow_body(run, auth)))
        cases.append(("over capacity", 429, await _over_capacity(run, auth)))
        await run.session.post(url + "/admin/replicas/stub-0/drain")
        cases.append(("no healthy replica", 503, await post("/v1/completions", json.dumps(BODY).encode())))
        for name, expected, (status, headers, raw) in cases:
            try:
                check_error(status, headers, raw, expected)
            except (AssertionError, KeyError, ValueError) as exc:
                raise AssertionError(f"{name}: {status} {headers} {raw[:300]!r}") from exc
        assert "POST" in next(c[2][1]["allow"] for c in cases if c[1] == 405)


async def _slow_body(run: StubRun, auth: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    async def trickle() -> Any:
        yield b'{"model": '
        await asyncio.sleep(1.0)
        yield b'"x"}'

    url = run.balancer.url + "/v1/completions"
    async with run.session.post(url, data=trickle(), headers=auth) as response:
        return response.status, lower(response.headers), await response.read()


async def _over_capacity(run: StubRun, auth: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """Hold the one slot with a slow body, then ask again."""
    release = asyncio.Event()

    async def held_body() -> Any:
        yield b'{"model": '
        await release.wait()
        yield b'"x"}'

    url = run.balancer.url + "/v1/completions"
    holder = asyncio.create_task(run.session.post(url, data=held_body(), headers=auth))
    await asyncio.sleep(0.1)
    try:
        async with run.session.post(url, data=json.dumps(BODY), headers=auth) as response:
            return response.status, lower(response.headers), await response.read()
    finally:
        release.set()
        held: aiohttp.ClientResponse = await holder
        held.release()
