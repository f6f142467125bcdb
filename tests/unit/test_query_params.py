"""Query parameters of the admin endpoints (:func:`balancer.api.parsing.check_query`): an unknown
name or a name given twice is a 400, never read as one of its values."""

from __future__ import annotations

import pytest
from multidict import MultiDict

from balancer.api.errors import ApiError
from balancer.api.parsing import check_query

KNOWN = frozenset({"minutes", "limit"})


def test_known_parameters_given_once_pass() -> None:
    check_query(MultiDict([("minutes", "1"), ("limit", "2")]), KNOWN)
    check_query(MultiDict(), KNOWN)
    check_query({"limit": "3"}, KNOWN)


def test_an_unknown_parameter_is_refused() -> None:
    with pytest.raises(ApiError) as refused:
        check_query(MultiDict([("minute", "1")]), KNOWN)
    assert refused.value.status == 400
    assert "unknown query parameter(s) ['minute']" in refused.value.message


def test_a_repeated_parameter_is_refused() -> None:
    query = MultiDict([("minutes", "0.1"), ("limit", "1"), ("minutes", "false")])
    with pytest.raises(ApiError) as refused:
        check_query(query, KNOWN)
    assert refused.value.status == 400
    assert "['minutes'] given more than once" in refused.value.message
