"""The HTTP requests in flight, so that shutdown can end them at its deadline (I/O: asyncio tasks).

aiohttp runs each request's handler in a task of its own. On shutdown its runner waits up to
``shutdown_timeout`` for the handlers, then cancels only the request's body and waits up to
``shutdown_timeout`` *again* before it cancels the handler: a stream kept going for twice the grace
(and a second more per wait past 5 s, which aiohttp rounds up). :class:`InflightRequests` keeps
each handler's task (its middleware, outermost), so that the owner of the runner can cancel what is
left once its own grace is over and the stop is bounded by ``shutdown_grace_s`` as documented.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class InflightRequests:
    """The tasks of the requests being handled (one per request; at most the connections open)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - aiohttp always runs a handler in a task
            return await handler(request)
        self._tasks.add(task)
        try:
            return await handler(request)
        finally:
            self._tasks.discard(task)

    def cancel_all(self) -> int:
        """Cancel every request still in flight (their handlers release what they hold); how many."""
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        return len(tasks)
