"""``cancel_all``: a task that swallows a cancellation is cancelled again, and one that never ends is
left (logged) instead of hanging its owner (a lease manager's tick hung so, 2026-11-30)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from unstalled import Unstalled

from balancer import tasks
from balancer.tasks import cancel_all


async def swallowing(swallow: int, cancelled: list[int]) -> None:
    """Waits forever; swallows its first ``swallow`` cancellations."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(1)
            if len(cancelled) > swallow:
                raise


async def test_a_task_that_swallows_one_cancellation_is_cancelled_again() -> None:
    cancelled: list[int] = []
    plain = asyncio.create_task(asyncio.sleep(3600))
    stubborn = asyncio.create_task(swallowing(1, cancelled))
    await asyncio.sleep(0)
    started = Unstalled()  # a loaded machine's stall of this process is not a round
    await asyncio.wait_for(cancel_all([plain, stubborn]), 5 * tasks.CANCEL_WAIT_S)  # hung before
    assert plain.cancelled() and stubborn.cancelled()
    assert len(cancelled) == 2
    assert started.seconds() < 4 * tasks.CANCEL_WAIT_S  # one more round, not the bound


async def test_a_task_that_never_ends_is_left_and_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every round waits out its whole wait here: a tenth of a second instead of the half (0.6 s in
    # all, not 3 s); how many rounds, what is cancelled and what is logged do not depend on it, and
    # each cancellation reaches the task in the loop's next turn, long before any round's wait ends
    monkeypatch.setattr(tasks, "CANCEL_WAIT_S", 0.1)
    cancelled: list[int] = []
    stubborn = asyncio.create_task(swallowing(tasks.CANCEL_ROUNDS, cancelled))
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="balancer.tasks"):
        # returns after its rounds (0.6 s) instead of hanging; the second is slack for a loaded machine
        await asyncio.wait_for(cancel_all([stubborn]), tasks.CANCEL_ROUNDS * tasks.CANCEL_WAIT_S + 1.0)
    assert not stubborn.done()
    assert len(cancelled) == tasks.CANCEL_ROUNDS
    assert "still running after" in caplog.text and stubborn.get_name() in caplog.text
    stubborn.cancel()  # the one more it needed
    with contextlib.suppress(asyncio.CancelledError):
        await stubborn


async def test_exceptions_are_retrieved_and_finished_tasks_are_fine() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fails())
    done = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    await cancel_all([failed, done])
    await cancel_all([])
    assert isinstance(failed.exception(), RuntimeError) and done.done()
