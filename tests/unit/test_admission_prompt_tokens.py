"""The per-tenant cap on prompt tokens in flight (``limits.max_inflight_prompt_tokens_per_tenant``):
the pure rule (:func:`balancer.service.admission.prompt_tokens_fit`), and the token gate of
:class:`balancer.service.admission.Admission` on the event loop (no I/O): a tenant over its allowance
waits in order while another tenant goes on, a prompt over the cap goes alone, a wait past the
deadline is a 429 with Retry-After, and every way out gives its tokens back."""

from __future__ import annotations

import asyncio

import pytest

from balancer.service.admission import (
    TENANT_PROMPT_TOKENS,
    Admission,
    AdmissionLimits,
    AdmissionRefused,
    prompt_tokens_fit,
)


def gate(cap: int | None = 1000, timeout_s: float = 5.0) -> Admission:
    return Admission(AdmissionLimits(64, 64, timeout_s, max_inflight_prompt_tokens_per_tenant=cap))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_the_rule_fits_under_the_cap_and_lets_a_prompt_over_it_go_alone() -> None:
    assert prompt_tokens_fit(0, 10, 1000)
    assert prompt_tokens_fit(990, 10, 1000)
    assert not prompt_tokens_fit(991, 10, 1000)
    assert prompt_tokens_fit(0, 5000, 1000)  # larger than the cap, nothing held: alone
    assert not prompt_tokens_fit(1, 5000, 1000)


async def test_a_tenant_over_its_tokens_waits_in_order_while_another_tenant_goes_on() -> None:
    admission = gate(1000)
    loop = asyncio.get_running_loop()
    noisy, quiet = admission.tenant("noisy"), admission.tenant("quiet")
    deadline = loop.time() + 5
    await admission.take_prompt_tokens(noisy, 800, deadline)
    order: list[int] = []

    async def take(tokens: int) -> None:
        await admission.take_prompt_tokens(noisy, tokens, deadline)
        order.append(tokens)

    first = asyncio.create_task(take(800))
    second = asyncio.create_task(take(100))  # would fit, but waits behind the tenant's earlier one
    await settle()
    assert order == [] and noisy.prompt_tokens == 800
    await asyncio.wait_for(admission.take_prompt_tokens(quiet, 500, deadline), 0.5)  # not held back
    assert quiet.prompt_tokens == 500
    admission.give_back_prompt_tokens(noisy, 800)
    await asyncio.gather(first, second)
    assert order == [800, 100] and noisy.prompt_tokens == 900


async def test_a_prompt_over_the_cap_goes_alone_and_holds_the_tenants_next_ones() -> None:
    admission = gate(1000)
    noisy = admission.tenant("noisy")
    deadline = asyncio.get_running_loop().time() + 5
    await admission.take_prompt_tokens(noisy, 5000, deadline)  # alone: at once
    small = asyncio.create_task(admission.take_prompt_tokens(noisy, 1, deadline))
    await settle()
    assert not small.done()
    admission.give_back_prompt_tokens(noisy, 5000)
    await asyncio.wait_for(small, 0.5)
    assert noisy.prompt_tokens == 1


async def test_a_wait_past_the_deadline_is_a_429_with_retry_after_and_lets_the_next_go() -> None:
    admission = gate(1000, timeout_s=0.05)
    noisy = admission.tenant("noisy")
    loop = asyncio.get_running_loop()
    await admission.take_prompt_tokens(noisy, 600, loop.time() + 5)
    with pytest.raises(AdmissionRefused) as refused:
        await admission.take_prompt_tokens(noisy, 900, loop.time() + 0.05)
    assert refused.value.status == 429 and refused.value.limit == TENANT_PROMPT_TOKENS
    assert refused.value.retry_after_s >= 1.0
    assert not noisy.token_waiters and noisy.prompt_tokens == 600
    # a smaller one behind the one that gave up goes at once once it is gone
    big = asyncio.create_task(admission.take_prompt_tokens(noisy, 900, loop.time() + 0.05))
    small = asyncio.create_task(admission.take_prompt_tokens(noisy, 100, loop.time() + 5))
    await settle()
    assert not small.done()
    with pytest.raises(AdmissionRefused):
        await big
    await asyncio.wait_for(small, 0.5)
    assert noisy.prompt_tokens == 700


async def test_a_cancelled_waiter_takes_nothing_and_one_let_in_as_it_is_cancelled_gives_back() -> None:
    admission = gate(1000)
    noisy = admission.tenant("noisy")
    deadline = asyncio.get_running_loop().time() + 5
    await admission.take_prompt_tokens(noisy, 1000, deadline)
    waiter = asyncio.create_task(admission.take_prompt_tokens(noisy, 500, deadline))
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not noisy.token_waiters and noisy.prompt_tokens == 1000
    waiter = asyncio.create_task(admission.take_prompt_tokens(noisy, 500, deadline))
    await settle()
    admission.give_back_prompt_tokens(noisy, 1000)  # lets it in ...
    waiter.cancel()  # ... as it is cancelled: it gives its tokens back
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert noisy.prompt_tokens == 0 and not noisy.token_waiters
