"""The simulator's event loop: virtual-time order, FIFO among equal times, cancellation, bounds."""

from __future__ import annotations

import math
import random

import pytest

from loadtests.simulate.des import EventLoop


def test_events_run_in_time_order_and_move_virtual_time() -> None:
    loop = EventLoop()
    seen: list[tuple[str, float, float]] = []

    def note(name: str, at_s: float) -> None:
        seen.append((name, at_s, loop.now_s))

    for name, at_s in (("c", 3.0), ("a", 1.0), ("b", 2.5)):
        loop.schedule(at_s, note, name)
    assert loop.run() == 3
    assert seen == [("a", 1.0, 1.0), ("b", 2.5, 2.5), ("c", 3.0, 3.0)]
    assert loop.now_s == 3.0 and loop.processed == 3


def test_equal_times_run_in_scheduling_order() -> None:
    loop = EventLoop()
    order: list[int] = []
    for n in range(50):
        loop.schedule(1.0, lambda arg, _: order.append(arg), n)
    loop.run()
    assert order == list(range(50))


def test_random_schedule_is_sorted_and_stable() -> None:
    rng = random.Random(7)
    loop = EventLoop()
    planned = [(rng.choice([0.5, 1.0, 1.5, 2.0]), n) for n in range(300)]
    out: list[tuple[float, int]] = []
    for at_s, n in planned:
        loop.schedule(at_s, lambda arg, now: out.append((now, arg)), n)
    loop.run()
    assert out == sorted(planned)  # by time, then by scheduling order (n grows with it)


def test_actions_schedule_more_events_including_now() -> None:
    loop = EventLoop()
    trail: list[tuple[str, float]] = []

    def first(_: None, now: float) -> None:
        trail.append(("first", now))
        loop.schedule(now, lambda _a, t: trail.append(("same instant", t)))
        loop.schedule(now + 0.25, lambda _a, t: trail.append(("later", t)))

    loop.schedule(1.0, first)
    loop.schedule(1.1, lambda _a, t: trail.append(("queued", t)))
    loop.run()
    assert trail == [("first", 1.0), ("same instant", 1.0), ("queued", 1.1), ("later", 1.25)]


def test_cancelled_events_do_not_run() -> None:
    loop = EventLoop()
    ran: list[str] = []
    keep = loop.schedule(1.0, lambda arg, _: ran.append(arg), "keep")
    drop = loop.schedule(0.5, lambda arg, _: ran.append(arg), "drop")
    loop.cancel(drop)
    loop.cancel(999)  # unknown handle: ignored
    assert loop.next_at() == 1.0
    assert loop.run() == 1
    assert ran == ["keep"] and keep != drop


def test_time_never_runs_backwards() -> None:
    loop = EventLoop()
    loop.schedule(2.0, lambda *_: None)
    loop.run()
    with pytest.raises(ValueError):
        loop.schedule(1.0, lambda *_: None)
    with pytest.raises(ValueError):
        loop.schedule(math.inf, lambda *_: None)
    with pytest.raises(ValueError):
        loop.schedule(math.nan, lambda *_: None)


def test_run_until_and_max_events() -> None:
    loop = EventLoop()
    for at_s in (1.0, 2.0, 3.0, 4.0):
        loop.schedule(at_s, lambda *_: None)
    assert loop.run(until_s=2.0) == 2
    assert loop.now_s == 2.0 and len(loop) == 2
    assert loop.run(max_events=1) == 1 and loop.now_s == 3.0
    assert loop.run() == 1 and loop.next_at() is None
