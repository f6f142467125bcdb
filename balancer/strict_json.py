"""Strict JSON in and out (pure): what kvlb writes is RFC 8259 JSON, and what it reads must be.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default and reads them back, but
they are not JSON: strict parsers (Go, Rust's serde_json, ``jq``, browsers' ``JSON.parse``) reject
the whole document. Every JSON kvlb writes (HTTP answers, the Redis-shared policy, the CLI's output)
goes through :func:`dumps`; every JSON body it reads through :func:`loads`. :func:`loads_steps` and
:func:`dumps_steps` do the same a bounded piece at a time (generators of steps, for a large
document read or written on the event loop: the gathered admin views of ``--workers N``).

A non-finite number in an answer is written as ``null``. None is expected: every policy weight is
bounded (``PolicyWeights``), so cost terms stay finite, and scraped load values are finite or
dropped; ``null`` is the representation if one ever appears (a client then sees "unknown", never a
document it cannot parse).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Generator
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


STEP_CHARS = 8 * 1024
"""Characters of JSON text :func:`loads_steps` decodes, or :func:`dumps_steps` encodes, between two
steps (at least one array item a step, whatever its size): replica views were decoded at about
55 kB and encoded at about 32 kB per ms of CPU (scratch script, load 5 on 2 cores, 2026-12-01,
h-workersmerge), so a step is about 0.15-0.3 ms."""

_DECODER = json.JSONDecoder(parse_constant=_refuse)
_SPACE = re.compile(r"[ \t\n\r]*")


def loads_steps(data: str | bytes, step_chars: int = STEP_CHARS) -> Generator[None, None, Any]:
    """:func:`loads` in steps (run by :func:`balancer.tasks.stepwise`): the same value, or the same
    ``ValueError`` class, but the top-level array's items, or the arrays of a top-level object
    (``{"replicas": [...], ...}``), decoded one at a time, a step ending once ``step_chars``
    characters were decoded; any other value is decoded in one go."""
    if isinstance(data, str):
        if data.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", data, 0)
        text = data
    else:
        text = data.decode(json.detect_encoding(data), "surrogatepass")
    stepped = _Stepped(text, step_chars)
    start = _SPACE.match(text, 0).end()  # type: ignore[union-attr]
    if text.startswith("{", start):
        value: Any = yield from stepped.members(start + 1)
    elif text.startswith("[", start):
        value = yield from stepped.items(start + 1)
    else:
        value, stepped.at = _DECODER.raw_decode(text, start)
    end = _SPACE.match(text, stepped.at).end()  # type: ignore[union-attr]
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


class _Stepped:
    """The walk of :func:`loads_steps`: where it is in ``text``, and where its step began."""

    def __init__(self, text: str, step_chars: int) -> None:
        self.text = text
        self.at = 0
        self.step_chars = step_chars
        self.step_began = 0

    def _space(self, at: int) -> int:
        return _SPACE.match(self.text, at).end()  # type: ignore[union-attr]

    def _expect(self, at: int, what: str, message: str) -> int:
        if not self.text.startswith(what, at):
            raise json.JSONDecodeError(message, self.text, at)
        return at + 1

    def items(self, at: int) -> Generator[None, None, list[Any]]:
        """The array whose ``[`` ends before ``at``, item by item; :attr:`at` after its ``]``."""
        out: list[Any] = []
        at = self._space(at)
        if self.text.startswith("]", at):
            self.at = at + 1
            return out
        while True:
            item, at = _DECODER.raw_decode(self.text, at)
            out.append(item)
            if at - self.step_began >= self.step_chars:
                yield
                self.step_began = at
            at = self._space(at)
            if self.text.startswith("]", at):
                self.at = at + 1
                return out
            at = self._space(self._expect(at, ",", "Expecting ',' delimiter"))

    def members(self, at: int) -> Generator[None, None, dict[str, Any]]:
        """The object whose ``{`` ends before ``at``: an array member by :meth:`items`, any other
        member in one go; :attr:`at` after its ``}``."""
        out: dict[str, Any] = {}
        at = self._space(at)
        if self.text.startswith("}", at):
            self.at = at + 1
            return out
        while True:
            if not self.text.startswith('"', at):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", self.text, at)
            key, at = _DECODER.raw_decode(self.text, at)
            at = self._space(self._expect(self._space(at), ":", "Expecting ':' delimiter"))
            if self.text.startswith("[", at):
                out[key] = yield from self.items(at + 1)
                at = self.at
            else:
                out[key], at = _DECODER.raw_decode(self.text, at)
            at = self._space(at)
            if self.text.startswith("}", at):
                self.at = at + 1
                return out
            at = self._space(self._expect(at, ",", "Expecting ',' delimiter"))


def dumps_steps(value: Any, step_chars: int = STEP_CHARS) -> Generator[None, None, str]:
    """:func:`dumps` (without options) in steps (run by :func:`balancer.tasks.stepwise`): the same
    text, but the items of a top-level array, or of the arrays of a top-level object whose keys are
    strings, encoded one at a time, a step ending once ``step_chars`` characters were written; any
    other value is encoded in one go."""
    written = 0

    def array(items: list[Any] | tuple[Any, ...]) -> Generator[None, None, str]:
        nonlocal written
        parts: list[str] = []
        for item in items:
            part = dumps(item)
            parts.append(part)
            written += len(part)
            if written >= step_chars:
                yield
                written = 0
        return "[" + ", ".join(parts) + "]"

    if isinstance(value, list | tuple):
        return (yield from array(value))
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        return dumps(value)
    members: list[str] = []
    for key, member in value.items():
        encoded = (yield from array(member)) if isinstance(member, list | tuple) else dumps(member)
        members.append(dumps(key) + ": " + encoded)
    return "{" + ", ".join(members) + "}"
