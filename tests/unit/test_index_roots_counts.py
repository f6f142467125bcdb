"""``PrefixTable.held_roots`` kept incrementally (``RootCounts``) equals counting the old way.

The old way walked every listed root key and looked its holder mask up (O(roots) a call); the
table now keeps per replica the count of listed roots it holds, updated wherever a listed root's
mask changes. Long seeded random sequences of every operation that changes a mask (stores, chained
and one-block stores, removals, clears, gap resyncs with suspect holds and their expiry, receipts
that settle or teach blocks, stores under blocks a gap lost, speculative adds with expiry, overflow
and deferred re-adds, ``drop_blocks``, ``drop_speculated``, dropped and re-added replicas, eviction
under a small budget, snapshot save and restore) check after every step that the kept counts are
the scan's, for every replica and for random subsets, and that the list of roots stays bounded.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import asdict

import pytest

from balancer.events import Cleared, Removed, Resync, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.roots import ROOTS_SLACK
from balancer.index.slots import TableLimits
from balancer.index.snapshot import dump_table, load_table
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 2
HASHER = BlockHasher("m", BS)
REPLICAS = tuple(ReplicaId(name) for name in "abcd")


def scan(table: PrefixTable, among: Collection[ReplicaId] | None) -> dict[ReplicaId, int]:
    """The old ``held_roots``: every listed root's mask looked up, each replica counted once a root."""
    mask, template = table._slots.candidates(among)
    counts = template.copy()
    for key in table._roots.listed:
        bits = table._masks.get(key, 0) & mask
        if bits:
            for replica in table._slots.group(bits)[0]:
                counts[replica] += 1
    return counts


def engine_hash(tokens: Sequence[int]) -> EngineHash:
    """A stable engine hash of a block, chained (it hashes the whole prefix up to the block)."""
    digest = hashlib.blake2b(repr(tuple(tokens)).encode(), digest_size=6).digest()
    return EngineHash(int.from_bytes(digest, "little"))


def block_hashes(tokens: Sequence[int], bs: int) -> list[EngineHash]:
    return [engine_hash(tokens[: (i + 1) * bs]) for i in range(len(tokens) // bs)]


def make_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes: a few heads of 1–3 blocks, each with a few tails of 1–3 blocks."""
    prompts: list[list[int]] = []
    token = 1
    for _ in range(5):
        head_blocks = rng.randint(1, 3)
        head = list(range(token, token + head_blocks * BS))
        token += head_blocks * BS
        prompts.append(head)
        for _ in range(rng.randint(1, 3)):
            tail_blocks = rng.randint(1, 3)
            prompts.append(head + list(range(token, token + tail_blocks * BS)))
            token += tail_blocks * BS
    return prompts


class Driver:
    """One random sequence of table operations; ``step`` runs one and returns its name."""

    def __init__(self, rng: random.Random, limits: TableLimits) -> None:
        self.rng = rng
        self.limits = limits
        self.table = PrefixTable(HASHER, limits)
        self.prompts = make_prompts(rng)
        self.now = 0.0
        self.snapshots = 0
        self.counted: Counter[str] = Counter()
        """The counters of the tables a snapshot replaced."""

    def _prompt(self) -> list[int]:
        return self.rng.choice(self.prompts)

    def _stored(self, prompt: list[int], start: int, stop: int, rank: int, chained: bool = False) -> Stored:
        parent = None if start == 0 else engine_hash(prompt[: start * BS])
        engine = tuple(engine_hash(prompt[: (i + 1) * BS]) for i in range(start, stop))
        return Stored(rank, parent, engine, pack_tokens(prompt[start * BS : stop * BS]), BS, chained=chained)

    def step(self) -> str:
        rng, t = self.rng, self.table
        replica = rng.choice(REPLICAS)
        rank = rng.choice((0, 0, 1))
        prompt = self._prompt()
        blocks = len(prompt) // BS
        op = rng.choices(
            (
                "store",
                "store_pages",
                "remove",
                "clear",
                "gap",
                "resync",
                "spec",
                "spec_matched",
                "spec_odd",
                "tick",
                "drop_blocks",
                "drop_speculated",
                "drop_replica",
                "settle_suspect",
                "learn",
                "note_routes",
                "snapshot",
            ),
            weights=(14, 4, 6, 2, 4, 1, 10, 6, 2, 6, 2, 2, 1, 4, 2, 4, 1),
        )[0]
        if op == "store":
            start = rng.choice((0, rng.randrange(blocks)))
            stop = rng.randint(start + 1, blocks)
            t.apply(replica, [self._stored(prompt, start, stop, rank)], self.now)
        elif op == "store_pages":  # one event per page, as SGLang publishes, or merged (chained)
            stop = rng.randint(1, blocks)
            if rng.random() < 0.5:
                t.apply(replica, [self._stored(prompt, 0, stop, rank, chained=True)], self.now)
            else:
                t.apply(replica, [self._stored(prompt, i, i + 1, rank) for i in range(stop)], self.now)
        elif op == "remove":
            hashes = tuple(engine_hash(prompt[: (i + 1) * BS]) for i in range(blocks) if rng.random() < 0.5)
            t.apply(replica, [Removed(rank, hashes)], self.now)
        elif op == "clear":
            t.apply(replica, [Cleared(rank)], self.now)
        elif op == "gap":
            t.apply(replica, [Resync(rank, "gap")], self.now)
        elif op == "resync":
            t.apply(replica, [Resync(rank, "restart")], self.now)
        elif op in ("spec", "spec_matched"):
            keys = tuple(HASHER.request_keys([*prompt, 7]))[: rng.randint(1, blocks)]
            if op == "spec_matched":  # the router's way: the match notes the held prefix, the add defers
                t.match_confirmed(keys, None, self.now)
            ttl = rng.choice((0.3, 1.0, 5.0))
            t.add_speculative(replica, keys, ttl, self.now)
            if rng.random() < 0.3:  # the first-token add of the same tuple
                t.add_speculative(replica, keys, ttl * 2, self.now)
        elif op == "spec_odd":  # a caller passing a chain from its middle: its first key is listed
            keys = tuple(HASHER.request_keys([*prompt, 7]))
            t.add_speculative(replica, keys[rng.randrange(len(keys)) :], rng.choice((0.3, 2.0)), self.now)
        elif op == "tick":
            self.now += rng.choice((0.05, 0.2, 0.6, 1.5))
        elif op == "drop_blocks":
            keys = HASHER.request_keys([*prompt, 7])
            t.drop_blocks(replica, keys[rng.randrange(len(keys)) :])
        elif op == "drop_speculated":
            since = rng.choice((None, self.now - 0.5))
            t.drop_speculated(replica, HASHER.request_keys([*prompt, 7]), self.now, since)
        elif op == "drop_replica":
            t.drop_replica(replica)
        elif op == "settle_suspect":
            keys = HASHER.request_keys([*prompt, 7])
            cut = rng.randint(0, len(keys))
            t.settle_suspect(replica, keys[:cut], keys[cut:], self.now)
        elif op == "learn":  # a receipt teaching blocks (a root among them, not listed anew)
            keys = HASHER.request_keys([*prompt, 7])
            depth = rng.randint(1, len(keys))
            hashes = block_hashes(prompt, BS)[:depth]
            t.learn_blocks(replica, keys[:depth], hashes, self.now - rng.choice((0.0, 0.1)), hold=True)
        elif op == "note_routes":
            if t.routes_wanted(replica, self.now):
                t.note_routes(
                    replica, HASHER.request_keys([*prompt, 7]), [*prompt, 7], block_hashes, self.now
                )
        elif op == "snapshot":
            self.snapshots += 1
            data = dump_table(t, self.snapshots, f"{self.snapshots}-0")
            self.counted.update(asdict(t.counters))
            self.table = load_table(data, HASHER, self.limits).table
        return op

    def counters(self) -> Counter[str]:
        """The table counters over the whole sequence (snapshots restart them)."""
        return self.counted + Counter(asdict(self.table.counters))

    def check(self) -> None:
        t, rng = self.table, self.rng
        for among in (None, tuple(r for r in REPLICAS if rng.random() < 0.5)):
            got = t.held_roots(among, self.now)
            assert got == scan(t, among), (among, got, scan(t, among))
        roots = t._roots
        assert roots.in_table == sum(key in t._masks for key in roots.listed)
        assert all(count >= 0 for count in roots.by_replica.values())
        assert t.roots_listed <= 2 * max(roots.live_at_prune, roots.in_table) + ROOTS_SLACK + 1


def _seeded_driver(seed: int) -> Driver:
    """A driver over a table whose limits the seed picks (small ones, so eviction and overflow happen)."""
    rng = random.Random(seed)
    limits = TableLimits(
        capacity_blocks=rng.choice((12, 30, 200)),
        max_speculative_keys=rng.choice((8, 40, 1000)),
        max_slots=rng.choice((9, 64)),
        gap_hold_s=rng.choice((0.0, 0.5, 0.5)),
        gap_keep_s=rng.choice((0.0, 2.0)),
    )
    return Driver(rng, limits)


@pytest.mark.parametrize("seed", range(24))
def test_kept_root_counts_equal_the_scan_after_every_step(seed: int) -> None:
    driver = _seeded_driver(seed)
    seen: set[str] = set()
    for _ in range(600):
        seen.add(driver.step())
        driver.check()
    assert len(seen) >= 15  # the sequence exercised nearly every operation


def test_the_sequences_reach_every_path_that_changes_a_mask() -> None:
    """Over the seeds above, every way into and out of the table happened (so the test covers it)."""
    totals: Counter[str] = Counter()
    for seed in range(24):
        driver = _seeded_driver(seed)
        for _ in range(600):
            driver.step()
        totals += driver.counters()
    for counter in (
        "evicted_blocks",
        "speculative_overflow",
        "speculative_expired",
        "speculative_confirmed",
        "speculative_compactions",
        "slot_overflow",
        "suspect_marked",
        "suspect_confirmed",
        "suspect_dropped",
        "suspect_frontier_dropped",
        "suspect_restored",
        "routed_resolved",
    ):
        assert totals[counter] > 0, (counter, totals)
    print(totals)


def test_the_scan_and_the_counts_agree_with_many_roots_and_ranks() -> None:
    """Many distinct roots on a large table: a store of many chains at once, then removals."""
    t = PrefixTable(HASHER, TableLimits(capacity_blocks=10_000))
    rng = random.Random(5)
    for i in range(300):
        tokens = [10_000 + 7 * i + j for j in range(3 * BS)]
        replica = REPLICAS[i % 4]
        t.apply(
            replica,
            [Stored(i % 2, None, tuple(EngineHash(100 * i + j) for j in range(3)), pack_tokens(tokens), BS)],
            0.0,
        )
        if rng.random() < 0.3:
            t.add_speculative(REPLICAS[(i + 1) % 4], HASHER.request_keys(tokens), 1.0, 0.0)
    assert t.held_roots(None, 0.5) == scan(t, None)
    for i in range(0, 300, 3):
        t.apply(REPLICAS[i % 4], [Removed(i % 2, (EngineHash(100 * i),))], 0.5)
    assert t.held_roots(None, 0.5) == scan(t, None)
    assert t.held_roots(None, 2.0) == scan(t, None)  # the speculative ones expired
