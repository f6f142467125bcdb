"""Paged prefix (radix) KV cache of one emulated engine rank (pure: no I/O, no clock).

The pool holds ``capacity_blocks`` pages of ``page_size`` tokens. Pages are either **cached** (nodes of
a radix tree keyed by page contents, shared by every request with that prefix) or **private** (the
pages a running request reserved for tokens not yet in the tree). A node is a run of pages, as in
SGLang's radix cache; inserting a sequence that diverges inside a node splits it at a page boundary
(no event: page identities and hashes do not change).

* Requests hold a :class:`Lease`: the deepest tree node they use is locked, and so are its ancestors
  (a reference count per node). Locked pages are never evicted.
* When the pool runs short, unlocked **leaf** nodes are evicted, least recently used first (ties by
  age), whole nodes at a time, exactly as SGLang's ``evict`` deletes leaves. With ``evict_whole_nodes``
  off, only as many pages as needed go, tail page first (vLLM's block pool: a request's blocks are
  freed tail first into an LRU queue and evicted one by one on reuse), so the head of a long prefix
  survives a small eviction, as measured on a real vLLM engine (docs/real-engines.md).
* Every change to the tree is recorded as an engine-neutral :data:`CacheRecord` (pages stored under a
  parent page, pages removed, cache cleared) for the personalities to turn into wire events.

With ``store_partial`` (TRT-LLM) the last page of an inserted sequence may be short; it is cached as
its own page, a leaf, and a later full page at the same position becomes a sibling. Matching only
ever counts full pages. Times (``now``) are model seconds supplied by the caller.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PageTokens = tuple[int, ...]


@dataclass(eq=False, slots=True)
class Page:
    """One cached page; ``page_id`` is unique per cache for its lifetime (hash maps key on it)."""

    page_id: int
    tokens: PageTokens


@dataclass(frozen=True, slots=True)
class PagesStored:
    """New pages chained under ``parent`` (``None``: the root); page ``i``'s parent is page ``i - 1``."""

    parent: Page | None
    pages: tuple[Page, ...]


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """Pages evicted from the tree, root-most first within each evicted node."""

    pages: tuple[Page, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """The whole tree was dropped (a flush)."""


CacheRecord = PagesStored | PagesRemoved | CacheCleared


class _Node:
    __slots__ = ("children", "last_access_s", "lock_ref", "pages", "parent", "uid")

    def __init__(self, uid: int, pages: list[Page], parent: _Node | None, last_access_s: float) -> None:
        self.uid = uid
        self.pages = pages
        self.parent = parent
        self.children: dict[PageTokens, _Node] = {}
        self.lock_ref = 0
        self.last_access_s = last_access_s


@dataclass(eq=False, slots=True)
class Lease:
    """The cache state one running request holds: a locked node and its private page reservation."""

    node: _Node
    private_blocks: int
    cached_tokens: int
    generation: int
    released: bool = False


@dataclass(slots=True)
class CacheStats:
    """Counters in pages; ``evictions`` counts evicted nodes, ``evicted_blocks`` their pages."""

    evictions: int = 0
    evicted_blocks: int = 0
    stored_blocks: int = 0
    flushes: int = 0
    records: list[CacheRecord] = field(default_factory=list)


class PrefixCache:
    """A bounded paged prefix cache with reference counts and LRU eviction of unreferenced leaves."""

    def __init__(
        self,
        *,
        page_size: int,
        capacity_blocks: int,
        store_partial: bool = False,
        evict_whole_nodes: bool = True,
    ) -> None:
        if page_size <= 0 or capacity_blocks <= 0:
            raise ValueError(f"page_size and capacity_blocks must be > 0 ({page_size}, {capacity_blocks})")
        self.page_size = page_size
        self.capacity_blocks = capacity_blocks
        self.store_partial = store_partial
        self.evict_whole_nodes = evict_whole_nodes
        self._next_id = 0
        self._generation = 0
        self._root = _Node(self._new_id(), [], None, 0.0)
        self._nodes: dict[int, _Node] = {}
        self.tree_blocks = 0
        self.private_blocks = 0
        self.evictable_blocks = 0
        self.stats = CacheStats()

    # ------------------------------------------------------------------------------------ counters

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.tree_blocks - self.private_blocks

    @property
    def active_blocks(self) -> int:
        """Pages in use by running requests (locked tree pages plus private reservations)."""
        return self.tree_blocks - self.evictable_blocks + self.private_blocks

    # ------------------------------------------------------------------------------------- queries

    def pages_of(self, tokens: Sequence[int], *, partial: bool = False) -> list[PageTokens]:
        """``tokens`` cut into pages; the short tail is kept only with ``partial``."""
        size = self.page_size
        end = len(tokens) if partial else len(tokens) - len(tokens) % size
        return [tuple(tokens[start : min(start + size, end)]) for start in range(0, end, size)]

    def match_tokens(self, tokens: Sequence[int]) -> int:
        """Tokens of the longest cached full-page prefix of ``tokens`` (changes nothing)."""
        _, matched = self._walk(self.pages_of(tokens), split=False)
        return matched * self.page_size

    def listing(self, limit: int) -> tuple[list[tuple[int, PageTokens]], bool]:
        """The cached pages, each parent before its children: ``(parent, tokens)`` with ``parent``
        the position of its parent page in the list (-1: a root page), at most ``limit`` of them
        (changes nothing); and whether the cap left some out. What ``GET /admin/blocks`` lists, so
        that a check can compare the blocks themselves, not their count, with a router's index."""
        out: list[tuple[int, PageTokens]] = []
        stack: list[tuple[_Node, int]] = [(child, -1) for child in reversed(self._root.children.values())]
        while stack:
            node, parent = stack.pop()
            for page in node.pages:
                if len(out) >= limit:
                    return out, True
                out.append((parent, page.tokens))
                parent = len(out) - 1
            stack.extend((child, parent) for child in reversed(node.children.values()))
        return out, False

    # ----------------------------------------------------------------------------------- requests

    def acquire(self, match_tokens: Sequence[int], reserve_tokens: int, now: float) -> Lease | None:
        """Lock the cached prefix of ``match_tokens`` and reserve pages for ``reserve_tokens`` in all.

        Evicts LRU leaves if needed. Returns ``None`` (and changes nothing but evictions) when the
        pool cannot hold the reservation even after evicting every unreferenced page.
        """
        node, matched = self._walk(self.pages_of(match_tokens), split=True)
        self._lock(node, now)
        need = max(0, math.ceil(reserve_tokens / self.page_size) - matched)
        if self.free_blocks + self.evictable_blocks < need:
            self._unlock(node, now)
            return None
        if self.free_blocks < need:
            self._evict(need - self.free_blocks)
        self.private_blocks += need
        return Lease(node, need, matched * self.page_size, self._generation)

    def insert(self, lease: Lease, tokens: Sequence[int], now: float) -> None:
        """Cache the pages of ``tokens`` (computed KV of the lease's request) and move its lock there.

        Pages already cached are reused (the request's duplicate private pages are freed); new pages
        are taken from the lease's reservation first, then from free or evicted pages. If the pool is
        exhausted the insertion is cut short: caching is best effort, as in the engines.
        """
        if lease.released or lease.generation != self._generation:
            return
        pages = self.pages_of(tokens, partial=self.store_partial)
        node, done = self._walk(pages, split=True)
        before = self._depth(lease.node)
        fresh = pages[done:]
        released = min(lease.private_blocks, max(0, done + len(fresh) - before))
        lease.private_blocks -= released
        self.private_blocks -= released
        room = released + self.free_blocks
        if room < len(fresh):
            self._pin(node, +1)  # the walk's end must survive the eviction the new pages hang under
            self._evict(len(fresh) - room)
            self._pin(node, -1)
            room = released + self.free_blocks
        fresh = fresh[: max(0, room)]
        deepest = self._add_node(node, fresh, now) if fresh else node
        self._lock(deepest, now)
        self._unlock(lease.node, now)
        lease.node = deepest

    def release(self, lease: Lease, now: float) -> None:
        """The request is done: unlock its pages (they become evictable) and free its reservation."""
        if lease.released:
            return
        lease.released = True
        if lease.generation != self._generation:
            return
        self._unlock(lease.node, now)
        self.private_blocks -= lease.private_blocks
        lease.private_blocks = 0

    def flush(self) -> bool:
        """Drop every cached page, as ``/flush_cache`` does; refused (``False``) while requests run."""
        if self.private_blocks or any(child.lock_ref for child in self._root.children.values()):
            return False
        self._drop_tree()
        self.stats.flushes += 1
        self.stats.records.append(CacheCleared())
        return True

    def reset(self) -> None:
        """Forget everything, leases included (an engine restart); pending records are discarded."""
        self._drop_tree()
        self.private_blocks = 0
        self._generation += 1
        self.stats.records.clear()

    def take_records(self) -> list[CacheRecord]:
        """Records since the last call, in mutation order."""
        records = self.stats.records
        self.stats.records = []
        return records

    # ------------------------------------------------------------------------------------ internals

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _walk(self, pages: Sequence[PageTokens], *, split: bool) -> tuple[_Node, int]:
        """Deepest node matching a prefix of ``pages`` and the number of pages matched.

        With ``split`` a node matched only partly is split so the match ends on a node boundary;
        without it the count includes the partly matched pages but the node returned is their parent.
        """
        node, done = self._root, 0
        while done < len(pages):
            child = node.children.get(pages[done])
            if child is None:
                break
            same = 0
            while (
                same < len(child.pages)
                and done + same < len(pages)
                and child.pages[same].tokens == pages[done + same]
            ):
                same += 1
            if same < len(child.pages):
                if not split:
                    return node, done + same
                return self._split(child, same), done + same
            node, done = child, done + same
        return node, done

    def _split(self, child: _Node, keep: int) -> _Node:
        parent = child.parent
        assert parent is not None
        head = _Node(self._new_id(), child.pages[:keep], parent, child.last_access_s)
        head.lock_ref = child.lock_ref
        parent.children[head.pages[0].tokens] = head
        child.pages = child.pages[keep:]
        child.parent = head
        head.children[child.pages[0].tokens] = child
        self._nodes[head.uid] = head
        return head

    def _add_node(self, parent: _Node, fresh: Sequence[PageTokens], now: float) -> _Node:
        pages = [Page(self._new_id(), tokens) for tokens in fresh]
        node = _Node(self._new_id(), pages, parent, now)
        parent.children[pages[0].tokens] = node
        self._nodes[node.uid] = node
        self.tree_blocks += len(pages)
        self.evictable_blocks += len(pages)  # unlocked until the caller locks it
        self.stats.stored_blocks += len(pages)
        anchor = parent.pages[-1] if parent is not self._root else None
        self.stats.records.append(PagesStored(anchor, tuple(pages)))
        return node

    def _depth(self, node: _Node) -> int:
        depth = 0
        walker: _Node | None = node
        while walker is not None:
            depth += len(walker.pages)
            walker = walker.parent
        return depth

    def _pin(self, node: _Node, delta: int) -> None:
        """Hold (+1) or let go (−1) of one node without touching its access time."""
        if node is self._root:
            return
        if node.lock_ref == 0:
            self.evictable_blocks -= len(node.pages)
        node.lock_ref += delta
        if node.lock_ref == 0:
            self.evictable_blocks += len(node.pages)

    def _lock(self, node: _Node, now: float) -> None:
        walker: _Node | None = node
        while walker is not None and walker is not self._root:
            if walker.lock_ref == 0:
                self.evictable_blocks -= len(walker.pages)
            walker.lock_ref += 1
            walker.last_access_s = now
            walker = walker.parent

    def _unlock(self, node: _Node, now: float) -> None:
        walker: _Node | None = node
        while walker is not None and walker is not self._root:
            walker.lock_ref -= 1
            if walker.lock_ref == 0:
                self.evictable_blocks += len(walker.pages)
            walker.last_access_s = now
            walker = walker.parent

    def _evict(self, need_blocks: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``need_blocks`` pages are free."""
        heap = [
            (n.last_access_s, n.uid, n) for n in self._nodes.values() if not n.children and not n.lock_ref
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < need_blocks and heap:
            _, _, victim = heapq.heappop(heap)
            if not self.evict_whole_nodes and len(victim.pages) > need_blocks - freed:
                freed += self._evict_tail(victim, need_blocks - freed)
                break
            parent = victim.parent
            assert parent is not None
            del parent.children[victim.pages[0].tokens]
            del self._nodes[victim.uid]
            freed += len(victim.pages)
            self.tree_blocks -= len(victim.pages)
            self.evictable_blocks -= len(victim.pages)
            self.stats.evictions += 1
            self.stats.evicted_blocks += len(victim.pages)
            order = victim.pages if self.evict_whole_nodes else list(reversed(victim.pages))
            self.stats.records.append(PagesRemoved(tuple(order)))
            if parent is not self._root and not parent.children and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access_s, parent.uid, parent))
        return freed

    def _evict_tail(self, victim: _Node, count: int) -> int:
        """Evict the last ``count`` pages of leaf ``victim`` (fewer than it has), tail first."""
        gone = victim.pages[-count:]
        del victim.pages[-count:]
        self.tree_blocks -= count
        self.evictable_blocks -= count
        self.stats.evicted_blocks += count
        self.stats.records.append(PagesRemoved(tuple(reversed(gone))))
        return count

    def _drop_tree(self) -> None:
        self._root.children.clear()
        self._nodes.clear()
        self.tree_blocks = 0
        self.evictable_blocks = 0


def coalesce_removals(records: Sequence[CacheRecord]) -> list[CacheRecord]:
    """Merge runs of consecutive :class:`PagesRemoved` into one, as both engines publish them."""
    merged: list[CacheRecord] = []
    for record in records:
        last = merged[-1] if merged else None
        if isinstance(record, PagesRemoved) and isinstance(last, PagesRemoved):
            merged[-1] = PagesRemoved(last.pages + record.pages)
        else:
            merged.append(record)
    return merged
