"""The drains kept for removed replicas (up to 1,000 listed) are listed, made and encoded a few at a
time on both faces (branch h-workersmerge): with 1,200 kept drains on a real balancer (over the
admin-list bench's fleet of two replicas), ``GET /admin/replicas``' body made in steps, the clocks
held and no other work in between, is the text of the answer made in one go, in about 1,000 / 50 +
1,200 / 50 pauses more than the views' own; gRPC's kept drain messages encoded 20 at a time read
back as the one-go message."""

from __future__ import annotations

import pytest

from balancer import strict_json
from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.admin_replicas import (
    KEPT_PER_STEP,
    MAX_LISTED_KEPT_DRAINS,
    VIEWS_PER_STEP,
    kept_drain_views_in_steps,
    replicas_answer,
    replicas_body,
)
from balancer.api.grpc.admin import kept_drain_parts
from balancer.api.grpc.replica_messages import kept_drain_message
from balancer.health.book import DrainNote
from balancer.types import ReplicaId
from loadtests.bench.admin_list import _settled, running

KEPT = 1_200
REPLICAS = 2


@pytest.mark.faults_long  # make faults: a balancer over the bench's fleet child (9 s at load 30)
async def test_kept_drains_in_steps_are_the_one_go_answer() -> None:
    async with running(REPLICAS) as balancer:
        await _settled(balancer, REPLICAS)
        state = balancer.state
        held_monotonic, held_wall = state.monotonic(), state.wall_clock()
        clocks = state.monotonic, state.wall_clock
        state.monotonic, state.wall_clock = (lambda: held_monotonic), (lambda: held_wall)
        state.health.drain_keep_s = 3600.0
        try:
            for index in range(KEPT):
                note = DrainNote("ops", "test 127.0.0.1", held_wall - 60, f"rack {index % 7} é")
                replica = ReplicaId(f"gone-{index:04d}")
                assert state.health.adopt_kept(replica, note, held_wall - index, held_monotonic, held_wall)
            steps = replicas_body(state)
            pauses = 0
            while True:
                try:
                    steps.send(None)
                except StopIteration as done:
                    body = done.value
                    break
                pauses += 1
            one_go = replicas_answer(state)
            assert body == strict_json.dumps(one_go)
            assert (
                len(one_go["kept_drains"]) == MAX_LISTED_KEPT_DRAINS and one_go["kept_drains_total"] == KEPT
            )
            views = (REPLICAS - 1) // VIEWS_PER_STEP
            kept = (KEPT - 1) // KEPT_PER_STEP + MAX_LISTED_KEPT_DRAINS // KEPT_PER_STEP
            assert views + kept < pauses < views + kept + len(body) // strict_json.STEP_CHARS + 2, pauses

            listed, total = await kept_drain_views_in_steps(state)
            parts = await kept_drain_parts(listed)
            assert len(parts) == MAX_LISTED_KEPT_DRAINS // 20 and total == KEPT
            whole = pb.ListReplicasResponse(
                kept_drains=[kept_drain_message(view) for view in one_go["kept_drains"]]
            )
            assert pb.ListReplicasResponse.FromString(b"".join(parts)) == whole
        finally:
            state.monotonic, state.wall_clock = clocks
