"""The noisy tenant's scenarios (``loadtests.tenant_noise``): each request is what the tenant
isolation walk sent (sizes, tenant headers), built in process without a server."""

from __future__ import annotations

import json

import pytest

from loadtests.tenant_noise import (
    HEADER,
    HUGE_CHARS,
    NOISES,
    OVER_CHARS,
    TOKEN_IDS,
    VALUE_CHARS,
    VALUES,
    WALK_LOOPS,
    Scenario,
)


def test_every_scenario_has_the_walk_s_loops() -> None:
    assert set(WALK_LOOPS) == set(NOISES)
    with pytest.raises(ValueError):
        Scenario("nothing")


def test_the_tenant_headers() -> None:
    assert HEADER not in Scenario("default").headers(0, 0)
    assert Scenario("flood").headers(3, 4)[HEADER] == "noisy"
    made_up = {Scenario("made-up").headers(loop, sent)[HEADER] for loop in range(3) for sent in range(3)}
    assert len(made_up) == 9
    values = Scenario("values")
    seen = {values.headers(loop, sent)[HEADER] for loop in range(64) for sent in range(400)}
    assert len(seen) == VALUES and {len(value) for value in seen} == {VALUE_CHARS}


def test_the_bodies() -> None:
    ids = json.loads(Scenario("token-ids").body(0, 0))["prompt"]
    assert len(ids) == TOKEN_IDS
    for noise, chars in (("huge", HUGE_CHARS), ("over-chars", OVER_CHARS)):
        scenario = Scenario(noise)
        first, second = (json.loads(scenario.body(0, sent))["messages"][0]["content"] for sent in range(2))
        assert chars < len(first) < chars + 40 and first != second  # a head of its own each
    hot = Scenario("hot-prefix")
    a, b = (json.loads(hot.body(loop, 0))["prompt"] for loop in range(2))
    assert len(a.split()) > 1000 and a.split()[:1000] == b.split()[:1000] and a != b
    stream = json.loads(Scenario("streams").body(1, 2))
    assert stream["stream"] is True and stream["max_tokens"] == 2000
