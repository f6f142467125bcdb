"""Receipts: the engine's cached_tokens against the route's prediction, and the index corrections."""

from __future__ import annotations

import random

import pytest

from balancer.events import Stored
from balancer.index.hashing import pack_tokens
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.receipts import ComputedMarks, ReceiptBook, read_receipt
from balancer.routing.router import (
    PoolRequest,
    PoolRouter,
    RouteLimits,
    RoutePlan,
    computed_blocks,
    reusable_blocks,
)
from balancer.sources.base import stalled_stream_hint
from balancer.types import BlockKey, Decision, EngineHash, ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")
BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS + 3))  # 8 full blocks and 3 tokens
KEYS = tuple(BlockKey(k) for k in range(100, 108))


def stored(tokens: list[int], blocks: int, first_hash: int = 1) -> Stored:
    return Stored(
        dp_rank=0,
        parent=None,
        engine_hashes=tuple(EngineHash(first_hash + i) for i in range(blocks)),
        tokens=pack_tokens(tokens[: blocks * BS]),
        block_size=BS,
    )


def test_read_receipt_names_the_keys_either_side_disagrees_on() -> None:
    exact = read_receipt(A, KEYS, BS, 5 * BS, 5 * BS + 7)  # partial blocks do not count
    assert (exact.error_blocks, exact.exact, exact.within_one_block, exact.stale, exact.unseen) == (
        0,
        True,
        True,
        (),
        (),
    )
    fewer = read_receipt(A, KEYS, BS, 6 * BS, 2 * BS)
    assert (fewer.error_blocks, fewer.stale, fewer.unseen) == (-4, KEYS[2:6], ())
    assert not fewer.within_one_block
    more = read_receipt(A, KEYS, BS, BS, 3 * BS)
    assert (more.error_blocks, more.stale, more.unseen) == (2, (), KEYS[1:3])
    beyond = read_receipt(A, KEYS, BS, 0, 20 * BS)  # never names keys the request does not have
    assert beyond.unseen == KEYS and beyond.reported_blocks == 20
    with pytest.raises(ValueError):
        read_receipt(A, KEYS, 0, 0, 0)


def test_receipt_book_is_a_bounded_window_per_replica() -> None:
    book = ReceiptBook(window=4)
    for predicted, reported in [(9, 0), (2, 2), (3, 4), (5, 5), (1, 1)]:
        book.record(read_receipt(A, KEYS, BS, predicted * BS, reported * BS))
    stats = book.stats(A)  # the first (-9) left the window
    assert (stats.receipts, stats.exact, stats.within_one_block) == (4, 3, 4)
    assert stats.accuracy == 0.75 and stats.mean_error_blocks == 0.25
    assert book.stats(B).accuracy is None
    book.forget(A)
    assert book.stats(A).receipts == 0


def test_receipt_book_running_totals_match_the_window_recounted() -> None:
    """The totals kept as errors enter and leave equal a recount of the window, at every step."""
    rng = random.Random(7)
    book = ReceiptBook(window=5)
    window: list[int] = []
    for _ in range(200):
        predicted, reported = rng.randrange(4), rng.randrange(4)
        book.record(read_receipt(A, KEYS, BS, predicted * BS, reported * BS))
        window = [*window, reported - predicted][-5:]
        stats = book.stats(A)
        assert stats.receipts == len(window)
        assert stats.exact == sum(1 for e in window if e == 0)
        assert stats.within_one_block == sum(1 for e in window if -1 <= e <= 1)
        assert stats.mean_error_blocks == sum(window) / len(window)
        assert book.accuracy(A) == stats.accuracy  # the shortcut dispatch reads on every receipt
    assert book.accuracy(B) is None
    book.forget(A)
    assert book.accuracy(A) is None


@pytest.mark.parametrize(
    ("tokens", "mode", "blocks"),
    [
        (128, "plain", 7),
        (129, "plain", 8),
        (1, "plain", 0),
        (0, "plain", 0),
        (129, "trtllm", 8),
        (130, "bigram", 8),
    ],
)
def test_reusable_blocks_leave_the_last_token_to_compute(tokens: int, mode: str, blocks: int) -> None:
    assert reusable_blocks(tokens, BS, mode) == blocks  # type: ignore[arg-type]


def test_prediction_of_a_block_aligned_prompt_held_whole_is_one_block_short() -> None:
    router = PoolRouter("m")
    router.add_replica(A, BS, "plain")
    prompt = PROMPT[: 8 * BS]
    router.space_of[A].table.apply(A, [stored(prompt, 8)], now=0.0)
    plan = router.plan(prompt, [A], make_policy("cost"), PolicyWeights(), router.rng, now=1.0)
    assert plan.decision.overlap_blocks == 8 and plan.cached_tokens == 7 * BS and plan.block_size == BS


DROPS = RouteLimits(speculative_ttl_s=2.0, pending_ttl_s=30.0, receipt_drops=True)


def test_fewer_reported_drops_the_stale_holdings_not_yet_stored_again() -> None:
    router = PoolRouter("m", route_limits=DROPS)
    router.add_replica(A, BS, "plain")
    table = router.space_of[A].table
    table.apply(A, [stored(PROMPT, 8)], now=0.0)  # the engine evicts behind our back afterwards
    lease = router.route(PoolRequest(PROMPT, make_policy("cost"), PolicyWeights(), "r"), 1.0)
    assert lease.plan.cached_tokens == 8 * BS
    settled = lease.settle_receipt(3 * BS, now=2.0)  # the engine had 3 blocks
    assert settled.receipt.error_blocks == -5 and len(settled.receipt.stale) == 5
    assert settled.dropped_blocks == 5
    assert table.held_blocks(A) == 3
    keys = list(lease.plan.keys)
    assert table.match(keys, [A], 2.0, True).of(A) == 3  # real holdings: what the engine reported
    assert table.match(keys, [A], 2.0).of(A) == 8  # the request's own recomputation, speculated
    assert router.receipts.stats(A).exact == 0
    # the engine's store of the recomputed blocks comes later: held again, confirmed
    table.apply(A, [stored(PROMPT, 8)], now=2.5)
    assert table.match(keys, [A], 100.0).of(A) == 8


def test_fewer_reported_keeps_blocks_the_engine_stored_again_since_the_routing() -> None:
    router = PoolRouter("m", route_limits=DROPS)
    router.add_replica(A, BS, "plain")
    table = router.space_of[A].table
    table.apply(A, [stored(PROMPT, 8)], now=0.0)
    lease = router.route(PoolRequest(PROMPT, make_policy("cost"), PolicyWeights(), "r"), 1.0)
    table.apply(A, [stored(PROMPT, 8)], now=1.5)  # the request's own blocks, stored before the receipt
    settled = lease.settle_receipt(3 * BS, now=2.0)
    assert len(settled.receipt.stale) == 5 and settled.dropped_blocks == 0
    assert table.match(list(lease.plan.keys), [A], 100.0).of(A) == 8


def test_more_reported_learns_the_prefix_as_speculative_entries() -> None:
    router = PoolRouter("m", route_limits=RouteLimits(speculative_ttl_s=2.0, pending_ttl_s=2.0))
    router.add_replica(A, BS, "plain")
    router.add_replica(B, BS, "plain")
    table = router.space_of[A].table
    request = PoolRequest(PROMPT, make_policy("round_robin"), PolicyWeights(), "r")
    lease = router.route(request, 0.0)
    replica = lease.replica
    lease.release(0.1)
    settled = lease.settle_receipt(6 * BS, now=10.0)  # its own speculative entries expired long ago
    assert settled.receipt.error_blocks == 6 and settled.learned_blocks == 6
    keys = list(lease.plan.keys)
    assert table.match(keys, [replica], 11.0).of(replica) == 6
    assert table.match(keys, [replica], 12.0).of(replica) == 0  # speculative_ttl_s later, unconfirmed
    assert router.receipts.stats(replica).receipts == 1


def test_n_above_one_reads_a_report_above_the_prediction_as_a_siblings_hit() -> None:
    """``n: 2`` on a prompt the engine never saw: real vLLM 0.32 reported 224 of 241 tokens cached
    (its second sequence found the blocks the first had just computed); not an index miss."""
    router = PoolRouter("m", route_limits=RouteLimits(speculative_ttl_s=2.0, pending_ttl_s=30.0))
    router.add_replica(A, BS, "plain")
    table = router.space_of[A].table
    request = PoolRequest(PROMPT, make_policy("cost"), PolicyWeights(), "r", max_tokens=4, sequences=2)
    lease = router.route(request, 0.0)
    assert lease.plan.cached_tokens == 0 and lease.plan.sequences == 2
    settled = lease.settle_receipt(8 * BS, now=1.0)
    assert settled.receipt.exact and settled.receipt.unseen == () and settled.learned_blocks == 0
    assert router.receipts.stats(A).exact == 1
    assert computed_blocks(lease.plan, settled.receipt.reported_blocks) == 8  # the first one computed them
    # fewer than predicted is still stale: a later sequence finds at least what the first one did
    table.apply(A, [stored(PROMPT, 8)], now=2.0)
    lease = router.route(request, 3.0)
    assert lease.plan.cached_tokens == 8 * BS
    settled = lease.settle_receipt(3 * BS, now=4.0)
    assert settled.receipt.error_blocks == -5 and len(settled.receipt.stale) == 5
    assert table.held_blocks(A) == 8


def test_receipts_without_speculation_learn_nothing_and_drop_nothing() -> None:
    router = PoolRouter("m", route_limits=RouteLimits(speculative_ttl_s=0.0, receipt_drops=True))
    router.add_replica(A, BS, "plain")
    table = router.space_of[A].table
    table.apply(A, [stored(PROMPT, 8)], now=0.0)
    lease = router.route(PoolRequest(PROMPT, make_policy("cost"), PolicyWeights(), "r"), 1.0)
    settled = lease.settle_receipt(0, now=2.0)
    assert (settled.dropped_blocks, settled.learned_blocks, table.held_blocks(A)) == (0, 0, 8)


def test_drops_are_off_by_default_receipts_only_measure_and_learn() -> None:
    router = PoolRouter("m", route_limits=RouteLimits(speculative_ttl_s=2.0, pending_ttl_s=30.0))
    router.add_replica(A, BS, "plain")
    table = router.space_of[A].table
    table.apply(A, [stored(PROMPT, 8)], now=0.0)
    lease = router.route(PoolRequest(PROMPT, make_policy("cost"), PolicyWeights(), "r"), 1.0)
    settled = lease.settle_receipt(3 * BS, now=2.0)
    assert (settled.receipt.error_blocks, len(settled.receipt.stale), settled.dropped_blocks) == (-5, 5, 0)
    assert table.held_blocks(A) == 8


def test_admin_replicas_table_shows_accuracy_lag_and_last_resync() -> None:
    from balancer.cli.command import replicas_table

    views = [
        {
            "id": "sim-0",
            "routable": True,
            "inflight": 2,
            "index": {"blocks": 120},
            "prediction": {"receipts": 256, "accuracy": 0.98828125, "within_one_block": 1.0},
            "events": {"last_lag_s": 0.004, "last_resync_age_s": None},
        },
        {
            "id": "sim-1",
            "routable": False,
            "inflight": 0,
            "index": {"blocks": 0},
            "prediction": {},
            "events": None,
        },
        {
            "id": "sim-2",
            "routable": False,
            "health": {"probe_ok": True, "draining": True, "breaker": "closed"},
        },
        {
            "id": "sim-3",
            "routable": False,
            "health": {"probe_ok": False, "draining": False, "breaker": "open"},
        },
        {
            "id": "sim-4",
            "routable": False,
            "health": {"probe_ok": True, "draining": False, "breaker": "open"},
        },
    ]
    lines = replicas_table(views).splitlines()
    assert lines[0].split() == [
        "replica", "routable", "inflight", "blocks", "receipts", "exact", "within_1", "lag_s", "resync_age_s",
        "events",
    ]  # fmt: skip
    assert lines[1].split() == ["sim-0", "yes", "2", "120", "256", "0.988", "1.000", "0.004", "-", "-"]
    assert lines[2].split() == ["sim-1", "no", "0", "0", "-", "-", "-", "-", "-", "-"]
    # why not (the SRE walk of 2026-12-01: a drained replica showed "no" like a dead one)
    assert [line.split()[1] for line in lines[3:]] == ["no:draining", "no:probe-failing", "no:breaker-open"]


def test_admin_replicas_table_says_what_is_wrong_with_the_event_streams() -> None:
    """The engine walk of 2026-12-01 (h-enginewalk): a block size other than the engine's, or an
    events endpoint with no publisher, showed nowhere in the table; the sources' ``last_error``
    now makes the ``events`` column and one line per source under the table, with its fix."""
    from balancer.cli.command import replicas_table

    def source(connected: bool | None, error: str | None, age_s: float | None) -> dict[str, object]:
        return {
            "endpoint": "tcp://127.0.0.1:5557",
            "connected": connected,
            "last_error": error,
            "last_error_age_s": age_s,
        }

    size = "1 malformed event skipped in one message, first: event 0: block_size 32 != 16"
    views = [
        {"id": "sim-0", "routable": True, "events": {"sources": [source(True, None, None)]}},
        {"id": "sim-1", "routable": True, "events": {"sources": [source(True, size, 3.0)]}},
        {"id": "sim-2", "routable": True, "events": {"sources": [source(False, "nothing accepts", 0.1)]}},
        {"id": "sim-3", "routable": True, "events": {"sources": [source(True, "old trouble", 900.0)]}},
        {
            "id": "sim-4",
            "routable": True,
            "events": {"sources": [source(True, None, None)], "hint": "no batch"},
        },
    ]
    lines = replicas_table(views).splitlines()
    assert [line.split()[-1] for line in lines[1:6]] == ["ok", "error", "not-connected", "ok", "silent"]
    assert lines[6:] == [
        f"sim-1 tcp://127.0.0.1:5557: {size} (3 s ago)",
        "sim-2 tcp://127.0.0.1:5557: nothing accepts (0 s ago)",
        "sim-3 tcp://127.0.0.1:5557: old trouble (900 s ago)",
        "sim-4 events: no batch",
    ]


def test_computed_blocks_count_what_the_engine_stored_anew_never_the_last_tokens_block() -> None:
    """``kvlb_route_computed_prompt_blocks_total``'s figure (``KvlbReplicaEventsStopped`` expects
    events for it): a canary's block-aligned prompt found whole computes nothing new, though its
    last block is recomputed; a new prompt computes its reusable blocks less the cached ones."""

    def plan(prompt_tokens: int, keys: int) -> RoutePlan:
        decision = Decision(ReplicaId("r0"), "cost", 0, keys, 0, ())
        return RoutePlan(decision, prompt_tokens, 0, tuple(BlockKey(k) for k in range(keys)), 1, 16)

    assert computed_blocks(plan(64, 4), 3) == 0  # aligned canary: 3 reusable, 3 reported
    assert computed_blocks(plan(64, 4), 0) == 3  # new: the last token's block is not counted
    assert computed_blocks(plan(70, 4), 1) == 3
    assert computed_blocks(plan(70, 4), 4) == 0  # more reported than reusable: none
    assert computed_blocks(plan(10, 0), 0) == 0


def test_computed_marks_find_the_first_decision_after_a_batch_within_one_spacing() -> None:
    """Marks of requests that computed new blocks: a new one once the newest is a spacing old, the
    newest 16 kept (so they span 15 spacings); ``since`` counts the marks after a batch."""
    marks = ComputedMarks()
    r = ReplicaId("r0")
    assert marks.since(r, 0.0) is None
    marks.add(r, 10.0, 0, 1.0)  # nothing computed: no mark
    assert marks.since(r, 0.0) is None
    for k in range(100):  # a request every 0.25 s from t=10 to 34.75, 3 blocks each: a mark a second
        marks.add(r, 10.0 + 0.25 * k, 3, 1.0)
    since = marks.since(r, 0.0)
    assert since is not None and since.first_wall_s == 19.0  # 25 marks made, the newest 16 kept
    after = marks.since(r, 31.5)
    assert after is not None and (after.first_wall_s, after.blocks) == (32.0, 3 * 4 * 3)
    assert marks.since(r, 34.9) is None  # a batch after every mark: nothing computed since
    marks.add(r, 12.0, 5, 1.0)  # a request decided long ago, answered late: merged into the newest
    after = marks.since(r, 31.5)
    assert after is not None and after.blocks == 3 * 4 * 3 + 5
    marks.forget(r)
    assert marks.since(r, 0.0) is None


def test_stalled_stream_hint_waits_for_its_bound() -> None:
    assert stalled_stream_hint(10, 100.0, 129.0, 30.0) is None
    assert stalled_stream_hint(0, 100.0, 200.0, 30.0) is None
    assert stalled_stream_hint(10, 100.0, 200.0, 0.0) is None  # off
    hint = stalled_stream_hint(10, 100.0, 130.0, 30.0)
    assert hint is not None and hint.startswith("no KV event batch for 30 s while the engine computed 10 ")
