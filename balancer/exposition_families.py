"""The kept ``/metrics`` text of one ``Counter``, ``Gauge`` or ``Histogram`` family between two
scrapes: :mod:`balancer.exposition`'s path for the families kvlb declares (most of them per replica).

Their values are read straight from the children (``prometheus_client``'s ``MutexValue`` fields,
without the lock, the ``Sample`` tuples and the ``le`` labels ``_child_samples`` builds at each
call). When neither a family's children nor any of their values changed since the last scrape, its
whole text (bytes) is written again as it was: at 200 replicas most families are per-replica
counters at 0 (:meth:`balancer.metrics.Metrics.init_replica`) and their constant ``_created``
timestamps. Else each child whose values did not change gives its kept lines again, and the others
are written from their kept label texts (``name{labels} ``). The text is what
``generate_latest`` writes, byte for byte, with one exception: a value that went from ``0.0`` to
``-0.0`` (equal floats) keeps its text ``0.0`` until it changes again.

:func:`render_family` is a generator that yields between children once :class:`Work` says a step is
done, so that a caller on the event loop can let it run between two steps. Not for a family whose
values are kept in ``PROMETHEUS_MULTIPROC_DIR`` files (:func:`direct` says so): the caller renders
those from ``collect()``. Pure: reads the collectors it is given, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from operator import attrgetter, methodcaller
from typing import Final, cast

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client import metrics as client_metrics
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.values import MutexValue

STEP_WORK: Final = 500
"""The work between two yields of :func:`render_family` (and :class:`balancer.exposition.Exposition`'s
steps): about one unit a sample line written afresh (a few µs: more for the first, whose label text
is built), one a child whose kept lines are written again, one per 20 values of a family checked
unchanged. At 200 replicas and load 5 on 2 shared cores a step of 500 took at most 2.7–4.7 ms of
CPU in later renders and 7.1–12.4 ms in a first one (``python -m loadtests.bench.metrics_cost``,
``longest_step_ms``, 2026-12-01)."""
UNCHANGED_VALUES_A_UNIT: Final = 20
"""How many values of a family compared with the last scrape's make one unit of :data:`STEP_WORK`."""

NumberText = Callable[[float], str]
"""A value's text, as ``generate_latest`` writes it (``floatToGoString``)."""
PrefixText = Callable[[str, dict[str, str]], str]
"""A sample line up to its value, from its name and labels (``name{k="v",...} ``)."""
HeaderText = Callable[[MetricWrapperBase], tuple[str, str]]
"""A family's HELP and TYPE lines, and those of its ``_created`` family."""


class Work:
    """The work done since the last yield of a render (see :data:`STEP_WORK`)."""

    __slots__ = ("done", "step")

    def __init__(self, step: int = STEP_WORK) -> None:
        self.done = 0
        self.step = step

    def add(self, units: int) -> bool:
        """Count ``units``; ``True`` (and start a new step) once a step is done: time to yield."""
        self.done += units
        if self.done < self.step:
            return False
        self.done = 0
        return True


class KeptChild:
    """One child's texts: its label texts (``prefixes``, the ``_created`` one apart), the values its
    main lines were written from and those lines, its ``_created`` value and line."""

    __slots__ = ("created", "created_line", "created_prefix", "lines", "prefixes", "values")

    def __init__(self, prefixes: tuple[str, ...], created_prefix: str | None) -> None:
        self.prefixes = prefixes
        self.created_prefix = created_prefix
        self.values: list[float] | None = None
        self.lines = ""
        self.created: float | None = None
        self.created_line = ""


class KeptFamily:
    """One family's texts as the last scrape wrote them: its children (the objects, in order, and by
    label values), the value cells read from them (``MutexValue``; ``None`` when a gauge child
    calls a function), the values and ``_created`` timestamps read, its whole text, and each
    child's texts by label values."""

    __slots__ = (
        "cells", "children", "chunk", "created", "header", "kept", "labelled", "stride", "use_created",
        "values",
    )  # fmt: skip

    def __init__(
        self,
        header: tuple[str, str],
        children: list[MetricWrapperBase],
        labelled: list[tuple[tuple[str, ...], MetricWrapperBase]],
        use_created: bool,
    ) -> None:
        self.header = header
        self.children = children
        self.labelled = labelled
        self.use_created = use_created
        self.cells = _cells(children)
        self.stride = len(self.cells) // len(children) if children and self.cells is not None else 1
        self.values: list[float] = []
        self.created: list[float] = []
        self.chunk = b""
        self.kept: dict[tuple[str, ...], KeptChild] = {}

    @property
    def prefixes(self) -> int:
        """How many label texts it keeps."""
        return sum(len(child.prefixes) + (child.created_prefix is not None) for child in self.kept.values())


_VALUE: Final = attrgetter("_value")
_CREATED: Final = attrgetter("_created")
_DICT: Final = attrgetter("__dict__")
_HAS_FUNCTION: Final = methodcaller("__contains__", "_child_samples")
"""True of a child's ``__dict__`` once ``Gauge.set_function`` replaced its ``_child_samples``."""


def _use_created() -> bool:
    return bool(getattr(client_metrics, "_use_created", True))


def _cells(children: list[MetricWrapperBase]) -> list[MutexValue] | None:
    """The value cells of ``children``, in order (a histogram child's buckets, then its sum); ``None``
    when one is a gauge reading a function."""
    if not children:
        return []
    if type(children[0]) is Histogram:
        histograms = cast(list[Histogram], children)
        return [cell for c in histograms for cell in (*c._buckets, c._sum)]
    if _calls_a_function(children):
        return None
    return list(map(_VALUE, children))


def _calls_a_function(children: list[MetricWrapperBase]) -> bool:
    """Whether a gauge child reads a function (``set_function``), each checked at C speed."""
    return any(map(_HAS_FUNCTION, map(_DICT, children)))


def direct(children: Sequence[MetricWrapperBase]) -> bool:
    """Whether the values of ``children`` (of one collector) can be read straight from their fields
    (kept in process memory, ``MutexValue``; not in ``PROMETHEUS_MULTIPROC_DIR`` files)."""
    if not children:
        return True
    first = children[0]
    value = first._sum if isinstance(first, Histogram) else cast(Counter, first)._value
    return type(value) is MutexValue


def _gauge_value(child: MetricWrapperBase) -> float:
    """A gauge child's value: ``set_function``'s function called, as ``generate_latest`` does."""
    if "_child_samples" in child.__dict__:
        return float(next(iter(child._child_samples())).value)
    return cast(float, cast(Gauge, child)._value._value)


def _lines(child: MetricWrapperBase, kept: KeptChild, values: list[float], number: NumberText) -> str:
    """``child``'s main lines from its label texts and ``values`` (a histogram's raw bucket counts
    then its sum, a value else)."""
    prefixes = kept.prefixes
    if type(child) is not Histogram:
        return f"{prefixes[0]}{number(values[0])}\n"
    buckets = len(values) - 1
    out: list[str] = []
    acc = 0.0
    for prefix, count in zip(prefixes[:buckets], values[:buckets], strict=True):
        acc += count
        out.append(f"{prefix}{number(acc)}\n")
    out.append(f"{prefixes[buckets]}{number(acc)}\n")
    if len(prefixes) > buckets + 1:  # a histogram whose first bound is negative has no _sum
        out.append(f"{prefixes[buckets + 1]}{number(values[-1])}\n")
    return "".join(out)


def _new_child(
    collector: MetricWrapperBase, values: tuple[str, ...], child: MetricWrapperBase, prefix: PrefixText
) -> KeptChild:
    """A child's label texts, from the samples ``prometheus_client`` builds (once per label set)."""
    series = list(zip(collector._labelnames, values, strict=True))
    main: list[str] = []
    created: str | None = None
    for sample in child._child_samples():
        text = prefix(collector._name + sample.name, dict(series + list(sample.labels.items())))
        if sample.name == "_created":
            created = text
        else:
            main.append(text)
    return KeptChild(tuple(main), created)


def _labelled(collector: MetricWrapperBase) -> list[tuple[tuple[str, ...], MetricWrapperBase]]:
    """``collector``'s children by label values (itself when it has no labels), in their order."""
    if not collector._labelnames:
        return [((), collector)]
    with collector._lock:
        return [(tuple(values), child) for values, child in collector._metrics.items()]


def _objects(collector: MetricWrapperBase) -> list[MetricWrapperBase]:
    """``collector``'s children, in their order (itself when it has no labels)."""
    if not collector._labelnames:
        return [collector]
    with collector._lock:
        return list(collector._metrics.values())


def render_family(
    collector: MetricWrapperBase,
    kept: KeptFamily | None,
    out: list[bytes],
    work: Work,
    texts: tuple[NumberText, PrefixText, HeaderText],
) -> Generator[None, None, KeptFamily | None]:
    """Append the text of ``collector`` to ``out``, from ``kept`` (the last scrape's) where nothing
    changed; yields each time ``work`` says a step is done. ``texts`` writes a value, a label text
    and the family's header lines (once per family: its name and help do not change). Returns what
    to keep, or ``None`` (having written nothing) when its values are not :func:`direct`."""
    use_created = _use_created()
    children = _objects(collector)
    if kept is None or kept.children != children or kept.use_created != use_created:
        labelled = _labelled(collector)
        children = [child for _, child in labelled]
        if not direct(children):
            return None
        header = kept.header if kept is not None else texts[2](collector)
        family = KeptFamily(header, children, labelled, use_created)
        if kept is not None and kept.use_created == use_created:
            family.kept = kept.kept
        kept = family
    elif type(collector) is Gauge and kept.cells is not None and _calls_a_function(children):
        kept.cells = None  # a child's set_function since the last scrape
    cells = kept.cells
    values = list(map(_VALUE, cells)) if cells is not None else [_gauge_value(c) for c in children]
    created = list(map(_CREATED, children)) if use_created and type(collector) is not Gauge else []
    if kept.chunk and values == kept.values and created == kept.created:
        out.append(kept.chunk)
        if work.add(1 + (len(values) + len(created)) // UNCHANGED_VALUES_A_UNIT):
            yield
        return kept
    number, prefix, _ = texts
    old = kept.kept
    new: dict[tuple[str, ...], KeptChild] = {}
    main: list[str] = [kept.header[0]]
    created_lines: list[str] = []
    stride = kept.stride
    for index, (label_values, child) in enumerate(kept.labelled):
        entry = old.get(label_values)
        if entry is None:
            entry = _new_child(collector, label_values, child, prefix)
        child_values = values[index * stride : (index + 1) * stride]
        units = 1
        if entry.values != child_values:
            entry.lines = _lines(child, entry, child_values, number)
            entry.values = child_values
            units += len(entry.prefixes)
        if entry.created_prefix is not None and created:
            if entry.created != created[index]:
                entry.created = created[index]
                entry.created_line = f"{entry.created_prefix}{number(created[index])}\n"
                units += 1
            created_lines.append(entry.created_line)
        new[label_values] = entry
        main.append(entry.lines)
        if work.add(units):
            yield
    if created_lines:
        main.append(kept.header[1])
        main.extend(created_lines)
    kept.chunk = "".join(main).encode("utf-8")
    kept.kept, kept.values, kept.created = new, values, created
    out.append(kept.chunk)
    return kept
