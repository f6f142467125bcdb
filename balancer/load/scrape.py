"""The generic half of load scraping (pure: text/JSON in, :class:`ScrapedLoad` out; no I/O, no clock).

What is here serves every engine: :class:`ScrapedLoad` (one engine's own view of its load),
:class:`ScrapeTarget` (an endpoint and the parser of its body), :class:`ScrapeError`, the Prometheus
text parser (:func:`parse_prometheus`), the range checks of a gauge's samples
(:func:`checked_samples`, :func:`checked_prometheus`, by :mod:`balancer.load.gauge_checks`) and the
aggregation over DP ranks. Each engine's own parsers (its metric names, their kinds, its JSON report
shapes) live next to its spec under :mod:`balancer.engines` (:mod:`balancer.engines.sglang_load`,
:func:`balancer.engines.vllm.parse_vllm_prometheus`, :mod:`balancer.engines.trtllm_load`) and are
built from these parts; the generic helpers of JSON reports are in :mod:`balancer.load.scrape_json`.

Aggregation over series: a series is one DP rank when it carries a ``dp``/``dp_rank``/``engine``/
``attention_dp_rank`` label, else all series share rank "". Series of the same rank (other TP/PP
ranks report the same scheduler) are merged by ``max`` (:func:`rank_values`); ranks are then summed
for counts (:func:`rank_sum`) and averaged for fractions (:func:`rank_mean`).

Range checks (:mod:`balancer.load.gauge_checks`): every figure read has a kind (a request count, a
token or block count, a fraction, a lifetime counter); a gauge with a sample out of its kind's range
(NaN for a count, ±Inf, negative, a fraction for a count, above a sanity limit, a usage above 1 or
below 0) is dropped whole (its field is ``None``: unknown, as when not reported) and listed in
:attr:`ScrapedLoad.rejected`; the other fields of the report are kept.

Each engine's spec (:mod:`balancer.engines`) lists its :class:`ScrapeTarget` s in the order
:mod:`balancer.load.scraper` tries them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from balancer.errors import BalancerError
from balancer.load.gauge_checks import Kind, Rejection, rejected
from balancer.load.tracker import EngineStats

RANK_LABELS = ("dp", "dp_rank", "engine", "attention_dp_rank")

Labels = dict[str, str]
Samples = dict[str, list[tuple[Labels, float]]]


class ScrapeError(BalancerError):
    """An engine's load report is missing, malformed, or lacks every field we need."""


@dataclass(frozen=True, slots=True)
class ScrapedLoad:
    """One engine's own view of its load; a field is ``None`` when the engine did not report it."""

    running_reqs: int | None = None
    waiting_reqs: int | None = None
    kv_usage: float | None = None
    """Used fraction of the KV pool, 0..1 (mean over DP ranks)."""
    used_tokens: int | None = None
    capacity_tokens: int | None = None
    cache_hit_rate: float | None = None
    """0..1; SGLang's recent rate, vLLM's lifetime hits/queries, TRT-LLM's ``cacheHitRate``."""
    dp_ranks: int = 1
    rejected: tuple[Rejection, ...] = ()
    """Figures of the report out of range, dropped (their fields are ``None``): one per gauge."""

    def engine_stats(self) -> EngineStats:
        """The part :meth:`balancer.load.tracker.LoadTracker.observe` takes."""
        return EngineStats(self.running_reqs, self.waiting_reqs, self.kv_usage, self.capacity_tokens)


Parser = Callable[[bytes], ScrapedLoad | None]
"""A response body → the load it reports; ``None`` means idle (an empty drain). Raises ``ScrapeError``."""


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One load endpoint of an engine and the parser of its body."""

    path: str
    """Path (and query) on the replica's HTTP base URL, e.g. ``/v1/loads?include=core,memory``."""
    parse: Parser
    """Turns the body of a 200 response into a load."""
    prometheus: bool = False
    """A Prometheus exposition: a replica's ``metrics_path`` setting replaces ``path``."""


def text_parser(parse: Callable[[str], ScrapedLoad]) -> Parser:
    """A body parser from a text parser (the body is UTF-8; bad bytes are replaced)."""
    return lambda body: parse(body.decode("utf-8", "replace"))


def json_parser(parse: Callable[[object], ScrapedLoad | None]) -> Parser:
    """A body parser from a parser of JSON documents; a body that is not JSON raises ``ScrapeError``."""

    def parse_json(body: bytes) -> ScrapedLoad | None:
        try:
            document = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ScrapeError(f"body is not JSON: {exc}") from None
        return parse(document)

    return parse_json


def with_metrics_path(targets: Iterable[ScrapeTarget], metrics_path: str | None) -> tuple[ScrapeTarget, ...]:
    """``targets`` with ``metrics_path`` (unless empty) in place of every Prometheus target's path."""
    if not metrics_path:
        return tuple(targets)
    return tuple(replace(target, path=metrics_path) if target.prometheus else target for target in targets)


# --- Prometheus text -----------------------------------------------------------------------------


def parse_prometheus(text: str, names: Collection[str], *, keep_nan: bool = False) -> Samples:
    """Samples of the metrics named in ``names`` (exact names), as ``{name: [(labels, value)]}``.

    Comment lines, other metrics and NaN values (unless ``keep_nan``) are skipped; a malformed line
    of a wanted metric raises :class:`ScrapeError`.
    """
    wanted = frozenset(names)
    out: Samples = {}
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        has_labels = brace != -1 and (space == -1 or brace < space)
        end = brace if has_labels else space
        name = line if end == -1 else line[:end]
        if name not in wanted:
            continue
        labels, rest = _split_labels(line, brace) if has_labels else ({}, line[len(name) :])
        value = _sample_value(rest, line)
        if keep_nan or not math.isnan(value):
            out.setdefault(name, []).append((labels, value))
    return out


def _split_labels(line: str, start: int) -> tuple[Labels, str]:
    """Parse ``{k="v",...}`` from ``line[start]``; returns the labels and what follows ``}``."""
    labels: Labels = {}
    pos = start + 1
    while True:
        while pos < len(line) and line[pos] in " ,":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, line[pos + 1 :]
        eq = line.find("=", pos)
        if eq == -1 or eq + 1 >= len(line) or line[eq + 1] != '"':
            raise ScrapeError(f"bad label set in line {line[:120]!r}")
        key = line[pos:eq].strip()
        value, pos = _quoted(line, eq + 2)
        labels[key] = value


def _quoted(line: str, pos: int) -> tuple[str, int]:
    """A label value from ``pos`` (just after the opening quote) to the closing quote."""
    chars: list[str] = []
    while pos < len(line):
        char = line[pos]
        if char == "\\" and pos + 1 < len(line):
            nxt = line[pos + 1]
            chars.append("\n" if nxt == "n" else nxt)
            pos += 2
        elif char == '"':
            return "".join(chars), pos + 1
        else:
            chars.append(char)
            pos += 1
    raise ScrapeError(f"unterminated label value in line {line[:120]!r}")


def _sample_value(rest: str, line: str) -> float:
    parts = rest.split()
    if not parts:
        raise ScrapeError(f"no value in line {line[:120]!r}")
    try:
        return float(parts[0])
    except ValueError:
        raise ScrapeError(f"bad value in line {line[:120]!r}") from None


def checked_samples(samples: Samples, kinds: Mapping[str, Kind], rejections: list[Rejection]) -> Samples:
    """``samples`` without each gauge of ``kinds`` that holds a sample out of its kind's range (the
    first such sample of each is appended to ``rejections``); gauges not in ``kinds`` are kept.

    A NaN fraction is no sample (a rate of 0/0: a rank that served nothing yet), as Prometheus
    means it; a NaN count is refused."""
    good: Samples = {}
    for name, series in samples.items():
        kind = kinds.get(name)
        bad = None
        if kind == "fraction":
            series = [(labels, value) for labels, value in series if not math.isnan(value)]
            if not series:
                continue
        if kind is not None:
            bad = next((r for r in (rejected(name, value, kind) for _, value in series) if r), None)
        if bad is None:
            good[name] = series
        else:
            rejections.append(bad)
    return good


def checked_fraction(gauge: str, value: float | None, rejections: list[Rejection]) -> float | None:
    """A derived fraction (a ratio of two checked figures), refused when above 1."""
    if value is None:
        return None
    bad = rejected(gauge, value, "fraction")
    if bad is not None:
        rejections.append(bad)
        return None
    return value


def rank_values(series: Iterable[tuple[Labels, float]]) -> dict[str, float]:
    """One value per DP rank: series of the same rank (TP/PP replicas of it) merge by max."""
    ranks: dict[str, float] = {}
    for labels, value in series:
        rank = next((labels[key] for key in RANK_LABELS if key in labels), "")
        ranks[rank] = max(value, ranks.get(rank, value))
    return ranks


def rank_sum(samples: Samples, name: str) -> float | None:
    """The sum over DP ranks of gauge ``name`` (a count); ``None`` when it has no sample."""
    ranks = rank_values(samples.get(name, ()))
    return sum(ranks.values()) if ranks else None


def rank_mean(samples: Samples, name: str) -> float | None:
    """The mean over DP ranks of gauge ``name`` (a fraction); ``None`` when it has no sample."""
    ranks = rank_values(samples.get(name, ()))
    return sum(ranks.values()) / len(ranks) if ranks else None


def count_of(value: float | None) -> int | None:
    """A checked count as an ``int`` (``None`` stays ``None``)."""
    return None if value is None else round(value)


def rank_count(samples: Samples, name: str) -> int:
    """How many DP ranks report gauge ``name`` (at least 1)."""
    return max(1, len(rank_values(samples.get(name, ()))))


def prefixed(prefixes: Iterable[str], gauges: Mapping[str, Kind]) -> dict[str, Kind]:
    """Every gauge of ``gauges`` under every prefix of ``prefixes``, with its kind."""
    return {prefix + gauge: kind for prefix in prefixes for gauge, kind in gauges.items()}


def checked_prometheus(
    text: str, kinds: Mapping[str, Kind], prefixes: Iterable[str], required: str
) -> tuple[str, Samples, list[Rejection]]:
    """The prefix in use (the first whose ``required`` gauge has a sample), the samples of the gauges
    of ``kinds`` with every gauge holding a sample out of range dropped (NaN included, so that it is
    refused), and those rejections. Raises :class:`ScrapeError` when no prefix has ``required``."""
    samples = parse_prometheus(text, kinds.keys(), keep_nan=True)
    prefix = next((p for p in prefixes if samples.get(p + required)), None)
    if prefix is None:
        raise ScrapeError(f"no {' / '.join(p + required for p in prefixes)} in the metrics")
    rejections: list[Rejection] = []
    return prefix, checked_samples(samples, kinds, rejections), rejections
