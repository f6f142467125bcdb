"""Owned asyncio tasks: start one that reports an unexpected end, cancel a group and wait (I/O).

Every long-running task of kvlb (event sources and appliers, scrapers, probers, discovery, the fleet's
loops) runs until its owner cancels it. :func:`spawn` starts one with :func:`report_exit` attached: a
task that died with an exception is logged as an error, one that ended by itself at info level (a
ZMQ source ends when its context terminates, a fleet loop when its stop event is set).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

log = logging.getLogger(__name__)


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


async def cancel_all(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` in reverse start order and wait for each to finish."""
    for task in reversed(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
