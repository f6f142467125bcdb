"""Scrape-time collectors: counters that pure code keeps, read when Prometheus scrapes (pure).

The prefix table, the key and token-id memos and the upstream client count in plain ``int`` fields
(no ``prometheus_client`` call on their hot paths). Each collector here turns one kind of those
counters into ``kvlb_<subsystem>_<name>_total`` families at scrape time, from a ``source`` the
composition root (``app.py``) sets once the counted objects exist; before that it exports zeros or
nothing. :meth:`balancer.metrics.Metrics.create` registers one of each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Final

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from balancer.index.hashing import KeyMemo
from balancer.index.slots import TableCounters
from balancer.tokenizer.token_ids import TokenIdMemo
from balancer.upstream.client import UpstreamCounters
from balancer.upstream.http1 import PARSE_ERROR_REASONS


class TableCountersCollector(Collector):
    """Every key space's :class:`~balancer.index.slots.TableCounters`, read at scrape time, as
    ``kvlb_index_table_<counter>_total{space}``: the table's evictions, its overflows (speculative
    keys, slots, the gap-recovery memories' forgotten entries) and its gap recovery. ``source`` is
    set by the composition root once the pools exist (nothing is exported before)."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, TableCounters]] = dict

    def collect(self) -> Iterator[CounterMetricFamily]:
        counters = self.source()
        for counter in fields(TableCounters):
            family = CounterMetricFamily(
                f"kvlb_index_table_{counter.name}",
                f"The prefix table's {counter.name.replace('_', ' ')} count (TableCounters.{counter.name}).",
                labels=["space"],
            )
            for space, values in counters.items():
                family.add_metric([space], getattr(values, counter.name))
            yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        for counter in fields(TableCounters):
            yield CounterMetricFamily(f"kvlb_index_table_{counter.name}", "", labels=["space"])


class TokenIdMemoCollector(Collector):
    """The :class:`~balancer.tokenizer.token_ids.TokenIdMemo`'s counters, read at scrape time:
    ``kvlb_tokenizer_token_id_memo_{hits,misses,evictions}_total`` (runs of token-id prompt text, or
    of a gRPC prompt's packed ids, found, decoded, and forgotten at ``limits.token_id_memo_runs``) and
    ``kvlb_tokenizer_token_id_memo_prompt_evictions_total`` (whole prompts noted, forgotten when the
    runs they list pass the same limit).
    ``source`` is set by the composition root once the memo exists (zeros before)."""

    COUNTERS: Final = ("hits", "misses", "evictions", "prompt_evictions")

    def __init__(self) -> None:
        self.source: Callable[[], TokenIdMemo] = lambda: TokenIdMemo(0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        memo = self.source()
        for name in self.COUNTERS:
            yield CounterMetricFamily(
                f"kvlb_tokenizer_token_id_memo_{name}",
                f"Token-id prompt text: {name.replace('_', ' ')} of the decoded-ids memo.",
                value=getattr(memo, name),
            )

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        for name in self.COUNTERS:
            yield CounterMetricFamily(f"kvlb_tokenizer_token_id_memo_{name}", "")


class KeyMemoCollector(Collector):
    """Every key space's :class:`~balancer.index.hashing.KeyMemo` (the routing keys of prompt runs
    already hashed), read at scrape time: ``kvlb_route_key_memo_<counter>_total{space}`` for
    ``hits``, ``misses`` and ``evictions`` (runs found, hashed, and forgotten at
    ``RouteLimits.key_memo_runs``) and ``prompt_evictions`` (whole prompts noted and forgotten at the
    same limit). ``source`` is set by the composition root once the pools exist."""

    COUNTERS: Final = ("hits", "misses", "evictions", "prompt_evictions")

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, KeyMemo]] = dict

    def collect(self) -> Iterator[CounterMetricFamily]:
        memos = self.source()
        for name in self.COUNTERS:
            family = CounterMetricFamily(
                f"kvlb_route_key_memo_{name}",
                f"Routing keys of prompt runs: {name.replace('_', ' ')} of the key memo.",
                labels=["space"],
            )
            for space, memo in memos.items():
                family.add_metric([space], getattr(memo, name))
            yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        for name in self.COUNTERS:
            yield CounterMetricFamily(f"kvlb_route_key_memo_{name}", "", labels=["space"])


class UpstreamCountersCollector(Collector):
    """The upstream client's :class:`~balancer.upstream.client.UpstreamCounters`, read at scrape time:
    ``kvlb_upstream_protocol_errors_total{reason}``, ``kvlb_upstream_stale_retries_total`` and
    ``kvlb_upstream_pool_waits_total``. ``source`` is set by the composition root once the client
    exists (nothing is counted before)."""

    def __init__(self) -> None:
        self.source: Callable[[], UpstreamCounters] = lambda: UpstreamCounters(
            dict.fromkeys(PARSE_ERROR_REASONS, 0)
        )

    def collect(self) -> Iterator[CounterMetricFamily]:
        counters = self.source()
        errors = CounterMetricFamily(
            "kvlb_upstream_protocol_errors",
            "Replica answers that could not be framed as HTTP/1.1, by reason.",
            labels=["reason"],
        )
        for reason, count in counters.protocol_errors.items():
            errors.add_metric([reason], count)
        yield errors
        yield CounterMetricFamily(
            "kvlb_upstream_stale_retries",
            "Requests resent on a fresh connection after a reused one closed before any answer byte.",
            value=counters.stale_retries,
        )
        yield CounterMetricFamily(
            "kvlb_upstream_pool_waits",
            "Requests that waited for a free upstream connection (upstream.max_connections in use).",
            value=counters.pool_waits,
        )

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        yield CounterMetricFamily("kvlb_upstream_protocol_errors", "", labels=["reason"])
        yield CounterMetricFamily("kvlb_upstream_stale_retries", "")
        yield CounterMetricFamily("kvlb_upstream_pool_waits", "")
