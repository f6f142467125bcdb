"""The per-tenant request-rate limit's buckets (:class:`balancer.service.tenant_rate.TenantRates`):
bursts, refills, the wait a refusal names, the default tenant, the bounded table (least recently seen
out, newcomers held to one shared bucket so made-up tenant values cannot pass the limit) and what a
bucket weighs. Pure: every call is given ``now``."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from balancer.service.admission import TENANT_CHARS
from balancer.service.tenant_rate import BUCKET_BYTES, TenantRates, burst_per_worker, per_worker


def let_in(rates: TenantRates, name: str | None, now: float, count: int) -> int:
    return sum(rates.check(name, now) == 0.0 for _ in range(count))


def test_a_full_bucket_lets_its_burst_in_at_once_then_refuses_with_the_wait_for_a_token() -> None:
    rates = TenantRates(rate_per_s=10.0, burst=5, max_tenants=8)
    assert let_in(rates, "a", 100.0, 5) == 5
    wait = rates.check("a", 100.0)
    assert wait == pytest.approx(0.1)  # one token back every 1/10 s
    assert rates.check("a", 100.0 + wait / 2) == pytest.approx(wait / 2)
    assert rates.check("a", 100.0 + wait) == 0.0
    assert rates.check("a", 100.0 + wait) > 0


def test_refusals_change_nothing_so_a_tenant_sending_flat_out_gets_the_rate_exactly() -> None:
    rates = TenantRates(rate_per_s=50.0, burst=10, max_tenants=8)
    # 20,000 requests a second for 10 s: 10 at once, then 50 a second
    allowed = sum(rates.check("noisy", i / 20_000) == 0.0 for i in range(200_000))
    assert allowed == 10 + 50 * 10 - 1 or allowed == 10 + 50 * 10


def test_an_idle_tenant_refills_to_its_burst_and_no_further() -> None:
    rates = TenantRates(rate_per_s=2.0, burst=3, max_tenants=8)
    assert let_in(rates, "a", 0.0, 10) == 3
    assert let_in(rates, "a", 1000.0, 10) == 3  # idle for long: a burst again, not 2,000


def test_tenants_have_buckets_of_their_own() -> None:
    rates = TenantRates(rate_per_s=1.0, burst=2, max_tenants=8)
    assert let_in(rates, "noisy", 0.0, 100) == 2
    assert let_in(rates, "quiet", 0.0, 2) == 2
    assert let_in(rates, None, 0.0, 5) == 2  # the default tenant's own bucket
    assert let_in(rates, "", 0.0, 1) == 0  # an empty header value is the default tenant
    assert rates.tenants == 2


def test_a_tenant_is_named_by_its_first_characters_as_admission_names_it() -> None:
    rates = TenantRates(rate_per_s=1.0, burst=1, max_tenants=8)
    base = "t" * TENANT_CHARS
    assert rates.check(base + "a", 0.0) == 0.0
    assert rates.check(base + "b", 0.0) > 0  # the same tenant
    assert rates.known(base + "zzz") and not rates.known("other")


def test_made_up_tenant_values_are_held_together_to_the_newcomers_bucket() -> None:
    evicted: list[int] = []
    rates = TenantRates(
        rate_per_s=10.0, burst=5, max_tenants=100, new_rate_per_s=20.0, on_evict=lambda: evicted.append(1)
    )
    rng = random.Random(7)
    allowed = 0
    for i in range(100_000):  # 10,000 made-up values a second for 10 s
        if rates.check(f"{rng.getrandbits(64):x}", i / 10_000) == 0.0:
            allowed += 1
    assert allowed <= 5 + 20 * 10  # the newcomers' burst and rate, not one bucket each
    assert allowed >= 20 * 10 - 1
    assert rates.tenants == 100  # bounded
    assert len(evicted) == allowed - 100


def test_a_tenant_sending_steadily_keeps_its_bucket_through_a_flood_of_made_up_values() -> None:
    rates = TenantRates(rate_per_s=100.0, burst=10, max_tenants=64, new_rate_per_s=100.0)
    quiet_refused = 0
    for i in range(50_000):  # 5 s: a made-up value every 0.1 ms, the quiet tenant every 20 ms
        now = i / 10_000
        rates.check(f"made-up-{i}", now)
        if i % 200 == 0 and rates.check("quiet", now) != 0.0:
            quiet_refused += 1
    assert quiet_refused == 0
    assert rates.known("quiet")


def test_the_least_recently_seen_tenant_is_the_one_dropped() -> None:
    rates = TenantRates(rate_per_s=1.0, burst=10, max_tenants=2, new_rate_per_s=100.0)
    rates.check("a", 0.0)
    rates.check("b", 0.0)
    rates.check("a", 0.1)  # b is now the least recently seen
    rates.check("c", 0.2)
    assert rates.known("a") and rates.known("c") and not rates.known("b")
    # a tenant pushed out comes back as a newcomer: with a full bucket again, through the
    # newcomers' bucket (so being pushed out never lets a tenant past its own limit for long)
    assert rates.check("b", 0.3) == 0.0


def test_a_refused_newcomer_gets_no_bucket() -> None:
    rates = TenantRates(rate_per_s=1.0, burst=1, max_tenants=8, new_rate_per_s=1.0)
    assert rates.check("first", 0.0) == 0.0
    wait = rates.check("second", 0.0)
    assert wait == pytest.approx(1.0)
    assert not rates.known("second") and rates.tenants == 1


def test_per_worker_shares() -> None:
    assert per_worker(100.0, 2) == 50.0
    assert per_worker(100.0, 1) == 100.0
    assert burst_per_worker(5, 2) == 3
    assert burst_per_worker(1, 4) == 1


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        TenantRates(rate_per_s=0.0, burst=1, max_tenants=1)
    with pytest.raises(ValueError):
        TenantRates(rate_per_s=1.0, burst=0, max_tenants=1)
    with pytest.raises(ValueError):
        TenantRates(rate_per_s=1.0, burst=1, max_tenants=1, new_rate_per_s=0.0)


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
def test_a_bucket_weighs_at_most_bucket_bytes() -> None:
    """The heaviest keys (128 characters of 4 bytes each) in a full table of 4,096, traced."""
    count = 4096
    rates = TenantRates(rate_per_s=1.0, burst=count, max_tenants=count)
    names = [f"{i:08d}" + "\U0001f600" * (TENANT_CHARS - 8) for i in range(count)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for name in names:
            assert rates.check(name[: TENANT_CHARS + 1] + "x", 1.0) == 0.0  # the key is a cut copy
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert rates.tenants == count
    per_bucket = held / count
    assert per_bucket <= BUCKET_BYTES
    assert per_bucket > BUCKET_BYTES * 0.6  # the constant is not a wild over-estimate


def test_the_newcomers_bucket_has_a_depth_of_its_own() -> None:
    rates = TenantRates(rate_per_s=1.0, burst=1, max_tenants=64, new_rate_per_s=20.0, new_burst=20)
    assert sum(rates.check(f"t{i}", 0.0) == 0.0 for i in range(50)) == 20
    assert rates.check("t0", 0.0) > 0  # each newcomer then has its own bucket of 1, used
