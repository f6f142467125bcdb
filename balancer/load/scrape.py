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

A :class:`ScrapeTarget` pairs an endpoint with the parser of its body; each engine's spec
(:mod:`balancer.engines`) lists its targets in the order :mod:`balancer.load.scraper` tries them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from balancer.errors import BalancerError
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


def parse_prometheus(text: str, names: Collection[str]) -> Samples:
    """Samples of the metrics named in ``names`` (exact names), as ``{name: [(labels, value)]}``.

    Comment lines, other metrics and NaN values are skipped; a malformed line of a wanted metric
    raises :class:`ScrapeError`.
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
        if not math.isnan(value):
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


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def _rank_count(samples: Samples, name: str) -> int:
    return max(1, len(_per_rank(samples.get(name, ()))))


_SGLANG_GAUGES = (
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "cache_hit_rate",
    "num_used_tokens",
    "max_total_num_tokens",
)


def parse_sglang_prometheus(text: str) -> ScrapedLoad:
    """SGLang ``/metrics`` (either prefix). Raises :class:`ScrapeError` without ``num_running_reqs``."""
    names = [prefix + gauge for prefix in ("sglang:", "sglang_") for gauge in _SGLANG_GAUGES]
    samples = parse_prometheus(text, names)
    prefix = next((p for p in ("sglang:", "sglang_") if samples.get(p + "num_running_reqs")), None)
    if prefix is None:
        raise ScrapeError("no sglang:num_running_reqs / sglang_num_running_reqs in the metrics")
    return ScrapedLoad(
        running_reqs=_count(_sum(samples, prefix + "num_running_reqs")),
        waiting_reqs=_count(_sum(samples, prefix + "num_queue_reqs")),
        kv_usage=_mean(samples, prefix + "token_usage"),
        used_tokens=_count(_sum(samples, prefix + "num_used_tokens")),
        capacity_tokens=_count(_sum(samples, prefix + "max_total_num_tokens")),
        cache_hit_rate=_mean(samples, prefix + "cache_hit_rate"),
        dp_ranks=_rank_count(samples, prefix + "num_running_reqs"),
    )


def parse_vllm_prometheus(text: str) -> ScrapedLoad:
    """vLLM ``/metrics``. Raises :class:`ScrapeError` without ``vllm:num_requests_running``."""
    samples = parse_prometheus(
        text,
        (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_hit_rate",
            "vllm:cache_config_info",
        ),
    )
    if not samples.get("vllm:num_requests_running"):
        raise ScrapeError("no vllm:num_requests_running in the metrics")
    usage = _mean(samples, "vllm:kv_cache_usage_perc")
    if usage is None:
        usage = _mean(samples, "vllm:gpu_cache_usage_perc")
    hits = _sum(samples, "vllm:prefix_cache_hits_total")
    queries = _sum(samples, "vllm:prefix_cache_queries_total")
    hit_rate = hits / queries if hits is not None and queries else None
    if hit_rate is None:
        hit_rate = _mean(samples, "vllm:gpu_prefix_cache_hit_rate")
    return ScrapedLoad(
        running_reqs=_count(_sum(samples, "vllm:num_requests_running")),
        waiting_reqs=_count(_sum(samples, "vllm:num_requests_waiting")),
        kv_usage=usage,
        capacity_tokens=_vllm_capacity_tokens(samples.get("vllm:cache_config_info", ())),
        cache_hit_rate=hit_rate,
        dp_ranks=_rank_count(samples, "vllm:num_requests_running"),
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


_TRTLLM_GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_utilization",
    "kv_cache_hit_rate",
    "kv_cache_used_blocks",
    "kv_cache_max_blocks",
    "kv_cache_tokens_per_block",
)


def parse_trtllm_prometheus(text: str) -> ScrapedLoad:
    """TRT-LLM ``/prometheus/metrics`` (``trtllm_``, or ``trtllm:`` as relabelled by Dynamo)."""
    names = [prefix + gauge for prefix in ("trtllm_", "trtllm:") for gauge in _TRTLLM_GAUGES]
    samples = parse_prometheus(text, names)
    prefix = next((p for p in ("trtllm_", "trtllm:") if samples.get(p + "num_requests_running")), None)
    if prefix is None:
        raise ScrapeError("no trtllm_num_requests_running in the metrics")
    per_block = _mean(samples, prefix + "kv_cache_tokens_per_block")
    used = _sum(samples, prefix + "kv_cache_used_blocks")
    total = _sum(samples, prefix + "kv_cache_max_blocks")
    return ScrapedLoad(
        running_reqs=_count(_sum(samples, prefix + "num_requests_running")),
        waiting_reqs=_count(_sum(samples, prefix + "num_requests_waiting")),
        kv_usage=_mean(samples, prefix + "kv_cache_utilization"),
        used_tokens=_count(used * per_block) if used is not None and per_block else None,
        capacity_tokens=_count(total * per_block) if total is not None and per_block else None,
        cache_hit_rate=_mean(samples, prefix + "kv_cache_hit_rate"),
        dp_ranks=_rank_count(samples, prefix + "num_requests_running"),
    )


# --- JSON ----------------------------------------------------------------------------------------


def _num(obj: Mapping[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` present in ``obj`` as a finite number (bools are not numbers)."""
    for key in keys:
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ScrapeError(f"{key} is not a number: {value!r:.40}")
        return float(value)
    return None


def _total(rows: list[Mapping[str, Any]], *keys: str) -> float | None:
    values = [v for v in (_num(row, *keys) for row in rows) if v is not None]
    return sum(values) if values else None


def _average(rows: list[Mapping[str, Any]], *keys: str) -> float | None:
    values = [v for v in (_num(row, *keys) for row in rows) if v is not None]
    return sum(values) / len(values) if values else None


def _rows(value: object, what: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list) or not value or not all(isinstance(row, dict) for row in value):
        raise ScrapeError(f"{what} is not a non-empty list of objects")
    return value


def parse_sglang_loads(body: object) -> ScrapedLoad:
    """SGLang ``/v1/loads`` (``{"loads": [...]}``) or any of the three ``/get_load`` shapes."""
    if isinstance(body, dict) and "loads" in body:
        return _sglang_v1_loads(_rows(body["loads"], "loads"))
    if isinstance(body, dict) and "load" in body:
        return ScrapedLoad(used_tokens=_count(_num(body, "load")))
    if isinstance(body, list):
        return _sglang_get_load(_rows(body, "get_load"))
    raise ScrapeError(f"unknown SGLang load shape: {type(body).__name__}")


def _sglang_v1_loads(rows: list[Mapping[str, Any]]) -> ScrapedLoad:
    running = _total(rows, "num_running_reqs")
    if running is None:
        raise ScrapeError("/v1/loads rows lack num_running_reqs")
    return ScrapedLoad(
        running_reqs=_count(running),
        waiting_reqs=_count(_total(rows, "num_waiting_reqs")),
        kv_usage=_average(rows, "token_usage"),
        used_tokens=_count(_total(rows, "num_used_tokens")),
        capacity_tokens=_count(_total(rows, "max_total_num_tokens", "num_total_tokens")),
        cache_hit_rate=_average(rows, "cache_hit_rate"),
        dp_ranks=len(rows),
    )


def _sglang_get_load(rows: list[Mapping[str, Any]]) -> ScrapedLoad:
    """``/get_load`` per-rank list: ``num_reqs`` counts running + waiting."""
    total = _total(rows, "num_reqs")
    waiting = _total(rows, "num_waiting_reqs")
    if total is None:
        raise ScrapeError("/get_load rows lack num_reqs")
    running = total - waiting if waiting is not None else None
    return ScrapedLoad(
        running_reqs=_count(running),
        waiting_reqs=_count(waiting),
        used_tokens=_count(_total(rows, "num_tokens")),
        dp_ranks=len(rows),
    )


def parse_trtllm_iteration_stats(body: object) -> ScrapedLoad | None:
    """TRT-LLM ``/metrics`` JSON: the newest iteration of each attention-DP rank, summed.

    Returns ``None`` for an empty list (no iteration ran since the last drain: the engine is idle).
    """
    if not isinstance(body, list):
        raise ScrapeError(f"iteration stats must be a list, got {type(body).__name__}")
    if not body:
        return None
    newest: dict[object, Mapping[str, Any]] = {}
    for item in body:
        if not isinstance(item, dict):
            raise ScrapeError("iteration stats hold a non-object")
        newest[item.get("attentionDpRank", 0)] = item  # later iterations overwrite earlier ones
    rows = list(newest.values())
    running = _total(rows, "numActiveRequests")
    if running is None:
        raise ScrapeError("iteration stats lack numActiveRequests")
    kv_rows = [row["kvCacheStats"] for row in rows if isinstance(row.get("kvCacheStats"), dict)]
    used = _total(kv_rows, "usedNumBlocks")
    capacity = _total(kv_rows, "maxNumBlocks")
    per_block = _average(kv_rows, "tokensPerBlock")
    return ScrapedLoad(
        running_reqs=_count(running),
        waiting_reqs=_count(_total(rows, "numQueuedRequests")),
        kv_usage=used / capacity if used is not None and capacity else None,
        used_tokens=_count(used * per_block) if used is not None and per_block else None,
        capacity_tokens=_count(capacity * per_block) if capacity is not None and per_block else None,
        cache_hit_rate=_average(kv_rows, "cacheHitRate"),
        dp_ranks=len(rows),
    )
