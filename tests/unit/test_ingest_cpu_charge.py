"""What the ingestion budget is charged: a step's own CPU, not a collection the interpreter ran
inside it (``gc_tuning.thread_cpu_s``, ``OwnCpu``); ``CpuBudget`` shows its level."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from balancer.gc_tuning import thread_cpu_s
from balancer.sources.budget import CpuBudget
from balancer.sources.pipeline import OwnCpu


def _a_heap_of_cycles(count: int) -> list[Any]:
    """``count`` live containers in cycles: what a full collection has to walk."""
    heap: list[Any] = []
    for _ in range(count):
        node: list[Any] = []
        node.append(node)
        heap.append(node)
    return heap


def test_a_collection_inside_an_apply_step_is_not_charged() -> None:
    heap = _a_heap_of_cycles(400_000)
    collection_cpu_s = 0.0

    async def apply_step() -> None:
        nonlocal collection_cpu_s
        started = time.thread_time()
        gc.collect()  # what an allocation crossing the threshold triggers inside an apply
        collection_cpu_s = time.thread_time() - started

    async def main() -> float:
        owned = OwnCpu(apply_step())
        await owned
        return owned.cpu_s

    charged_s = asyncio.run(main())
    del heap
    assert collection_cpu_s > 0.01, "the heap was too small to measure a collection"
    assert charged_s < collection_cpu_s / 4, (charged_s, collection_cpu_s)


def test_thread_cpu_s_counts_a_step_s_own_work() -> None:
    started = thread_cpu_s()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:
        pass
    assert thread_cpu_s() - started >= 0.04


def test_the_budget_level_shows_the_debt() -> None:
    budget = CpuBudget(share=0.25, burst_s=0.5)
    budget.charge(0.7, 0.0)
    assert abs(budget.level_s(0.0) + 0.2) < 1e-9
    assert abs(budget.level_s(0.4) + 0.1) < 1e-9
    assert budget.level_s(100.0) == 0.5
