"""Receipts teach an SGLang replica the pages a gap lost, under SGLang's own page hashes.

The events are built with the emulator's page hash (``tests/wire_hashes.py``, which the real SGLang
0.5.23 captures confirm); kvlb's router computes its own (:func:`balancer.engines.sglang.page_hashes`)
and must trust it only once the replica's events agreed with it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from wire_hashes import sglang_page_hashes

from balancer.engines.sglang import SPEC as SGLANG
from balancer.events import Removed, Resync, Stored
from balancer.index.hashing import pack_tokens
from balancer.index.slots import TableLimits
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import HASH_CHECK_RECEIPTS, HASH_TRUST_BLOCKS, PoolRequest, PoolRouter
from balancer.types import EngineHash, ReplicaId, to_u64

R = ReplicaId("r0")
PAGE = 4
POLICY = make_policy("cost")


def engine_pages(tokens: Sequence[int]) -> list[EngineHash]:
    """The hashes SGLang publishes for the full pages of ``tokens`` (signed i64 on the wire)."""
    full = len(tokens) // PAGE
    return [EngineHash(to_u64(value)) for value, _ in sglang_page_hashes(tokens, PAGE)[:full]]


def stored(tokens: Sequence[int]) -> Stored:
    hashes = engine_pages(tokens)
    return Stored(0, None, tuple(hashes), pack_tokens(tokens[: len(hashes) * PAGE]), PAGE)


def router() -> PoolRouter:
    r = PoolRouter("m", TableLimits(gap_hold_s=0.5, gap_keep_s=2.0), rng=random.Random(1))
    r.add_replica(R, PAGE, SGLANG.align_mode, SGLANG.block_hashes)
    return r


def serve(r: PoolRouter, prompt: list[int], cached_tokens: int, now: float) -> int:
    """Route ``prompt``, settle the engine's ``cached_tokens``; returns the pages taught."""
    lease = r.route(PoolRequest(prompt, POLICY, PolicyWeights(), "q"), now)
    settled = lease.settle_receipt(cached_tokens, now)
    lease.release(now)
    return settled.taught_blocks


def test_a_receipt_teaches_pages_whose_stores_a_gap_lost_under_the_engines_hashes() -> None:
    r = router()
    table = r.space_of[R].table
    now = 0.0
    for i in range(HASH_TRUST_BLOCKS // 4 + 1):  # the engine's events store 5 pages a request
        prompt = [7, i, *range(100, 118)]
        table.apply(R, [stored(prompt)], now)
        serve(r, prompt, 20, now)
        now += 0.1
    assert r.hash_trust(R) is True
    lost = [9, 9, *range(500, 518)]  # stored while the events were lost
    table.apply(R, [Resync(0, "gap")], now)
    assert serve(r, [*lost, 1, 2, 3, 4, 5], 20, now + 0.1) == 5
    assert table.engine_hashes(R) >= set(engine_pages(lost))
    removed = table.apply(R, [Removed(0, (engine_pages(lost)[-1],))], now + 0.2)
    assert removed.removed_blocks == 1  # the engine's own handle: its removal finds the page


def test_a_replica_whose_pages_hash_otherwise_is_never_trusted() -> None:
    """A bigram or salted SGLang, or another engine behind the name: its events never match."""
    r = router()
    table = r.space_of[R].table
    for i in range(8):
        prompt = [7, i, *range(100, 118)]
        other = tuple(EngineHash(h ^ 1) for h in engine_pages(prompt))
        table.apply(R, [Stored(0, None, other, pack_tokens(prompt), PAGE)], i * 0.1)
        serve(r, prompt, 20, i * 0.1)
    assert r.hash_trust(R) is not True  # nothing matched (a computed hash naming another key: False)
    table.apply(R, [Resync(0, "gap")], 1.0)
    assert serve(r, [9, 9, *range(500, 518)], 20, 1.1) == 0


def test_a_store_under_pages_a_gap_lost_is_applied_from_a_routed_request_without_a_receipt() -> None:
    """A stream without ``usage`` gives no receipt: the request routed after the gap still names the
    lost pages by the engine's hashes, so the engine's store of its new page under them is applied."""
    r = router()
    table = r.space_of[R].table
    now = 0.0
    for i in range(HASH_TRUST_BLOCKS // 4 + 1):
        prompt = [7, i, *range(100, 118)]
        table.apply(R, [stored(prompt)], now)
        serve(r, prompt, 20, now)
        now += 0.1
    lost = [9, 9, *range(500, 510)]  # 3 pages stored while the events were lost
    table.apply(R, [Resync(0, "gap")], now)
    prompt = [*lost, 1, 2, 3, 4, 5]  # 4 full pages, the lost 3 first
    lease = r.route(PoolRequest(prompt, POLICY, PolicyWeights(), "q"), now + 0.1)
    lease.release(now + 0.2)  # no receipt
    pages = engine_pages(prompt)
    child = Stored(0, pages[2], (pages[3],), pack_tokens(prompt[3 * PAGE : 4 * PAGE]), PAGE)
    result = table.apply(R, [child], now + 0.2)
    assert result.skipped_unknown_parent == 0 and result.stored_blocks == 1
    assert table.engine_hashes(R) >= set(pages[:4])
    before_gap = router()  # the same without a gap: nothing noted, the store is skipped
    before_gap.route(PoolRequest(prompt, POLICY, PolicyWeights(), "q"), 0.0).release(0.1)
    assert before_gap.space_of[R].table.apply(R, [child], 0.2).skipped_unknown_parent == 1


def test_receipts_of_blocks_the_index_never_held_do_not_use_up_the_check() -> None:
    """Receipts whose pages the index holds none of (they came before the pages' events, or after a
    clear) show neither a match nor a mismatch: however many, the replica's hashes are still
    trusted once its events and receipts agree."""
    r = router()
    table = r.space_of[R].table
    now = 0.0
    for i in range(HASH_CHECK_RECEIPTS + 10):  # reused pages whose stores the index never saw
        serve(r, [8, i, *range(200, 218)], 20, now)
        now += 0.01
    assert r.hash_trust(R) is None
    for i in range(HASH_TRUST_BLOCKS // 4 + 1):
        prompt = [7, i, *range(100, 118)]
        table.apply(R, [stored(prompt)], now)
        serve(r, prompt, 20, now)
        now += 0.1
    assert r.hash_trust(R) is True


def test_receipts_of_held_blocks_no_computed_hash_names_give_the_replica_up() -> None:
    """The pages are held (by their key) under hashes kvlb does not compute: every receipt counts,
    and after ``HASH_CHECK_RECEIPTS`` of them the replica's hashes are given up."""
    r = router()
    table = r.space_of[R].table
    for i in range(HASH_CHECK_RECEIPTS):
        prompt = [7, i, *range(100, 118)]
        other = tuple(EngineHash(h ^ 1) for h in engine_pages(prompt))
        table.apply(R, [Stored(0, None, other, pack_tokens(prompt), PAGE)], i * 0.01)
        assert r.hash_trust(R) is None
        serve(r, prompt, 20, i * 0.01)
    assert r.hash_trust(R) is False
