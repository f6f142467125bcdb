"""``BehindClock`` (pure): when a run of reads without an empty socket is ``behind``. A pause of the
process between two reads is not reading, and a burst of a few messages is never a flood."""

from __future__ import annotations

from balancer.sources.read_ahead import MAX_READ_GAP_S, MIN_BEHIND_MESSAGES, BehindClock


def test_a_long_pause_in_a_short_burst_is_not_behind() -> None:
    clock = BehindClock(max_behind_s=1.0)
    assert not clock.read(0.0)
    assert not clock.read(5.0)  # five seconds paused between the first two reads
    assert not clock.read(5.001)
    assert clock.reading_s <= 2 * MAX_READ_GAP_S and clock.paused_s >= 4.8


def test_a_flood_is_behind_once_it_has_read_for_max_behind_s_and_handled_enough_messages() -> None:
    clock = BehindClock(max_behind_s=1.0)
    now, behind_at = 0.0, None
    for i in range(200):  # a message every 10 ms: a flood decoded at 100 messages a second
        if clock.read(now) and behind_at is None:
            behind_at = i
        now += 0.01
    assert behind_at is not None and 100 <= behind_at <= 102  # after about one second, as before
    # many pauses are still counted up to MAX_READ_GAP_S each: a crawl of long gaps is behind too
    crawl = BehindClock(max_behind_s=1.0)
    results = [crawl.read(2.0 * i) for i in range(MIN_BEHIND_MESSAGES + 1)]
    assert results[-1] and not any(results[:MIN_BEHIND_MESSAGES])


def test_fewer_than_the_minimum_messages_are_never_behind_and_reset_starts_afresh() -> None:
    clock = BehindClock(max_behind_s=0.001)
    assert not any(clock.read(0.05 * i) for i in range(MIN_BEHIND_MESSAGES))
    assert clock.read(0.05 * MIN_BEHIND_MESSAGES)
    assert "messages handled in the run" in clock.explain()
    clock.reset()
    assert clock.handled == 0 and clock.reading_s == 0.0 and not clock.read(100.0)
