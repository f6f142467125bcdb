"""``eventually``: wait for a condition another component makes true (a test helper of the source,
relay and log tests)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    check: Callable[[], bool],
    timeout_s: float = 5.0,
    poll_s: float = 0.005,
    seen: Callable[[], object] | None = None,
) -> None:
    """Poll ``check`` every ``poll_s`` seconds until it is true; fail after ``timeout_s`` seconds,
    saying what ``seen`` returns then (when given)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError("condition not met in time" + (f": {seen()}" if seen is not None else ""))
        await asyncio.sleep(poll_s)
