"""A text far over ``limits.max_prompt_tokens`` is refused before all of it is tokenized, over real
sockets: a balancer (its tokenizer built with the same limit, as ``kvlb serve`` builds it) and an
emulated replica on 127.0.0.1. HTTP answers 400 and gRPC INVALID_ARGUMENT with one clear message,
for a text prompt and a chat; a long text within the limit, encoded in pieces, is routed with
the ids of a whole encode."""

from __future__ import annotations

import pytest
from grpc_harness import failure, grpc_running
from kvlb_harness import MODEL, nothing_held, wait_for

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits

LIMIT = 2_000
"""``limits.max_prompt_tokens`` here, of the settings and of the tokenizer alike."""
LINE = "alpha river stone cloud green seven quiet table\n"
"""Nine tokens a line."""


@pytest.fixture(scope="module")
def tokenizer() -> HfTokenizer:
    return default_tokenizer(TokenizeLimits(max_prompt_tokens=LIMIT, piece_chars=1_000))


async def test_a_text_far_over_the_limit_is_refused_from_its_first_pieces(tokenizer: HfTokenizer) -> None:
    far = LINE * 20_000  # 960,000 characters, 180,000 tokens: 90 times the limit
    assert len(tokenizer._tokenizer.encode(far).ids) > 50 * LIMIT
    limits = {"limits__max_prompt_tokens": LIMIT, "limits__max_body_bytes": 4 * len(far)}
    async with grpc_running(tokenizer, 1, **limits) as g:
        h = g.http
        text = await h.post("/v1/completions", {"model": MODEL, "prompt": far, "max_tokens": 1})
        chat = await h.post(
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": far}], "max_tokens": 1},
        )
        for answer in (text, chat):
            assert answer.status == 400, answer.body
            message = answer.json()["error"]["message"]
            assert "(the rest was not tokenized), over the limit of 2000 tokens" in message, message
            counted = int(message.split("at least ")[1].split()[0])
            assert LIMIT < counted <= LIMIT + 30 * 9  # the limit, and at most one piece of 1,000 characters
        routed = g.balancer.Route(pb.RouteRequest(request=pb.GenerateRequest(model=MODEL, prompt_text=far)))
        error = await failure(routed)
        assert error.code().name == "INVALID_ARGUMENT"
        assert error.details() == text.json()["error"]["message"]
        within = LINE * 40  # 1,920 characters in pieces of 1,000: 360 tokens, routed
        answer = await h.post("/v1/completions", {"model": MODEL, "prompt": within, "max_tokens": 4})
        # the emulated replica's answer (its small cache refuses the prompt) names the count it got
        expected = len(tokenizer._tokenizer.encode(within).ids)
        assert "x-kvlb-replica" in answer.headers and f"prompt ({expected})".encode() in answer.body
        await wait_for("every byte given back", lambda: nothing_held(h), timeout_s=10.0)
