"""Scrape-time collectors: counters that pure code keeps, read when Prometheus scrapes (pure).

The prefix table, the key and token-id memos, the tokenizers' segment caches and the upstream client
count in plain ``int`` fields (no ``prometheus_client`` call on their hot paths). Each collector here
turns one kind of those counters into ``kvlb_<subsystem>_<name>_total`` families (and a few gauges
of what is held) at scrape time, from a ``source`` the composition root (``app.py``) sets once the
counted objects exist; before that it exports zeros or nothing.
:meth:`balancer.metrics.Metrics.create` registers one of each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import ClassVar, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from balancer.index.hashing import KeyMemo
from balancer.index.slots import TableCounters
from balancer.load.tracker import LoadTrackerStats
from balancer.tokenizer.segments import SegmentCache
from balancer.tokenizer.token_ids import TokenIdMemo
from balancer.tokenizer.words import WordMemo
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


class _MemoCollector(Collector):
    """A request memo's counters and gauges, read at scrape time from ``source`` (the memo's
    ``counts()``): ``kvlb_http_<MEMO>_<counter>_total`` for each of ``COUNTERS``, with the gauges
    ``kvlb_http_<MEMO>_entries`` and ``kvlb_http_<MEMO>_held_bytes``. ``source`` is set by the web
    application once the memo exists (zeros before)."""

    MEMO: ClassVar[str]
    """The memo's name in its families (``body_memo``)."""
    COUNTERS: ClassVar[tuple[str, ...]]
    """The counters ``counts()`` gives, each a ``_total`` family."""
    WHAT: ClassVar[str]
    """What the counters count, for their help text."""
    ENTRIES_HELP: ClassVar[str]
    """The help text of the ``_entries`` gauge."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, int]] = dict

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counts = self.source()
        memo = self.MEMO
        for name in self.COUNTERS:
            yield CounterMetricFamily(
                f"kvlb_http_{memo}_{name}",
                f"{self.WHAT}: {name.replace('_', ' ')} of the {memo.replace('_', ' ')}.",
                value=counts.get(name, 0),
            )
        yield GaugeMetricFamily(
            f"kvlb_http_{memo}_entries", self.ENTRIES_HELP, value=counts.get("entries", 0)
        )
        yield GaugeMetricFamily(
            f"kvlb_http_{memo}_held_bytes",
            f"Bytes counted of the {memo.replace('_', ' ')}'s entries.",
            value=counts.get("held_bytes", 0),
        )

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        for name in self.COUNTERS:
            yield CounterMetricFamily(f"kvlb_http_{self.MEMO}_{name}", "")
        yield GaugeMetricFamily(f"kvlb_http_{self.MEMO}_entries", "")
        yield GaugeMetricFamily(f"kvlb_http_{self.MEMO}_held_bytes", "")


class BodyMemoCollector(_MemoCollector):
    """The HTTP body memo's counters (:meth:`balancer.api.body_memo.BodyMemo.counts`), read at
    scrape time: ``kvlb_http_body_memo_{hits,misses,evictions,too_large}_total`` (bodies found,
    looked up and not found, forgotten at ``limits.body_memo_entries``/``body_memo_bytes``, and not
    kept because their ids alone pass ``body_memo_bytes``), with the gauges
    ``kvlb_http_body_memo_entries`` and ``kvlb_http_body_memo_held_bytes``. ``source`` is set by the
    web application once the memo exists (zeros before)."""

    MEMO = "body_memo"
    COUNTERS = ("hits", "misses", "evictions", "too_large")
    WHAT = "Whole request bodies"
    ENTRIES_HELP = "Bodies the body memo holds."


class PrefixMemoCollector(_MemoCollector):
    """The HTTP prefix memo's counters (:meth:`balancer.api.prefix_memo.PrefixMemo.counts`), read at
    scrape time: ``kvlb_http_prefix_memo_{hits,misses,learned,refused,fallbacks,evictions,too_large}_total``
    (chat bodies whose tail alone was decoded; bodies of 2 kB or more with no known prefix; prefixes
    kept; proposed prefixes whose decoder state was not proved; bodies with a known prefix decoded
    whole; prefixes forgotten at ``limits.prefix_memo_entries``/``prefix_memo_bytes``; prefixes not
    kept because their fields alone pass ``prefix_memo_bytes``), with the gauges
    ``kvlb_http_prefix_memo_entries`` and ``kvlb_http_prefix_memo_held_bytes``. ``source`` is set by
    the web application once the memo exists (zeros before)."""

    MEMO = "prefix_memo"
    COUNTERS = ("hits", "misses", "learned", "refused", "fallbacks", "evictions", "too_large")
    WHAT = "Chat body prefixes"
    ENTRIES_HELP = "Prefixes the prefix memo holds (pending ones included)."


class LoadTrackerCollector(Collector):
    """Every pool's :class:`~balancer.load.tracker.LoadTracker` counters, read at scrape time:
    ``kvlb_load_tracker_overflow_total{pool}`` (reservations dropped, oldest first, for a new one
    past ``LoadConfig.max_tracked_requests``: their load stops counting before their release) and
    ``kvlb_load_tracker_expired_total{pool}`` (dropped at ``LoadConfig.max_age_s`` without a
    release), with the gauge ``kvlb_load_tracker_requests{pool}`` (tracked now). ``source`` is set
    by the composition root once the pools exist (nothing is exported before)."""

    COUNTERS: Final = {"overflow": "overflow_total", "expired": "expired_total"}

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, LoadTrackerStats]] = dict

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.source()
        for name, attribute in self.COUNTERS.items():
            family = CounterMetricFamily(
                f"kvlb_load_tracker_{name}",
                f"Reservations of the pool's load tracker dropped without a release: {name}.",
                labels=["pool"],
            )
            for pool, values in stats.items():
                family.add_metric([pool], getattr(values, attribute))
            yield family
        tracked = GaugeMetricFamily(
            "kvlb_load_tracker_requests", "Requests the pool's load tracker counts now.", labels=["pool"]
        )
        for pool, values in stats.items():
            tracked.add_metric([pool], values.tracked_requests)
        yield tracked

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        for name in self.COUNTERS:
            yield CounterMetricFamily(f"kvlb_load_tracker_{name}", "", labels=["pool"])
        yield GaugeMetricFamily("kvlb_load_tracker_requests", "", labels=["pool"])


class SegmentCacheCollector(Collector):
    """Every tokenizer's :class:`~balancer.tokenizer.segments.SegmentCache`, read at scrape time,
    labelled ``tokenizer`` (its name; pools sharing a tokenizer share its cache):
    ``kvlb_tokenizer_segment_cache_evictions_total{tokenizer,bound}`` (segments dropped for the ids
    cap, ``bound="tokens"``, or for ``limits.segment_cache_bytes``, ``bound="bytes"``),
    ``kvlb_tokenizer_segment_cache_refused_total{tokenizer}`` (segments over a quarter of either
    cap, encoded every time), ``kvlb_tokenizer_segment_cache_{hits,misses}_total{tokenizer}`` and the
    gauges ``kvlb_tokenizer_segment_cache_bytes`` and ``kvlb_tokenizer_segment_cache_tokens``.
    ``source`` is set by the composition root once the pools exist (nothing is exported before).
    Beside each cache, its tokenizer's :class:`~balancer.tokenizer.words.WordMemo` (``words``):
    ``kvlb_tokenizer_word_memo_{hits,misses,evictions}_total{tokenizer}`` (new texts found word by
    word, texts with words missing, words dropped for the memo's bounds) and the gauge
    ``kvlb_tokenizer_word_memo_bytes``."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, SegmentCache]] = dict
        self.words: Callable[[], Mapping[str, WordMemo]] = dict

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        caches = self.source()
        evictions = CounterMetricFamily(
            "kvlb_tokenizer_segment_cache_evictions",
            "Segments dropped from the segment cache, by the bound that dropped them.",
            labels=["tokenizer", "bound"],
        )
        counters = {
            name: CounterMetricFamily(
                f"kvlb_tokenizer_segment_cache_{name}",
                f"Segments of chat messages and prompts: {name} of the segment cache.",
                labels=["tokenizer"],
            )
            for name in ("refused", "hits", "misses")
        }
        held_bytes = GaugeMetricFamily(
            "kvlb_tokenizer_segment_cache_bytes",
            "Bytes the segment cache counts (limits.segment_cache_bytes bounds them).",
            labels=["tokenizer"],
        )
        held_tokens = GaugeMetricFamily(
            "kvlb_tokenizer_segment_cache_tokens", "Token ids the segment cache holds.", labels=["tokenizer"]
        )
        for name, cache in caches.items():
            evictions.add_metric([name, "tokens"], cache.evictions)
            evictions.add_metric([name, "bytes"], cache.byte_evictions)
            for counter, family in counters.items():
                family.add_metric([name], getattr(cache, counter))
            held_bytes.add_metric([name], cache.cached_bytes)
            held_tokens.add_metric([name], cache.cached_tokens)
        yield evictions
        yield from counters.values()
        yield held_bytes
        yield held_tokens
        yield from _word_memo_families(self.words())

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        yield CounterMetricFamily("kvlb_tokenizer_segment_cache_evictions", "", labels=["tokenizer", "bound"])
        for name in ("refused", "hits", "misses"):
            yield CounterMetricFamily(f"kvlb_tokenizer_segment_cache_{name}", "", labels=["tokenizer"])
        yield GaugeMetricFamily("kvlb_tokenizer_segment_cache_bytes", "", labels=["tokenizer"])
        yield GaugeMetricFamily("kvlb_tokenizer_segment_cache_tokens", "", labels=["tokenizer"])
        for name in WORD_MEMO_COUNTERS:
            yield CounterMetricFamily(f"kvlb_tokenizer_word_memo_{name}", "", labels=["tokenizer"])
        yield GaugeMetricFamily("kvlb_tokenizer_word_memo_bytes", "", labels=["tokenizer"])


WORD_MEMO_COUNTERS = ("hits", "misses", "evictions")


def _word_memo_families(
    memos: Mapping[str, WordMemo],
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The word memos' families (:class:`SegmentCacheCollector`)."""
    counters = {
        name: CounterMetricFamily(
            f"kvlb_tokenizer_word_memo_{name}",
            f"New chat text encoded word by word: {name} of the word memo.",
            labels=["tokenizer"],
        )
        for name in WORD_MEMO_COUNTERS
    }
    held = GaugeMetricFamily(
        "kvlb_tokenizer_word_memo_bytes", "Bytes the word memo counts.", labels=["tokenizer"]
    )
    for name, memo in memos.items():
        for counter, family in counters.items():
            family.add_metric([name], getattr(memo, counter))
        held.add_metric([name], memo.held_bytes)
    yield from counters.values()
    yield held


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
    ``kvlb_upstream_pool_waits_total``, ``kvlb_upstream_usage_events_dropped_total`` and
    ``kvlb_upstream_usage_unfiltered_events_total``. ``source`` is set by the composition root once the client
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
        yield CounterMetricFamily(
            "kvlb_upstream_usage_events_dropped",
            "Usage-only events taken out of streams whose client did not ask for usage "
            "(pools[].stream_usage).",
            value=counters.usage_events_dropped,
        )
        yield CounterMetricFamily(
            "kvlb_upstream_usage_unfiltered_events",
            "Stream events passed on without the usage filter: longer than its bound before their end.",
            value=counters.usage_unfiltered_events,
        )

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The families without samples (what the registry checks names against)."""
        yield CounterMetricFamily("kvlb_upstream_protocol_errors", "", labels=["reason"])
        yield CounterMetricFamily("kvlb_upstream_stale_retries", "")
        yield CounterMetricFamily("kvlb_upstream_pool_waits", "")
        yield CounterMetricFamily("kvlb_upstream_usage_events_dropped", "")
        yield CounterMetricFamily("kvlb_upstream_usage_unfiltered_events", "")


class DropsCollector(Collector):
    """One counter family of what a bounded structure dropped at its cap, counted in plain ints by
    pure code and read at scrape time: ``source`` maps each value of the one label to its count (set
    by whoever builds the structures; nothing is exported before)."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        """``name`` without ``_total`` (``prometheus_client`` adds it)."""
        self.name = name
        self.documentation = documentation
        self.label = label
        self.source: Callable[[], Mapping[str, int]] = dict

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, count in self.source().items():
            family.add_metric([value], count)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The family without samples (what the registry checks names against)."""
        yield CounterMetricFamily(self.name, "", labels=[self.label])
