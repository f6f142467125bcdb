"""``GET /admin/replicas`` and gRPC ``Admin/ListReplicas`` make their replica views (and messages) a
few replicas at a time with kvlb's event loop let run in between (branch h-listreplicas): a real
balancer over replicas served by the admin-list bench's fleet (``loadtests/bench/admin_list.py``: a
child process answering ``/health``, ``/v1/models`` and ``/metrics`` on a port each, and a ZMQ PUB
each).

* The listing stays consistent while discovery changes the pools: a replica removed while a listing
  is being made is left out, every other one is there, each view whole, and the HTTP body made in
  steps is the text ``strict_json.dumps`` gives of the answer made in one go.

How long the loop is held at 100 replicas: ``test_admin_list_hold.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses

from balancer import strict_json
from balancer.api.admin_replicas import VIEWS_PER_STEP, replicas_answer, replicas_body, replicas_in_steps
from balancer.types import ReplicaId
from loadtests.bench.admin_list import MODEL, _settled, running

STATIC = 2
DISCOVERED = 18


async def test_a_replica_removed_while_the_replicas_are_listed_is_left_out_and_no_view_is_half_made() -> None:
    async with running(STATIC) as balancer:
        await _settled(balancer, STATIC)
        state = balancer.state
        lifecycle = balancer.replicas
        assert lifecycle is not None
        statics = list(state.pools[MODEL].replicas.values())
        for index in range(DISCOVERED):  # as discovery adds them: same engines, other ids
            config = dataclasses.replace(statics[index % STATIC], id=f"d{index:02d}")
            assert await lifecycle.add(MODEL, config)
        ids = [config.id for config in state.pools[MODEL].replicas.values()]
        assert len(ids) == STATIC + DISCOVERED and ids[STATIC] == "d00"
        fields = set(replicas_answer(state)["replicas"][0])

        # made in steps with no other work in between (and the clocks held): the one-go text
        clocks = state.monotonic, state.wall_clock
        held_monotonic, held_wall = state.monotonic(), state.wall_clock()
        state.monotonic, state.wall_clock = (lambda: held_monotonic), (lambda: held_wall)
        try:
            steps = replicas_body(state)
            yields = 0
            while True:
                try:
                    steps.send(None)
                except StopIteration as done:
                    body = done.value
                    break
                yields += 1
            assert body == strict_json.dumps(replicas_answer(state))
        finally:
            state.monotonic, state.wall_clock = clocks
        assert yields == (STATIC + DISCOVERED - 1) // VIEWS_PER_STEP

        # d10 (the 13th) is removed after the listing's first step, before it reaches d10
        gone = "d10"
        listing = asyncio.create_task(replicas_in_steps(state))
        await asyncio.sleep(0)  # the listing made its first step and let the loop run
        assert not listing.done()
        removal = asyncio.create_task(lifecycle.remove(ReplicaId(gone)))
        answer = await listing
        assert await removal
        listed = [view["id"] for view in answer["replicas"]]
        assert listed == [replica for replica in ids if replica != gone]
        for view in answer["replicas"]:
            assert set(view) == fields, view["id"]
            assert view["health"] is not None and view["load"]["replica"] == view["id"], view["id"]
        assert gone not in {config.id for config in state.pools[MODEL].replicas.values()}
        # and a listing after it, in one go or in steps, agrees on who is listed
        assert [view["id"] for view in replicas_answer(state)["replicas"]] == listed
        assert [view["id"] for view in (await replicas_in_steps(state))["replicas"]] == listed
