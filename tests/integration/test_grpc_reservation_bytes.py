"""gRPC ``Route(reserve=true)`` reservations are bounded in bytes (``limits.max_reserved_bytes``).

A reservation keeps its decision's plan, with the prompt's token ids and block keys, until its
``Release`` or ``timeouts.total_s``, after its call returned and gave its bytes back to
``limits.max_inflight_body_bytes``. Counted only (``limits.max_inflight``), 1,024 reservations of
the largest prompts held about 1.7 GiB; now a reservation that would pass the byte cap is refused
with RESOURCE_EXHAUSTED and counted, and one released makes room again.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_harness import failure, grpc_running, token_request
from kvlb_harness import MODEL, metric, shared_deepseek

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.grpc.server import RESERVATION_BYTES, RESERVED_KEY_BYTES
from balancer.tokenizer.tokenizer import Tokenizer

PROMPT_IDS = 4096
"""Token ids of each reserved prompt: 1,024 blocks of the emulator's 4-token pages."""
EACH_BYTES = RESERVATION_BYTES + 4 * PROMPT_IDS + RESERVED_KEY_BYTES * (PROMPT_IDS // 4)


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def _prompt(number: int) -> list[int]:
    return [number * 10_000 + position % 9_000 for position in range(PROMPT_IDS)]


async def test_reservations_past_the_byte_cap_are_refused_and_counted(tokenizer: Tokenizer) -> None:
    async with grpc_running(tokenizer, limits__max_reserved_bytes=2 * EACH_BYTES + EACH_BYTES // 2) as g:
        h = g.http
        for number in (1, 2):
            held = await g.balancer.Route(
                pb.RouteRequest(
                    request=token_request(_prompt(number), request_id=f"big-{number}"), reserve=True
                )
            )
            assert held.reserved
        assert await metric(h, "kvlb_grpc_reservations_bytes") == 2 * EACH_BYTES
        third = pb.RouteRequest(request=token_request(_prompt(3), request_id="big-3"), reserve=True)
        refused = await failure(g.balancer.Route(third))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_reserved_bytes" in refused.details()
        assert await metric(h, "kvlb_grpc_reservations_refused_total", bound="bytes") == 1
        assert await metric(h, "kvlb_grpc_reservations_refused_total", bound="count") == 0
        state = h.balancer.state
        assert state is not None
        (router,) = [pool.router for pool in state.pools.values()]
        assert sum(router.in_flight(r) for r in router.space_of) == 2  # the refused one committed nothing
        assert await metric(h, "kvlb_load_tracker_requests", pool=MODEL) == 2
        unreserved = await g.balancer.Route(pb.RouteRequest(request=token_request(_prompt(3))))
        assert not unreserved.reserved  # a decision without a reservation holds nothing: not refused
        await g.balancer.Release(pb.ReleaseRequest(request_id="big-1"))
        assert await metric(h, "kvlb_grpc_reservations_bytes") == EACH_BYTES
        assert (await g.balancer.Route(third)).reserved  # the room given back is used
        assert await metric(h, "kvlb_grpc_reservations_bytes") == 2 * EACH_BYTES
