"""Prometheus collectors for every kvlb subsystem, bound to an injected registry (pure).

Names follow ``kvlb_<subsystem>_<name>_<unit>``. One :class:`Metrics` is built by the composition root
(``app.py``) and passed down; tests build their own with a fresh ``CollectorRegistry``, so there is no
global state to reset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DECISION_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3)


@dataclass(frozen=True, slots=True)
class Metrics:
    """Every collector kvlb exports. Build with :meth:`create`."""

    registry: CollectorRegistry
    # http / requests
    requests_total: Counter
    ttft_seconds: Histogram
    e2e_seconds: Histogram
    shed_total: Counter
    retries_total: Counter
    inflight_requests: Gauge
    # routing
    route_decision_seconds: Histogram
    route_decisions_total: Counter
    predicted_cached_tokens_total: Counter
    reported_cached_tokens_total: Counter
    # events
    events_applied_total: Counter
    events_decode_errors_total: Counter
    events_seq_gaps_total: Counter
    events_replays_total: Counter
    events_resyncs_total: Counter
    events_queue_overflow_total: Counter
    events_oversize_total: Counter
    events_lag_seconds: Gauge
    # index
    index_blocks: Gauge
    index_replica_blocks: Gauge
    index_skipped_total: Counter
    # load / replicas
    replica_load: Gauge
    replica_healthy: Gauge
    scrape_errors_total: Counter
    # process
    process_asyncio_tasks: Gauge
    # redis fleet (only moves when redis.url is set)
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
    redis_mirror_partial: Gauge
    redis_replicas_dropped_total: Counter
    redis_policy_updates_total: Counter
    redis_snapshots_total: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> Metrics:
        reg = registry if registry is not None else CollectorRegistry()
        # kvlb_process_{cpu_seconds_total,resident_memory_bytes,open_fds,...}: capacity and leaks.
        ProcessCollector(namespace="kvlb", registry=reg)
        return cls(
            registry=reg,
            requests_total=Counter(
                "kvlb_http_requests_total",
                "Requests answered, by endpoint, status code, replica and policy.",
                ["endpoint", "status", "replica", "policy"],
                registry=reg,
            ),
            ttft_seconds=Histogram(
                "kvlb_http_ttft_seconds",
                "Time from request arrival to the first upstream byte.",
                ["replica", "policy"],
                buckets=_LATENCY_BUCKETS_S,
                registry=reg,
            ),
            e2e_seconds=Histogram(
                "kvlb_http_e2e_seconds",
                "Time from request arrival to the last byte sent to the client.",
                ["replica", "policy"],
                buckets=_LATENCY_BUCKETS_S,
                registry=reg,
            ),
            shed_total=Counter(
                "kvlb_admission_shed_total",
                "Requests refused by admission control (429/503), by reason.",
                ["reason"],
                registry=reg,
            ),
            retries_total=Counter(
                "kvlb_upstream_retries_total",
                "Requests retried on another replica before the first byte, by reason.",
                ["reason"],
                registry=reg,
            ),
            inflight_requests=Gauge(
                "kvlb_http_inflight_requests", "Requests being served now.", registry=reg
            ),
            route_decision_seconds=Histogram(
                "kvlb_route_decision_seconds",
                "Time to choose a replica (hashing, index match, policy).",
                buckets=_DECISION_BUCKETS_S,
                registry=reg,
            ),
            route_decisions_total=Counter(
                "kvlb_route_decisions_total",
                "Routing decisions, by policy and chosen replica.",
                ["policy", "replica"],
                registry=reg,
            ),
            predicted_cached_tokens_total=Counter(
                "kvlb_route_predicted_cached_tokens_total",
                "Prompt tokens the router predicted to be cached on the chosen replica.",
                ["replica"],
                registry=reg,
            ),
            reported_cached_tokens_total=Counter(
                "kvlb_route_reported_cached_tokens_total",
                "Prompt tokens the replica reported as cached (usage.prompt_tokens_details.cached_tokens).",
                ["replica"],
                registry=reg,
            ),
            events_applied_total=Counter(
                "kvlb_events_applied_total",
                "KV events applied to the index, by engine, event type and status.",
                ["engine", "type", "status"],
                registry=reg,
            ),
            events_decode_errors_total=Counter(
                "kvlb_events_decode_errors_total",
                "Engine messages or events that could not be decoded, by engine and reason.",
                ["engine", "reason"],
                registry=reg,
            ),
            events_seq_gaps_total=Counter(
                "kvlb_events_seq_gaps_total",
                "Gaps seen in a replica's event sequence (ZMQ seq or TRT-LLM event_id).",
                ["replica"],
                registry=reg,
            ),
            events_replays_total=Counter(
                "kvlb_events_replays_total",
                "Replay requests to an engine's replay socket, by outcome (filled, partial, failed, empty).",
                ["replica", "outcome"],
                registry=reg,
            ),
            events_resyncs_total=Counter(
                "kvlb_events_resyncs_total",
                "Times a replica's index state was cleared to resynchronise, by reason.",
                ["replica", "reason"],
                registry=reg,
            ),
            events_queue_overflow_total=Counter(
                "kvlb_events_queue_overflow_total",
                "Event queue overflows (the replica is cleared and resynchronised).",
                ["replica"],
                registry=reg,
            ),
            events_oversize_total=Counter(
                "kvlb_events_oversize_total",
                "Events dropped for carrying more than limits.max_event_blocks blocks (the rank resyncs).",
                ["replica"],
                registry=reg,
            ),
            events_lag_seconds=Gauge(
                "kvlb_events_lag_seconds",
                "Engine timestamp of the last applied batch vs our clock (wall time, may be skewed).",
                ["replica"],
                registry=reg,
            ),
            index_blocks=Gauge(
                "kvlb_index_blocks",
                "Blocks in the prefix index (kind=unique|held|speculative).",
                ["kind"],
                registry=reg,
            ),
            index_replica_blocks=Gauge(
                "kvlb_index_replica_blocks",
                "Blocks the index says a replica's caches hold (all ranks and key spaces), set at "
                "scrape time; compare with the engine's own cache size.",
                ["replica"],
                registry=reg,
            ),
            index_skipped_total=Counter(
                "kvlb_index_skipped_total",
                "Events the index skipped, by reason (unknown_parent, unknown_removal, block_size).",
                ["reason"],
                registry=reg,
            ),
            replica_load=Gauge(
                "kvlb_replica_load",
                "Per-replica load (kind=inflight|pending_prefill_tokens|decode_blocks|waiting|kv_usage).",
                ["replica", "kind"],
                registry=reg,
            ),
            replica_healthy=Gauge(
                "kvlb_replica_healthy",
                "1 when the replica is healthy and routable, else 0.",
                ["replica"],
                registry=reg,
            ),
            scrape_errors_total=Counter(
                "kvlb_scrape_errors_total",
                "Failed engine metric scrapes, by replica.",
                ["replica"],
                registry=reg,
            ),
            process_asyncio_tasks=Gauge(
                "kvlb_process_asyncio_tasks",
                "Tasks alive on kvlb's event loop, counted at scrape time (the scrape's own included); "
                "flat under steady load, growth means a leak.",
                registry=reg,
            ),
            **_redis_collectors(reg),
        )


class _RedisCollectors(TypedDict):
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
    redis_mirror_partial: Gauge
    redis_replicas_dropped_total: Counter
    redis_policy_updates_total: Counter
    redis_snapshots_total: Counter


def _redis_collectors(reg: CollectorRegistry) -> _RedisCollectors:
    """The ``kvlb_redis_*`` collectors of the fleet mode (:mod:`balancer.fleet`)."""
    return {
        "redis_up": Gauge(
            "kvlb_redis_up", "1 while this balancer's last Redis calls succeeded, else 0.", registry=reg
        ),
        "redis_errors_total": Counter(
            "kvlb_redis_errors_total",
            "Failed Redis calls, by component (writer, mirror, lease, policy, snapshot).",
            ["component"],
            registry=reg,
        ),
        "redis_apply_seconds": Histogram(
            "kvlb_redis_apply_seconds",
            "Time of one event batch applied to the Redis index (retries included).",
            buckets=_LATENCY_BUCKETS_S,
            registry=reg,
        ),
        "redis_apply_retries_total": Counter(
            "kvlb_redis_apply_retries_total",
            "Event batch applies retried after a Redis error (the batch waits, bounded by the queue).",
            registry=reg,
        ),
        "redis_stale_writes_total": Counter(
            "kvlb_redis_stale_writes_total",
            "Writes refused because the replica's generation moved on (another ingester or a drop).",
            registry=reg,
        ),
        "redis_leases_held": Gauge(
            "kvlb_redis_leases_held", "Replica ingestion leases this balancer holds.", registry=reg
        ),
        "redis_lease_events_total": Counter(
            "kvlb_redis_lease_events_total",
            "Ingestion lease changes of this balancer (acquired, released, lost, retaken after expiring).",
            ["event"],
            registry=reg,
        ),
        "redis_fleet_members": Gauge(
            "kvlb_redis_fleet_members", "Live balancers seen in Redis (heartbeats).", registry=reg
        ),
        "redis_mirror_lag_seconds": Gauge(
            "kvlb_redis_mirror_lag_seconds",
            "Our wall clock minus the Redis time of the last stream entry the mirror applied.",
            ["space"],
            registry=reg,
        ),
        "redis_mirror_entries_total": Counter(
            "kvlb_redis_mirror_entries_total",
            "Stream entries applied to the local mirror, by key space.",
            ["space"],
            registry=reg,
        ),
        "redis_mirror_resyncs_total": Counter(
            "kvlb_redis_mirror_resyncs_total",
            "Mirror rebuilds after stream entries went missing, by key space.",
            ["space"],
            registry=reg,
        ),
        "redis_mirror_skipped_entries_total": Counter(
            "kvlb_redis_mirror_skipped_entries_total",
            "Stream entries the mirror could not decode and skipped (one with an entry number also"
            " rebuilds the mirror), by key space.",
            ["space"],
            registry=reg,
        ),
        "redis_wrongtype_keys_total": Counter(
            "kvlb_redis_wrongtype_keys_total",
            "Keys of kvlb's namespace found holding another type (garbage written over them), deleted"
            " and rebuilt by this balancer's next write.",
            registry=reg,
        ),
        "redis_mirror_partial": Gauge(
            "kvlb_redis_mirror_partial",
            "1 when the mirror was built from a trimmed stream (older blocks unknown), by key space.",
            ["space"],
            registry=reg,
        ),
        "redis_replicas_dropped_total": Counter(
            "kvlb_redis_replicas_dropped_total",
            "Replicas dropped fleet-wide after no events and failed health beyond the timeout.",
            ["replica"],
            registry=reg,
        ),
        "redis_policy_updates_total": Counter(
            "kvlb_redis_policy_updates_total",
            "Policy changes written to Redis (source=local) or adopted from it (source=remote).",
            ["source"],
            registry=reg,
        ),
        "redis_snapshots_total": Counter(
            "kvlb_redis_snapshots_total",
            "Mirror table snapshots written to or loaded from Redis (op=write|load).",
            ["op"],
            registry=reg,
        ),
    }
