"""``TokenizerGate``: a tenant's turns in the tokenizer's threads, in order, bounded, given back
whatever way a waiter ends; other tenants never wait for it."""

from __future__ import annotations

import asyncio

import pytest

from balancer.service.admission import AdmissionRefused, Tenant
from balancer.service.tokenizer_gate import TENANT_TOKENIZING, TokenizerGate


async def test_a_tenant_over_its_turns_waits_in_order_while_another_goes_on() -> None:
    gate = TokenizerGate(2, 1.0)
    a, b = Tenant("a"), Tenant("b")
    loop = asyncio.get_running_loop()
    assert gate.try_enter(a) and gate.try_enter(a)
    assert not gate.try_enter(a)
    assert gate.try_enter(b)  # another tenant's turn is its own
    order: list[int] = []

    async def wait(index: int) -> None:
        await gate.enter(a, loop.time() + 5)
        order.append(index)

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert order == [] and gate.taken(a) == 2
    gate.leave(a)
    gate.leave(a)
    await asyncio.sleep(0)
    assert order == [0, 1] and gate.taken(a) == 2  # the turns passed on, still two taken
    gate.leave(a)
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2]
    for _ in range(2):
        gate.leave(a)
    gate.leave(b)
    assert gate.tenants == 0  # nothing kept for idle tenants


async def test_a_waiter_past_its_deadline_is_refused_503_and_a_cancelled_one_passes_its_turn_on() -> None:
    gate = TokenizerGate(1, 0.05)
    a = Tenant("a")
    loop = asyncio.get_running_loop()
    assert gate.try_enter(a)
    with pytest.raises(AdmissionRefused) as refused:
        await gate.enter(a, loop.time() + 0.05)
    assert refused.value.status == 503 and refused.value.limit == TENANT_TOKENIZING
    assert refused.value.retry_after_s >= 1.0
    first = asyncio.create_task(gate.enter(a, loop.time() + 5))
    second = asyncio.create_task(gate.enter(a, loop.time() + 5))
    await asyncio.sleep(0)
    gate.leave(a)  # the turn goes to ``first``, which is cancelled before it runs: it passes on
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert gate.taken(a) == 1
    gate.leave(a)
    assert gate.tenants == 0


def test_at_least_one_turn() -> None:
    with pytest.raises(ValueError):
        TokenizerGate(0, 1.0)
