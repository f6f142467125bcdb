"""``quick_init``: the same construction as the dataclass ``__init__`` it replaces, or a refusal."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest

from balancer.frozen import quick_init
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

    for cls in (Mutable, NoSlots, KwOnly, PostInit, NotInInit):
        with pytest.raises(TypeError):
            quick_init(cls)
