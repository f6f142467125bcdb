"""Every stream gives a receipt: kvlb asks each engine for usage and gives the client only what it
asked for (``pools[].stream_usage``), through emulated replicas of each engine kind."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvlb_harness import MODEL, Harness, metric_value, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer

PROMPT = list(range(2000, 2040))


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def request(suffix: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [*PROMPT, suffix],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        **extra,
    }


def events(body: bytes) -> list[Any]:
    """The stream's payloads, without what differs from one answer to the next (id, created)."""
    out: list[Any] = []
    for block in body.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        payload = block[6:]
        if payload == b"[DONE]":
            out.append("[DONE]")
            continue
        decoded = json.loads(payload)
        decoded.pop("id", None)
        decoded.pop("created", None)
        out.append(decoded)
    return out


async def receipts(h: Harness, replica: str) -> float:
    async with h.session.get(h.url + "/metrics") as response:
        return metric_value(await response.text(), "kvlb_route_receipts_total", replica=replica) or 0.0


@pytest.mark.parametrize("engine", ["sglang", "vllm", "trtllm"])
async def test_a_stream_without_include_usage_gives_a_receipt_and_the_client_no_usage(
    tokenizer: Tokenizer, engine: str
) -> None:
    async with running(tokenizer, count=1, engines=(engine,)) as h:
        direct_url = h.replicas[0].url
        before = await receipts(h, "r0")
        answer = await h.post("/v1/completions", request(1))
        assert answer.status == 200
        assert b'"usage"' not in answer.body
        assert await receipts(h, "r0") == before + 1
        # what the engine itself sends such a client: the same events
        async with h.session.post(direct_url + "/v1/completions", json=request(1)) as direct:
            assert events(await direct.read()) == events(answer.body)
        # a client that asked gets the usage event as the engine sends it
        asked = await h.post("/v1/completions", request(2, stream_options={"include_usage": True}))
        got = events(asked.body)
        assert got[-1] == "[DONE]" and got[-2]["choices"] == [] and got[-2]["usage"]["prompt_tokens"] == 41
        async with h.session.post(
            direct_url + "/v1/completions", json=request(2, stream_options={"include_usage": True})
        ) as direct:
            assert events(await direct.read()) == got
        assert await receipts(h, "r0") == before + 2


async def test_other_stream_options_are_kept(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, count=1) as h:
        before = await receipts(h, "r0")
        answer = await h.post("/v1/completions", request(3, stream_options={"include_usage": False}))
        assert answer.status == 200 and b'"usage"' not in answer.body
        assert await receipts(h, "r0") == before + 1


async def test_the_switch_off_forwards_the_body_as_it_came(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, count=1, pool={"stream_usage": False}) as h:
        before = await receipts(h, "r0")
        answer = await h.post("/v1/completions", request(4))
        assert answer.status == 200 and b'"usage"' not in answer.body
        assert await receipts(h, "r0") == before  # the engine said nothing: no receipt
