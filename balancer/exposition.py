"""The ``/metrics`` text of a registry, as ``prometheus_client.generate_latest`` writes it, but cheaper.

``generate_latest`` builds a ``Metric`` with a label dict per sample (``collect()``), then formats
every sample's line from scratch: it sorts the labels, checks and escapes every label name and value
and the metric name (regular expressions), and writes the value with ``floatToGoString``, all pure
Python on the event loop. At 200 replicas kvlb exports some 20,000 samples: hundreds of ms a scrape
on a loaded machine (``python -m loadtests.bench.metrics_cost``). Between two scrapes the label sets
hardly change, only the values, so :class:`Exposition` keeps, from one scrape to the next, the text
of each sample line up to its value (``name{labels} ``): per child of a ``Counter``, ``Gauge`` or
``Histogram`` (read directly, without ``collect()``), per sample of any other collector; and the text
of each value of 1e6 or more (the ``_created`` timestamps, constant). The output is byte-identical to
``generate_latest``'s with its default (underscores) escaping (``tests/unit/test_exposition.py``).

Bounded: what it keeps is what the last scrape wrote (each scrape builds it anew from the previous
one), so a series removed from the registry (:meth:`balancer.metrics.Metrics.forget_replica`) leaves
it at the next scrape. Not thread-safe: one instance per registry, called from one thread (the loop).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Final, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

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
"""The collector classes whose children's sample names and labels never change (only their values),
so their text up to the value is kept per child: their samples are read from each child directly,
without the ``Metric`` and label dicts ``collect()`` builds. A subclass takes the generic path."""

_ChildKey = tuple[object, tuple[str, ...]]
_ChildText = tuple[tuple[str, str | None], ...]
"""Each sample of a child: its text up to the value and its OpenMetrics suffix (else ``None``)."""


class Exposition:
    """Renders one registry as ``generate_latest`` does, keeping each sample's text up to its value
    from the previous :meth:`render` (see the module docstring). :attr:`prefixes` is how many
    samples' texts it keeps (those of the last render: about 100 B each)."""

    __slots__ = ("_children", "_large", "_prefixes", "_registry")

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._prefixes: dict[_PrefixKey, str] = {}
        self._children: dict[_ChildKey, _ChildText] = {}
        self._large: dict[float, str] = {}

    @property
    def prefixes(self) -> int:
        return len(self._prefixes) + sum(len(text) for text in self._children.values())

    @property
    def numbers(self) -> int:
        """How many texts of values of 1e6 or more (the ``_created`` timestamps) it keeps."""
        return len(self._large)

    def render(self) -> bytes:
        """The registry's exposition now (UTF-8), byte for byte what ``generate_latest`` returns."""
        old, old_children = self._prefixes, self._children
        new: dict[_PrefixKey, str] = {}
        new_children: dict[_ChildKey, _ChildText] = {}
        old_large: dict[float, str] = self._large
        new_large: dict[float, str] = {}

        def number(value: float) -> str:
            """``floatToGoString(value)``: ``repr`` below 1e6, whose text Go writes alike; above, the
            text kept from the last render (a ``_created`` timestamp keeps its value)."""
            d = float(value)
            if -1e6 < d < 1e6:
                return repr(d)
            text = new_large.get(d)
            if text is None:
                text = old_large.get(d)
                if text is None:
                    text = _to_go(d)
                new_large[d] = text
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

        def om_families(name: str, documentation: str, om_samples: dict[str, list[str]]) -> None:
            for suffix, lines in sorted(om_samples.items()):
                append(_help(name + suffix, documentation))
                append(_type(name + suffix, "gauge"))
                output.extend(lines)

        def fast(collector: MetricWrapperBase) -> None:
            metric: Metric = collector._get_metric()  # type: ignore[no-untyped-call]
            suffixed = family(metric.name, metric.type, metric.documentation)
            om_samples: dict[str, list[str]] = {}
            labelnames: tuple[str, ...] = collector._labelnames
            children: list[tuple[tuple[str, ...], MetricWrapperBase]]
            if labelnames:
                with collector._lock:
                    children = [(tuple(values), child) for values, child in collector._metrics.items()]
            else:
                children = [((), collector)]
            for values, child in children:
                key = (collector, values)
                text = new_children.get(key) or old_children.get(key)
                samples = tuple(child._child_samples())
                if text is None or len(text) != len(samples):
                    series = list(zip(labelnames, values, strict=True))
                    text = tuple(
                        (
                            _prefix(collector._name + s.name, dict(series + list(s.labels.items()))),
                            suffixed.get(collector._name + s.name),
                        )
                        for s in samples
                    )
                new_children[key] = text
                for (prefix, suffix), sample in zip(text, samples, strict=True):
                    if suffix is None:
                        append(f"{prefix}{number(sample.value)}\n")
                    else:
                        om_samples.setdefault(suffix, []).append(f"{prefix}{number(sample.value)}\n")
            om_families(metric.name, metric.documentation, om_samples)

        def generic(metrics: Iterable[Metric]) -> None:
            for metric in metrics:
                suffixed = family(metric.name, metric.type, metric.documentation)
                om_samples: dict[str, list[str]] = {}
                for sample in metric.samples:
                    suffix = suffixed.get(sample.name)
                    if suffix is None:
                        append(line(sample))
                    else:
                        om_samples.setdefault(suffix, []).append(line(sample))
                om_families(metric.name, metric.documentation, om_samples)

        registry = self._registry
        with registry._lock:
            collectors = list(registry._collector_to_names)
            target_info: Metric | None = (
                registry._target_info_metric() if registry._target_info else None  # type: ignore[no-untyped-call]
            )
        if target_info is not None:
            generic([target_info])
        for collector in collectors:
            if type(collector) in _FAST_TYPES:
                fast(cast(MetricWrapperBase, collector))
            else:
                generic(collector.collect())
        self._prefixes, self._children, self._large = new, new_children, new_large
        return "".join(output).encode("utf-8")


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


def merge_rendered(texts: Mapping[int, str]) -> str | None:
    """The expositions of several workers as one, each sample labelled ``worker``: what
    :func:`balancer.api.siblings.merge_metrics` writes, byte for byte, from texts as
    ``generate_latest`` (or :class:`Exposition`) writes them, without parsing them into families and
    label dicts (that parser takes seconds at 200 replicas). Label texts, names and help lines are
    copied (they are escaped alike on both sides); values are read and written again (``1.7e+09``
    becomes ``1700000000.0``) and timestamps dropped, as the parser-based merge does. ``None`` when
    a text is not in that shape (a line it does not expect): the caller then parses."""
    order: list[str] = []
    families: dict[str, list[str]] = {}
    for index in sorted(texts):
        worker = f'worker="{index}"'
        lines: list[str] | None = None
        help_line: str | None = None
        allowed: tuple[str, ...] = ()
        for raw in texts[index].split("\n"):
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
    out: list[str] = []
    for name in order:
        out.extend(families[name])
    return "\n".join(out) + "\n"
