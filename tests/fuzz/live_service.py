"""A balancer with emulated replicas on an event loop in a background thread (test helper, I/O).

Synchronous clients (schemathesis's ``requests``, raw sockets for slowloris) talk to it from the test
thread; :func:`live` starts it, yields the harness, and stops everything (bounded waits) on exit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from kvlb_harness import Harness, running, shared_deepseek

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


class LiveService:
    """The running harness and its loop (call :meth:`run` to execute a coroutine on that loop)."""

    def __init__(self) -> None:
        self.harness: Harness | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        assert self.harness is not None
        return self.harness.url

    def run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)


@contextmanager
def live(count: int = 2, **overrides: Any) -> Iterator[LiveService]:
    """``count`` replicas and a balancer (``overrides`` as in :func:`kvlb_harness.settings_for`)."""
    service = LiveService()
    ready: Future[None] = Future()
    tokenizer = shared_deepseek()

    async def main() -> None:
        service.loop = asyncio.get_running_loop()
        service._stop = asyncio.Event()
        try:
            async with running(tokenizer, count, **overrides) as harness:
                service.harness = harness
                ready.set_result(None)
                await service._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="kvlb-live", daemon=True)
    thread.start()
    try:
        ready.result(START_TIMEOUT_S)
        yield service
    finally:
        service.stop()
        thread.join(STOP_TIMEOUT_S)
        assert not thread.is_alive(), "the live service did not stop"
