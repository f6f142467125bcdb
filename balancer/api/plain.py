"""kvlb's status dataclasses as the plain dicts the admin views are made of (pure).

:func:`plain_dict` gives what ``dataclasses.asdict`` gives, at a fraction of its cost: ``asdict``
calls ``copy.deepcopy`` on every leaf and looks the class's fields up again for every instance,
about 65 calls a replica in ``GET /admin/replicas`` (its ``load``, ``events`` and ``scrape``), which
took most of the view's time (2026-12-01, h-grpclist: ``loadtests/bench/admin_list.py``). Here a
class's field names are looked up once, and a leaf of an immutable built-in type (``str``, ``int``,
``float``, ``bool``, ``None``) is used as it is, which is what ``deepcopy`` returns for it; any other
leaf is still deep-copied, and lists, tuples and dicts are rebuilt as ``asdict`` rebuilds them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

_ATOMS = frozenset({str, int, float, bool, type(None)})
"""Types ``copy.deepcopy`` returns as they are (and ``asdict`` with them)."""
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
"""Each dataclass's field names, as ``dataclasses.fields`` lists them (one entry per class: bounded
by the classes the program defines)."""


def plain_dict(instance: Any) -> dict[str, Any]:
    """``dataclasses.asdict(instance)``: equal, with the same types of containers and keys."""
    if not dataclasses.is_dataclass(instance) or isinstance(instance, type):
        raise TypeError("plain_dict() should be called on dataclass instances")
    result: dict[str, Any] = _plain(instance)
    return result


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind in _ATOMS:
        return value
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(kind):
        names = _FIELD_NAMES[kind] = tuple(field.name for field in dataclasses.fields(kind))
    if names is not None:
        out: dict[str, Any] = {}
        for name in names:
            item = getattr(value, name)
            out[name] = item if type(item) in _ATOMS else _plain(item)  # most leaves: no call
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple, as asdict
        return kind(*[_plain(item) for item in value])
    if isinstance(value, list | tuple):
        return kind(_plain(item) for item in value)
    if isinstance(value, dict):
        return kind((_plain(key), _plain(item)) for key, item in value.items())
    return copy.deepcopy(value)
