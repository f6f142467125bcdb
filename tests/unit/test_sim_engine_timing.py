"""The emulated engine's loop counts how far it fell behind its model (``replicas/sim/engine.py``).

The loop reads model time from an injected monotonic clock: a clock that never moves is a machine
with no delay at all (every step is applied on time, the chain never restarts); a clock that
jumps 50 ms at every read is a machine too busy to wake the loop on time (every step is late, and
the chain restarts from "now", losing model time). No assertion depends on the real machine's speed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

from replicas.sim.cache import CacheRecord, PrefixCache
from replicas.sim.engine import MAX_LAG_WALL_S, RankLoop, SimClock
from replicas.sim.faults import FaultSettings, FaultState
from replicas.sim.profiles import get_profile
from replicas.sim.scheduler import SGLANG_CACHING, Scheduler, SimRequest, StepResult
from replicas.sim.timing import TimeScale


class _Quiet:
    def on_step(self, rank: int, result: StepResult | None, records: Sequence[CacheRecord]) -> None:
        pass


async def _serve_one(monotonic: Callable[[], float], tokens: int = 6) -> RankLoop:
    profile = get_profile("h100-llama3-8b")
    scheduler = Scheduler(
        profile,
        PrefixCache(page_size=16, capacity_blocks=256),
        SGLANG_CACHING,
        max_waiting=16,
        vocab_size=profile.vocab_size,
    )
    clock = SimClock(TimeScale(100.0), monotonic=monotonic)  # real sleeps 100x shorter than the model
    loop = RankLoop(
        0, scheduler, clock, FaultState(FaultSettings(), random.Random(0)), _Quiet(), lambda *_: None
    )
    loop.start()
    try:
        handle = loop.submit(SimRequest("q", list(range(64)), tokens, 0.0))
        assert handle is not None
        async with asyncio.timeout(30):
            while await handle.next() is not None:
                pass
    finally:
        await loop.stop()
    return loop


async def test_a_loop_on_time_is_never_late_and_never_slips() -> None:
    loop = await _serve_one(lambda: 0.0)
    figures = loop.timing.to_dict()
    assert figures["steps_total"] >= 6
    assert figures["step_late_model_s_total"] == 0.0
    assert figures["step_slips_total"] == 0
    assert figures["step_slip_model_s_total"] == 0.0


async def test_a_loop_woken_late_counts_its_lateness_and_the_model_time_it_lost() -> None:
    ticks = iter(range(1_000_000))
    jump_wall_s = 0.05
    assert jump_wall_s > MAX_LAG_WALL_S
    loop = await _serve_one(lambda: next(ticks) * jump_wall_s)
    figures = loop.timing.to_dict()
    steps = figures["steps_total"]
    assert steps >= 6
    # every read of the clock is 50 ms of wall (5 s of model) after the last one
    assert figures["step_late_model_s_total"] >= steps * 0.9 * jump_wall_s * 100
    assert figures["step_slips_total"] == steps - 1  # every step after the first restarts the chain
    assert figures["step_slip_model_s_total"] >= (steps - 1) * 0.9 * jump_wall_s * 100
