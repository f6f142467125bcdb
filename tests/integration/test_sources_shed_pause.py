"""A pause of the process is not a flood, against a real publisher: a burst of a few messages whose
reading is interrupted by a pause longer than ``max_behind_s`` (a collection, the process
descheduled on a loaded machine) is decoded in order, not shed and resynced (CI of 2026-12-01: a
replica that sent one prompt's events shed them and lost its indexed blocks). The shed warning
says which cause shed a run, in figures."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import pytest
import zmq.asyncio
from zmq_rig import (  # noqa: F401  (pytest fixtures)
    FAST,
    REPLICA,
    Publisher,
    ctx_fixture,
    eventually,
    publisher_fixture,
    running,
)


def _hold_the_loop(seconds: float) -> None:
    """Block the loop (the source with it), as a long collection or a descheduled process does."""
    time.sleep(seconds)


class PausingGate:
    """A gate that admits every message and pauses the whole process once, after the first decode
    it is charged for (``time.sleep`` on the source's loop, holding it as a long collection does)."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.paused = False

    def admits(self) -> bool:
        return True

    def charge(self, cpu_s: float) -> None:
        if not self.paused:
            self.paused = True
            _hold_the_loop(self.pause_s)

    def spent(self) -> str:
        return "it never is"


async def test_a_pause_in_a_burst_of_three_messages_does_not_shed_them(
    ctx: zmq.asyncio.Context, publisher: Publisher
) -> None:
    """Three pages published at once; the process pauses twice ``max_behind_s`` after decoding the
    first. Before 2026-12-01 the second was shed (``behind``: the run had read for longer than
    ``max_behind_s`` without finding the socket empty), the rank resynced and the rest dropped."""
    settings = dataclasses.replace(FAST, max_behind_s=0.3)
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
        gate = PausingGate(0.6)
        rig.source.gate = gate
        await publisher.wait_subscribed()
        await asyncio.wait_for(publisher.replay_served.wait(), 5)
        await publisher.pages(3)
        await rig.settle(2)
        assert gate.paused
        assert rig.source.shed == 0
        assert rig.index.pages() == [1, 2, 3] and rig.index.resyncs() == []


async def test_a_backlog_shed_for_being_behind_is_warned_with_its_figures(
    ctx: zmq.asyncio.Context, publisher: Publisher, caplog: pytest.LogCaptureFixture
) -> None:
    """A real backlog (400 pages queued, ``max_behind_s`` 2 ms) is still shed for ``behind``, and
    the warning says so: how long the run read and how many messages it handled (before, the same
    words for every cause: "events arrive faster than its ingestion budget allows")."""
    settings = dataclasses.replace(FAST, max_behind_s=0.002, flood_pause_s=0.2)
    caplog.set_level(logging.WARNING, logger="balancer.sources.zmq_sub")
    async with running(ctx, publisher.endpoint, publisher.replay_endpoint, settings=settings) as rig:
        await publisher.wait_subscribed()
        await asyncio.wait_for(publisher.replay_served.wait(), 5)
        await publisher.pages(400)
        _hold_the_loop(0.3)  # while libzmq moves the pages onto the SUB
        await eventually(lambda: rig.source.shed > 0)
    (warning,) = [r.getMessage() for r in caplog.records if "shedding events" in r.getMessage()]
    assert f"replica {REPLICA} rank 0: shedding events (cause behind: read for " in warning
    assert "messages handled in the run" in warning
