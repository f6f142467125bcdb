"""Client errors over real sockets: malformed bodies, limits, unknown models, auth, overrides."""

from __future__ import annotations

import json

import pytest
from kvlb_harness import MODEL, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def message_of(body: bytes) -> str:
    error = json.loads(body)["error"]
    assert isinstance(error["type"], str) and isinstance(error["code"], int)
    return str(error["message"])


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/chat/completions", b"", 400, "empty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "'model'"),
    ("/v1/chat/completions", b'{"model": "sim-test"}', 400, "'messages'"),
    ("/v1/chat/completions", b'{"model": "sim-test", "messages": [{"content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", b'{"model": "sim-test", "messages": [], "stream": true}', 400, "'messages'"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": "hi", "stream": "yes"}', 400, "'stream'"),
    ("/v1/completions", b'{"model": "sim-test"}', 400, "'prompt'"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [1, "a"]}', 400, "'prompt'"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [1], "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [5, -1]}', 400, "outside"),
    # token ids the typed decoder refuses: the stdlib path answers each with its own message
    ("/v1/completions", b'{"model": "sim-test", "prompt": [5, 4294967296]}', 400, "outside [0, 2**32)"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [5, true]}', 400, "array of token ids"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [5, 6.0]}', 400, "array of token ids"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [5, 1e3]}', 400, "array of token ids"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [[5, 6], [7]]}', 400, "batched prompts"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": []}', 400, "must not be empty"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [5,,6]}', 400, "not valid JSON"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": [05]}', 400, "not valid JSON"),
    (
        "/v1/completions",
        b'{"model": "sim-test", "prompt": ' + str(list(range(80))).encode() + b"}",
        400,
        "limit",
    ),
    ("/v1/completions", b'{"model": "gpt-9", "prompt": "hi"}', 404, "known models: sim-test"),
    ("/v1/completions", b'{"model": "sim-test", "prompt": "' + b"x" * 3000 + b'"}', 413, "max_body_bytes"),
    ("/v1/nothing", b"{}", 404, "Not Found"),
]
"""(path, body, expected status, text the error message must contain)."""


async def test_bad_requests_get_a_clear_message(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, limits__max_body_bytes=2048, limits__max_prompt_tokens=64) as h:
        for path, body, status, needle in BAD_REQUESTS:
            answer = await h.post(path, body)
            assert answer.status == status, (body[:60], answer.body)
            assert needle in message_of(answer.body), (body[:60], answer.body)
            assert answer.headers["Content-Type"].startswith("application/json")
            assert "x-request-id" in answer.headers
        # The balancer still serves after all of that.
        assert (
            await h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        ).status == 200


async def test_api_keys_and_the_admin_token_are_enforced(tokenizer: Tokenizer) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}
    async with running(tokenizer, 1, auth__api_keys=["k1", "k2"], auth__admin_token="root") as h:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
            answer = await h.post("/v1/completions", body, headers=headers)
            assert answer.status == 401 and "API key" in message_of(answer.body)
            assert answer.headers["WWW-Authenticate"] == "Bearer"
        assert (await h.post("/v1/completions", body, headers={"Authorization": "Bearer k2"})).status == 200
        async with h.session.get(h.url + "/admin/policy", headers={"Authorization": "Bearer k1"}) as response:
            # a client key is known, only not allowed there: 403 (was a 401 until 2026-12-01)
            assert response.status == 403 and "needs the admin token" in message_of(await response.read())
            assert "WWW-Authenticate" not in response.headers
        async with h.session.get(h.url + "/admin/policy", headers={"Authorization": "Bearer k3"}) as response:
            assert response.status == 401 and "admin token" in message_of(await response.read())
            assert response.headers["WWW-Authenticate"] == "Bearer"
        assert (await h.admin("GET", "/admin/policy", token="root"))["name"] == "cost"
        async with h.session.get(h.url + "/healthz") as response:
            assert response.status == 200


async def test_weight_override_header_needs_permission(tokenizer: Tokenizer) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}
    async with running(tokenizer, 1) as h:
        answer = await h.post("/v1/completions", body, headers={"x-kvlb-weights": '{"overlap_credit": 0.5}'})
        assert answer.status == 403 and "allow_weight_override" in message_of(answer.body)
    async with running(tokenizer, 1, auth__allow_weight_override=True) as h:
        answer = await h.post("/v1/completions", body, headers={"x-kvlb-weights": '{"overlap_credit": 0.5}'})
        assert answer.status == 200
        for bad in ('{"overlap_credit": 5}', '{"bogus": 1}', "[1]", "{"):
            answer = await h.post("/v1/completions", body, headers={"x-kvlb-weights": bad})
            assert answer.status == 400 and "x-kvlb-weights" in message_of(answer.body)
