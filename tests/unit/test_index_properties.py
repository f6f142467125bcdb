"""Random event sequences against a brute-force model of the index (hypothesis).

Blocks come from a two-letter alphabet, so prompts share prefixes often. A path (tuple of letters)
names a prefix; the model keeps, per (replica, dp_rank), ``engine hash → path`` and the set of held
paths, and answers a match by walking the prompt's paths. Engine hashes are content-derived, as the
engines make them; in the no-eviction machine a block may also arrive under a second handle.
The eviction machine adds a tiny block budget and an exact LRU model (budgets under 128 blocks
evict exactly down to the budget).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from balancer.events import Cleared, Removed, Resync, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 2
HASHER = BlockHasher("prop", BS)
REPLICAS = [ReplicaId(name) for name in ("r0", "r1", "r2")]
Path = tuple[int, ...]
Cache = tuple[ReplicaId, int]

paths = st.lists(st.integers(0, 1), min_size=1, max_size=4).map(tuple)
caches = st.tuples(st.sampled_from(REPLICAS), st.integers(0, 1))


def engine_hash(path: Path, handle: int) -> EngineHash:
    return EngineHash(hash((path, handle)) & 0xFFFF_FFFF_FFFF_FFFF)


def tokens(path: Sequence[int]) -> list[int]:
    return [letter + 1 for letter in path for _ in range(BS)]


class IndexModel(RuleBasedStateMachine):
    capacity = 10_000
    handles = 2

    def __init__(self) -> None:
        super().__init__()
        self.table = PrefixTable(HASHER, TableLimits(capacity_blocks=self.capacity))
        self.maps: dict[Cache, dict[int, Path]] = {}
        """engine hash → path per cache; entries of evicted paths stay, as in the table."""
        self.holders: dict[Path, set[Cache]] = {}
        """Held paths in LRU order (least recently stored first) and the caches holding them."""

    def held(self, cache: Cache) -> set[Path]:
        return {path for path, caches in self.holders.items() if cache in caches}

    def _hold(self, cache: Cache, path: Path) -> None:
        caches = self.holders.pop(path, set())
        caches.add(cache)
        self.holders[path] = caches

    def _unhold(self, cache: Cache, path: Path) -> None:
        if path in self.holders and path not in self.maps.get(cache, {}).values():
            self.holders[path].discard(cache)
            if not self.holders[path]:
                del self.holders[path]

    stored = Bundle("stored")

    @rule(target=stored, cache=caches, path=paths, split=st.integers(0, 4), handle=st.integers(0, 1))
    def store(self, cache: Cache, path: Path, split: int, handle: int) -> tuple[Cache, Path]:
        self._store(cache, path, split, handle)
        return cache, path

    @rule(target=stored, entry=stored, elsewhere=st.none() | caches, handle=st.integers(0, 1))
    def store_again(
        self, entry: tuple[Cache, Path], elsewhere: Cache | None, handle: int
    ) -> tuple[Cache, Path]:
        """The same blocks again: on another cache, or on the same one under another handle."""
        cache = elsewhere or entry[0]
        self._store(cache, entry[1], 0, handle)
        return cache, entry[1]

    @rule(target=stored, entry=stored, suffix=paths, handle=st.integers(0, 1))
    def extend(self, entry: tuple[Cache, Path], suffix: Path, handle: int) -> tuple[Cache, Path]:
        cache, path = entry
        self._store(cache, path + suffix, len(path), handle)
        return cache, path + suffix

    def _store(self, cache: Cache, path: Path, split: int, handle: int) -> None:
        handle %= self.handles
        split = min(split, len(path) - 1)
        parent = None if split == 0 else engine_hash(path[:split], handle)
        known = self.maps.get(cache, {})
        event = Stored(
            cache[1],
            parent,
            tuple(engine_hash(path[: i + 1], handle) for i in range(split, len(path))),
            pack_tokens(tokens(path[split:])),
            BS,
        )
        result = self.table.apply(cache[0], [event], 0.0)
        if parent is not None and parent not in known:
            assert result.skipped_unknown_parent == 1 and result.stored_blocks == 0
            return
        assert parent is None or known[parent] == path[:split]
        cache_map = self.maps.setdefault(cache, {})
        for i in range(split, len(path)):
            cache_map[engine_hash(path[: i + 1], handle)] = path[: i + 1]
            self._hold(cache, path[: i + 1])
        evicted = 0
        while len(self.holders) > self.capacity:
            del self.holders[next(iter(self.holders))]
            evicted += 1
        assert result.evicted_blocks == evicted

    @rule(entry=stored, keep=st.integers(0, 4), handle=st.integers(0, 1))
    def remove_stored(self, entry: tuple[Cache, Path], keep: int, handle: int) -> None:
        cache, path = entry
        self.remove(cache, path[: max(1, len(path) - keep)], handle)

    @rule(cache=caches, path=paths, handle=st.integers(0, 1))
    def remove(self, cache: Cache, path: Path, handle: int) -> None:
        handle %= self.handles
        h = engine_hash(path, handle)
        result = self.table.apply(cache[0], [Removed(cache[1], (h,))], 0.0)
        cache_map = self.maps.get(cache, {})
        if h not in cache_map:
            assert result.unknown_removals == 1
            return
        removed = cache_map.pop(h)
        self._unhold(cache, removed)

    @rule(cache=caches, resync=st.booleans())
    def clear(self, cache: Cache, resync: bool) -> None:
        event = Resync(cache[1], "gap") if resync else Cleared(cache[1])
        self.table.apply(cache[0], [event], 0.0)
        for path in set(self.maps.pop(cache, {}).values()):
            self._unhold(cache, path)

    @rule(replica=st.sampled_from(REPLICAS))
    def drop(self, replica: ReplicaId) -> None:
        expected = 0
        for cache in [c for c in self.maps if c[0] == replica]:
            expected += len(self.held(cache))
            for path in set(self.maps.pop(cache).values()):
                self._unhold(cache, path)
        assert self.table.drop_replica(replica) == expected

    @rule(
        entry=stored,
        suffix=st.just(()) | paths,
        among=st.none() | st.lists(st.sampled_from(REPLICAS), unique=True),
    )
    def match_stored(self, entry: tuple[Cache, Path], suffix: Path, among: list[ReplicaId] | None) -> None:
        self.match(entry[1] + suffix, among)

    @rule(path=paths, among=st.none() | st.lists(st.sampled_from(REPLICAS), unique=True))
    def match(self, path: Path, among: list[ReplicaId] | None) -> None:
        result = self.table.match(HASHER.request_keys(tokens(path)), among, 0.0)
        expected = {r: self.overlap(r, path) for r in (among if among is not None else REPLICAS)}
        if among is None:  # replicas the table never heard of (or dropped) are not listed
            assert {r: n for r, n in result.blocks.items() if n} == {r: n for r, n in expected.items() if n}
        else:
            assert result.blocks == expected
        for replica, best in result.blocks.items():
            if best:
                assert self.depth((replica, result.best_rank[replica]), path) == best

    def depth(self, cache: Cache, path: Path) -> int:
        held = self.held(cache)
        n = 0
        while n < len(path) and path[: n + 1] in held:
            n += 1
        return n

    def overlap(self, replica: ReplicaId, path: Path) -> int:
        return max((self.depth((replica, rank), path) for rank in (0, 1)), default=0)

    @invariant()
    def sizes_agree(self) -> None:
        stats = self.table.stats()
        assert stats.unique_blocks == len(self.holders)
        assert stats.held_blocks == sum(len(self.held(cache)) for cache in self.maps)
        assert stats.unique_blocks <= self.capacity


class EvictingModel(IndexModel):
    capacity = 6
    handles = 1  # a second handle plus eviction is a documented approximation (see table.py)


SETTINGS = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestIndexModel = IndexModel.TestCase
TestIndexModel.settings = SETTINGS
TestEvictingModel = EvictingModel.TestCase
TestEvictingModel.settings = SETTINGS
