"""Bulk helpers of the prefix table's deferred bookkeeping (pure: no I/O, no clock, no state).

:class:`~balancer.index.table.PrefixTable` defers work the request path would otherwise do per key,
and settles it later in one pass; these functions make that pass cost about one step per run of
keys instead of one per key, and give exactly what the per-key form gives:

* :func:`first_uses`: the distinct keys of the logged routed chains, in the order of their first
  listing, each with the first chain listing it (``PrefixTable._settle_order`` re-inserts them at
  the end of the LRU order, newest use first; ``SpecSlot.settle`` gives each its newest listing's
  expiry): ``dict.fromkeys`` over every key, minus the lookups of prefixes already listed;
* :func:`group_by_value`: a replica's speculative keys grouped by expiry
  (``PrefixTable._compact_spec_heap`` rebuilds one heap entry per group).

Checked against those plain references in ``tests/unit/test_index_settle.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import compress, islice, repeat
from operator import ne

__all__ = ["first_uses", "group_by_value"]


def first_uses(chains: Iterable[tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """The keys of ``chains`` in the order of their first listing, each mapped to the first chain
    listing it: ``dict.fromkeys(chain.from_iterable(chains))`` with other values, in fewer lookups.

    Routed chains share prefixes (a system prompt, earlier turns): block keys are chained, so a
    chain that lists an earlier chain's key at the same depth lists all its keys before it too.
    Such a leading run is found with a binary search, then proven already listed by comparing it
    with the earlier chain (a C-speed compare, by identity for keys from the same memo) instead of
    a lookup per key; a chain for which the proof fails has every key looked up. So the result is
    exact for any sequences, chained or not."""
    seen: dict[int, tuple[int, ...]] = {}
    contains = seen.__contains__
    for keys in chains:
        count = len(keys)
        if not count:
            continue
        lead = 0  # keys[:lead] are known to be listed already
        if contains(keys[0]):
            if contains(keys[-1]):
                lead = count
            else:  # keys[0] listed, keys[-1] not: the last listed one of the leading run
                low, high = 0, count - 1
                while high - low > 1:
                    mid = (low + high) // 2
                    if contains(keys[mid]):
                        low = mid
                    else:
                        high = mid
                lead = low + 1
            other = seen[keys[lead - 1]]
            if other is keys:  # listed whole before (a request's two adds): nothing to compare
                pass
            elif lead == count == len(other):  # the same keys again (a repeated prompt): no slices
                lead = count if other == keys else 0
            elif len(other) < lead or other[:lead] != keys[:lead]:
                lead = 0
        if lead < count:  # a key listed already keeps its first chain (``setdefault``, at C speed)
            deque(map(seen.setdefault, keys[lead:] if lead else keys, repeat(keys)), maxlen=0)
    return seen


def group_by_value(expiry: dict[int, float]) -> dict[float, list[int]]:
    """The keys of ``expiry`` grouped by their value: the groups in the order of their first key,
    each group's keys in the dict's order. The keys of one add are mostly adjacent with one shared
    value, so the runs of equal values are found at C speed and the loop is per run, not per key."""
    keys = list(expiry)
    values = list(expiry.values())
    if not keys:
        return {}
    starts = [0, *compress(range(1, len(values)), map(ne, islice(values, 1, None), values))]
    groups: dict[float, list[int]] = {}
    for start, stop in zip(starts, [*starts[1:], len(keys)], strict=True):
        run = keys[start:stop]
        found = groups.get(values[start])
        if found is None:
            groups[values[start]] = run
        else:
            found.extend(run)
    return groups
