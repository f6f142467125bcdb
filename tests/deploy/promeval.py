"""A small PromQL evaluator for kvlb's alert rules (pure): instant queries over recorded samples, an
alert's ``for``, and promtool's rule-test files, so that the rules are checked where promtool is not
installed, and against samples scraped from a real ``kvlb serve``.

It covers the grammar ``deploy/prometheus/kvlb-alerts.yaml`` uses: selectors with matchers, ranges
and ``offset``; ``rate``, ``increase`` and ``changes``; ``sum``, ``max``, ``min``, ``count`` and
``avg`` by or without labels; ``+ - * /``, comparisons (with ``bool``) and ``and``/``or``/``unless``,
one-to-one with ``on`` or ``ignoring``, or many-to-one with ``group_left`` (no extra labels).
Anything else raises ``ValueError``. ``rate`` is the counter's
increase between the range's first and last samples (resets counted as Prometheus does) over their
distance in time; Prometheus extrapolates to the range's edges, so figures right at a threshold may
differ. A series missing from a scrape is stale from then on, as Prometheus marks it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]
Value = float | Vector
LOOKBACK_S = 300.0
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_TOKEN = re.compile(
    r"\s*(?:(?P<dur>\d+(?:ms|[smhdwy])(?!\w))|(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
    r'|(?P<id>[A-Za-z_:][\w:]*)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>==|!=|=~|!~|>=|<=|[-+*/(){}\[\],=<>]))'
)
_LEVELS = [("or",), ("and", "unless"), ("==", "!=", ">", "<", ">=", "<="), ("+", "-"), ("*", "/")]
_AGGREGATIONS = {"sum", "max", "min", "count", "avg"}
_FUNCTIONS = {"rate", "increase", "changes"}


def duration_s(text: str) -> float:
    """``5m`` → 300.0 (one unit, as the rules write them)."""
    match = re.fullmatch(r"(\d+)(ms|[smhdwy])", text.strip())
    if match is None:
        raise ValueError(f"not a duration: {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class Store:
    """Samples by series (labels with ``__name__``), in time order; ``None`` marks a series stale."""

    series: dict[Labels, list[tuple[float, float | None]]] = field(default_factory=dict)

    def add(self, labels: dict[str, str], t: float, value: float | None) -> None:
        self.series.setdefault(tuple(sorted(labels.items())), []).append((t, value))

    def add_scrape(self, t: float, exposition: str, **extra: str) -> None:
        """One ``/metrics`` text at ``t`` (``_created`` samples left out, as Prometheus does by
        default); a series of the same ``extra`` labels that it no longer offers goes stale."""
        seen = set()
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = {"__name__": sample.name, **sample.labels, **extra}
                seen.add(tuple(sorted(labels.items())))
                self.add(labels, t, float(sample.value))
        mine = set(extra.items())
        for key, samples in self.series.items():
            if key not in seen and mine <= set(key) and samples[-1][1] is not None:
                samples.append((t, None))


@dataclass(frozen=True)
class _Selector:
    matchers: tuple[tuple[str, str, str], ...]
    range_s: float | None
    offset_s: float


@dataclass(frozen=True)
class _Call:
    name: str
    args: tuple[Any, ...]
    grouping: tuple[str, tuple[str, ...]] | None = None


@dataclass(frozen=True)
class _Binary:
    op: str
    left: Any
    right: Any
    matching: tuple[str, tuple[str, ...]] | None
    bool_: bool
    group_left: bool = False
    """Many-to-one: several left elements may match one right element; each keeps its own labels."""


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos, text = 0, text.strip()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                raise ValueError(f"cannot parse {text[pos:]!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.i = 0

    def peek(self) -> str:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, found {token!r}")
        self.i += 1
        return token

    def labels(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return tuple(names)

    def expr(self, level: int = 0) -> Any:
        if level == len(_LEVELS):
            return self.primary()
        left = self.expr(level + 1)
        while self.peek() in _LEVELS[level]:
            op = self.take()
            bool_ = self.peek() == "bool" and bool(self.take())
            matching = None
            if self.peek() in ("on", "ignoring"):
                matching = (self.take(), self.labels())
            group_left = matching is not None and self.peek() == "group_left" and bool(self.take())
            if self.peek() in ("group_left", "group_right", "(") and group_left:
                raise ValueError("group_right, and group_left with labels, are not supported")
            if self.peek() == "group_right":
                raise ValueError("group_right is not supported")
            left = _Binary(op, left, self.expr(level + 1), matching, bool_, group_left)
        return left

    def primary(self) -> Any:
        kind, token = self.tokens[self.i] if self.i < len(self.tokens) else ("", "")
        if token == "(":
            self.take()
            inner = self.expr()
            self.take(")")
            return inner
        if kind == "num":
            self.take()
            return float(token)
        if token in _AGGREGATIONS:
            self.take()
            grouping = (self.take(), self.labels()) if self.peek() in ("by", "without") else None
            self.take("(")
            inner = self.expr()
            self.take(")")
            if self.peek() in ("by", "without"):
                grouping = (self.take(), self.labels())
            return _Call(token, (inner,), grouping)
        if kind == "id" and self.tokens[self.i + 1 : self.i + 2] == [("op", "(")]:
            if token not in _FUNCTIONS:
                raise ValueError(f"function {token} is not supported")
            self.take()
            self.take("(")
            arg = self.expr()
            self.take(")")
            return _Call(token, (arg,))
        return self.selector()

    def selector(self) -> _Selector:
        matchers = []
        if self.peek() != "{":
            matchers.append(("__name__", "=", self.take()))
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                name, op, value = self.take(), self.take(), self.take()
                matchers.append((name, op, value[1:-1].encode().decode("unicode_escape")))
                if self.peek() == ",":
                    self.take()
            self.take("}")
        range_s = None
        if self.peek() == "[":
            self.take()
            range_s = duration_s(self.take())
            self.take("]")
        offset_s = 0.0
        if self.peek() == "offset":
            self.take()
            offset_s = duration_s(self.take())
        return _Selector(tuple(matchers), range_s, offset_s)


def parse(expr: str) -> Any:
    parser = _Parser(expr)
    tree = parser.expr()
    if parser.i != len(parser.tokens):
        raise ValueError(f"unexpected {parser.peek()!r} in {expr!r}")
    return tree


def _matches(labels: Labels, matchers: Iterable[tuple[str, str, str]]) -> bool:
    values = dict(labels)
    for name, op, wanted in matchers:
        value = values.get(name, "")
        ok = {"=": value == wanted, "!=": value != wanted}.get(op)
        if ok is None:
            ok = re.fullmatch(wanted, value) is not None
            ok = ok if op == "=~" else not ok
        if not ok:
            return False
    return True


def _without_name(labels: Labels) -> Labels:
    return tuple(item for item in labels if item[0] != "__name__")


def _key(labels: Labels, matching: tuple[str, tuple[str, ...]] | None) -> Labels:
    if matching is not None and matching[0] == "on":
        return tuple(item for item in labels if item[0] in matching[1])
    ignored = matching[1] if matching is not None else ()
    return tuple(item for item in _without_name(labels) if item[0] not in ignored)


def _arith(op: str, a: float, b: float) -> float:
    if op == "/":
        return a / b if b else (float("nan") if a == 0 else float("inf") * (1 if a > 0 else -1))
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _compare(op: str, a: float, b: float) -> bool:
    return {"==": a == b, "!=": a != b, ">": a > b, "<": a < b, ">=": a >= b, "<=": a <= b}[op]


class Evaluator:
    def __init__(self, store: Store, lookback_s: float = LOOKBACK_S) -> None:
        self.store, self.lookback_s = store, lookback_s

    def instant(self, expr: str | Any, t: float) -> Value:
        node = parse(expr) if isinstance(expr, str) else expr
        return self._eval(node, t)

    def _range(self, node: Any, t: float) -> dict[Labels, list[tuple[float, float]]]:
        if not isinstance(node, _Selector) or node.range_s is None:
            raise ValueError("a range function needs a range selector")
        end = t - node.offset_s
        out = {}
        for labels, samples in self.store.series.items():
            if _matches(labels, node.matchers):
                kept = [(ts, v) for ts, v in samples if end - node.range_s <= ts <= end and v is not None]
                if kept:
                    out[labels] = kept
        return out

    def _eval(self, node: Any, t: float) -> Value:
        if isinstance(node, float):
            return node
        if isinstance(node, _Selector):
            if node.range_s is not None:
                raise ValueError("a range selector needs a function")
            end, vector = t - node.offset_s, {}
            for labels, samples in self.store.series.items():
                if _matches(labels, node.matchers):
                    last = [v for ts, v in samples if end - self.lookback_s < ts <= end]
                    if last and last[-1] is not None:
                        vector[labels] = last[-1]
            return vector
        if isinstance(node, _Call) and node.name in _FUNCTIONS:
            return self._function(node, t)
        if isinstance(node, _Call):
            return self._aggregate(node, t)
        return self._binary(node, t)

    def _function(self, node: _Call, t: float) -> Vector:
        vector = {}
        for labels, samples in self._range(node.args[0], t).items():
            values = [v for _, v in samples]
            if node.name == "changes":
                vector[_without_name(labels)] = float(sum(a != b for a, b in itertools.pairwise(values)))
                continue
            if len(samples) < 2:
                continue
            grown = sum(b - a if b >= a else b for a, b in itertools.pairwise(values))
            rate = grown / (samples[-1][0] - samples[0][0])
            range_s = node.args[0].range_s
            vector[_without_name(labels)] = rate if node.name == "rate" else rate * range_s
        return vector

    def _aggregate(self, node: _Call, t: float) -> Vector:
        inner = self._eval(node.args[0], t)
        if not isinstance(inner, dict):
            raise ValueError(f"{node.name} needs a vector")
        groups: dict[Labels, list[float]] = {}
        how, names = node.grouping or ("by", ())
        for labels, value in inner.items():
            kept = [i for i in _without_name(labels) if (i[0] in names) == (how == "by")]
            groups.setdefault(tuple(kept), []).append(value)
        reduce: dict[str, Callable[[list[float]], float]] = {
            "sum": sum, "max": max, "min": min, "count": len, "avg": lambda vs: sum(vs) / len(vs)
        }  # fmt: skip
        return {key: float(reduce[node.name](vs)) for key, vs in groups.items()}

    def _binary(self, node: _Binary, t: float) -> Value:
        left, right, op = self._eval(node.left, t), self._eval(node.right, t), node.op
        comparison = op in _LEVELS[2]
        if not isinstance(left, dict) and not isinstance(right, dict):
            return float(_compare(op, left, right)) if comparison else _arith(op, left, right)
        if op in ("and", "or", "unless"):
            if not isinstance(left, dict) or not isinstance(right, dict):
                raise ValueError(f"{op} needs vectors on both sides")
            right_keys = {_key(labels, node.matching) for labels in right}
            kept = {k: v for k, v in left.items() if (_key(k, node.matching) in right_keys) == (op == "and")}
            if op == "or":
                left_keys = {_key(labels, node.matching) for labels in left}
                kept = dict(left) | {
                    k: v for k, v in right.items() if _key(k, node.matching) not in left_keys
                }
            return kept
        pairs: list[tuple[Labels, float, float, float]] = []  # (labels, left, right, kept value)
        if isinstance(left, dict) and isinstance(right, dict):
            by_key: dict[Labels, tuple[Labels, float]] = {}
            for labels, value in right.items():
                if _key(labels, node.matching) in by_key:
                    raise ValueError("many-to-many matching")
                by_key[_key(labels, node.matching)] = (labels, value)
            matched: set[Labels] = set()
            for labels, value in left.items():
                match = by_key.get(_key(labels, node.matching))
                if match is not None:
                    if not node.group_left and _key(labels, node.matching) in matched:
                        raise ValueError("many-to-one matching needs group_left")
                    matched.add(_key(labels, node.matching))
                    many = node.group_left or not node.matching
                    result = labels if many else _key(labels, node.matching)
                    pairs.append((result, value, match[1], value))
        elif isinstance(left, dict):
            pairs = [(labels, value, float(right), value) for labels, value in left.items()]  # type: ignore[arg-type]
        else:
            pairs = [(labels, float(left), value, value) for labels, value in right.items()]  # type: ignore[union-attr]
        out = {}
        for labels, a, b, kept_value in pairs:
            if comparison and not node.bool_:
                if _compare(op, a, b):
                    out[labels] = kept_value
            else:
                computed = float(_compare(op, a, b)) if comparison else _arith(op, a, b)
                out[_without_name(labels)] = computed
        return out


def firing(
    rule: dict[str, Any], evaluator: Evaluator, times: Iterable[float]
) -> dict[float, list[dict[str, str]]]:
    """The alerts ``rule`` fires at each of ``times`` (ascending, one per evaluation): the labels of
    each result active for the rule's ``for`` at least, with the rule's own labels."""
    hold_s = duration_s(rule["for"]) if "for" in rule else 0.0
    tree, out = parse(rule["expr"]), {}
    since: dict[Labels, float] = {}
    for t in times:
        value = evaluator.instant(tree, t)
        active = value if isinstance(value, dict) else {}
        since = {labels: since.get(labels, t) for labels in active}
        out[t] = [
            {**dict(_without_name(labels)), **rule.get("labels", {})}
            for labels, start in since.items()
            if t - start >= hold_s
        ]
    return out


def expand_values(text: str) -> list[float | None]:
    """promtool's series notation: ``a+bxN`` (N+1 values), ``axN``, ``_`` (no sample), ``_xN``."""
    values: list[float | None] = []
    for item in text.split():
        match = re.fullmatch(r"(_|-?[\d.]+(?:e[+-]?\d+)?)(?:([+-][\d.]+)?x(\d+))?", item)
        if match is None:
            raise ValueError(f"cannot expand {item!r}")
        start, step, count = match.group(1), match.group(2), match.group(3)
        if start == "_":
            values += [None] * int(count or 1)
            continue
        n = int(count) if count is not None else 0
        values += [float(start) + float(step or 0) * i for i in range(n + 1)]
    return values


def _series_labels(text: str) -> dict[str, str]:
    match = re.fullmatch(r"([A-Za-z_:][\w:]*)(?:\{(.*)\})?", text.strip())
    if match is None:
        raise ValueError(f"cannot read series {text!r}")
    pairs = re.findall(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"', match.group(2) or "")
    return {"__name__": match.group(1), **dict(pairs)}


def run_rule_tests(test_file: dict[str, Any], rules: list[dict[str, Any]]) -> list[str]:
    """promtool's ``alert_rule_test`` cases of one test file, against ``rules``: the failures, as
    text (empty: all passed). Labels are compared exactly; annotations only where their template
    uses ``$labels`` alone (``$value`` formatting is promtool's)."""
    failures = []
    by_name = {rule["alert"]: rule for rule in rules if "alert" in rule}
    step_s = duration_s(test_file.get("evaluation_interval", "1m"))
    for case in test_file["tests"]:
        store, interval_s = Store(), duration_s(case.get("interval", "1m"))
        for item in case["input_series"]:
            for i, value in enumerate(expand_values(item["values"])):
                if value is not None:
                    store.add(_series_labels(item["series"]), i * interval_s, value)
        evaluator = Evaluator(store)
        for check in case["alert_rule_test"]:
            rule = by_name[check["alertname"]]
            end = duration_s(check["eval_time"])
            times = [i * step_s for i in range(int(end // step_s) + 1)]
            got = sorted(sorted(alert.items()) for alert in firing(rule, evaluator, times)[times[-1]])
            wanted = sorted(sorted(a.get("exp_labels", {}).items()) for a in check.get("exp_alerts", []))
            where = f"{case['name']!r} at {check['eval_time']}, {check['alertname']}"
            if got != wanted:
                failures.append(f"{where}: fired {got}, expected {wanted}")
            for alert in check.get("exp_alerts", []):
                failures += [f"{where}: {wrong}" for wrong in _annotation_errors(rule, alert)]
    return failures


def _annotation_errors(rule: dict[str, Any], alert: dict[str, Any]) -> list[str]:
    labels, wanted, errors = alert.get("exp_labels", {}), alert.get("exp_annotations", {}), []
    for name, template in rule.get("annotations", {}).items():
        if "$value" in template or name not in wanted:
            continue
        text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: str(labels.get(m.group(1), "")), template)
        if text != wanted[name]:
            errors.append(f"{name} {text!r}, expected {wanted[name]!r}")
    return errors
