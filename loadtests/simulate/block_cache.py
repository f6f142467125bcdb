"""The emulator's paged prefix cache at block level, for the fast replica model (pure: no clock, no I/O).

:class:`BlockCache` behaves exactly as :class:`replicas.sim.cache.PrefixCache` with whole-node
eviction and full pages only (how the simulated SGLang replicas cache), but a page is named by one
integer, the block key of its whole prefix (the router's chained XXH3 over the page's tokens, seeded
with its parent's key), instead of a tuple of its tokens. In a radix tree a child is looked up under
its parent, where "same key" and "same tokens" are the same thing (up to a 64-bit hash collision), so
matches, splits, insertions, reference counts, LRU evictions and page ids are those of the emulator's
class, operation for operation; ``tests/unit/test_simulate_block_cache.py`` replays random request
streams through both and compares every result and every event.

What changes is the cost: a page is two integers (key and page id) instead of a tuple of tokens, the
tree walk compares lists of keys, and eviction pops a heap of evictable leaves kept up to date (lazily:
stale entries are skipped) instead of building one from every node on each call. Changes are produced
directly as the router's ``Stored``/``Removed`` events (page ids as engine hashes, the pages' packed
tokens), which is what the fleet made of the emulator's change records.

Not supported (the simulator does not use them): partial pages, tail-first eviction, flush and reset.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from balancer.events import KvEvent, Removed, Stored
from balancer.types import EngineHash

_HEAP_SLACK = 64
"""Stale eviction-heap entries tolerated beyond twice the live nodes before the heap is rebuilt."""


class _Node:
    __slots__ = ("alive", "children", "depth", "ids", "keys", "last_access_s", "lock_ref", "parent", "uid")

    def __init__(
        self,
        uid: int,
        keys: list[int],
        ids: list[int],
        parent: _Node | None,
        depth: int,
        last_access_s: float,
    ) -> None:
        self.uid = uid
        self.keys = keys
        """Block keys of the node's pages, root-most first."""
        self.ids = ids
        """Page ids (the engine hashes of the events), one per key."""
        self.parent = parent
        self.depth = depth
        """Pages from the root to the end of this node."""
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access_s = last_access_s
        self.alive = True


@dataclass(eq=False, slots=True)
class BlockLease:
    """What one running request holds: a locked node and its private page reservation."""

    node: _Node
    private_blocks: int
    cached_tokens: int
    released: bool = False


@dataclass(slots=True)
class BlockCacheStats:
    """Counters in pages; ``evictions`` counts evicted nodes, ``evicted_blocks`` their pages."""

    evictions: int = 0
    evicted_blocks: int = 0
    stored_blocks: int = 0


class BlockCache:
    """A bounded paged prefix cache over block keys (module docstring); LRU eviction of unlocked leaves."""

    def __init__(self, *, page_size: int, capacity_blocks: int) -> None:
        if page_size <= 0 or capacity_blocks <= 0:
            raise ValueError(f"page_size and capacity_blocks must be > 0 ({page_size}, {capacity_blocks})")
        self.page_size = page_size
        self.capacity_blocks = capacity_blocks
        self._next_id = 1
        self._root = _Node(1, [], [], None, 0, 0.0)  # uid 1, as the emulator's first id
        self._live_nodes = 0
        self._leaves: list[tuple[float, int, _Node]] = []
        """Unlocked leaves by (last access, uid), lazily: an entry is live while it matches its node."""
        self.tree_blocks = 0
        self.private_blocks = 0
        self.evictable_blocks = 0
        self.stats = BlockCacheStats()
        self._events: list[KvEvent] = []

    # ------------------------------------------------------------------------------------ counters

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.tree_blocks - self.private_blocks

    @property
    def active_blocks(self) -> int:
        """Pages in use by running requests (locked tree pages plus private reservations)."""
        return self.tree_blocks - self.evictable_blocks + self.private_blocks

    # ------------------------------------------------------------------------------------- queries

    def match_blocks(self, keys: Sequence[int], count: int) -> int:
        """Pages of the longest cached prefix of ``keys[:count]`` (changes nothing)."""
        return self._walk(keys, count, split=False)[1]

    # ----------------------------------------------------------------------------------- requests

    def acquire(self, keys: Sequence[int], count: int, reserve_tokens: int, now: float) -> BlockLease | None:
        """Lock the cached prefix of ``keys[:count]`` and reserve pages for ``reserve_tokens`` in all.

        As ``PrefixCache.acquire`` given the tokens of those pages: evicts LRU leaves if needed;
        ``None`` (nothing changed but evictions) when the pool cannot hold the reservation.
        """
        node, matched = self._walk(keys, count, split=True)
        self._lock(node, now)
        need = max(0, math.ceil(reserve_tokens / self.page_size) - matched)
        if self.free_blocks + self.evictable_blocks < need:
            self._unlock(node, now)
            return None
        if self.free_blocks < need:
            self._evict(need - self.free_blocks)
        self.private_blocks += need
        return BlockLease(node, need, matched * self.page_size)

    def insert(self, lease: BlockLease, keys: Sequence[int], count: int, tokens: bytes, now: float) -> None:
        """Cache pages ``keys[:count]`` (computed by the lease's request) and move its lock there.

        ``tokens`` holds the pages' token ids packed as little-endian u32 (page ``i`` at bytes
        ``[4·i·page_size, 4·(i+1)·page_size)``), for the ``Stored`` events of new pages. Pages already
        cached are reused, new ones come from the reservation first; best effort when the pool is
        exhausted, exactly as ``PrefixCache.insert``.
        """
        if lease.released:
            return
        node, done = self._walk(keys, count, split=True)
        fresh = count - done
        released = min(lease.private_blocks, max(0, count - lease.node.depth))
        lease.private_blocks -= released
        self.private_blocks -= released
        room = released + self.free_blocks
        if room < fresh:
            self._pin(node, +1)  # as the emulator: the walk's end survives the eviction
            self._evict(fresh - room)
            self._pin(node, -1)
            room = released + self.free_blocks
        fresh = min(fresh, max(0, room))
        deepest = self._add_node(node, keys, done, done + fresh, tokens, now) if fresh > 0 else node
        self._lock(deepest, now)
        self._unlock(lease.node, now)
        lease.node = deepest

    def release(self, lease: BlockLease, now: float) -> None:
        """The request is done: unlock its pages (they become evictable) and free its reservation."""
        if lease.released:
            return
        lease.released = True
        self._unlock(lease.node, now)
        self.private_blocks -= lease.private_blocks
        lease.private_blocks = 0

    def take_events(self) -> list[KvEvent]:
        """Events since the last call, in mutation order."""
        events = self._events
        self._events = []
        return events

    # ------------------------------------------------------------------------------------ internals

    def _walk(self, keys: Sequence[int], count: int, *, split: bool) -> tuple[_Node, int]:
        """Deepest node matching a prefix of ``keys[:count]`` and the pages matched (as
        ``PrefixCache._walk``: with ``split`` a partly matched node is split at the match's end)."""
        node, done = self._root, 0
        while done < count:
            child = node.children.get(keys[done])
            if child is None:
                break
            ours = child.keys
            end = done + len(ours)
            if end <= count and ours == keys[done:end]:
                node, done = child, end
                continue
            same, limit = 1, min(len(ours), count - done)
            while same < limit and ours[same] == keys[done + same]:
                same += 1
            if same == len(ours):  # ``keys`` was not a list: the fast comparison could not tell
                node, done = child, end
                continue
            if not split:
                return node, done + same
            return self._split(child, same), done + same
        return node, done

    def _split(self, child: _Node, keep: int) -> _Node:
        parent = child.parent
        assert parent is not None
        self._next_id += 1
        head = _Node(
            self._next_id,
            child.keys[:keep],
            child.ids[:keep],
            parent,
            parent.depth + keep,
            child.last_access_s,
        )
        head.lock_ref = child.lock_ref
        parent.children[head.keys[0]] = head
        child.keys = child.keys[keep:]
        child.ids = child.ids[keep:]
        child.parent = head
        head.children[child.keys[0]] = child
        self._live_nodes += 1
        return head

    def _add_node(
        self, parent: _Node, keys: Sequence[int], start: int, stop: int, tokens: bytes, now: float
    ) -> _Node:
        first = self._next_id + 1
        count = stop - start
        self._next_id += count + 1  # page ids first, then the node's uid, as the emulator numbers them
        ids = list(range(first, first + count))
        node = _Node(self._next_id, list(keys[start:stop]), ids, parent, parent.depth + count, now)
        parent.children[node.keys[0]] = node
        self._live_nodes += 1
        self.tree_blocks += count
        self.evictable_blocks += count  # unlocked until the caller locks it
        self.stats.stored_blocks += count
        step = 4 * self.page_size
        anchor = EngineHash(parent.ids[-1]) if parent is not self._root else None
        hashes = tuple(EngineHash(page_id) for page_id in ids)
        self._events.append(Stored(0, anchor, hashes, tokens[start * step : stop * step], self.page_size))
        self._push(node)
        return node

    def _pin(self, node: _Node, delta: int) -> None:
        """Hold (+1) or let go (−1) of one node without touching its access time."""
        if node is self._root:
            return
        if node.lock_ref == 0:
            self.evictable_blocks -= len(node.keys)
        node.lock_ref += delta
        if node.lock_ref == 0:
            self.evictable_blocks += len(node.keys)
            if not node.children:
                self._push(node)

    def _stamp(self, node: _Node, now: float) -> float:
        """The eviction priority ``node`` takes when it is locked or unlocked at ``now`` (smallest
        evicted first): here its access time (LRU); the oracle's cache overrides it."""
        return now

    def _lock(self, node: _Node, now: float) -> None:
        root = self._root
        walker: _Node | None = node
        while walker is not None and walker is not root:
            if walker.lock_ref == 0:
                self.evictable_blocks -= len(walker.keys)
            walker.lock_ref += 1
            walker.last_access_s = self._stamp(walker, now)
            walker = walker.parent

    def _unlock(self, node: _Node, now: float) -> None:
        root = self._root
        walker: _Node | None = node
        while walker is not None and walker is not root:
            walker.lock_ref -= 1
            walker.last_access_s = self._stamp(walker, now)
            if walker.lock_ref == 0:
                self.evictable_blocks += len(walker.keys)
                if not walker.children:
                    self._push(walker)
            walker = walker.parent

    def _push(self, node: _Node) -> None:
        """``node`` may have just become an unlocked leaf, or changed its access time as one."""
        heap = self._leaves
        heapq.heappush(heap, (node.last_access_s, node.uid, node))
        if len(heap) > 2 * self._live_nodes + _HEAP_SLACK:
            live = {entry[2].uid: entry for entry in heap if self._evictable(entry)}
            heap[:] = live.values()
            heapq.heapify(heap)

    def _evictable(self, entry: tuple[float, int, _Node]) -> bool:
        node = entry[2]
        return node.alive and not node.lock_ref and not node.children and node.last_access_s == entry[0]

    def _evict(self, need_blocks: int) -> int:
        """Evict unlocked leaves, least recently used first (ties: oldest node), until ``need_blocks``
        pages are free; a parent left an unlocked leaf joins the candidates, as in the emulator."""
        heap = self._leaves
        freed = 0
        while freed < need_blocks and heap:
            entry = heapq.heappop(heap)
            if not self._evictable(entry):
                continue
            pages, parent = self._drop_leaf(entry[2])
            freed += pages
            if parent is not None:
                heapq.heappush(heap, (parent.last_access_s, parent.uid, parent))
        return freed

    def _drop_leaf(self, victim: _Node) -> tuple[int, _Node | None]:
        """Evict the unlocked leaf ``victim``: unlink it, count its pages out and note their
        ``Removed`` event. Returns its pages, and its parent when that is left an unlocked leaf (a new
        candidate; ``None`` otherwise)."""
        parent = victim.parent
        assert parent is not None
        del parent.children[victim.keys[0]]
        victim.alive = False
        self._live_nodes -= 1
        pages = len(victim.keys)
        self.tree_blocks -= pages
        self.evictable_blocks -= pages
        self.stats.evictions += 1
        self.stats.evicted_blocks += pages
        self._events.append(Removed(0, tuple(EngineHash(page_id) for page_id in victim.ids)))
        if parent is not self._root and not parent.children and not parent.lock_ref:
            return pages, parent
        return pages, None
