"""The replay poll schedule of a ZMQ source (:mod:`balancer.sources.replay_poll`): pure, ``now`` passed."""

from __future__ import annotations

from balancer.sources.replay_poll import ReplayPollSchedule


def test_a_poll_is_due_after_a_whole_interval_of_silence() -> None:
    polls = ReplayPollSchedule(0.5, 4.0, 2.0, now=100.0)
    assert not polls.due(100.49)
    assert polls.timeout_ms(100.0) == 501
    assert polls.due(100.5)
    assert polls.timeout_ms(101.0) == 1  # overdue: poll at once, never a negative wait


def test_empty_answers_double_the_interval_up_to_its_maximum_once_the_engine_is_no_longer_busy() -> None:
    polls = ReplayPollSchedule(0.5, 4.0, 2.0, now=0.0)
    polls.heard(10.0)  # a batch: busy for 2 s
    polls.answered_empty(10.5)
    assert polls.interval_s == 0.5  # a busy engine's next burst must find it short
    intervals = []
    now = 12.0
    for _ in range(5):
        polls.answered_empty(now)
        intervals.append(polls.interval_s)
        now += polls.interval_s
    assert intervals == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert not polls.due(now - 0.01) and polls.due(now)


def test_a_batch_resets_the_interval_and_the_silence() -> None:
    polls = ReplayPollSchedule(0.5, 4.0, 0.0, now=0.0)
    for now in (1.0, 2.0, 3.0):
        polls.answered_empty(now)
    assert polls.interval_s == 4.0
    polls.heard(3.2)
    assert polls.interval_s == 0.5
    assert not polls.due(3.6) and polls.due(3.7)
