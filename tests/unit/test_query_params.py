"""Query parameters of the admin endpoints (:func:`balancer.api.parsing.check_query`): an unknown
name or a name given twice is a 400, never read as one of its values. Numbers in a query or path
are read in ASCII decimal digits only (:func:`~balancer.api.parsing.decimal_number`,
:func:`~balancer.api.parsing.decimal_integer`), not as everything Python's ``float``/``int`` take."""

from __future__ import annotations

import pytest
from multidict import MultiDict

from balancer.api.errors import ApiError
from balancer.api.parsing import check_query, decimal_integer, decimal_number

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


@pytest.mark.parametrize(
    ("text", "number"),
    [("10", 10.0), ("0.5", 0.5), ("5.", 5.0), (".5", 0.5), ("1e-1", 0.1), ("2E+2", 200.0), ("0", 0.0)],
)
def test_decimal_numbers_are_read(text: str, number: float) -> None:
    assert decimal_number(text) == number


@pytest.mark.parametrize(
    "text",
    [
        "1_0",
        " 5",
        "5 ",
        "5\n",
        "\t5",
        "+5",
        "-5",
        "\u0665",
        "\uff15",
        "inf",
        "nan",
        "0x5",
        "",
        ".",
        "1e",
        "e1",
    ],
)
def test_what_float_reads_beyond_decimal_digits_is_refused(text: str) -> None:
    assert decimal_number(text) is None


def test_a_decimal_number_too_large_for_a_float_is_infinite() -> None:
    assert decimal_number("1e400") == float("inf")


@pytest.mark.parametrize(("text", "value"), [("12", 12), ("-3", -3), ("007", 7), ("9" * 30, int("9" * 30))])
def test_decimal_integers_are_read(text: str, value: int) -> None:
    assert decimal_integer(text) == value


@pytest.mark.parametrize(
    "text", ["1_0", " 5", "5 ", "+5", "--5", "-", "\u0665", "5.0", "1e1", "", "9" * 5000]
)
def test_what_int_reads_beyond_decimal_digits_is_refused(text: str) -> None:
    assert decimal_integer(text) is None
