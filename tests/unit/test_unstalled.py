"""``Unstalled`` (tests/unstalled.py), the latency tests' stopwatch: a wait is counted whole, the time
this thread spent runnable but off the CPU is not."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from unstalled import Unstalled

SCHEDSTAT = f"/proc/self/task/{threading.get_native_id()}/schedstat"


def test_a_wait_is_counted_whole() -> None:
    """A sleep is not run-queue time: a behaviour that waits too long still fails its bound."""
    clock = Unstalled()
    time.sleep(0.2)
    assert clock.seconds() >= 0.19


@pytest.mark.skipif(not os.path.exists(SCHEDSTAT), reason="the kernel has no per-thread schedstat")
def test_time_spent_runnable_beside_a_busy_process_on_one_cpu_is_not_counted() -> None:
    """This thread and a busy process share one CPU for 0.8 s: the kernel gives each a part of it,
    and the thread's waits for its turn are taken off (what is left is at least its own CPU time)."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: the calling thread)
        os.sched_setaffinity(busy.pid, {cpu})
        time.sleep(0.1)  # the busy process is running
        clock, began, cpu_began = Unstalled(), time.perf_counter(), time.thread_time()
        while time.perf_counter() - began < 0.8:
            sum(range(1000))
        unstalled_s, cpu_s = clock.seconds(), time.thread_time() - cpu_began
        wall_s = time.perf_counter() - began
    finally:
        busy.kill()
        busy.wait(5)
        os.sched_setaffinity(0, before)
    assert unstalled_s < wall_s - 0.2, (wall_s, cpu_s, unstalled_s)  # at most 0.6 s of 0.8 on the CPU
    assert unstalled_s >= cpu_s - 0.02, (wall_s, cpu_s, unstalled_s)
