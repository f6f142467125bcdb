"""Turning one replica's event batch into one ``APPLY`` script call (pure: no I/O, no clock).

The Redis index cannot hash in Lua, so keys are computed here. A ``Stored`` chains from its parent's
key, which lives in the cache's engine-hash map: either an earlier event of the same batch defines
it (tracked in :attr:`BatchPlan.overlay`), or it comes from Redis. :func:`outside_parents` names the
parents of the second kind; :class:`ParentHints` remembers what this writer stored before, so that
most of them need no read; the rest are read with one pipelined ``HMGET``. ``APPLY`` checks hinted
parents before writing anything (a stale hint makes the call retry with a read) and re-checks every
parent where it is used, under the script's atomicity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import islice

from balancer.events import Cleared, KvEvent, Removed, Resync, Stored, event_blocks, split_chained
from balancer.index.base import ApplyResult
from balancer.index.hashing import BlockHasher, chain_keys
from balancer.index.redis.schema import hex_u64, hex_u64s

ScriptArgs = list[str | int]
Parents = dict[tuple[int, int], int | None]
"""(dp_rank, parent engine hash) → its block key, ``None`` when the cache does not know it."""


def accepts(hasher: BlockHasher, event: Stored) -> bool:
    """Whether a ``Stored`` fits the pool (block size, lookahead, enough tokens)."""
    bs = hasher.block_size
    look = hasher.lookahead_tokens
    return (
        event.block_size == bs
        and event.lookahead_tokens == look
        and len(event.tokens) >= 4 * (len(event.engine_hashes) * bs + look)
    )


def outside_parents(hasher: BlockHasher, events: Sequence[KvEvent]) -> dict[int, set[int]]:
    """Per rank, the parents that no earlier event of the batch surely defines."""
    defined: dict[int, set[int]] = {}
    outside: dict[int, set[int]] = {}
    for event in events:
        if type(event) is Stored:
            if not event.engine_hashes or not accepts(hasher, event):
                continue
            known = defined.setdefault(event.dp_rank, set())
            if event.parent is None or event.parent in known:
                known.update(event.engine_hashes)
            else:
                outside.setdefault(event.dp_rank, set()).add(event.parent)
        elif type(event) is Removed:
            defined.get(event.dp_rank, set()).difference_update(event.engine_hashes)
        else:
            defined.pop(event.dp_rank, None)
    return outside


@dataclass(slots=True)
class BatchPlan:
    """The script operations of one batch and the engine-hash map changes they make."""

    ops: ScriptArgs = field(default_factory=list)
    """``'S' rank parent expected ehs keys`` | ``'R' rank ehs`` | ``'C' rank`` (hex, concatenated)."""
    overlay: dict[int, dict[int, int | None]] = field(default_factory=dict)
    """Per rank, engine hash → key (``None``: removed) as the batch leaves them."""
    cleared: set[int] = field(default_factory=set)
    """Ranks cleared by the batch (their map is ``overlay[rank]`` alone afterwards)."""
    result: ApplyResult = field(default_factory=ApplyResult)
    """Counts decided here: block-size skips, parent skips, clears, resyncs."""


def plan_batch(hasher: BlockHasher, events: Sequence[KvEvent], parents: Parents) -> BatchPlan:
    """Hash every accepted ``Stored`` and encode the batch (skips are counted in ``result``)."""
    plan = BatchPlan()
    result, overlay, ops = plan.result, plan.overlay, plan.ops
    for event in events:
        if type(event) is Stored:
            if not accepts(hasher, event):
                result.skipped_block_size_mismatch += 1
                continue
            if not event.engine_hashes:
                continue
            rank = event.dp_rank
            parent_hex = expected_hex = ""
            if event.parent is None:
                seed = hasher.root_seed(event.lora_name, event.cache_salt)
            else:
                mine = overlay.get(rank, {})
                if event.parent in mine:
                    known = mine[event.parent]
                else:
                    known = None if rank in plan.cleared else parents.get((rank, event.parent))
                if known is None:
                    result.skipped_unknown_parent += 1
                    continue
                seed = known
                parent_hex, expected_hex = hex_u64(event.parent), hex_u64(known)
            count = len(event.engine_hashes)
            keys = chain_keys(seed, event.tokens, hasher.block_size, count, hasher.lookahead_tokens)
            overlay.setdefault(rank, {}).update(zip(event.engine_hashes, keys, strict=True))
            ops += ["S", rank, parent_hex, expected_hex, hex_u64s(event.engine_hashes), hex_u64s(keys)]
        elif type(event) is Removed:
            if event.engine_hashes:
                overlay.setdefault(event.dp_rank, {}).update(dict.fromkeys(event.engine_hashes))
                ops += ["R", event.dp_rank, hex_u64s(event.engine_hashes)]
        elif isinstance(event, Cleared | Resync):
            overlay[event.dp_rank] = {}
            plan.cleared.add(event.dp_rank)
            ops += ["C", event.dp_rank]
            result.cleared_caches += type(event) is Cleared
            result.resyncs += type(event) is Resync
    return plan


class ParentHints:
    """What this writer last stored per cache: engine hash → key, oldest dropped past the cap.

    Only a hint: ``APPLY`` verifies each one used against Redis before writing, so a stale entry
    (another writer, a drop, an eviction's map compaction) costs one retry, never a wrong key.
    ``dropped`` counts the hints dropped past the cap (``kvlb_redis_parent_hints_dropped_total``).
    """

    def __init__(self, per_cache: int) -> None:
        self._per_cache = per_cache
        self._caches: dict[tuple[str, int], dict[int, int]] = {}
        self.dropped = 0
        """Hints dropped, oldest first, past ``per_cache`` (a cache's own clears are not counted)."""

    def take(self, replica: str, outside: dict[int, set[int]]) -> Parents:
        """Remove from ``outside`` the parents hinted for ``replica``; return those hints."""
        found: Parents = {}
        for rank, ehs in outside.items():
            cache = self._caches.get((replica, rank))
            if cache:
                hit = {eh for eh in ehs if eh in cache}
                found.update(((rank, eh), cache[eh]) for eh in hit)
                ehs -= hit
        return found

    def split_known(self, replica: str, rank: int, ehs_hex: list[str]) -> tuple[list[int], list[str]]:
        """The keys hinted for these engine hashes (hex), and the engine hashes not hinted."""
        cache = self._caches.get((replica, rank), {})
        known: list[int] = []
        unknown: list[str] = []
        for eh_hex in ehs_hex:
            key = cache.get(int(eh_hex, 16))
            if key is None:
                unknown.append(eh_hex)
            else:
                known.append(key)
        return known, unknown

    def learn(self, replica: str, plan: BatchPlan) -> None:
        """Record the map changes of a batch that ``APPLY`` accepted."""
        if self._per_cache <= 0:
            return
        for rank in plan.cleared:
            self._caches.pop((replica, rank), None)
        for rank, changes in plan.overlay.items():
            cache = self._caches.setdefault((replica, rank), {})
            for eh, key in changes.items():
                if key is None:
                    cache.pop(eh, None)
                else:
                    cache[eh] = key
            excess = len(cache) - self._per_cache
            if excess > 0:
                for eh in list(islice(cache, excess)):
                    del cache[eh]
                self.dropped += excess

    def forget(self, replica: str) -> None:
        for cache in [c for c in self._caches if c[0] == replica]:
            del self._caches[cache]


def hint_checks(hinted: Parents) -> ScriptArgs:
    """``APPLY``'s check list: ``rank, engine hash, expected key`` per hinted parent."""
    checks: ScriptArgs = []
    for (rank, eh), key in hinted.items():
        checks += [rank, hex_u64(eh), "" if key is None else hex_u64(key)]
    return checks


def split_batch(hasher: BlockHasher, events: Sequence[KvEvent], max_blocks: int) -> list[list[KvEvent]]:
    """The batch as segments of at most ``max_blocks`` blocks each, one ``APPLY`` call apiece.

    A longer accepted ``Stored`` becomes consecutive ``Stored`` pieces, each chained to the previous
    piece's last engine hash (the same keys: the parent's key comes from the map the piece before
    wrote); a longer ``Removed`` becomes pieces. A ``Cleared``/``Resync`` starts a segment, so that
    its cache can be emptied in bounded steps right before it (:data:`scripts.CLEAR_STEP`)."""
    segments: list[list[KvEvent]] = []
    current: list[KvEvent] = []
    size = 0
    for event in events:
        if isinstance(event, Cleared | Resync) and current:
            segments.append(current)
            current, size = [], 0
        for piece in _pieces(hasher, event, max_blocks):
            blocks = event_blocks(piece)
            if current and size + blocks > max_blocks:
                segments.append(current)
                current, size = [], 0
            current.append(piece)
            size += blocks
    if current:
        segments.append(current)
    return segments


def _pieces(hasher: BlockHasher, event: KvEvent, max_blocks: int) -> list[KvEvent]:
    if type(event) is Stored and event.chained:  # the script stores chains: give it the events
        return list(split_chained(event))
    if event_blocks(event) <= max_blocks:
        return [event]
    if type(event) is Removed:
        ehs = event.engine_hashes
        return [Removed(event.dp_rank, ehs[i : i + max_blocks]) for i in range(0, len(ehs), max_blocks)]
    if type(event) is not Stored or not event.engine_hashes or not accepts(hasher, event):
        return [event]  # skipped whole by the script; the ingest cap bounds its size
    pieces: list[KvEvent] = []
    width = 4 * event.block_size
    look = 4 * event.lookahead_tokens
    ehs = event.engine_hashes
    for start in range(0, len(ehs), max_blocks):
        end = min(len(ehs), start + max_blocks)
        parent = event.parent if start == 0 else ehs[start - 1]
        tokens = event.tokens[start * width : end * width + look]
        pieces.append(replace(event, parent=parent, engine_hashes=ehs[start:end], tokens=tokens))
    return pieces


@dataclass(slots=True)
class OpKeys:
    """What one ``APPLY`` call's operations name, so that its ``KEYS`` can be declared."""

    ranks: set[int] = field(default_factory=set)
    """Ranks whose engine-hash map the ops read or write."""
    stored_keys: list[str] = field(default_factory=list)
    """Block keys (hex) the ``S`` ops store."""
    stores: int = 0
    """``S`` ops (each may be followed by an eviction round)."""
    removed_fields: dict[int, list[str]] = field(default_factory=dict)
    """Per rank, the engine hashes (hex) whose current map values the ``R`` ops release. (The values
    an ``S`` may replace are rare: ``APPLY`` names the undeclared ones and is called again.)"""
    cleared: set[int] = field(default_factory=set)
    """Ranks a ``C`` op empties (every value of their map may be released)."""


def op_keys(ops: ScriptArgs, hinted: Parents) -> OpKeys:
    """Walk ``BatchPlan.ops`` (and the hinted parents' ranks) as ``APPLY`` will."""
    out = OpKeys(ranks={rank for rank, _ in hinted})
    i = 0
    while i < len(ops):
        op, rank = ops[i], int(ops[i + 1])
        out.ranks.add(rank)
        if op == "S":
            out.stored_keys.extend(split_hex(str(ops[i + 5])))
            out.stores += 1
            i += 6
        elif op == "R":
            out.removed_fields.setdefault(rank, []).extend(split_hex(str(ops[i + 2])))
            i += 3
        else:
            out.cleared.add(rank)
            i += 2
    return out


def split_hex(joined: str) -> list[str]:
    """Concatenated 16-digit hex values, one string each."""
    return [joined[i : i + 16] for i in range(0, len(joined), 16)]
