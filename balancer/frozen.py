"""A faster ``__init__`` for the frozen dataclasses the request path builds per request (pure).

The ``__init__`` that ``dataclasses`` writes for a frozen class sets each field with
``object.__setattr__(self, name, value)``, which looks the attribute up on the type every time:
about 0.14 µs a field, 2.6 µs for the 19 fields of a :class:`~balancer.types.CostTerms`, of which
a routed request builds one per candidate. :func:`quick_init` writes the same ``__init__`` (same
parameters, same defaults, same values set) over the slotted class's own member descriptors,
which skips that lookup: about half the time. The class stays frozen (its ``__setattr__`` still
raises), and ``dataclasses.replace``, equality, hashing, pickling and ``asdict`` are untouched.

Calling a member descriptor's ``__set__`` still costs a call, with its argument tuple, per field.
So the ``__init__`` builds through a *builder*: a plain (not frozen) class with the same slots, hence
the same layout, which the new instance takes as its ``__class__`` while its fields are stored with
ordinary attribute stores, and gives back at the end (also when a default factory raises):
the cost policy's part of a 4-replica decision (4 :class:`~balancer.types.CostTerms` of 22 fields
and a ``Decision`` of 8) went from 243,097 to 182,546 instructions (docs/benchmarks.md, "round
13"). CPython's test of that ``__class__`` assignment (same base, same slots) is made once at
decoration; a class that failed it (a ``__weakref__`` slot) would keep the descriptor calls, as does
a class of fewer than :data:`BUILDER_MIN_FIELDS` fields (there the two class swaps cost more).

Only for frozen slotted dataclasses whose only base is ``object`` and whose fields are all
``__init__`` parameters, positional or keyword (no ``kw_only``, ``init=False``, ``InitVar`` or
``__post_init__``): anything else is refused at import, so a field added later cannot be silently
skipped. A ``default_factory`` is called for each instance that does not pass the field, as the
dataclass ``__init__`` does.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")


class _Factory:
    """The default of a field with a ``default_factory`` (a fresh value per instance)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()

__all__ = ["quick_init"]

BUILDER_MIN_FIELDS = 4
"""Fields from which the builder is used. Measured per construction (callgrind, CPython 3.11):
descriptor calls about 1,390 + 680 instructions a field, the builder about 3,450 + 130: 3,439
against 3,850 at 3 fields, 6,938 against 4,563 at 8, 16,439 against 6,358 at 22."""


def quick_init(cls: type[T]) -> type[T]:
    """Give the frozen slotted dataclass ``cls`` an ``__init__`` that sets each slot through its
    member descriptor (class decorator, above ``@dataclass``). Raises ``TypeError`` on a class it
    cannot serve exactly."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: quick_init needs a frozen dataclass with slots")
    if cls.__bases__ != (object,):
        raise TypeError(f"{cls.__name__}: quick_init needs a class whose only base is object")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: quick_init does not call __post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if list(inspect.signature(cls.__init__).parameters)[1:] != [f.name for f in fields]:
        raise TypeError(f"{cls.__name__}: quick_init takes no InitVar or init=False field")
    names: dict[str, Any] = {"_FACTORY": _FACTORY}
    arguments: list[str] = []
    body: list[str] = []
    builder = _builder(cls) if len(fields) >= BUILDER_MIN_FIELDS else None
    for f in fields:
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init takes plain init fields only")
        names[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        value = f.name
        if f.default_factory is not dataclasses.MISSING:
            names[f"_factory_{f.name}"] = f.default_factory
            arguments.append(f"{f.name}=_FACTORY")
            value = f"_factory_{f.name}() if {f.name} is _FACTORY else {f.name}"
        elif f.default is dataclasses.MISSING:
            arguments.append(f.name)
        else:
            names[f"_default_{f.name}"] = f.default
            arguments.append(f"{f.name}=_default_{f.name}")
        body.append(f"        self.{f.name} = {value}" if builder else f"    _set_{f.name}(self, {value})")
    if builder is not None and body:
        names.update(_BUILDER=builder, _CLASS=cls, _SET_CLASS=object.__setattr__)
        body = ['    _SET_CLASS(self, "__class__", _BUILDER)', "    try:", *body, "    finally:"]
        body.append("        self.__class__ = _CLASS")
    source = f"def __init__(self, {', '.join(arguments)}):\n" + ("\n".join(body) or "    pass") + "\n"
    exec(source, names)
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__init__.__annotations__)  # the same signature, for introspection
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def _builder(cls: type) -> type | None:
    """A plain class with ``cls``'s slots that an instance of ``cls`` can take as its ``__class__``
    and give back (tried once here), or ``None``."""
    slots = cls.__dict__["__slots__"]
    if isinstance(slots, str) or "__dict__" in slots or "__weakref__" in slots:
        return None
    builder = type(f"{cls.__name__}Builder", (), {"__slots__": tuple(slots), "__module__": cls.__module__})
    probe: object = object.__new__(cls)
    try:
        object.__setattr__(probe, "__class__", builder)
        probe.__class__ = cls
    except TypeError:  # pragma: no cover - a layout CPython does not let the two classes share
        return None
    return builder
