"""Owned asyncio tasks: start one that reports an unexpected end, cancel a group and wait (I/O).

Every long-running task of kvlb (event sources and appliers, scrapers, probers, discovery, the fleet's
loops) runs until its owner cancels it. :func:`spawn` starts one with :func:`report_exit` attached: a
task that died with an exception is logged as an error, one that ended by itself at info level (a
ZMQ source ends when its context terminates, a fleet loop when its stop event is set).
:func:`stepwise` runs a long piece of pure work written as a generator of steps, giving the loop a
turn between two (the ``/metrics`` render and the workers' merge); :func:`at_once` runs one without
a pause (a caller off the loop, or one whose input is small).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Generator, Sequence
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)

_T = TypeVar("_T")


async def stepwise(steps: Generator[None, None, _T]) -> _T:
    """Run ``steps`` to its end, letting the loop run its other callbacks (requests, I/O) between two
    steps; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(_T, done.value)
        await asyncio.sleep(0)


def at_once(steps: Generator[None, None, _T]) -> _T:
    """What a generator of steps returns, run without a pause."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(_T, done.value)


def spawn(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """Start ``coro`` as task ``name``; its end is reported by :func:`report_exit`."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(report_exit)
    return task


def report_exit(task: asyncio.Task[None]) -> None:
    """Log a task that died (error, with its traceback) or ended by itself (info); cancelled: nothing."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("task %s died", task.get_name(), exc_info=exc)
    else:
        log.info("task %s ended", task.get_name())


CANCEL_WAIT_S = 0.5
"""How long :func:`cancel_all` waits for the tasks to end before cancelling the rest again (seconds)."""
CANCEL_ROUNDS = 6
"""Cancellations :func:`cancel_all` sends a task at most before it leaves it running (logged)."""


async def cancel_all(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` in reverse start order and wait for each to finish.

    A task may swallow a cancellation and go on (an applier writing through the Redis Cluster
    client did, once in a few dozen lease hand-overs, 2026-11-30: its ``cancelling()`` count stood
    at 1 while it waited for its next batch). Waiting for it without end hung the caller: the lease
    manager's tick, its lock held, so the balancer renewed no lease and took none. Tasks still
    running after :data:`CANCEL_WAIT_S` are cancelled again, up to :data:`CANCEL_ROUNDS` times in
    all; one still running then is logged as an error and left."""
    pending = list(tasks)
    for _round in range(CANCEL_ROUNDS):
        if not pending:
            break
        for task in reversed(pending):
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
        pending = [task for task in pending if task in still]
    if pending:
        names = ", ".join(task.get_name() for task in pending)
        log.error("%d task(s) still running after %d cancellations: %s", len(pending), CANCEL_ROUNDS, names)
    for task in tasks:  # retrieved, so an exception is never reported as unretrieved
        if task.done() and not task.cancelled():
            task.exception()
