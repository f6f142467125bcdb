"""Test helper: run a generator of steps (the stepped renders, listings and merges) to its end
without a pause, counting its pauses, so a test can compare its answer with the one-go one and see
that it did pause."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any


def run_steps(steps: Generator[None, None, Any]) -> tuple[Any, int]:
    """What ``steps`` returns, and how many times it paused."""
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, pauses
        pauses += 1
