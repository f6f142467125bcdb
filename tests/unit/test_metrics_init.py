"""Counters read 0 from a replica's registration on, and the known label sets cover what the code counts.

``prometheus_client`` gives a labelled counter no sample until ``labels(...)`` is called, so "no decode
errors yet" would read as "no data". :meth:`balancer.metrics.Metrics.init_replica` creates every known
label set at 0; the sets are checked here against the reasons and outcomes the code actually uses.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import get_args

from prometheus_client import generate_latest

import balancer
from balancer.events import Stored
from balancer.index.hashing import MEMO_CHUNK_BLOCKS, BlockHasher, KeyMemo, pack_tokens
from balancer.index.slots import TableCounters, TableLimits
from balancer.index.table import PrefixTable
from balancer.load.gauge_checks import REASONS, Reason
from balancer.metrics import (
    APPLIED_OUTCOMES,
    DECODE_ERROR_REASONS,
    REMOVED_REPLICA_LABEL,
    REMOVED_REPLICAS_REMEMBERED,
    REPLAY_OUTCOMES,
    REPLAY_POLL_OUTCOMES,
    RESYNC_REASONS,
    Metrics,
)
from balancer.types import EngineHash, ReplicaId

SOURCES = sorted(Path(balancer.__file__).resolve().parent.rglob("*.py"))


def exported(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_a_registered_replica_has_every_counter_at_zero() -> None:
    metrics = Metrics.create()
    assert 'kvlb_events_decode_errors_total{engine="vllm"' not in exported(metrics)  # no sample yet
    metrics.init_replica("r0", "vllm", replays=True)
    metrics.init_replica("t0", "trtllm", replays=False)
    text = exported(metrics)
    for reason in DECODE_ERROR_REASONS:
        assert f'kvlb_events_decode_errors_total{{engine="vllm",reason="{reason}",replica="r0"}} 0.0' in text
        assert (
            f'kvlb_events_decode_errors_total{{engine="trtllm",reason="{reason}",replica="t0"}} 0.0' in text
        )
    for kind, status in APPLIED_OUTCOMES:
        assert f'kvlb_events_applied_total{{engine="vllm",status="{status}",type="{kind}"}} 0.0' in text
    for name in (
        "events_seq_gaps", "events_queue_overflow", "events_oversize", "events_disconnects",
        "scrape_errors", "route_predicted_cached_tokens", "route_reported_cached_tokens",
    ):  # fmt: skip
        assert f'kvlb_{name}_total{{replica="r0"}} 0.0' in text
    for reason in RESYNC_REASONS:
        assert f'kvlb_events_resyncs_total{{reason="{reason}",replica="r0"}} 0.0' in text
    assert 'kvlb_events_shed_total{replica="r0"} 0.0' in text  # a ZMQ source sheds, a TRT-LLM drain waits
    assert 'kvlb_events_shed_total{replica="t0"}' not in text
    for outcome in REPLAY_OUTCOMES:
        assert f'kvlb_events_replays_total{{outcome="{outcome}",replica="r0"}} 0.0' in text
        assert (
            f'kvlb_events_replays_total{{outcome="{outcome}",replica="t0"}}' not in text
        )  # no replay socket


def test_a_registered_replica_has_every_rejected_value_reason_at_zero() -> None:
    """``kvlb_scrape_rejected_values_total{replica, reason}`` (branch h-gauges): every reason the
    range check can give, at 0 from the registration."""
    assert set(REASONS) == set(get_args(Reason))
    metrics = Metrics.create()
    metrics.init_replica("r0", "vllm", replays=True)
    text = exported(metrics)
    for reason in REASONS:
        assert f'kvlb_scrape_rejected_values_total{{reason="{reason}",replica="r0"}} 0.0' in text


def test_init_keeps_counts_already_made() -> None:
    metrics = Metrics.create()
    metrics.events_decode_errors_total.labels("r0", "sglang", "frame").inc(3)
    metrics.init_replica("r0", "sglang", replays=True)
    assert 'kvlb_events_decode_errors_total{engine="sglang",reason="frame",replica="r0"} 3.0' in exported(
        metrics
    )


def test_the_known_decode_error_reasons_cover_every_reason_in_the_code() -> None:
    used = {
        match
        for path in SOURCES
        for match in re.findall(r'EventDecodeError\(\s*"([a-z_]+)"', path.read_text(encoding="utf-8"))
    }
    assert used and used <= set(DECODE_ERROR_REASONS)


def test_the_known_replay_outcomes_cover_the_subscriber() -> None:
    """The outcomes the ZMQ source's replays count (``sources/zmq_replay_merge.py``, read as text)
    are the ones :meth:`Metrics.init_replica` sets at 0, and the other way round."""
    text = (Path(balancer.__file__).resolve().parent / "sources" / "zmq_replay_merge.py").read_text(
        encoding="utf-8"
    )
    polls = set(
        re.findall(r'"([a-z_]+)" if found else \("([a-z_]+)" if complete else "([a-z_]+)"\)', text)[0]
    )
    assigned = set(re.findall(r'outcome = "([a-z_]+)"', text))
    assert polls | {"abandoned"} == set(REPLAY_POLL_OUTCOMES)  # abandoned: assigned after it
    assert assigned | polls == set(REPLAY_OUTCOMES) | set(REPLAY_POLL_OUTCOMES)


def test_every_table_counter_is_exported_per_key_space_at_scrape_time() -> None:
    """The prefix table's counters (evictions, overflows of its bounded memories, gap recovery) are
    read from the tables when scraped, one sample per key space; none before a source is set."""
    metrics = Metrics.create()
    assert "kvlb_index_table_evicted_blocks_total{" not in exported(metrics)
    hasher = BlockHasher("m", 2)
    table = PrefixTable(hasher, TableLimits(capacity_blocks=4, max_speculative_keys=1))
    metrics.index_tables.source = lambda: {"m/2/plain": table.counters}
    text = exported(metrics)
    for counter in fields(TableCounters):
        assert f'kvlb_index_table_{counter.name}_total{{space="m/2/plain"}} 0.0' in text
    tokens = list(range(1, 13))  # six blocks into a table of four
    engine = tuple(EngineHash(h) for h in range(6))
    table.apply(ReplicaId("a"), [Stored(0, None, engine, pack_tokens(tokens), 2)], 0.0)
    table.add_speculative(ReplicaId("b"), hasher.request_keys(list(range(50, 56))), 5.0, 0.0)
    assert table.counters.evicted_blocks > 0 and table.counters.speculative_overflow > 0
    text = exported(metrics)
    evicted, overflow = table.counters.evicted_blocks, table.counters.speculative_overflow
    assert f'kvlb_index_table_evicted_blocks_total{{space="m/2/plain"}} {float(evicted)}' in text
    assert f'kvlb_index_table_speculative_overflow_total{{space="m/2/plain"}} {float(overflow)}' in text


def test_every_key_memo_counter_is_exported_per_key_space_at_scrape_time() -> None:
    """The key memo's counters (runs found, hashed, forgotten; whole prompts forgotten) are read from
    the memos when scraped, one sample per key space; none before a source is set."""
    metrics = Metrics.create()
    assert "kvlb_route_key_memo_hits_total{" not in exported(metrics)
    hasher = BlockHasher("m", 2)
    memo = KeyMemo(1)
    metrics.key_memos.source = lambda: {"m/2/plain": memo}
    text = exported(metrics)
    for name in ("hits", "misses", "evictions", "prompt_evictions"):
        assert f'kvlb_route_key_memo_{name}_total{{space="m/2/plain"}} 0.0' in text
    run = 2 * MEMO_CHUNK_BLOCKS  # one whole run of blocks
    for first in (1, 10_000, 1):  # a run, another (the first is forgotten), the first again
        hasher.request_keys(list(range(first, first + run)), memo=memo)
    assert memo.misses == 3 and memo.evictions == 2
    text = exported(metrics)
    assert f'kvlb_route_key_memo_misses_total{{space="m/2/plain"}} {float(memo.misses)}' in text
    assert f'kvlb_route_key_memo_evictions_total{{space="m/2/plain"}} {float(memo.evictions)}' in text


def test_a_forgotten_child_is_made_again_after_its_removal() -> None:
    """``Children`` memoises ``labels()``; a replica's removal drops the gauge's child and forgets it
    there, so the next update lands in a child the registry exports again (not a detached one)."""
    metrics = Metrics.create()
    gauge = metrics.prediction_accuracy_ratio
    metrics.children.of(gauge, "r1").set(0.5)
    assert metrics.children.of(gauge, "r1") is metrics.children.of(gauge, "r1")
    assert 'kvlb_route_prediction_accuracy_ratio{replica="r1"} 0.5' in exported(metrics)
    metrics.children.forget(gauge, "r1")
    gauge.remove("r1")
    assert 'replica="r1"' not in exported(metrics).split("kvlb_route_prediction_accuracy_ratio", 1)[1]
    metrics.children.of(gauge, "r1").set(0.25)
    assert 'kvlb_route_prediction_accuracy_ratio{replica="r1"} 0.25' in exported(metrics)


def test_redis_up_exists_only_once_the_fleet_sets_it() -> None:
    """A balancer without Redis has no ``kvlb_redis_up`` (until 2026-12-01 it read 0, an outage)."""
    metrics = Metrics.create()
    assert "kvlb_redis_up" not in exported(metrics)
    metrics.set_redis_up(False)
    assert "kvlb_redis_up 0.0" in exported(metrics)
    metrics.set_redis_up(True)
    metrics.set_redis_up(True)
    assert "kvlb_redis_up 1.0" in exported(metrics)


def test_a_removed_replica_labels_late_requests_as_removed_within_a_bound() -> None:
    """After ``forget_replica`` a late request's series take ``(removed)``, not the id (which would
    bring the series back); an id added again is its own label again; the list keeps the last
    ``REMOVED_REPLICAS_REMEMBERED`` ids only."""
    metrics = Metrics.create()
    metrics.init_replica("pod-a", "sglang", replays=True)
    assert metrics.replica_label("pod-a") == "pod-a"
    metrics.forget_replica("pod-a")
    label = metrics.replica_label("pod-a")
    assert label == REMOVED_REPLICA_LABEL
    metrics.children.of(metrics.requests_total, "/v1/completions", "200", label, "cost").inc()
    text = generate_latest(metrics.registry).decode()
    assert 'replica="pod-a"' not in text and 'replica="(removed)"' in text
    metrics.init_replica("pod-a", "sglang", replays=True)  # the same id added again
    assert metrics.replica_label("pod-a") == "pod-a"
    for i in range(REMOVED_REPLICAS_REMEMBERED + 1):
        metrics.forget_replica(f"pod-{i}")
    assert len(metrics.removed) == REMOVED_REPLICAS_REMEMBERED
    assert metrics.replica_label("pod-0") == "pod-0"  # the oldest went
    assert metrics.replica_label(f"pod-{REMOVED_REPLICAS_REMEMBERED}") == REMOVED_REPLICA_LABEL


def test_removed_replica_ids_forgotten_at_the_cap_are_counted() -> None:
    """The removed ids past ``REMOVED_REPLICAS_REMEMBERED`` are dropped oldest first, and each drop is
    counted in ``kvlb_replica_removed_ids_forgotten_total`` (it was counted nowhere)."""
    metrics = Metrics.create()
    forgotten = "kvlb_replica_removed_ids_forgotten_total"
    for i in range(REMOVED_REPLICAS_REMEMBERED):
        metrics.forget_replica(f"pod-{i}")
    assert metrics.registry.get_sample_value(forgotten) == 0
    for i in range(REMOVED_REPLICAS_REMEMBERED, REMOVED_REPLICAS_REMEMBERED + 3):
        metrics.forget_replica(f"pod-{i}")
    assert metrics.registry.get_sample_value(forgotten) == 3
    assert f"{forgotten} 3.0" in exported(metrics)
    assert (
        metrics.replica_label("pod-2") == "pod-2" and metrics.replica_label("pod-3") == REMOVED_REPLICA_LABEL
    )
