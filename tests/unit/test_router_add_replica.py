"""PoolRouter.add_replica while the pool routes (discovery): the load tracker and its data stay."""

from __future__ import annotations

from balancer.load.tracker import EngineStats
from balancer.routing.router import PoolRouter
from balancer.types import ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def test_a_new_key_space_keeps_the_tracker_and_other_replicas_load() -> None:
    router = PoolRouter("m")
    router.add_replica(A, 16, "plain")
    tracker = router.tracker()
    observe = tracker.observe  # what a running scraper holds
    assert tracker.reserve("req-1", A, prefill_tokens=64, decode_blocks=5, now=1.0)
    assert observe(A, EngineStats(running_reqs=3, waiting_reqs=2, kv_usage=0.5), 1.0)

    router.add_replica(B, 8, "plain")  # a new, smaller block size: a new key space

    assert router.tracker() is tracker
    load = router.tracker().snapshot(2.0).of(A)
    assert (load.pending_prefill_seqs, load.pending_prefill_tokens) == (1, 64)
    assert (load.running_reqs, load.waiting_reqs, load.kv_usage) == (3, 2, 0.5)
    assert router.tracker().config.block_size_tokens == 8 == router.reference_block_size
    assert load.pending_prefill_blocks == 64 / 8
    # the request reserved before the change still releases normally
    assert router.tracker().release("req-1", 3.0)
    assert router.tracker().snapshot(3.0).of(A).in_flight_seqs == 0


def test_same_or_larger_block_size_changes_nothing_and_removal_forgets_only_that_replica() -> None:
    router = PoolRouter("m")
    router.add_replica(A, 16, "plain")
    tracker = router.tracker()
    tracker.reserve("req-a", A, 32, 2, 1.0)
    router.add_replica(B, 16, "plain")
    router.add_replica(C, 32, "trtllm")
    assert router.tracker() is tracker and tracker.config.block_size_tokens == 16
    tracker.reserve("req-c", C, 32, 2, 1.0)
    router.remove_replica(C)
    snapshot = tracker.snapshot(2.0)
    assert snapshot.of(A).in_flight_seqs == 1 and snapshot.of(C).in_flight_seqs == 0
    assert C not in router.space_of and C not in router.spaces[(32, "trtllm")].replicas
