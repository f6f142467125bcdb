"""The ``/metrics`` text of a registry, as ``prometheus_client.generate_latest`` writes it, but cheaper
and in steps.

``generate_latest`` builds a ``Metric`` with a label dict per sample (``collect()``), then formats
every sample's line from scratch: it sorts the labels, checks and escapes every label name and value
and the metric name (regular expressions), and writes the value with ``floatToGoString``, all pure
Python on the event loop. At 200 replicas kvlb exports some 30,000 samples, most of them per-replica
counters at 0 and their constant ``_created`` timestamps: hundreds of ms a scrape on a loaded
machine (``python -m loadtests.bench.metrics_cost``). :class:`Exposition` keeps, from one scrape to
the next, the text of each ``Counter``, ``Gauge`` and ``Histogram`` family (read from the children
directly, without ``collect()``: :mod:`balancer.exposition_families`), written again whole when none
of its values changed, child by child else; and, for any other collector, the text of each sample
line up to its value (``name{labels} ``). It renders in steps (:meth:`Exposition.steps`) that the
``/metrics`` handler runs with the loop's other work between them. The output is byte-identical to
``generate_latest``'s with its default (underscores) escaping (``tests/unit/test_exposition.py``;
one exception: :mod:`balancer.exposition_families`).

Bounded: what it keeps is what the last scrape wrote (each scrape keeps anew what it wrote), so a
series removed from the registry (:meth:`balancer.metrics.Metrics.forget_replica`) leaves it at the
next scrape. Not thread-safe: one instance per registry, called from one thread (the loop).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Final, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from balancer.exposition_families import STEP_WORK, KeptFamily, Work, render_family
from balancer.tasks import at_once

_ESCAPING: Final = openmetrics.UNDERSCORES
"""``generate_latest``'s default escaping of metric and label names (what ``/metrics`` serves)."""
_OM_SUFFIXES: Final = ("_created", "_gsum", "_gcount")
"""The OpenMetrics samples ``generate_latest`` moves into a gauge family of their own, in this order
of test (it writes the families sorted by suffix)."""

_to_go: Final = cast(Callable[[float], str], floatToGoString)
_metric_name: Final = cast(Callable[[str, str], str], openmetrics.escape_metric_name)
_label_name: Final = cast(Callable[[str, str], str], openmetrics.escape_label_name)
_label_value: Final = cast(Callable[[str, str, bool], str], openmetrics._escape)

_PrefixKey = tuple[str, tuple[tuple[str, str], ...]]


def _prefix(name: str, labels: dict[str, str]) -> str:
    """A sample line up to its value: ``name{k="v",...} `` (labels sorted), as ``generate_latest``."""
    if labels:
        rendered = ",".join(
            f'{_label_name(k, _ESCAPING)}="{_label_value(v, openmetrics.ALLOWUTF8, False)}"'
            for k, v in sorted(labels.items())
        )
        return f"{_metric_name(name, _ESCAPING)}{{{rendered}}} "
    return f"{_metric_name(name, _ESCAPING)} "


def _help(name: str, documentation: str) -> str:
    escaped = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {_metric_name(name, _ESCAPING)} {escaped}\n"


def _type(name: str, kind: str) -> str:
    return f"# TYPE {_metric_name(name, _ESCAPING)} {kind}\n"


_TYPE_NAMES: Final = {
    "info": "gauge",
    "stateset": "gauge",
    "gaugehistogram": "histogram",
    "unknown": "untyped",
}


_FAST_TYPES: Final = (Counter, Gauge, Histogram)
"""The collector classes whose children's sample names and labels never change (only their values):
:mod:`balancer.exposition_families` keeps each family's text and reads its values from the children
directly. A subclass takes the generic path (``collect()``)."""


class Exposition:
    """Renders one registry as ``generate_latest`` does, keeping each family's and sample's text from
    the previous render (see the module docstring). :meth:`steps` renders in steps (for the event
    loop); :meth:`render` all at once. :attr:`prefixes` is how many samples' label texts it keeps
    (those of the last render: about 100 B each)."""

    __slots__ = ("_families", "_prefixes", "_registry", "_step")

    def __init__(self, registry: CollectorRegistry, step: int = STEP_WORK) -> None:
        self._registry = registry
        self._prefixes: dict[_PrefixKey, str] = {}
        self._families: dict[MetricWrapperBase, KeptFamily] = {}
        self._step = step

    @property
    def prefixes(self) -> int:
        return len(self._prefixes) + sum(family.prefixes for family in self._families.values())

    def render(self) -> bytes:
        """The registry's exposition now (UTF-8), byte for byte what ``generate_latest`` returns."""
        return at_once(self.steps())

    def steps(self) -> Generator[None, None, bytes]:
        """:meth:`render` in steps: yields after about ``step`` units of work (:data:`STEP_WORK`: a
        few ms), between two families or two children, and returns the text. Between two steps the
        registry may change (a series added or removed, a value set): the text is then of some
        moment between the first step and the last, each sample as it was when its family was
        written. Two renders may run at once (two scrapes): each keeps what it wrote, family by
        family, the last one's staying."""
        old = self._prefixes
        new: dict[_PrefixKey, str] = {}
        large: dict[float, str] = {}
        work = Work(self._step)

        def number(value: float) -> str:
            """``floatToGoString(value)``: ``repr`` below 1e6, whose text Go writes alike."""
            d = float(value)
            if -1e6 < d < 1e6:
                return repr(d)
            text = large.get(d)
            if text is None:
                text = large[d] = _to_go(d)
            return text

        output: list[str] = []
        append = output.append

        def line(sample: Sample) -> str:
            key = (sample.name, tuple(sample.labels.items()))
            prefix = new.get(key)
            if prefix is None:
                prefix = old.get(key)
                if prefix is None:
                    prefix = _prefix(sample.name, sample.labels)
                new[key] = prefix
            if sample.timestamp is None:
                return f"{prefix}{number(sample.value)}\n"
            millis = int(float(cast(float, sample.timestamp)) * 1000)
            return f"{prefix}{number(sample.value)} {millis:d}\n"

        def family(name: str, kind: str, documentation: str) -> dict[str, str]:
            shown = name
            if kind == "counter":
                shown = name + "_total"
            elif kind == "info":
                shown = name + "_info"
            append(_help(shown, documentation))
            append(_type(shown, _TYPE_NAMES.get(kind, kind)))
            return {name + suffix: suffix for suffix in _OM_SUFFIXES}

        def generic(metrics: Iterable[Metric]) -> bool:
            """Append ``metrics``' text to ``chunks``; ``True`` when a step is done."""
            for metric in metrics:
                suffixed = family(metric.name, metric.type, metric.documentation)
                om_samples: dict[str, list[str]] = {}
                for sample in metric.samples:
                    suffix = suffixed.get(sample.name)
                    if suffix is None:
                        append(line(sample))
                    else:
                        om_samples.setdefault(suffix, []).append(line(sample))
                for suffix, lines in sorted(om_samples.items()):
                    append(_help(metric.name + suffix, metric.documentation))
                    append(_type(metric.name + suffix, "gauge"))
                    output.extend(lines)
            chunks.append("".join(output).encode("utf-8"))
            written = len(output)
            output.clear()
            return work.add(written)

        chunks: list[bytes] = []
        registry = self._registry
        with registry._lock:
            collectors = list(registry._collector_to_names)
            target_info: Metric | None = (
                registry._target_info_metric() if registry._target_info else None  # type: ignore[no-untyped-call]
            )
        if target_info is not None:
            generic([target_info])
        families: dict[MetricWrapperBase, KeptFamily] = {}
        for collector in collectors:
            if type(collector) not in _FAST_TYPES:
                if generic(collector.collect()):
                    yield
            else:
                wrapper = cast(MetricWrapperBase, collector)
                kept = yield from render_family(
                    wrapper, self._families.get(wrapper), chunks, work, (number, _prefix, _headers)
                )
                if kept is not None:
                    families[wrapper] = kept
                elif generic(wrapper.collect()):  # values in PROMETHEUS_MULTIPROC_DIR files
                    yield
        self._prefixes, self._families = new, families
        return b"".join(chunks)


def _headers(collector: MetricWrapperBase) -> tuple[str, str]:
    """The HELP and TYPE lines of ``collector``'s family and of its ``_created`` family."""
    metric: Metric = collector._get_metric()  # type: ignore[no-untyped-call]
    name, documentation = metric.name, metric.documentation
    shown = name + "_total" if metric.type == "counter" else name
    return (
        _help(shown, documentation) + _type(shown, metric.type),
        _help(name + "_created", documentation) + _type(name + "_created", "gauge"),
    )


_ALLOWED_SUFFIXES: Final = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
"""The sample names ``prometheus_client``'s text parser takes as a family's own, by type (after its
name): :func:`merge_rendered` gives up on any other sample, where that parser starts a new family."""


def _number(value: float) -> str:
    """A merged sample's value, as :func:`balancer.api.siblings.merge_metrics` writes it."""
    if value != value:
        return "NaN"
    if value in (math.inf, -math.inf):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


MERGE_STEP_LINES: Final = 1_000
"""Lines :func:`merge_rendered_steps` reads between two yields: 2,000 took up to 10–11 ms of CPU at
load 8–9 on 2 shared cores (``python -m loadtests.bench.metrics_cost``, ``merge_2_longest_step_ms``)."""


def merge_rendered(texts: Mapping[int, str]) -> str | None:
    """The expositions of several workers as one, each sample labelled ``worker``: what
    :func:`balancer.api.siblings.merge_metrics` writes, byte for byte, from texts as
    ``generate_latest`` (or :class:`Exposition`) writes them, without parsing them into families and
    label dicts (that parser takes seconds at 200 replicas). Label texts, names and help lines are
    copied (they are escaped alike on both sides); values are read and written again (``1.7e+09``
    becomes ``1700000000.0``) and timestamps dropped, as the parser-based merge does. ``None`` when
    a text is not in that shape (a line it does not expect): the caller then parses."""
    return at_once(merge_rendered_steps(texts))


def merge_rendered_steps(
    texts: Mapping[int, str], step: int = MERGE_STEP_LINES
) -> Generator[None, None, str | None]:
    """:func:`merge_rendered` in steps: yields after every ``step`` lines read (for the event loop:
    two workers' texts at 200 replicas are some 63,000 lines)."""
    read = 0
    order: list[str] = []
    families: dict[str, list[str]] = {}
    for index in sorted(texts):
        worker = f'worker="{index}"'
        lines: list[str] | None = None
        help_line: str | None = None
        allowed: tuple[str, ...] = ()
        for raw in texts[index].split("\n"):
            read += 1
            if read >= step:
                read = 0
                yield
            line = raw.strip()
            if not line:
                continue
            if line.startswith("# HELP "):
                help_line = line
                lines = None
                continue
            if line.startswith("# TYPE "):
                parts = line.split(" ")
                if help_line is None or len(parts) != 4 or not help_line.startswith(f"# HELP {parts[2]} "):
                    return None
                name, kind = parts[2], parts[3]
                if kind not in _ALLOWED_SUFFIXES or (kind == "counter" and not name.endswith("_total")):
                    return None
                lines = families.get(name)
                if lines is None:
                    lines = families[name] = [help_line, line]
                    order.append(name)
                allowed = tuple(name + suffix for suffix in _ALLOWED_SUFFIXES[kind])
                help_line = None
                continue
            if lines is None or line.startswith(("#", "{")):
                return None
            brace = line.find("{")
            if brace >= 0:
                close = line.rfind("} ")
                if close < brace:
                    return None
                name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 2 :]
                labelled = f"{name}{{{labels},{worker}}}" if labels else f"{name}{{{worker}}}"
            else:
                name, _, rest = line.partition(" ")
                labelled = f"{name}{{{worker}}}"
            if name not in allowed or " " in name:
                return None
            try:
                value = float(rest.split(" ", 1)[0])
            except ValueError:
                return None
            lines.append(f"{labelled} {_number(value)}")
    yield
    out: list[str] = []  # each family's text, joined a step at a time (the whole join took ~10 ms)
    for name in order:
        lines = families.pop(name)  # its lines freed in this step too, not all at the end
        out.append("\n".join(lines))
        read += len(lines)
        if read >= step:
            read = 0
            yield
    out.append("")  # the final newline, without copying the whole text once more
    return "\n".join(out)
