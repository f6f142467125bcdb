"""Prometheus collectors for every kvlb subsystem, bound to an injected registry (pure).

Names follow ``kvlb_<subsystem>_<name>_<unit>``. One :class:`Metrics` is built by the composition root
(``app.py``) and passed down; tests build their own with a fresh ``CollectorRegistry``, so there is no
global state to reset. Each subsystem's collectors are declared once, as the fields of a frozen
section (``_HttpCollectors``, ...) that the builder beside it fills; :class:`Metrics` inherits every
section, and registers the scrape-time collectors of :mod:`balancer.counter_collectors`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Final, Literal, TypeVar, cast, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.utils import floatToGoString

from balancer.counter_collectors import (
    BodyMemoCollector,
    DropsCollector,
    KeyMemoCollector,
    LoadTrackerCollector,
    PrefixMemoCollector,
    SegmentCacheCollector,
    TableCountersCollector,
    TokenIdMemoCollector,
    UpstreamCountersCollector,
)
from balancer.events import ResyncReason
from balancer.load.gauge_checks import REASONS as REJECTED_VALUE_REASONS

DECODE_ERROR_REASONS: Final = (
    "frame", "msgpack", "json", "schema", "stream", "replay_end", "event", "internal",
)  # fmt: skip
"""Every ``reason`` of ``kvlb_events_decode_errors_total``: the ``EventDecodeError`` reasons of the
decoders and sources, ``event`` (a malformed event in a good message) and ``internal`` (a decoder bug)."""
REPLAY_OUTCOMES: Final = ("filled", "empty", "partial", "failed")
"""Every ``outcome`` of ``kvlb_events_replays_total``."""
REPLAY_POLL_OUTCOMES: Final = ("new", "nothing", "failed", "abandoned")
"""Every ``outcome`` of ``kvlb_events_replay_polls_total``."""
DRAIN_OUTCOMES: Final = ("events", "empty", "failed", "disabled")
"""Every ``outcome`` of ``kvlb_events_drains_total`` (the TRT-LLM drain)."""
SHED_CAUSES: Final = ("budget", "behind", "backlog", "frames")
"""Every ``cause`` of ``kvlb_events_shed_runs_total`` (``balancer.sources.read_ahead.ShedCause``)."""
RESYNC_REASONS: Final[tuple[str, ...]] = get_args(ResyncReason)
"""Every ``reason`` of ``kvlb_events_resyncs_total`` (the reasons of :class:`balancer.events.Resync`)."""
APPLIED_OUTCOMES: Final = (
    ("stored", "applied"), ("stored", "unknown_parent"), ("stored", "block_size"), ("removed", "applied"),
    ("removed", "unknown"), ("cleared", "applied"), ("resync", "applied"), ("other", "ignored"),
    ("batch", "error"),
)  # fmt: skip
"""Every ``(type, status)`` of ``kvlb_events_applied_total``."""

_Collector = TypeVar("_Collector", Counter, Gauge, Histogram)

LoadKind = Literal[
    "inflight", "peer_inflight", "pending_prefill_tokens", "decode_blocks", "waiting", "kv_usage"
]
"""A ``kind`` of the deprecated ``kvlb_replica_load``."""
LOAD_KIND_METRICS: Final[Mapping[LoadKind, str]] = {
    "inflight": "kvlb_replica_inflight_seqs",
    "peer_inflight": "kvlb_replica_peer_inflight_seqs",
    "pending_prefill_tokens": "kvlb_replica_pending_prefill_tokens",
    "decode_blocks": "kvlb_replica_decode_blocks",
    "waiting": "kvlb_replica_waiting_seqs",
    "kv_usage": "kvlb_replica_kv_usage_ratio",
}
"""Each ``kind`` of the deprecated ``kvlb_replica_load`` (one name for sequences, tokens, blocks and a
ratio) and the metric named by its unit that replaces it (:meth:`Metrics.set_replica_load` sets both)."""


class Children:
    """Memoised ``labels(...)`` children of the collectors the request path updates.

    ``prometheus_client``'s ``labels()`` validates, converts and locks on every call (a few µs,
    about a dozen times per request); this is one dict lookup. It holds only children the collector holds
    anyway, so it is bounded as they are; a child ``remove()``d from its collector must be
    :meth:`forget`-ten here too (else an update would go to the removed child)."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[tuple[object, ...], object] = {}

    def of(self, collector: _Collector, *values: str) -> _Collector:
        """``collector.labels(*values)``, memoised."""
        key = (collector, *values)
        child = self._cache.get(key)
        if child is None:
            child = self._cache[key] = collector.labels(*values)
        return child  # type: ignore[return-value]

    def forget(self, collector: _Collector, *values: str) -> None:
        """Drop the memoised child of ``collector`` for ``values`` (call it when removing that child)."""
        self._cache.pop((collector, *values), None)

    def forget_value(self, collector: object, position: int, value: str) -> None:
        """Drop every memoised child of ``collector`` whose label at ``position`` is ``value``."""
        for key in [k for k in self._cache if k[0] is collector and k[1 + position] == value]:
            del self._cache[key]


REMOVED_REPLICA_LABEL: Final = "(removed)"
"""The ``replica`` label of what a request that ends after its replica left its pool counts (its
``kvlb_http_requests_total``, TTFT, end-to-end time, cached tokens and receipts): one label value for
every such replica, so those series do not come back once :meth:`Metrics.forget_replica` removed them."""
REMOVED_REPLICAS_REMEMBERED: Final = 4096
"""How many of the replica ids removed last :class:`RemovedReplicas` keeps (about 100 B each): a
request's life is bounded (``timeouts.total_s``), so only ids removed during one are needed."""


class RemovedReplicas:
    """The replica ids removed from their pools lately (at most :data:`REMOVED_REPLICAS_REMEMBERED`,
    the oldest out first): a request routed to one of them, still in flight when it was removed, is
    counted under :data:`REMOVED_REPLICA_LABEL` when it ends (:meth:`label`). An id added again
    leaves the list. ``forgotten`` (``kvlb_replica_removed_ids_forgotten_total``) counts the ids
    dropped at the cap; ``None`` counts nothing."""

    __slots__ = ("_forgotten", "_ids")

    def __init__(self, forgotten: Counter | None = None) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._forgotten = forgotten

    def add(self, replica: str) -> None:
        self._ids[replica] = None
        self._ids.move_to_end(replica)
        while len(self._ids) > REMOVED_REPLICAS_REMEMBERED:
            self._ids.popitem(last=False)
            if self._forgotten is not None:
                self._forgotten.inc()

    def discard(self, replica: str) -> None:
        self._ids.pop(replica, None)

    def label(self, replica: str) -> str:
        """``replica``, or :data:`REMOVED_REPLICA_LABEL` when it was removed (and not added again)."""
        return REMOVED_REPLICA_LABEL if replica in self._ids else replica

    def __len__(self) -> int:
        return len(self._ids)


_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ERROR_BUCKETS_BLOCKS = (-64.0, -16.0, -8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
"""Signed prediction errors (reported minus predicted blocks): exact = ``le="0"`` minus ``le="-1"``."""
_DECISION_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3)


def _fields(section: Any) -> dict[str, Any]:
    """A built section's collectors by field name, for :meth:`Metrics.create` (not a deep copy)."""
    return {f.name: getattr(section, f.name) for f in fields(section)}


def _constructors(reg: CollectorRegistry) -> tuple[partial[Counter], partial[Gauge], partial[Histogram]]:
    """``Counter``, ``Gauge`` and ``Histogram`` registering on ``reg``."""
    return partial(Counter, registry=reg), partial(Gauge, registry=reg), partial(Histogram, registry=reg)


DEFAULT_TTFT_SLO_S: Final = 2.5
"""``slo.ttft_s``'s default (seconds): a bound of :data:`_LATENCY_BUCKETS_S`."""
DEFAULT_TTFT_TARGET_RATIO: Final = 0.9
"""``slo.ttft_target_ratio``'s default."""


def bucket_label(bound_s: float) -> str:
    """The ``le`` label prometheus_client writes for the bucket bound ``bound_s`` (``2.5``, ``1.0``)."""
    to_go: Callable[[float], str] = cast(Callable[[float], str], floatToGoString)
    return to_go(float(bound_s))


def ttft_buckets(ttft_slo_s: float) -> tuple[float, ...]:
    """The bucket bounds of ``kvlb_http_ttft_seconds``: the latency buckets and the SLO's bound (so
    that ``KvlbTtftSloMissed`` reads the share over it from one bucket)."""
    return tuple(sorted({*_LATENCY_BUCKETS_S, float(ttft_slo_s)}))


@dataclass(frozen=True)
class _HttpCollectors:
    requests_total: Counter
    ttft_seconds: Histogram
    slo_ttft_seconds: Gauge
    slo_ttft_target_ratio: Gauge
    e2e_seconds: Histogram
    inflight_requests: Gauge
    body_timeouts_total: Counter
    body_chunk_overflow_total: Counter
    client_write_stalls_total: Counter


def _http_collectors(reg: CollectorRegistry, ttft_slo_s: float) -> _HttpCollectors:
    """``kvlb_http_*``: requests answered (HTTP and gRPC endpoints) and their latencies; and
    ``kvlb_slo_*``, the time to first token they are held to (``slo``)."""
    counter, gauge, histogram = _constructors(reg)
    return _HttpCollectors(
        requests_total=counter(
            "kvlb_http_requests_total",
            "Requests answered, by endpoint, status code, replica and policy.",
            ["endpoint", "status", "replica", "policy"],
        ),
        ttft_seconds=histogram(
            "kvlb_http_ttft_seconds",
            "Time from request arrival to the first upstream byte, by pool (its model), replica and "
            "policy; slo.ttft_s is one of the bucket bounds.",
            ["pool", "replica", "policy"],
            buckets=ttft_buckets(ttft_slo_s),
        ),
        slo_ttft_seconds=gauge(
            "kvlb_slo_ttft_seconds",
            "The time to first token a request should get (slo.ttft_s), in seconds; its le label is "
            "the kvlb_http_ttft_seconds bucket bound of the same value, which KvlbTtftSloMissed reads.",
            ["le"],
        ),
        slo_ttft_target_ratio=gauge(
            "kvlb_slo_ttft_target_ratio",
            "Share of requests whose first token should come within kvlb_slo_ttft_seconds "
            "(slo.ttft_target_ratio).",
        ),
        e2e_seconds=histogram(
            "kvlb_http_e2e_seconds",
            "Time from request arrival to the last byte sent to the client, by pool (its model), "
            "replica and policy.",
            ["pool", "replica", "policy"],
            buckets=_LATENCY_BUCKETS_S,
        ),
        inflight_requests=gauge("kvlb_http_inflight_requests", "Requests being served now."),
        body_timeouts_total=counter(
            "kvlb_http_body_timeouts_total",
            "Request bodies refused with 408 while being read, by the limit missed: body_read_s (the "
            "whole read took too long) or body_min_rate_bytes_per_s (behind the pace after "
            "timeouts.body_rate_grace_s).",
            ["limit"],
        ),
        body_chunk_overflow_total=counter(
            "kvlb_http_body_chunk_overflow_total",
            "Request bodies refused with 400 for arriving in more than limits.max_body_chunks HTTP "
            "chunks (each chunk costs aiohttp a Python call on the event loop).",
        ),
        client_write_stalls_total=counter(
            "kvlb_http_client_write_stalls_total",
            "Answers given up (499, the connection aborted) because the client stopped reading them, by "
            "face (http, grpc) and limit: client_write_stall_s (it took no byte for that long) or "
            "total_s (a write still waiting at the request's deadline).",
            ["face", "limit"],
        ),
    )


@dataclass(frozen=True)
class _AdmissionCollectors:
    shed_total: Counter
    admission_body_bytes: Gauge
    admission_tokenizing_bytes: Gauge
    admission_tenants: Gauge
    admission_tenant_overflow_total: Counter
    admission_tenant_rate_limited_total: Counter
    admission_tenant_rate_evictions_total: Counter
    admission_tenant_rate_buckets: Gauge
    admission_prompt_token_waits_total: Counter
    admission_tokenizing_waits_total: Counter
    admission_answer_overflow_total: Counter
    admission_parse_holds_total: Counter


def _admission_collectors(reg: CollectorRegistry) -> _AdmissionCollectors:
    """``kvlb_admission_*``: requests refused before routing, and the bytes the admitted hold."""
    counter, gauge, _ = _constructors(reg)
    return _AdmissionCollectors(
        shed_total=counter(
            "kvlb_admission_shed_total",
            "Requests refused by admission control (429/503), by reason: max_inflight (queue full), "
            "replica_full, queue_timeout, no_healthy, body_bytes (limits.max_inflight_body_bytes "
            "full: queue full or waited too long), tenant_queue (the tenant's "
            "limits.max_queued_per_tenant full), tenant_inflight (waited too long for a slot of the "
            "tenant's limits.max_inflight_per_tenant), tenant_prompt_tokens (waited too long, then "
            "429, for room in the tenant's limits.max_inflight_prompt_tokens_per_tenant), tenant_tokenizing "
            "(waited too long, then 503, for a turn of the tenant's limits.max_tokenizing_per_tenant), "
            "tenant_rate "
            "(the tenant's limits.tenant_rate_per_s bucket empty, 429 before the body is read).",
            ["reason"],
        ),
        admission_tokenizing_waits_total=counter(
            "kvlb_admission_tokenizing_waits_total",
            "Requests to be tokenized in a thread that found their tenant's "
            "limits.max_tokenizing_per_tenant turns taken and waited for one (let in later or "
            "refused: shed_total reason tenant_tokenizing).",
        ),
        admission_prompt_token_waits_total=counter(
            "kvlb_admission_prompt_token_waits_total",
            "Requests that found their tenant's limits.max_inflight_prompt_tokens_per_tenant taken "
            "and waited for room (let in later or refused: shed_total reason tenant_prompt_tokens).",
        ),
        admission_tenants=gauge(
            "kvlb_admission_tenants",
            "Tenants admission tracks now: with a request in flight or waiting (limits.max_tenants "
            "bounds them; per worker; the default and overflow tenants aside).",
        ),
        admission_tenant_overflow_total=counter(
            "kvlb_admission_tenant_overflow_total",
            "Requests of a new tenant that found limits.max_tenants tenants tracked and shared the "
            "overflow tenant (and its caps).",
        ),
        admission_tenant_rate_limited_total=counter(
            "kvlb_admission_tenant_rate_limited_total",
            "Requests refused (429) by limits.tenant_rate_per_s, by bucket: tenant (the tenant's own "
            "bucket empty) or new (a tenant without a bucket, and the newcomers' shared bucket of "
            'limits.tenant_rate_new_per_s empty). Also in kvlb_admission_shed_total{reason="tenant_rate"}.',
            ["bucket"],
        ),
        admission_tenant_rate_evictions_total=counter(
            "kvlb_admission_tenant_rate_evictions_total",
            "Tenant buckets of limits.tenant_rate_per_s dropped, least recently seen first, to make "
            "room for a newcomer's (limits.tenant_rate_tenants full); per worker.",
        ),
        admission_tenant_rate_buckets=gauge(
            "kvlb_admission_tenant_rate_buckets",
            "Tenant buckets limits.tenant_rate_per_s keeps now (at most limits.tenant_rate_tenants, "
            "784 B each at most; the default tenant's and the newcomers' aside; per worker).",
        ),
        admission_answer_overflow_total=counter(
            "kvlb_admission_answer_overflow_total",
            "Non-streaming answers that found limits.max_inflight_body_bytes full while they were "
            "buffered and were relayed to the client as they arrived instead (each holds one chunk "
            "of the replica's at a time from then on, counted even over the budget).",
        ),
        admission_parse_holds_total=counter(
            "kvlb_admission_parse_holds_total",
            "Request bodies (face=http) and gRPC messages (face=grpc: the protobuf parse, then the "
            "OpenAI body made of it) of 256 KiB or more that held the estimate of their parse in "
            "limits.max_inflight_body_bytes while parsed (balancer/api/parse_cost.py), by whether "
            "they had to wait for it (waited=yes: the budget was full; a wait too long is a 503 "
            'counted in kvlb_admission_shed_total{reason="body_bytes"}).',
            ["face", "waited"],
        ),
        admission_body_bytes=gauge(
            "kvlb_admission_body_bytes",
            "Bytes of request bodies, token ids and buffered non-streaming answers held by the "
            "requests in flight in this process, the estimate of a parse of a large body or message "
            "while it runs (and of a parsed gRPC message while its call lasts) and, while they are "
            "tokenized in a thread, the estimate of their parsed chats and text prompts and of the "
            "tokenizer's work (limits.max_inflight_body_bytes bounds them; per worker).",
        ),
        admission_tokenizing_bytes=gauge(
            "kvlb_admission_tokenizing_bytes",
            "The part of kvlb_admission_body_bytes held for the chats and text prompts waiting for or "
            "in a tokenizer thread, and for a large body's parse while it runs: the estimate of their "
            "parsed Python objects and of the tokenizer's working memory (340 B a character of ASCII "
            "text, 720 B of any other; per worker).",
        ),
    )


@dataclass(frozen=True)
class _UpstreamCollectors:
    retries_total: Counter
    upstream_api_key_rotations_total: Counter
    upstream_api_key_rejected_total: Counter
    upstream_api_key_rereads_total: Counter


def _upstream_collectors(reg: CollectorRegistry) -> _UpstreamCollectors:
    """``kvlb_upstream_*``: talking to replicas."""
    counter, _, _ = _constructors(reg)
    return _UpstreamCollectors(
        retries_total=counter(
            "kvlb_upstream_retries_total",
            "Requests retried on another replica before the first byte, by reason.",
            ["reason"],
        ),
        upstream_api_key_rotations_total=counter(
            "kvlb_upstream_api_key_rotations_total",
            "Engine API key files (api_key_file) whose new key was taken into use without a restart.",
        ),
        upstream_api_key_rejected_total=counter(
            "kvlb_upstream_api_key_rejected_total",
            "Reads of a changed engine API key file refused (the old key kept), by reason: unreadable "
            "(missing, no permission) or invalid (empty, too long, not printable ASCII).",
            ["reason"],
        ),
        upstream_api_key_rereads_total=counter(
            "kvlb_upstream_api_key_rereads_total",
            "Reads of engine API key files after start-up, by trigger: changed (the poll saw a new "
            "stat or symlink target) or refused (an engine answered 401, 403 or 407 to the key).",
            ["trigger"],
        ),
    )


@dataclass(frozen=True)
class _RouteCollectors:
    route_decision_seconds: Histogram
    route_decisions_total: Counter
    predicted_cached_tokens_total: Counter
    reported_cached_tokens_total: Counter
    computed_prompt_blocks_total: Counter
    prediction_error_blocks: Histogram
    receipts_total: Counter
    receipts_exact_total: Counter
    receipts_within_block_total: Counter
    prediction_accuracy_ratio: Gauge
    receipt_stale_blocks_total: Counter
    index_receipt_drops_blocks_total: Counter
    index_receipt_learned_blocks_total: Counter
    index_receipt_taught_blocks_total: Counter
    index_receipt_confirmed_blocks_total: Counter


def _route_collectors(reg: CollectorRegistry) -> _RouteCollectors:
    """``kvlb_route_*``: routing decisions and how well they predicted the cache; receipts (each
    response's ``cached_tokens`` against the prediction) and the index corrections they make."""
    counter, gauge, histogram = _constructors(reg)
    return _RouteCollectors(
        route_decision_seconds=histogram(
            "kvlb_route_decision_seconds",
            "Time to choose a replica (candidates, hashing, index match, policy; with the commitment "
            "when the request is forwarded).",
            buckets=_DECISION_BUCKETS_S,
        ),
        route_decisions_total=counter(
            "kvlb_route_decisions_total",
            "Routing decisions, by policy and chosen replica.",
            ["policy", "replica"],
        ),
        predicted_cached_tokens_total=counter(
            "kvlb_route_predicted_cached_tokens_total",
            "Prompt tokens the router predicted to be cached on the chosen replica.",
            ["replica"],
        ),
        reported_cached_tokens_total=counter(
            "kvlb_route_reported_cached_tokens_total",
            "Prompt tokens the replica reported as cached (usage.prompt_tokens_details.cached_tokens).",
            ["replica"],
        ),
        prediction_error_blocks=histogram(
            "kvlb_route_prediction_error_blocks",
            "Per response with cached_tokens: reported minus predicted cached blocks on the chosen "
            "replica (signed: < 0 the index promised blocks the engine lacked, > 0 it missed some).",
            ["replica"],
            buckets=_ERROR_BUCKETS_BLOCKS,
        ),
        computed_prompt_blocks_total=counter(
            "kvlb_route_computed_prompt_blocks_total",
            "Full prompt blocks the replica computed rather than found cached, by replica: per receipt, "
            "the request's blocks (in the replica's alignment) minus the cached ones it reported. An "
            "engine with prefix caching stores them and publishes them as KV events "
            "(KvlbReplicaEventsStopped).",
            ["replica"],
        ),
        receipts_total=counter(
            "kvlb_route_receipts_total",
            "Responses that reported cached_tokens (receipts), by replica.",
            ["replica"],
        ),
        receipts_exact_total=counter(
            "kvlb_route_receipts_exact_total",
            "Receipts whose cached blocks were exactly the predicted ones, by replica.",
            ["replica"],
        ),
        receipts_within_block_total=counter(
            "kvlb_route_receipts_within_block_total",
            "Receipts within one block of the prediction (either way), by replica.",
            ["replica"],
        ),
        prediction_accuracy_ratio=gauge(
            "kvlb_route_prediction_accuracy_ratio",
            "Share of exact predictions over the replica's last 256 receipts.",
            ["replica"],
        ),
        receipt_stale_blocks_total=counter(
            "kvlb_route_receipt_stale_blocks_total",
            "Blocks predicted cached that the engine reported missing (the index was stale), by replica.",
            ["replica"],
        ),
        index_receipt_drops_blocks_total=counter(
            "kvlb_index_receipt_drops_blocks_total",
            "Holdings dropped from the index because a receipt showed them stale, by replica.",
            ["replica"],
        ),
        index_receipt_learned_blocks_total=counter(
            "kvlb_index_receipt_learned_blocks_total",
            "Blocks a receipt showed cached that the index did not know, added as speculative entries,"
            " by replica.",
            ["replica"],
        ),
        index_receipt_taught_blocks_total=counter(
            "kvlb_index_receipt_taught_blocks_total",
            "Blocks a receipt showed cached that the index did not hold, held under the engine's own"
            " hashes (computed by kvlb, verified against the replica's events), by replica.",
            ["replica"],
        ),
        index_receipt_confirmed_blocks_total=counter(
            "kvlb_index_receipt_confirmed_blocks_total",
            "Suspect blocks (held through an event gap) that a receipt showed cached, and suspect"
            " blocks dropped unconfirmed that it showed still cached (held again), by replica.",
            ["replica"],
        ),
    )


@dataclass(frozen=True)
class _EventsCollectors:
    events_applied_total: Counter
    events_decode_errors_total: Counter
    events_seq_gaps_total: Counter
    events_replays_total: Counter
    events_replay_polls_total: Counter
    events_drains_total: Counter
    events_resyncs_total: Counter
    events_queue_overflow_total: Counter
    events_oversize_total: Counter
    events_shed_total: Counter
    events_shed_runs_total: Counter
    events_relay_history_trimmed_total: Counter
    events_disconnects_total: Counter
    events_decoder_forgotten_total: Counter
    events_lag_seconds: Gauge
    events_applied_batches_total: Counter


def _events_collectors(reg: CollectorRegistry) -> _EventsCollectors:
    """``kvlb_events_*``: KV event ingestion (decoding, ordering, replay, queues)."""
    counter, gauge, _ = _constructors(reg)
    return _EventsCollectors(
        events_applied_total=counter(
            "kvlb_events_applied_total",
            "KV events applied to the index, by engine, event type and status.",
            ["engine", "type", "status"],
        ),
        events_decode_errors_total=counter(
            "kvlb_events_decode_errors_total",
            "Engine messages or events that could not be decoded, by replica (the one that sent them; "
            "removed with it), engine and reason.",
            ["replica", "engine", "reason"],
        ),
        events_seq_gaps_total=counter(
            "kvlb_events_seq_gaps_total",
            "Gaps seen in a replica's event sequence (ZMQ seq or TRT-LLM event_id).",
            ["replica"],
        ),
        events_replays_total=counter(
            "kvlb_events_replays_total",
            "Replay requests to an engine's replay socket, or to worker 0's TRT-LLM relay (a catch-up of "
            "another worker of kvlb serve --workers N), by outcome (filled, partial, failed, empty).",
            ["replica", "outcome"],
        ),
        events_replay_polls_total=counter(
            "kvlb_events_replay_polls_total",
            "Replay requests sent while a ZMQ publisher's live stream was silent, by outcome (new: it "
            "held batches the live stream lost; nothing; failed; abandoned: the engine went away while "
            "it waited).",
            ["replica", "outcome"],
        ),
        events_drains_total=counter(
            "kvlb_events_drains_total",
            "TRT-LLM drains (POST /kv_cache_events) of a replica, by outcome: events (it held some), "
            "empty (the engine answered with nothing new: alive, its traffic stored no new block), "
            "failed, disabled (404).",
            ["replica", "outcome"],
        ),
        events_resyncs_total=counter(
            "kvlb_events_resyncs_total",
            "Times a replica's index state was cleared to resynchronise, by reason.",
            ["replica", "reason"],
        ),
        events_queue_overflow_total=counter(
            "kvlb_events_queue_overflow_total",
            "Event queue overflows (the replica is cleared and resynchronised).",
            ["replica"],
        ),
        events_oversize_total=counter(
            "kvlb_events_oversize_total",
            "Events dropped for carrying more than limits.max_event_blocks blocks (the rank resyncs).",
            ["replica"],
        ),
        events_shed_total=counter(
            "kvlb_events_shed_total",
            "Event messages read and dropped undecoded because the replica's ingestion CPU budget was "
            "spent (a flood; the rank resyncs once per run of shed messages).",
            ["replica"],
        ),
        events_shed_runs_total=counter(
            "kvlb_events_shed_runs_total",
            "Runs of shed event messages (each resyncs the rank once), by what started the run: budget "
            "(the replica's ingestion CPU budget spent, or its queue over half full), behind (the "
            "source read for limits.event_max_behind_s, at least 16 messages, without finding its "
            "socket empty; pauses of the process not counted), backlog (it found "
            "more than zmq max_backlog_bytes queued) or frames (a message of more than 8 frames, read "
            "no further: the SUB is dropped with the rest of it and reopened).",
            ["replica", "cause"],
        ),
        events_relay_history_trimmed_total=counter(
            "kvlb_events_relay_history_trimmed_total",
            "Drained TRT-LLM bodies worker 0 dropped from the relay's catch-up history at its bound "
            "(limits.relay_history_bytes): a later catch-up of another worker no longer reaches them.",
            ["replica"],
        ),
        events_disconnects_total=counter(
            "kvlb_events_disconnects_total",
            "Dropped connections to a ZMQ event publisher: the engine went away, the network failed, or "
            "ZMQ refused a message over limits.event_message_bytes (the rank resyncs, the SUB is reopened).",
            ["replica"],
        ),
        events_decoder_forgotten_total=counter(
            "kvlb_events_decoder_forgotten_total",
            "Entries of a replica's decoder memory dropped, oldest first, at its cap: TRT-LLM's "
            "partial-block hashes past max_partial_hashes (65,536; a forgotten one's later removal "
            "reaches the index as an unknown hash, and its block's update as a plain store).",
            ["replica"],
        ),
        events_lag_seconds=gauge(
            "kvlb_events_lag_seconds",
            "Engine timestamp of the last applied batch vs our clock (wall time, may be skewed).",
            ["replica"],
        ),
        events_applied_batches_total=counter(
            "kvlb_events_applied_batches_total",
            "Event batches applied to the index, by replica (each ingester counts its own: every worker "
            "without Redis, the lease holder with it); at 0 from the replica's registration when its "
            "pool has KV events, so a replica whose events never arrive shows 0.",
            ["replica"],
        ),
    )


@dataclass(frozen=True)
class _IndexCollectors:
    index_blocks: Gauge
    index_replica_blocks: Gauge
    index_skipped_total: Counter


def _index_collectors(reg: CollectorRegistry) -> _IndexCollectors:
    """``kvlb_index_*``: the prefix index's size and the events it skipped."""
    counter, gauge, _ = _constructors(reg)
    return _IndexCollectors(
        index_blocks=gauge(
            "kvlb_index_blocks",
            "Blocks in the prefix index (kind=unique|held|speculative).",
            ["kind"],
        ),
        index_replica_blocks=gauge(
            "kvlb_index_replica_blocks",
            "Blocks the index says a replica's caches hold (all ranks and key spaces), set at "
            "scrape time; compare with the engine's own cache size.",
            ["replica"],
        ),
        index_skipped_total=counter(
            "kvlb_index_skipped_total",
            "Events the index skipped, by reason (unknown_parent, unknown_removal, block_size).",
            ["reason"],
        ),
    )


@dataclass(frozen=True)
class _ReplicaCollectors:
    replica_load: Gauge
    replica_inflight_seqs: Gauge
    replica_peer_inflight_seqs: Gauge
    replica_pending_prefill_tokens: Gauge
    replica_decode_blocks: Gauge
    replica_waiting_seqs: Gauge
    replica_kv_usage_ratio: Gauge
    replica_healthy: Gauge
    replica_breaker_open: Gauge
    replica_model_mismatch: Gauge
    replica_key_refused: Gauge
    pool_routable_replicas: Gauge
    scrape_errors_total: Counter
    scrape_rejected_values_total: Counter
    replica_pending_drains_dropped_total: Counter
    replica_kept_drains_dropped_total: Counter
    replica_removed_ids_forgotten_total: Counter
    load_share_overflow_replicas_total: Counter
    load_share_overflow_tenants_total: Counter
    load_share_torn_reads_total: Counter


def _replica_collectors(reg: CollectorRegistry) -> _ReplicaCollectors:
    """``kvlb_replica_*``, ``kvlb_scrape_*`` and ``kvlb_load_share_*``: per-replica load and health,
    the metric scrapes, and the load shared between the workers of ``kvlb serve --workers N``."""
    counter, gauge, _ = _constructors(reg)
    return _ReplicaCollectors(
        replica_load=gauge(
            "kvlb_replica_load",
            "DEPRECATED since 2026-12-01, kept for one release (docs/operations.md, Upgrades): one "
            "metric per unit replaces it, with the same values. Per-replica load by kind: "
            "inflight (kvlb_replica_inflight_seqs), peer_inflight (kvlb_replica_peer_inflight_seqs), "
            "pending_prefill_tokens (kvlb_replica_pending_prefill_tokens), decode_blocks "
            "(kvlb_replica_decode_blocks), waiting (kvlb_replica_waiting_seqs), kv_usage "
            "(kvlb_replica_kv_usage_ratio).",
            ["replica", "kind"],
        ),
        replica_inflight_seqs=gauge(
            "kvlb_replica_inflight_seqs",
            "Sequences this worker routed to the replica and holds in prefill or decode (a request "
            "counts its OpenAI n): this worker's own part, sum over workers (--workers N). Replaces "
            'kvlb_replica_load{kind="inflight"}.',
            ["replica"],
        ),
        replica_peer_inflight_seqs=gauge(
            "kvlb_replica_peer_inflight_seqs",
            "Sequences the other workers of kvlb serve --workers N hold on the replica, as this "
            "worker's policy reads them from the shared load table (a request counts its n); only "
            'with --workers N (N > 1). Replaces kvlb_replica_load{kind="peer_inflight"}.',
            ["replica"],
        ),
        replica_pending_prefill_tokens=gauge(
            "kvlb_replica_pending_prefill_tokens",
            "Uncached prompt tokens of the requests this worker routed to the replica that are not "
            "at their first token yet: this worker's own part, sum over workers. "
            'Replaces kvlb_replica_load{kind="pending_prefill_tokens"}.',
            ["replica"],
        ),
        replica_decode_blocks=gauge(
            "kvlb_replica_decode_blocks",
            "KV blocks (of the pool's reference block size) the requests this worker routed to the "
            "replica hold while decoding (uncached prompt plus n x max_tokens): this worker's own "
            'part, sum over workers. Replaces kvlb_replica_load{kind="decode_blocks"}.',
            ["replica"],
        ),
        replica_waiting_seqs=gauge(
            "kvlb_replica_waiting_seqs",
            "Sequences waiting in the engine's own queue, as its last scrape reported them (an n = 8 "
            "request is 8); absent until an engine reports it. Every worker scrapes the same engine: "
            'max over workers. Replaces kvlb_replica_load{kind="waiting"}.',
            ["replica"],
        ),
        replica_kv_usage_ratio=gauge(
            "kvlb_replica_kv_usage_ratio",
            "Used share of the engine's KV pool, 0 to 1, as its last scrape reported it; absent "
            "until an engine reports it. Every worker scrapes the same engine: max over workers. "
            'Replaces kvlb_replica_load{kind="kv_usage"}.',
            ["replica"],
        ),
        load_share_overflow_replicas_total=counter(
            "kvlb_load_share_overflow_replicas_total",
            "Times a replica's load could not be shared with the other workers because all "
            "limits.load_share_slots slots of this worker were taken (the others then see only "
            "their own load on it).",
        ),
        load_share_overflow_tenants_total=counter(
            "kvlb_load_share_overflow_tenants_total",
            "Times a tenant's admitted requests, prompt tokens or rate bucket time could not be "
            "shared with the other workers because all limits.load_share_tenant_slots tenant slots "
            "of this worker were taken (the others then do not count its requests and tokens here "
            "against limits.max_inflight_per_tenant and max_inflight_prompt_tokens_per_tenant, nor "
            "its requests let in here against limits.tenant_rate_per_s).",
        ),
        load_share_torn_reads_total=counter(
            "kvlb_load_share_torn_reads_total",
            "Another worker's row of the shared load table read mid-update too often in a row; its "
            "previous read was used for that snapshot.",
        ),
        replica_healthy=gauge(
            "kvlb_replica_healthy",
            "1 when the replica is healthy and routable, else 0.",
            ["replica"],
        ),
        replica_breaker_open=gauge(
            "kvlb_replica_breaker_open",
            "1 while the replica's circuit breaker is not closed: open (refusing requests after "
            "breaker failures in a row, or failing probes) or half-open (waiting for a trial request to "
            "succeed); 0 once closed.",
            ["replica"],
        ),
        replica_key_refused=gauge(
            "kvlb_replica_key_refused",
            "1 while the replica's engine refuses kvlb's API key on GET /v1/models (vLLM's --api-key "
            "guards /v1/* only, so its probes pass): the replica is out of routing until the engine "
            "accepts the key; 0 otherwise (also where the list is not read: SGLang, TRT-LLM).",
            ["replica"],
        ),
        replica_model_mismatch=gauge(
            "kvlb_replica_model_mismatch",
            "1 while the replica's engine lists other models than its pool's on GET /v1/models and "
            "refuses other names (vLLM): the replica is out of routing until it serves the pool's "
            "model; 0 otherwise (also when the list is not read: SGLang, TRT-LLM).",
            ["replica"],
        ),
        pool_routable_replicas=gauge(
            "kvlb_pool_routable_replicas",
            "Replicas kvlb may route a new request of the pool (its model) to: probed healthy, breaker "
            "not open, not draining. 0: the pool answers 503, including when it has no replica at all.",
            ["pool"],
        ),
        scrape_errors_total=counter(
            "kvlb_scrape_errors_total",
            "Failed engine metric scrapes, by replica.",
            ["replica"],
        ),
        scrape_rejected_values_total=counter(
            "kvlb_scrape_rejected_values_total",
            "Figures of an engine's load report out of range (a NaN or negative count, a fraction "
            "for a count, +Inf, above a sanity limit, a usage outside 0..1), by replica and reason: "
            "each is dropped (that field reads unknown) and the rest of the report is kept.",
            ["replica", "reason"],
        ),
        replica_pending_drains_dropped_total=counter(
            "kvlb_replica_pending_drains_dropped_total",
            "Drains a sibling worker sent for replicas this worker had not discovered yet, dropped for "
            "newer ones (at most 64 kept, each for 30 s until the replica comes).",
        ),
        replica_kept_drains_dropped_total=counter(
            "kvlb_replica_kept_drains_dropped_total",
            "Drains of replicas discovery removed, kept for their id (health_drain_keep_s), dropped "
            "before their time for newer ones (at most 4,096 kept and 4 MiB).",
        ),
        replica_removed_ids_forgotten_total=counter(
            "kvlb_replica_removed_ids_forgotten_total",
            "Ids of replicas removed from their pools forgotten, oldest first, past the 4,096 kept "
            "(REMOVED_REPLICAS_REMEMBERED): a request still in flight on a forgotten one brings its "
            'series back under its own replica label instead of replica="(removed)".',
        ),
    )


PROCESS_RESTARTS_HELP: Final = (
    "Times the supervisor of kvlb serve --workers N restarted this worker after it exited (by the "
    "supervisor's count; 0 for --workers 1); rising means a worker crash loop."
)
"""``kvlb_process_restarts_total``'s help, also written for a worker that is down
(:func:`balancer.api.siblings.absent_worker_metrics`)."""


@dataclass(frozen=True)
class _ProcessCollectors:
    process_asyncio_tasks: Gauge
    process_restarts_total: Counter
    process_workers_crash_looping: Gauge
    log_suppressed_total: Counter
    log_causes_forgotten_total: Counter


def _process_collectors(reg: CollectorRegistry) -> _ProcessCollectors:
    """``kvlb_process_*`` beside the ``ProcessCollector``'s: the event loop's tasks, the restarts of
    this worker; and the log rate limiter's held-back warnings."""
    counter, gauge, _ = _constructors(reg)
    return _ProcessCollectors(
        process_asyncio_tasks=gauge(
            "kvlb_process_asyncio_tasks",
            "Tasks alive on kvlb's event loop, counted at scrape time (the scrape's own included); "
            "flat under steady load, growth means a leak.",
        ),
        process_restarts_total=counter(
            "kvlb_process_restarts_total",
            PROCESS_RESTARTS_HELP,
        ),
        process_workers_crash_looping=gauge(
            "kvlb_process_workers_crash_looping",
            "Workers of kvlb serve --workers N in a crash loop: workers.crash_loop_exits exits within "
            "workers.restart_window_s, or as many in a row before serving, by the supervisor's record, "
            "read at scrape time (0 for --workers 1).",
        ),
        log_suppressed_total=counter(
            "kvlb_log_suppressed_total",
            "Repeated warnings held back by the log rate limiter (balancer/log_limit.py), by cause.",
            ["cause"],
        ),
        log_causes_forgotten_total=counter(
            "kvlb_log_causes_forgotten_total",
            "Causes (a call site's cause and its subject, a replica) the log rate limiter forgot, "
            "least recently seen first, past its 1,024 a limiter; by the forgotten one's cause. A "
            "forgotten cause's next occurrence is logged at once, its held-back count lost.",
            ["cause"],
        ),
    )


@dataclass(frozen=True)
class _RedisCollectors:
    redis_up: Gauge
    redis_errors_total: Counter
    redis_apply_seconds: Histogram
    redis_apply_retries_total: Counter
    redis_stale_writes_total: Counter
    redis_leases_held: Gauge
    redis_lease_events_total: Counter
    redis_fleet_members: Gauge
    redis_mirror_lag_seconds: Gauge
    redis_mirror_entries_total: Counter
    redis_mirror_resyncs_total: Counter
    redis_mirror_skipped_entries_total: Counter
    redis_wrongtype_keys_total: Counter
    redis_stream_byte_trimmed_entries_total: Counter
    redis_mirror_partial: Gauge
    redis_replicas_dropped_total: Counter
    redis_policy_updates_total: Counter
    redis_snapshots_total: Counter
    redis_drain_whole_reads_total: Counter


def _redis_collectors(reg: CollectorRegistry) -> _RedisCollectors:
    """``kvlb_redis_*``: the fleet mode (:mod:`balancer.fleet`); they only move when ``redis.url`` is set."""
    counter, gauge, histogram = _constructors(reg)
    return _RedisCollectors(
        # Not registered here: only a balancer with redis.url exports it (Metrics.set_redis_up), so a
        # balancer without Redis has no series rather than a 0 that reads as an outage.
        redis_up=Gauge(
            "kvlb_redis_up",
            "1 while this balancer's last Redis calls succeeded, else 0 (only with redis.url set).",
            registry=None,
        ),
        redis_errors_total=counter(
            "kvlb_redis_errors_total",
            "Failed Redis calls, by component (writer, mirror, lease, policy, drain, snapshot).",
            ["component"],
        ),
        redis_apply_seconds=histogram(
            "kvlb_redis_apply_seconds",
            "Time of one event batch applied to the Redis index (retries included).",
            buckets=_LATENCY_BUCKETS_S,
        ),
        redis_apply_retries_total=counter(
            "kvlb_redis_apply_retries_total",
            "Event batch applies retried after a Redis error (the batch waits, bounded by the queue).",
        ),
        redis_stale_writes_total=counter(
            "kvlb_redis_stale_writes_total",
            "Writes refused because the replica's generation moved on (another ingester or a drop).",
        ),
        redis_leases_held=gauge("kvlb_redis_leases_held", "Replica ingestion leases this balancer holds."),
        redis_lease_events_total=counter(
            "kvlb_redis_lease_events_total",
            "Ingestion lease changes of this balancer (acquired, released, lost, retaken after expiring; "
            "orphan_retired: a replica that left without its holder retiring it; orphan_overflow: such "
            "replicas forgotten over the bound).",
            ["event"],
        ),
        redis_fleet_members=gauge("kvlb_redis_fleet_members", "Live balancers seen in Redis (heartbeats)."),
        redis_mirror_lag_seconds=gauge(
            "kvlb_redis_mirror_lag_seconds",
            "Our wall clock minus the Redis time of the last stream entry the mirror applied.",
            ["space"],
        ),
        redis_mirror_entries_total=counter(
            "kvlb_redis_mirror_entries_total",
            "Stream entries applied to the local mirror, by key space.",
            ["space"],
        ),
        redis_mirror_resyncs_total=counter(
            "kvlb_redis_mirror_resyncs_total",
            "Mirror rebuilds after stream entries went missing, by key space.",
            ["space"],
        ),
        redis_mirror_skipped_entries_total=counter(
            "kvlb_redis_mirror_skipped_entries_total",
            "Stream entries the mirror could not decode and skipped (one with an entry number also"
            " rebuilds the mirror), by key space.",
            ["space"],
        ),
        redis_wrongtype_keys_total=counter(
            "kvlb_redis_wrongtype_keys_total",
            "Keys of kvlb's namespace found holding another type (garbage written over them), deleted"
            " and rebuilt by this balancer's next write.",
        ),
        redis_stream_byte_trimmed_entries_total=counter(
            "kvlb_redis_stream_byte_trimmed_entries_total",
            "Stream entries this balancer's appends trimmed because the key space's stream passed"
            " redis.stream_max_bytes (before stream_maxlen), by key space.",
            ["space"],
        ),
        redis_mirror_partial=gauge(
            "kvlb_redis_mirror_partial",
            "1 when the mirror was built from a trimmed stream (older blocks unknown), by key space.",
            ["space"],
        ),
        redis_replicas_dropped_total=counter(
            "kvlb_redis_replicas_dropped_total",
            "Replicas dropped fleet-wide after no events and failed health beyond the timeout.",
            ["replica"],
        ),
        redis_policy_updates_total=counter(
            "kvlb_redis_policy_updates_total",
            "Policy changes written to Redis (source=local) or adopted from it (source=remote).",
            ["source"],
        ),
        redis_snapshots_total=counter(
            "kvlb_redis_snapshots_total",
            "Mirror table snapshots written to or loaded from Redis (op=write|load).",
            ["op"],
        ),
        redis_drain_whole_reads_total=counter(
            "kvlb_redis_drain_whole_reads_total",
            "Drain syncs that read the whole <prefix>:drained hash instead of the entries changed since"
            " the last, by reason (first, epoch, trimmed, changes, unversioned, periodic).",
            ["reason"],
        ),
    )


@dataclass(frozen=True)
class _FrontCollectors:
    grpc_reservations_refused_total: Counter
    grpc_reservations_bytes: Gauge
    siblings_answers_oversize_total: Counter


def _front_collectors(reg: CollectorRegistry) -> _FrontCollectors:
    """``kvlb_grpc_*`` and ``kvlb_siblings_*``: what the gRPC face keeps between calls (its
    reservations) and what a worker of ``kvlb serve --workers N`` reads of its siblings."""
    counter, gauge, _ = _constructors(reg)
    return _FrontCollectors(
        grpc_reservations_refused_total=counter(
            "kvlb_grpc_reservations_refused_total",
            "gRPC Route(reserve=true) calls refused with RESOURCE_EXHAUSTED because the reservations"
            " held were at their cap: bound=count (limits.max_inflight of them) or bound=bytes"
            " (limits.max_reserved_bytes of token ids and block keys); per worker.",
            ["bound"],
        ),
        grpc_reservations_bytes=gauge(
            "kvlb_grpc_reservations_bytes",
            "Bytes the gRPC reservations hold (their token ids and block keys, counted against"
            " limits.max_reserved_bytes; per worker).",
        ),
        siblings_answers_oversize_total=counter(
            "kvlb_siblings_answers_oversize_total",
            "Answers of sibling workers (kvlb serve --workers N: a console read, /metrics, a fan-out)"
            " refused for declaring or sending more than 64 MiB; that sibling is left out of the"
            " gathered answer, as one that did not answer.",
        ),
    )


@dataclass(frozen=True)
class _ConsoleCollectors:
    console_series_overflow_total: Counter
    console_ring_entries: Gauge
    console_ring_bytes: Gauge
    console_ring_evicted_total: Counter
    console_whatif_seconds: Histogram
    console_whatif_unmodelled_decisions_total: Counter
    console_whatif_unmoved_load_decisions_total: Counter
    console_audit_dropped_total: Counter


def _console_collectors(reg: CollectorRegistry) -> _ConsoleCollectors:
    """``kvlb_console_*``: the decision ring (``/admin/decisions``, ``/admin/whatif``), the audit log
    and the time series of the console's plots (``/admin/series``)."""
    counter, gauge, histogram = _constructors(reg)
    return _ConsoleCollectors(
        console_series_overflow_total=counter(
            "kvlb_console_series_overflow_total",
            "Items the series sampler left out of an interval at its bounds: kind=replicas (a "
            "request counted under (other) beyond console.series_max_replicas).",
            ["kind"],
        ),
        console_ring_entries=gauge(
            "kvlb_console_ring_entries", "Decisions held in the pool's decision ring.", ["pool"]
        ),
        console_ring_bytes=gauge(
            "kvlb_console_ring_bytes",
            "Estimated bytes held by the pool's decision ring (console.decision_ring_bytes caps it).",
            ["pool"],
        ),
        console_ring_evicted_total=counter(
            "kvlb_console_ring_evicted_total",
            "Decisions evicted from the ring, by the bound that evicted them (count or bytes).",
            ["pool", "reason"],
        ),
        console_whatif_seconds=histogram(
            "kvlb_console_whatif_seconds",
            "Time of one what-if replay (worker thread).",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        ),
        console_whatif_unmodelled_decisions_total=counter(
            "kvlb_console_whatif_unmodelled_decisions_total",
            "What-if decisions scored on their recorded prefix matches because the replay's cache "
            "model was full (console.whatif_max_cache_marks); the answer's tallies.unmodelled.",
            ["pool"],
        ),
        console_whatif_unmoved_load_decisions_total=counter(
            "kvlb_console_whatif_unmoved_load_decisions_total",
            "What-if decisions whose load the replay did not move (they read the load as recorded) "
            "because its load model held its bound of moved requests in flight at once "
            "(balancer.service.replay_load.MAX_LOAD_MOVES); the answer's tallies.load_unmodelled.",
            ["pool"],
        ),
        console_audit_dropped_total=counter(
            "kvlb_console_audit_dropped_total",
            "Policy changes dropped from the in-memory audit log (console.audit_log_size).",
        ),
    )


@dataclass(frozen=True, slots=True)
class Metrics(
    _HttpCollectors,
    _AdmissionCollectors,
    _UpstreamCollectors,
    _RouteCollectors,
    _EventsCollectors,
    _IndexCollectors,
    _ReplicaCollectors,
    _ProcessCollectors,
    _RedisCollectors,
    _ConsoleCollectors,
    _FrontCollectors,
):
    """Every collector kvlb exports: those of the subsystem sections it inherits (each declared once,
    in its section above, and built by the builder beside it, whose docstring names the subsystem),
    the registry and the scrape-time collectors. Build with :meth:`create`."""

    registry: CollectorRegistry
    index_tables: TableCountersCollector
    upstream_connections: UpstreamCountersCollector
    token_id_memo: TokenIdMemoCollector
    body_memo: BodyMemoCollector
    prefix_memo: PrefixMemoCollector
    key_memos: KeyMemoCollector
    segment_caches: SegmentCacheCollector
    load_trackers: LoadTrackerCollector
    parent_hints_dropped: DropsCollector
    """``kvlb_redis_parent_hints_dropped_total{space}``: the fleet runtime sets its source."""
    discovery_over_cap: DropsCollector
    """``kvlb_discovery_objects_over_cap_total{bound}``: set when discovery starts."""
    children: Children = field(default_factory=Children)
    """The request path's ``labels()`` children, memoised (:class:`Children`)."""
    removed: RemovedReplicas = field(default_factory=RemovedReplicas)
    """The replicas removed lately, whose late requests count under :data:`REMOVED_REPLICA_LABEL`."""

    def replica_label(self, replica: str) -> str:
        """The ``replica`` label of a request's series: its replica, or :data:`REMOVED_REPLICA_LABEL`
        once that replica left its pool (a request in flight at the removal would otherwise bring
        back the series :meth:`forget_replica` removed, one set per removed replica id)."""
        return self.removed.label(replica)

    def set_replica_load(self, replica: str, kind: LoadKind, value: float) -> None:
        """Set one load figure of ``replica``: its gauge named by its unit (:data:`LOAD_KIND_METRICS`)
        and, while it is kept, the deprecated ``kvlb_replica_load{kind}``, to the same value (both
        children memoised in :attr:`children`, which :meth:`forget_replica` clears with them)."""
        self.children.of(self._load_gauge(kind), replica).set(value)
        self.children.of(self.replica_load, replica, kind).set(value)

    def _load_gauge(self, kind: LoadKind) -> Gauge:
        match kind:
            case "inflight":
                return self.replica_inflight_seqs
            case "peer_inflight":
                return self.replica_peer_inflight_seqs
            case "pending_prefill_tokens":
                return self.replica_pending_prefill_tokens
            case "decode_blocks":
                return self.replica_decode_blocks
            case "waiting":
                return self.replica_waiting_seqs
            case "kv_usage":
                return self.replica_kv_usage_ratio

    def init_replica(self, replica: str, engine: str, *, replays: bool, events: bool = True) -> None:
        """Give every known label set of one replica's counters (and its engine's) a sample at 0, so
        that "no errors yet" reads 0 rather than no data. Called when the replica is registered (static
        or discovered); ``replays``: its transport has a replay socket (ZMQ); ``events``: its pool has
        KV events (``kvlb_events_applied_batches_total`` starts at 0 only then)."""
        self.removed.discard(replica)
        if events:
            self.events_applied_batches_total.labels(replica)
            self.events_decoder_forgotten_total.labels(replica)
        for reason in DECODE_ERROR_REASONS:
            self.events_decode_errors_total.labels(replica, engine, reason)
        for kind, status in APPLIED_OUTCOMES:
            self.events_applied_total.labels(engine, kind, status)
        for counter in (
            self.events_seq_gaps_total,
            self.events_queue_overflow_total,
            self.events_oversize_total,
            self.events_disconnects_total,
            self.scrape_errors_total,
            self.predicted_cached_tokens_total,
            self.reported_cached_tokens_total,
            self.computed_prompt_blocks_total,
        ):
            counter.labels(replica)
        for reason in RESYNC_REASONS:
            self.events_resyncs_total.labels(replica, reason)
        for reason in REJECTED_VALUE_REASONS:
            self.scrape_rejected_values_total.labels(replica, reason)
        if replays:  # the ZMQ transports: they also shed (kvlb_events_shed_total)
            self.events_shed_total.labels(replica)
            for cause in SHED_CAUSES:
                self.events_shed_runs_total.labels(replica, cause)
            for outcome in REPLAY_OUTCOMES:
                self.events_replays_total.labels(replica, outcome)
            for outcome in REPLAY_POLL_OUTCOMES:
                self.events_replay_polls_total.labels(replica, outcome)
        elif events:  # the TRT-LLM drain
            for outcome in DRAIN_OUTCOMES:
                self.events_drains_total.labels(replica, outcome)

    def forget_replica(self, replica: str) -> None:
        """Remove every series labelled ``replica="<replica>"`` (it left its pool): replica ids come
        and go with discovery (a pod's name is new at each rollout), so each one's counters, gauges
        and histograms would otherwise stay in ``/metrics`` for the life of the process, frozen
        (a stale ``kvlb_events_lag_seconds`` keeps an alert on it going). A replica added again starts
        at 0, a counter reset that ``rate()`` handles. ``kvlb_redis_replicas_dropped_total`` goes too: a
        pod that died is dropped (no events, failed probes), then removed by discovery, so keeping it
        would keep one series per dead pod. A request still in flight on it counts under
        :data:`REMOVED_REPLICA_LABEL` when it ends (:meth:`replica_label`)."""
        self.removed.add(replica)
        for item in fields(self):
            collector = getattr(self, item.name)
            if not isinstance(collector, Counter | Gauge | Histogram):
                continue
            names: tuple[str, ...] = collector._labelnames
            if "replica" not in names:
                continue
            position = names.index("replica")
            with collector._lock:
                keys = [key for key in collector._metrics if key[position] == replica]
            for key in keys:
                collector.remove(*key)
            self.children.forget_value(collector, position, replica)

    def set_redis_up(self, up: bool) -> None:
        """Set ``kvlb_redis_up``, exporting it from the first call on (the fleet mode's refresh): a
        balancer without Redis never calls this and has no such series."""
        with contextlib.suppress(ValueError):  # "Duplicated timeseries": registered by an earlier call
            self.registry.register(self.redis_up)
        self.redis_up.set(1 if up else 0)

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry | None = None,
        *,
        ttft_slo_s: float = DEFAULT_TTFT_SLO_S,
        ttft_target_ratio: float = DEFAULT_TTFT_TARGET_RATIO,
    ) -> Metrics:
        """Every collector, registered on ``registry`` (a fresh one when ``None``), built per
        subsystem; ``ttft_slo_s`` and ``ttft_target_ratio``: the ``slo`` settings, exported."""
        reg = registry if registry is not None else CollectorRegistry()
        # kvlb_process_{cpu_seconds_total,resident_memory_bytes,open_fds,...}: capacity and leaks.
        ProcessCollector(namespace="kvlb", registry=reg)
        tables = TableCountersCollector()
        reg.register(tables)
        connections = UpstreamCountersCollector()
        reg.register(connections)
        token_id_memo = TokenIdMemoCollector()
        reg.register(token_id_memo)
        body_memo = BodyMemoCollector()
        reg.register(body_memo)
        prefix_memo = PrefixMemoCollector()
        reg.register(prefix_memo)
        key_memos = KeyMemoCollector()
        reg.register(key_memos)
        segment_caches = SegmentCacheCollector()
        reg.register(segment_caches)
        load_trackers = LoadTrackerCollector()
        reg.register(load_trackers)
        parent_hints_dropped = DropsCollector(
            "kvlb_redis_parent_hints_dropped",
            "Parent hints (engine hash to key, what this writer last stored per cache) dropped, oldest "
            "first, past parent_hints_per_cache (65,536 a cache), by key space: a parent whose hint "
            "went costs APPLY one retry, never a wrong key.",
            "space",
        )
        reg.register(parent_hints_dropped)
        discovery_over_cap = DropsCollector(
            "kvlb_discovery_objects_over_cap",
            "Kubernetes objects (pods or EndpointSlices) discovery did not keep, by the bound that "
            "refused them: count (4 x discovery.max_replicas objects kept) or bytes "
            "(discovery.max_object_bytes of kept objects); their replicas are not added.",
            "bound",
        )
        reg.register(discovery_over_cap)
        replica_collectors = _replica_collectors(reg)
        metrics = cls(
            registry=reg,
            removed=RemovedReplicas(replica_collectors.replica_removed_ids_forgotten_total),
            index_tables=tables,
            upstream_connections=connections,
            token_id_memo=token_id_memo,
            body_memo=body_memo,
            prefix_memo=prefix_memo,
            key_memos=key_memos,
            segment_caches=segment_caches,
            load_trackers=load_trackers,
            parent_hints_dropped=parent_hints_dropped,
            discovery_over_cap=discovery_over_cap,
            **_fields(_http_collectors(reg, ttft_slo_s)),
            **_fields(_admission_collectors(reg)),
            **_fields(_upstream_collectors(reg)),
            **_fields(_route_collectors(reg)),
            **_fields(_events_collectors(reg)),
            **_fields(_index_collectors(reg)),
            **_fields(replica_collectors),
            **_fields(_process_collectors(reg)),
            **_fields(_redis_collectors(reg)),
            **_fields(_console_collectors(reg)),
            **_fields(_front_collectors(reg)),
        )
        metrics.slo_ttft_seconds.labels(bucket_label(ttft_slo_s)).set(ttft_slo_s)
        metrics.slo_ttft_target_ratio.set(ttft_target_ratio)
        return metrics
