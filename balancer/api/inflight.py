"""The HTTP requests in flight, so that shutdown can end them at its deadline (I/O: asyncio tasks).

aiohttp runs each request's handler in a task of its own. On shutdown its runner waits up to
``shutdown_timeout`` for the handlers, then cancels only the request's body and waits up to
``shutdown_timeout`` *again* before it cancels the handler: a stream kept going for twice the grace
(and a second more per wait past 5 s, which aiohttp rounds up). :class:`InflightRequests` keeps
each handler's task, so that the owner of the runner can cancel what is left once its own grace is
over and the stop is bounded by ``shutdown_grace_s`` as documented. The app's one middleware
(:func:`balancer.api.middleware.kvlb_middleware`, given this set by
:func:`balancer.api.http.build_web_app`) adds the task first and discards it last, around the whole
of its work: no middleware of its own for it (one coroutine a request less).
"""

from __future__ import annotations

import asyncio
from typing import Any


class InflightRequests:
    """The tasks of the requests being handled (one per request; at most the connections open)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        """The handlers' tasks; the middleware adds and discards them."""

    def __len__(self) -> int:
        return len(self.tasks)

    def cancel_all(self) -> int:
        """Cancel every request still in flight (their handlers release what they hold); how many."""
        tasks = [task for task in self.tasks if not task.done()]
        for task in tasks:
            task.cancel()
        return len(tasks)
