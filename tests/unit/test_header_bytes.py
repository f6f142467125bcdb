"""Header values that are not UTF-8 (aiohttp hands their bytes over as surrogates) are a 4xx, never a
500: the bearer check and the admin audit fingerprint encode them without failing (issue #17)."""

from __future__ import annotations

import pytest

from balancer.api.errors import ApiError
from balancer.api.middleware import caller_of, token_matches
from balancer.api.parsing import parse_weights_header
from balancer.policy import PolicyWeights

NOT_UTF8 = b"\xff\xfe\xed\xa0\x80".decode("utf-8", "surrogateescape")


def test_a_token_that_is_not_utf8_simply_does_not_match() -> None:
    assert not token_matches(NOT_UTF8, ("k1", "k2"))
    assert not token_matches("\ud800", ("k1",))
    assert token_matches("k2", ("k1", "k2"))


def test_the_audit_fingerprint_of_any_token_is_computed() -> None:
    assert caller_of(NOT_UTF8, "127.0.0.1").startswith("token:")
    assert caller_of("\udfff", None).endswith("@?")


def test_a_weights_header_with_undecodable_bytes_is_a_400() -> None:
    with pytest.raises(ApiError) as info:
        parse_weights_header('{"' + NOT_UTF8 + '": 1}', PolicyWeights())
    assert info.value.status == 400 and "lone UTF-16 surrogate" in info.value.message
