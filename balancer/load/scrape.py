"""Parsers of engine load reports (pure: text/JSON in, :class:`ScrapedLoad` out; no I/O, no clock).

What each engine reports, and how it becomes one load per replica:

* **SGLang** Prometheus ``/metrics`` (prefix ``sglang:`` through v0.5.3, ``sglang_`` later):
  ``num_running_reqs``, ``num_queue_reqs``, ``token_usage`` (0..1), ``cache_hit_rate``,
  ``num_used_tokens``, ``max_total_num_tokens``. ``/v1/loads`` JSON (``loads[]`` per DP rank) and the
  three ``/get_load`` shapes (``{"load": n}``; a list per rank of ``num_reqs`` = running + waiting,
  ``num_waiting_reqs``, ``num_tokens``).
* **vLLM** Prometheus: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (older ``vllm:gpu_cache_usage_perc``), prefix-cache hit counters,
  the pool size from ``vllm:cache_config_info``'s ``num_gpu_blocks`` and ``block_size`` labels.
* **TRT-LLM** ``/metrics`` JSON iteration stats (a drained list; the newest element per attention-DP
  rank counts): ``numActiveRequests``, ``numQueuedRequests``, ``kvCacheStats.usedNumBlocks /
  maxNumBlocks``; or Prometheus ``/prometheus/metrics`` (``trtllm_`` prefix).

Aggregation over series: a series is one DP rank when it carries a ``dp``/``dp_rank``/``engine``/
``attention_dp_rank`` label, else all series share rank "". Series of the same rank (other TP/PP
ranks report the same scheduler) are merged by ``max``; ranks are then summed for counts and
averaged for fractions.

Range checks (:mod:`balancer.load.gauge_checks`): every figure read has a kind (a request count, a
token or block count, a fraction, a lifetime counter); a gauge with a sample out of its kind's range
(NaN for a count, ±Inf, negative, a fraction for a count, above a sanity limit, a usage above 1 or
below 0) is dropped
whole (its field is ``None``: unknown, as when not reported) and listed in
:attr:`ScrapedLoad.rejected`; the other fields of the report are kept.

The JSON reports (SGLang's ``/v1/loads`` and ``/get_load``, TRT-LLM's iteration stats) are parsed in
:mod:`balancer.load.scrape_json`.

A :class:`ScrapeTarget` pairs an endpoint with the parser of its body; each engine's spec
(:mod:`balancer.engines`) lists its targets in the order :mod:`balancer.load.scraper` tries them.
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


def _checked(samples: Samples, kinds: Mapping[str, Kind], rejections: list[Rejection]) -> Samples:
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


def _per_rank(series: Iterable[tuple[Labels, float]]) -> dict[str, float]:
    """One value per DP rank: series of the same rank (TP/PP replicas of it) merge by max."""
    ranks: dict[str, float] = {}
    for labels, value in series:
        rank = next((labels[key] for key in RANK_LABELS if key in labels), "")
        ranks[rank] = max(value, ranks.get(rank, value))
    return ranks


def _sum(samples: Samples, name: str) -> float | None:
    ranks = _per_rank(samples.get(name, ()))
    return sum(ranks.values()) if ranks else None


def _mean(samples: Samples, name: str) -> float | None:
    ranks = _per_rank(samples.get(name, ()))
    return sum(ranks.values()) / len(ranks) if ranks else None


def count_of(value: float | None) -> int | None:
    """A checked count as an ``int`` (``None`` stays ``None``)."""
    return None if value is None else round(value)


def _rank_count(samples: Samples, name: str) -> int:
    return max(1, len(_per_rank(samples.get(name, ()))))


_SGLANG_GAUGES: dict[str, Kind] = {
    "num_running_reqs": "requests",
    "num_queue_reqs": "requests",
    "token_usage": "fraction",
    "cache_hit_rate": "fraction",
    "num_used_tokens": "tokens",
    "max_total_num_tokens": "tokens",
}


def _prefixed(prefixes: Iterable[str], gauges: Mapping[str, Kind]) -> dict[str, Kind]:
    return {prefix + gauge: kind for prefix in prefixes for gauge, kind in gauges.items()}


def _checked_prometheus(
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
    return prefix, _checked(samples, kinds, rejections), rejections


def parse_sglang_prometheus(text: str) -> ScrapedLoad:
    """SGLang ``/metrics`` (either prefix). Raises :class:`ScrapeError` without ``num_running_reqs``."""
    prefixes = ("sglang:", "sglang_")
    prefix, samples, rejections = _checked_prometheus(
        text, _prefixed(prefixes, _SGLANG_GAUGES), prefixes, "num_running_reqs"
    )
    return ScrapedLoad(
        running_reqs=count_of(_sum(samples, prefix + "num_running_reqs")),
        waiting_reqs=count_of(_sum(samples, prefix + "num_queue_reqs")),
        kv_usage=_mean(samples, prefix + "token_usage"),
        used_tokens=count_of(_sum(samples, prefix + "num_used_tokens")),
        capacity_tokens=count_of(_sum(samples, prefix + "max_total_num_tokens")),
        cache_hit_rate=_mean(samples, prefix + "cache_hit_rate"),
        dp_ranks=_rank_count(samples, prefix + "num_running_reqs"),
        rejected=tuple(rejections),
    )


_VLLM_GAUGES: dict[str, Kind] = {
    "num_requests_running": "requests",
    "num_requests_waiting": "requests",
    "kv_cache_usage_perc": "fraction",  # despite its name a fraction: "1 means 100 percent usage"
    "gpu_cache_usage_perc": "fraction",
    "prefix_cache_hits_total": "counter",
    "prefix_cache_queries_total": "counter",
    "gpu_prefix_cache_hit_rate": "fraction",
}
"""vLLM's gauges (``vllm:`` prefix); ``vllm:cache_config_info`` is read for its labels only."""


def parse_vllm_prometheus(text: str) -> ScrapedLoad:
    """vLLM ``/metrics``. Raises :class:`ScrapeError` without ``vllm:num_requests_running``."""
    kinds = _prefixed(("vllm:",), _VLLM_GAUGES)
    _, samples, rejections = _checked_prometheus(text, kinds, ("vllm:",), "num_requests_running")
    info = parse_prometheus(text, ("vllm:cache_config_info",))
    usage = _mean(samples, "vllm:kv_cache_usage_perc")
    if usage is None:
        usage = _mean(samples, "vllm:gpu_cache_usage_perc")
    hits = _sum(samples, "vllm:prefix_cache_hits_total")
    queries = _sum(samples, "vllm:prefix_cache_queries_total")
    hit_rate = hits / queries if hits is not None and queries else None
    hit_rate = checked_fraction(
        "vllm:prefix_cache_hits_total", hit_rate, rejections
    )  # more hits than queries
    if hit_rate is None:
        hit_rate = _mean(samples, "vllm:gpu_prefix_cache_hit_rate")
    return ScrapedLoad(
        running_reqs=count_of(_sum(samples, "vllm:num_requests_running")),
        waiting_reqs=count_of(_sum(samples, "vllm:num_requests_waiting")),
        kv_usage=usage,
        capacity_tokens=_vllm_capacity_tokens(info.get("vllm:cache_config_info", ())),
        cache_hit_rate=hit_rate,
        dp_ranks=_rank_count(samples, "vllm:num_requests_running"),
        rejected=tuple(rejections),
    )


def _vllm_capacity_tokens(series: Iterable[tuple[Labels, float]]) -> int | None:
    """Pool size from ``vllm:cache_config_info``'s ``num_gpu_blocks`` × ``block_size`` labels, summed
    over engines (DP ranks); ``None`` when a label is missing or not a positive integer."""
    per_engine: dict[str, int] = {}
    for labels, _ in series:
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if not (blocks.isdigit() and size.isdigit()) or int(blocks) * int(size) <= 0:
            return None
        per_engine[labels.get("engine", "")] = int(blocks) * int(size)
    return sum(per_engine.values()) or None


_TRTLLM_GAUGES: dict[str, Kind] = {
    "num_requests_running": "requests",
    "num_requests_waiting": "requests",
    "kv_cache_utilization": "fraction",
    "kv_cache_hit_rate": "fraction",
    "kv_cache_used_blocks": "tokens",
    "kv_cache_max_blocks": "tokens",
    "kv_cache_tokens_per_block": "tokens",
}


def parse_trtllm_prometheus(text: str) -> ScrapedLoad:
    """TRT-LLM ``/prometheus/metrics`` (``trtllm_``, or ``trtllm:`` as relabelled by Dynamo)."""
    prefixes = ("trtllm_", "trtllm:")
    prefix, samples, rejections = _checked_prometheus(
        text, _prefixed(prefixes, _TRTLLM_GAUGES), prefixes, "num_requests_running"
    )
    per_block = _mean(samples, prefix + "kv_cache_tokens_per_block")
    used = _sum(samples, prefix + "kv_cache_used_blocks")
    total = _sum(samples, prefix + "kv_cache_max_blocks")
    return ScrapedLoad(
        running_reqs=count_of(_sum(samples, prefix + "num_requests_running")),
        waiting_reqs=count_of(_sum(samples, prefix + "num_requests_waiting")),
        kv_usage=_mean(samples, prefix + "kv_cache_utilization"),
        used_tokens=count_of(used * per_block) if used is not None and per_block else None,
        capacity_tokens=count_of(total * per_block) if total is not None and per_block else None,
        cache_hit_rate=_mean(samples, prefix + "kv_cache_hit_rate"),
        dp_ranks=_rank_count(samples, prefix + "num_requests_running"),
        rejected=tuple(rejections),
    )
