"""Metric names in PromQL expressions, and the series names a Prometheus exposition offers (pure).

:func:`metric_names` drops strings, label matchers, range and offset durations, grouping clauses and
numbers, then keeps every identifier that is neither a function call nor a keyword. It is a checker's
approximation of the grammar (promtool, when installed, checks the syntax itself).
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
KEYWORDS |= {"offset", "inf", "nan"}
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
_SUFFIXES |= {"summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}


def metric_names(expr: str) -> set[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\boffset\s+-?[0-9a-z]+", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"(?<![\w:])\d+(\.\d+)?(e[+-]?\d+)?", " ", text, flags=re.IGNORECASE)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        token = match.group(0)
        if token.lower() in KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        names.add(token)
    return names


def exposed_series(exposition: str) -> set[str]:
    """Every series name a ``/metrics`` text offers, including families without samples yet."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
        names.update(sample.name for sample in family.samples)
    return names
