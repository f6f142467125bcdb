"""Writes kvlb-dashboard.json, the Grafana dashboard of kvlb (run: python deploy/grafana/generate.py).

Edit the panels here, not in the JSON: tests/deploy/test_observability.py checks that the JSON is
this script's output and that every metric a query names is one kvlb exports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvlb-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
R = "$__rate_interval"
SEL = 'job=~"$job"'
REP = 'job=~"$job", replica=~"$replica"'
API = f'{SEL}, endpoint!~"/metrics|/healthz|/readyz|/openapi.json"'

Target = tuple[str, str]  # (PromQL, legend)


def rate(metric: str, by: str = "", sel: str = SEL) -> str:
    """``sum [by (...)] (rate(metric{sel}[$__rate_interval]))``."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{sel}}}[{R}]))"


def ingested(metric: str, by: str) -> str:
    """``max by (...) (rate(metric[...]))``: an event counter of one replica, as its ingester counts it.
    Every worker of ``--workers N`` (and every balancer without Redis) reads the same events and
    counts them again, so a sum would show N times each gap, replay or resync."""
    return f"max by ({by}) (rate({metric}{{{REP}}}[{R}]))"


def load(metric: str, how: str = "sum") -> str:
    """``how by (replica) (metric)``: a replica's load gauge (``kvlb_replica_<name>_<unit>``). A
    worker's own part of the load (in flight, prefill, decode) sums over ``--workers N``; what every
    worker scrapes from the same engine (queue, KV usage) takes the ``max``."""
    return f"{how} by (replica) ({metric}{{{REP}}})"


def quantiles(metric: str) -> list[Target]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{R}])))", f"p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


def pool_p90(metric: str) -> str:
    """The 90th percentile of the histogram ``metric`` per pool (the ``pool`` label: its model)."""
    return f"histogram_quantile(0.9, sum by (le, pool) (rate({metric}_bucket{{{SEL}}}[{R}])))"


PREDICTED = rate("kvlb_route_predicted_cached_tokens_total")
REPORTED = rate("kvlb_route_reported_cached_tokens_total")
TTFT_P90 = (
    f"histogram_quantile(0.9, sum by (le, replica) (rate(kvlb_http_ttft_seconds_bucket{{{REP}}}[{R}])))"
)
RECEIPTS = rate("kvlb_route_receipts_total", "replica", REP)
EXACT = rate("kvlb_route_receipts_exact_total", "replica", REP)
WITHIN = rate("kvlb_route_receipts_within_block_total", "replica", REP)
FAILED_APPLY = rate("kvlb_events_applied_total", sel=f'{SEL}, type="batch", status="error"')
REDIS_WRITES_FAILING = rate("kvlb_redis_errors_total", sel=f'{SEL}, component=~"writer|lease"')

ROWS: list[tuple[str, list[tuple[str, str, list[Target], str]]]] = [
    ("Traffic", [
        ("Requests/s by status", "reqps",
         [(rate("kvlb_http_requests_total", "status", API), "{{status}}")], ""),
        ("Time to first token", "s", quantiles("kvlb_http_ttft_seconds"), ""),
        ("End to end latency", "s", quantiles("kvlb_http_e2e_seconds"), ""),
        ("p90 latency by pool", "s",
         [(pool_p90("kvlb_http_ttft_seconds"), "{{pool}} first token"),
          (pool_p90("kvlb_http_e2e_seconds"), "{{pool}} end to end")],
         "A pool is a configured model: one line each, whatever the replicas."),
        ("In flight", "short", [(f"sum(kvlb_http_inflight_requests{{{SEL}}})", "requests")], ""),
        ("Shed requests/s (admission)", "reqps",
         [(rate("kvlb_admission_shed_total", "reason"), "{{reason}}")], ""),
        ("Retried requests/s", "reqps", [(rate("kvlb_upstream_retries_total", "reason"), "{{reason}}")], ""),
        ("Upstream connections: refused answers, stale resends, waits (/s)", "reqps",
         [(rate("kvlb_upstream_protocol_errors_total", "reason"), "unframeable: {{reason}}"),
          (rate("kvlb_upstream_stale_retries_total"), "stale keep-alive resent"),
          (rate("kvlb_upstream_pool_waits_total"), "waited for a connection")],
         "kvlb's HTTP/1.1 client to replicas. Waits: all upstream.max_connections were in use."),
    ]),
    ("Cache affinity", [
        ("Cached prompt tokens/s: predicted vs reported", "short",
         [(PREDICTED, "predicted by kvlb"), (REPORTED, "reported by engines")],
         "Predicted: overlap the router saw; reported: usage.prompt_tokens_details.cached_tokens."),
        ("Reported / predicted cache hits", "percentunit", [(f"{REPORTED} / {PREDICTED}", "ratio")],
         "Near 1: the index is right. Well below 1: it holds blocks the engines evicted."),
        ("Cached tokens per request", "short",
         [(f"{REPORTED} / {rate('kvlb_route_decisions_total')}", "reported")], ""),
        ("Decision time", "s", quantiles("kvlb_route_decision_seconds"), "Hashing, index match and policy."),
        ("Prediction accuracy per replica", "percentunit",
         [(f"{WITHIN} / {RECEIPTS}", "{{replica}} within one block"),
          (f"{EXACT} / {RECEIPTS}", "{{replica}} exact")],
         "Receipts: the share of responses whose cached_tokens were the predicted blocks (exact) or "
         "within one block of them. Alert KvlbPredictionAccuracyLow under 90% within one block."),
        ("Receipt corrections (blocks/s)", "short",
         [(rate("kvlb_route_receipt_stale_blocks_total"), "stale (predicted, not reported)"),
          (rate("kvlb_index_receipt_drops_blocks_total"), "dropped from the index"),
          (rate("kvlb_index_receipt_learned_blocks_total"), "learned (reported, not predicted)")],
         "What receipts found wrong in the index and what they changed."),
    ]),
    ("Replicas", [
        ("Routed requests/s per replica", "reqps",
         [(rate("kvlb_route_decisions_total", "replica", REP), "{{replica}}")], ""),
        ("Sequences in flight per replica", "short",
         [(load("kvlb_replica_inflight_seqs"), "{{replica}}")], ""),
        ("Pending prefill tokens per replica", "short",
         [(load("kvlb_replica_pending_prefill_tokens"), "{{replica}}")], ""),
        ("Decode blocks per replica", "short", [(load("kvlb_replica_decode_blocks"), "{{replica}}")], ""),
        ("Index blocks per replica", "short",
         [(f"max by (replica) (kvlb_index_replica_blocks{{{REP}}})", "{{replica}}")],
         "Blocks the index says each replica's caches hold; flat at the engine's capacity once full."),
        ("Engine queue and KV usage", "short",
         [(load("kvlb_replica_waiting_seqs", "max"), "{{replica}} waiting"),
          (load("kvlb_replica_kv_usage_ratio", "max"), "{{replica}} kv usage")],
         "Scraped from the engines."),
        ("Healthy replicas", "short",
         [(f"min by (replica) (kvlb_replica_healthy{{{REP}}})", "{{replica}}"),
          (f"max by (pool) (kvlb_pool_routable_replicas{{{SEL}}})", "routable in pool {{pool}}"),
          (f"max by (replica) (kvlb_replica_breaker_open{{{REP}}})", "{{replica}} breaker open")],
         "Alert KvlbNoHealthyReplica when a pool's routable count is 0, KvlbReplicaBreakerOpen when a "
         "replica's breaker stays open 15 minutes."),
        ("TTFT p90 per replica", "s", [(TTFT_P90, "{{replica}}")],
         "Alert KvlbReplicaSlow at a mean over 4 times the fastest replica's, KvlbTtftSloMissed when "
         "over 10% of first tokens take over 2.5 s."),
        ("Scrape errors and refused figures/s", "short", [
            (rate("kvlb_scrape_errors_total", "replica", REP), "{{replica}}"),
            (rate("kvlb_scrape_rejected_values_total", "replica, reason", REP),
             "{{replica}} refused {{reason}}"),
        ], "Refused: figures of a report that parsed but were out of range (read as unknown). Alert "
           "KvlbReplicaLoadFiguresRejected when a replica's go on for 30 minutes."),
        ("Discovery objects left out/s", "short", [
            (f"max by (bound) (rate(kvlb_discovery_objects_over_cap_total{{{SEL}}}[{R}]))",
             "over {{bound}} cap"),
        ], "Kubernetes objects refused for discovery's count or bytes cap: their replicas are not "
           "routed to. Alert KvlbDiscoveryObjectsOverCap."),
    ]),
    ("Index and events", [
        ("Index blocks", "short", [(f"max by (kind) (kvlb_index_blocks{{{SEL}}})", "{{kind}}")],
         "unique, held (per cache) and speculative blocks, per balancer."),
        ("Event lag per replica", "s",
         [(f"max by (replica) (kvlb_events_lag_seconds{{{REP}}})", "{{replica}}")],
         "Engine timestamp of the newest applied batch vs kvlb's clock (SGLang/vLLM)."),
        ("Events applied/s", "short",
         [(rate("kvlb_events_applied_total", "engine, type, status"), "{{engine}} {{type}} {{status}}")], ""),
        ("Sequence gaps and replays", "short", [
            (ingested("kvlb_events_seq_gaps_total", "replica"), "{{replica}} gaps"),
            (ingested("kvlb_events_replays_total", "replica, outcome"), "{{replica}} replay {{outcome}}"),
            (ingested("kvlb_events_drains_total", "replica, outcome"), "{{replica}} drain {{outcome}}"),
        ], "As one ingester counts them (the highest of the workers and balancers that read them)."),
        ("Resyncs and queue overflows", "short", [
            (ingested("kvlb_events_resyncs_total", "replica, reason"), "{{replica}} resync {{reason}}"),
            (ingested("kvlb_events_queue_overflow_total", "replica"), "{{replica}} overflow"),
            (ingested("kvlb_events_shed_runs_total", "replica, cause"), "{{replica}} shed run {{cause}}"),
        ], "As one ingester counts them. Alert KvlbEventResyncStorm over 3 in 10 minutes, "
           "KvlbEventPublisherBadFrames at any shed run of cause frames in an hour."),
        ("Decode errors and skipped events", "short", [
            (ingested("kvlb_events_decode_errors_total", "replica, reason"), "{{replica}} decode {{reason}}"),
            (rate("kvlb_index_skipped_total", "reason"), "skipped {{reason}}"),
        ], "skipped block_size: a replica's block size differs from its events'."),
    ]),
    ("Redis", [
        ("Index writes failing (Redis health)", "short", [
            (FAILED_APPLY, "failed applies/s"),
            (REDIS_WRITES_FAILING, "writer and lease errors/s"),
        ], "Alert KvlbIndexBackendErrors. A Redis outage shows as writer and lease errors: the writer "
           "retries and a balancer without its lease applies nothing, so few applies fail."),
        ("Redis up per balancer", "short", [(f"min by (instance) (kvlb_redis_up{{{SEL}}})", "{{instance}}")],
         "1 while the balancer's last Redis calls succeeded, 0 while they fail; no series on a "
         "balancer without Redis."),
        ("Redis errors/s", "short", [(rate("kvlb_redis_errors_total", "component"), "{{component}}")], ""),
        ("Redis apply time", "s", quantiles("kvlb_redis_apply_seconds"), "One batch, retries included."),
        ("Ingestion leases", "short", [
            (f"sum by (instance) (kvlb_redis_leases_held{{{SEL}}})", "{{instance}} held"),
            (rate("kvlb_redis_lease_events_total", "event"), "{{event}}/s"),
        ], "Each replica's events are ingested by the one balancer holding its lease."),
        ("Mirror lag and fleet members", "short", [
            (f"max by (space) (kvlb_redis_mirror_lag_seconds{{{SEL}}})", "lag s {{space}}"),
            (f"max (kvlb_redis_fleet_members{{{SEL}}})", "balancers"),
        ], "Mirror lag: our clock minus the last applied stream entry's Redis time."),
        ("Mirror rebuilds and stream trims/s", "short", [
            (f"max by (instance, space) (rate(kvlb_redis_mirror_resyncs_total{{{SEL}}}[{R}]))",
             "{{instance}} rebuilds {{space}}"),
            (rate("kvlb_redis_stream_byte_trimmed_entries_total", "space"), "trimmed for bytes {{space}}"),
        ], "Alert KvlbRedisMirrorResyncing at 3 rebuilds of one mirror in 15 minutes; trims for bytes "
           "rising with them: raise redis.stream_max_bytes."),
    ]),
    ("Balancer process", [
        ("CPU per balancer", "percentunit",
         [(f"sum by (instance) (rate(kvlb_process_cpu_seconds_total{{{SEL}}}[{R}]))", "{{instance}}")],
         "Cores used; capacity sizing in docs/operations.md."),
        ("Resident memory", "bytes",
         [(f"max by (instance) (kvlb_process_resident_memory_bytes{{{SEL}}})", "{{instance}}")], ""),
        ("Open fds and asyncio tasks", "short", [
            (f"max by (instance) (kvlb_process_open_fds{{{SEL}}})", "{{instance}} fds"),
            (f"max by (instance) (kvlb_process_asyncio_tasks{{{SEL}}})", "{{instance}} tasks"),
        ], "Flat under steady load; growth means a leak."),
    ]),
]  # fmt: skip


def panel(panel_id: int, title: str, unit: str, targets: list[Target], description: str) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        y += 1
        for position, spec in enumerate(row):
            item = panel(len(panels) + 1, *spec)
            item["gridPos"] = {"h": 8, "w": 12, "x": 12 * (position % 2), "y": y + 8 * (position // 2)}
            panels.append(item)
        y += 8 * ((len(row) + 1) // 2)
    datasource = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
    return {
        "title": "kvlb",
        "uid": "kvlb-overview",
        "description": "KV-cache-aware load balancer: traffic, cache affinity, replicas, index and events.",
        "tags": ["kvlb", "llm", "inference"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {
            "list": [
                datasource,
                variable("job", "label_values(kvlb_http_inflight_requests, job)"),
                variable("replica", 'label_values(kvlb_replica_healthy{job=~"$job"}, replica)'),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
