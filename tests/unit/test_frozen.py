"""``quick_init``: the same construction as the dataclass ``__init__`` it replaces, or a refusal."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest

from balancer.frozen import BUILDER_MIN_FIELDS, quick_init
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy.base import PolicyInputs, RouteRequest
from balancer.routing.router import PoolRequest, RoutePlan
from balancer.service.decisions import DecisionRecord
from balancer.types import CostTerms, Decision, Overlap


@dataclass(frozen=True, slots=True)
class _Plain:
    name: str
    count: int
    ratio: float | None = None
    tags: tuple[str, ...] = ()


@quick_init
@dataclass(frozen=True, slots=True)
class _Quick:
    name: str
    count: int
    ratio: float | None = None
    tags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _PlainFactory:
    name: str
    seen: dict[str, int] = field(default_factory=dict)


@quick_init
@dataclass(frozen=True, slots=True)
class _QuickFactory:
    name: str
    seen: dict[str, int] = field(default_factory=dict)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("a", 1), {}),
        (("a", 1, 0.5), {}),
        (("a",), {"count": 2, "tags": ("x",)}),
        ((), {"name": "b", "count": 3, "ratio": None, "tags": ()}),
    ],
)
def test_it_builds_what_the_dataclass_init_builds(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    plain, quick = _Plain(*args, **kwargs), _Quick(*args, **kwargs)  # type: ignore[arg-type]
    assert dataclasses.astuple(quick) == dataclasses.astuple(plain)
    assert repr(quick).removeprefix("_Quick") == repr(plain).removeprefix("_Plain")
    assert hash(quick) == hash(_Quick(*args, **kwargs))  # type: ignore[arg-type]
    assert dataclasses.replace(quick, count=9).count == 9
    assert pickle.loads(pickle.dumps(quick)) == quick
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.count = 5  # type: ignore[misc]


def test_a_default_factory_gives_each_instance_its_own_value() -> None:
    first, second = _QuickFactory("a"), _QuickFactory("b")
    assert first.seen == {} and first.seen is not second.seen
    given = {"x": 1}
    assert _QuickFactory("c", given).seen is given
    assert dataclasses.astuple(_QuickFactory("a")) == dataclasses.astuple(_PlainFactory("a"))
    assert str(inspect.signature(_QuickFactory)) == str(inspect.signature(_PlainFactory))


def test_it_refuses_the_calls_the_dataclass_init_refuses() -> None:
    for call in (lambda cls: cls("a"), lambda cls: cls("a", 1, other=2), lambda cls: cls("a", 1, 2.0, (), 5)):
        with pytest.raises(TypeError):
            call(_Plain)
        with pytest.raises(TypeError):
            call(_Quick)


_REQUEST_PATH = (
    CostTerms,
    Decision,
    Overlap,
    ReplicaLoad,
    LoadSnapshot,
    RouteRequest,
    PolicyInputs,
    RoutePlan,
    DecisionRecord,
)


@pytest.mark.parametrize("cls", [*_REQUEST_PATH, RoutePlan, PoolRequest])
def test_the_request_path_classes_keep_their_parameters(cls: type) -> None:
    """Each decorated class takes exactly its fields, in order, with their defaults."""
    parameters = list(inspect.signature(cls).parameters.values())
    fields = dataclasses.fields(cls)
    assert [p.name for p in parameters] == [f.name for f in fields]
    for parameter, f in zip(parameters, fields, strict=True):
        if f.default_factory is not dataclasses.MISSING:
            assert repr(parameter.default) == "<factory>"
        elif f.default is dataclasses.MISSING:
            assert parameter.default is inspect.Parameter.empty
        else:
            assert parameter.default == f.default


def test_it_refuses_classes_it_cannot_serve_exactly() -> None:
    @dataclass(slots=True)
    class Mutable:
        name: str

    @dataclass(frozen=True)
    class NoSlots:
        name: str

    @dataclass(frozen=True, slots=True)
    class KwOnly:
        name: str = field(kw_only=True)

    @dataclass(frozen=True, slots=True)
    class PostInit:
        name: str

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class NotInInit:
        name: str = field(default="", init=False)

    @dataclass(frozen=True, slots=True)
    class Derived(_Plain):
        more: int = 0

    for cls in (Mutable, NoSlots, KwOnly, PostInit, NotInInit, Derived):
        with pytest.raises(TypeError):
            quick_init(cls)


def _refuse() -> dict[str, int]:
    raise RuntimeError("no default today")


@quick_init
@dataclass(frozen=True, slots=True)
class _QuickRaising:
    name: str
    seen: dict[str, int] = field(default_factory=_refuse)


@pytest.mark.parametrize("cls", [*_REQUEST_PATH, PoolRequest, _Quick, _QuickFactory])
def test_the_fields_are_stored_through_a_builder_of_the_same_layout(cls: type) -> None:
    """A class whose only base is ``object`` is built through its builder (plain stores into the
    same slots); the instance is of the class itself afterwards, and frozen."""
    init_names = cls.__init__.__code__.co_names
    if len(dataclasses.fields(cls)) >= BUILDER_MIN_FIELDS:
        assert "_BUILDER" in init_names and "_SET_CLASS" in init_names
    else:  # too few fields for the class swaps to pay
        assert "_BUILDER" not in init_names
    quick = _Quick("a", 1, 0.5, ("t",))
    assert type(quick) is _Quick and dataclasses.astuple(quick) == ("a", 1, 0.5, ("t",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.name = "b"  # type: ignore[misc]


def test_an_instance_whose_default_factory_raises_is_left_of_its_class() -> None:
    made: list[object] = []
    original = _QuickRaising.__init__

    def init(self: _QuickRaising, *args: object) -> None:
        made.append(self)
        original(self, *args)  # type: ignore[arg-type]

    _QuickRaising.__init__ = init  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError):
            _QuickRaising("a")
    finally:
        _QuickRaising.__init__ = original  # type: ignore[method-assign]
    assert type(made[0]) is _QuickRaising
    assert _QuickRaising("b", {"x": 1}).seen == {"x": 1}
