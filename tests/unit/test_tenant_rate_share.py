"""The per-tenant rate limit shared between the workers of ``kvlb serve --workers N``: each worker's
:class:`~balancer.service.tenant_rate.TenantRates` at the whole rate, starting from the latest bucket
time of every worker through a real shared-memory load table (:class:`SharedRates` over
:class:`~balancer.load.share.LoadShare`): one tenant alternating between two workers gets its rate
once, not twice; a tenant known to one worker is no newcomer on another; the newcomers' bucket is
one; expired bucket times free their slots when the slots run out."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from balancer.load.share import LoadShare, LoadTable
from balancer.service.tenant_rate import NEW_TENANTS_KEY, SharedRates, TenantRates


@pytest.fixture
def table() -> Iterator[LoadTable]:
    made = LoadTable(workers=2, slots=1, tenant_slots=4)
    try:
        yield made
    finally:
        made.close()


def worker(table: LoadTable, index: int, **kwargs: float) -> tuple[LoadShare, TenantRates, SharedRates]:
    share = LoadShare(table.name, index, table.workers, table.slots, table.tenant_slots, track=True)
    rates = TenantRates(
        kwargs.get("rate", 5.0),
        int(kwargs.get("burst", 5)),
        16,
        new_rate_per_s=kwargs.get("new_rate", 5.0),
        new_burst=int(kwargs.get("new_burst", 5)),
    )
    return share, rates, SharedRates(share.peer_tenant_tat, share.publish_tenant_tat)


def test_one_tenant_alternating_between_two_workers_gets_its_rate_once(table: LoadTable) -> None:
    """Rate 5/s, burst 5: requests of A sent to both workers in turn, 100 a second for 3 s, are let
    in 5 + 5 × 3 = 20 times in all (each worker alone would let in as many: 40 without sharing),
    and the default tenant likewise."""
    w0, w1 = worker(table, 0), worker(table, 1)
    start = 1000.0
    for name in ("a", None):
        let_in = 0
        for i in range(301):
            share, rates, shared = (w0, w1)[i % 2]
            let_in += shared.check(rates, name, start + i / 100) == 0.0
        assert let_in == 5 + 15, (name, let_in)
        start += 10
    for share, _, _ in (w0, w1):
        share.close()


def test_a_tenant_known_to_one_worker_is_no_newcomer_on_the_other(table: LoadTable) -> None:
    """The newcomers' bucket (1 a second, burst 1) is emptied by a made-up value on worker 0; A,
    let in on worker 0 before, is let in on worker 1 too (its own bucket, not the newcomers'), and
    another new value on worker 1 finds the newcomers' bucket empty, as on worker 0."""
    (s0, r0, h0), (s1, r1, h1) = (worker(table, i, new_rate=1.0, new_burst=1) for i in range(2))
    now = 2000.0
    assert h0.check(r0, "a", now) == 0.0  # a newcomer: takes the newcomers' one token
    assert h1.check(r1, "made-up-1", now) > 0  # the newcomers' bucket is the service's
    assert h1.check(r1, "a", now) == 0.0  # known to worker 0: no newcomer here
    assert r1.known("a") and s1.peer_tenant_tat(NEW_TENANTS_KEY) > 0
    for share in (s0, s1):
        share.close()


def test_expired_bucket_times_free_their_slots_when_the_slots_run_out(table: LoadTable) -> None:
    """Four tenant slots: four tenants' bucket times fill them; once those times have passed, a
    fifth tenant's time is shared (the sweep frees the expired slots) and none overflows."""
    overflows: list[int] = []
    share = LoadShare(table.name, 0, 2, 1, 4, track=True, on_tenant_overflow=lambda: overflows.append(1))
    other = LoadShare(table.name, 1, 2, 1, 4, track=True)
    past = time.monotonic() - 10
    for key in (1, 2, 3, 4):
        share.publish_tenant_tat(key, int(past * 1e9))
    assert [other.peer_tenant_tat(key) for key in (1, 2, 3, 4)] == [int(past * 1e9)] * 4
    share.publish_tenant_tat(5, int((past + 20) * 1e9))
    assert other.peer_tenant_tat(5) == int((past + 20) * 1e9) and overflows == []
    assert [other.peer_tenant_tat(key) for key in (1, 2, 3, 4)] == [0] * 4
    share.publish_tenant(6, 1)  # tenant 5's time is still to come: its slot stays; 6 takes a free one
    assert other.peer_tenant_tat(5) > 0 and other.peer_tenant_admitted(6) == 1
    share.close()
    other.close()
