"""The writers' error backoff (:class:`balancer.fleet.redis_back.Backoff`, pure): doubling waits up to
``max_s``, and a wait after a woken attempt failed is not cut short again."""

from __future__ import annotations

from balancer.fleet.redis_back import Backoff, RetrySettings


def test_waits_double_up_to_the_longest() -> None:
    backoff = Backoff(RetrySettings(initial_s=0.05, max_s=0.5))
    waits = [backoff.failed(float(i), woken=False) for i in range(7)]
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert backoff.failures == 7 and backoff.failed_at == 6.0 and backoff.wakeable


def test_a_woken_attempt_that_fails_waits_its_next_backoff_in_full() -> None:
    backoff = Backoff(RetrySettings(initial_s=0.05, max_s=0.5))
    assert backoff.failed(0.0, woken=False) == 0.05 and backoff.wakeable
    assert backoff.failed(0.01, woken=True) == 0.1  # the backoff still grows
    assert not backoff.wakeable  # served in full
    assert backoff.failed(0.11, woken=False) == 0.2 and backoff.wakeable
