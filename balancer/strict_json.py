"""Strict JSON in and out (pure): what kvlb writes is RFC 8259 JSON, and what it reads must be.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default and reads them back, but
they are not JSON: strict parsers (Go, Rust's serde_json, ``jq``, browsers' ``JSON.parse``) reject
the whole document. Every JSON kvlb writes (HTTP answers, the Redis-shared policy, the CLI's output)
goes through :func:`dumps`; every JSON body it reads through :func:`loads`.

A non-finite number in an answer is written as ``null``. None is expected: every policy weight is
bounded (``PolicyWeights``), so cost terms stay finite, and scraped load values are finite or
dropped; ``null`` is the representation if one ever appears (a client then sees "unknown", never a
document it cannot parse).
"""

from __future__ import annotations

import json
import math
from typing import Any

NON_FINITE = frozenset({"NaN", "Infinity", "-Infinity"})
"""The literals Python's ``json`` accepts and writes that are not JSON."""


class NotStrictJson(ValueError):
    """A document holding ``NaN``, ``Infinity`` or ``-Infinity`` (a ``ValueError``, as any bad JSON)."""


def _refuse(literal: str) -> Any:
    raise NotStrictJson(f"{literal} is not a JSON value (numbers must be finite)")


def loads(data: str | bytes, *, overflow_to_null: bool = False) -> Any:
    """``json.loads`` that refuses ``NaN``/``Infinity`` (:class:`NotStrictJson`, a ``ValueError``).
    With ``overflow_to_null``, a number too large for a float (``1e400``, which ``json`` reads as
    infinity) reads as ``None``: the value :func:`dumps` writes it back as."""
    if overflow_to_null:
        return json.loads(data, parse_constant=_refuse, parse_float=_finite_or_none)
    return json.loads(data, parse_constant=_refuse)


def _finite_or_none(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` whose output is always strict JSON: non-finite floats become ``null``."""
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except ValueError:  # a non-finite float somewhere: rare, so only then is the value copied
        return json.dumps(finite(value), allow_nan=False, **kwargs)


def finite(value: Any) -> Any:
    """A copy of a JSON-like ``value`` with every non-finite float replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value
