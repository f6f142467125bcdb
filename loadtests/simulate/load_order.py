"""A lazy heap of replicas ordered by a load key, for the simulator's candidate pruning (pure).

Randomness only from the passed ``random.Random`` (tie order among equal keys). See
:mod:`loadtests.simulate.routing` for how the orders bound the policy's choice.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable

from balancer.types import ReplicaId


class LoadOrder:
    """Replicas ordered by a load key (a lazy heap). Among equal keys the order is random with an
    ``rng``, else by replica name: then it depends only on the current keys, not on how many
    updates led there."""

    def __init__(self, rng: random.Random | None) -> None:
        self._rng = rng
        self._heap: list[tuple[float, float, ReplicaId, int]] = []
        self._version: dict[ReplicaId, int] = {}

    def update(self, replica: ReplicaId, key: float) -> None:
        version = self._version.get(replica, 0) + 1
        self._version[replica] = version
        tie = self._rng.random() if self._rng is not None else 0.0
        heapq.heappush(self._heap, (key, tie, replica, version))
        if len(self._heap) > 4 * len(self._version) + 64:
            self._heap = [e for e in self._heap if self._version[e[2]] == e[3]]
            heapq.heapify(self._heap)

    def discard(self, replica: ReplicaId) -> None:
        """Take ``replica`` out of the order (its entries become stale)."""
        if replica in self._version:
            self._version[replica] += 1

    def least(
        self,
        count: int,
        eligible: Callable[[ReplicaId], bool],
        bound: Callable[[float, ReplicaId], float] | None = None,
        best: float = math.inf,
        offset: float = 0.0,
    ) -> tuple[list[ReplicaId], float]:
        """Up to ``count`` eligible replicas with the lowest keys (the heap is left as it was).

        With ``bound`` (a replica's cost given its key; never below the key) the scan goes on past
        ``count`` while the next key is below the lowest bound seen (starting from ``best``), so
        every replica that could cost less is returned. Returns the replicas and that lowest bound.
        """
        keyed, best = self._scan(count, eligible, bound, best, offset)
        return [replica for _, replica in keyed], best

    def least_keyed(self, count: int, eligible: Callable[[ReplicaId], bool]) -> list[tuple[float, ReplicaId]]:
        """Up to ``count`` eligible replicas with the lowest keys, with their keys."""
        return self._scan(count, eligible, None, math.inf, 0.0)[0]

    def _scan(
        self,
        count: int,
        eligible: Callable[[ReplicaId], bool],
        bound: Callable[[float, ReplicaId], float] | None,
        best: float,
        offset: float,
    ) -> tuple[list[tuple[float, ReplicaId]], float]:
        heap = self._heap
        popped: list[tuple[float, float, ReplicaId, int]] = []
        chosen: list[tuple[float, ReplicaId]] = []
        while heap and (len(chosen) < count or (bound is not None and heap[0][0] + offset < best)):
            entry = heapq.heappop(heap)
            if self._version.get(entry[2]) != entry[3]:
                continue  # superseded by a later update
            popped.append(entry)
            if eligible(entry[2]):
                chosen.append((entry[0], entry[2]))
                if bound is not None:
                    best = min(best, bound(entry[0], entry[2]))
        for entry in popped:
            heapq.heappush(heap, entry)
        return chosen, best

    def has_below(self, key: float) -> bool:
        """Whether a replica may have a key below ``key`` (the heap's top is a lower bound)."""
        return bool(self._heap) and self._heap[0][0] < key
