"""A mergeable summary of positive durations (pure, no I/O, no clock): fixed log-scale buckets.

The console's series keeps one per interval for its TTFT percentiles (:mod:`balancer.service.series`),
so the workers of ``kvlb serve --workers N`` can send theirs and the service's percentiles come
from the counts added (:meth:`LogHistogram.merge`), not from the highest worker's.

Bucket ``i`` (0 ≤ i < :data:`BUCKETS`) holds the values in ``[MIN_S·RATIO^i, MIN_S·RATIO^(i+1))``
and stands for their harmonic mid-point ``2·MIN_S·RATIO^(i+1)/(1+RATIO)``. A quantile is the
nearest-rank one over the buckets, so it is that mid-point of the bucket the exact nearest-rank
value lies in: within :data:`RELATIVE_ERROR` (``(RATIO−1)/(RATIO+1)``, 4.76 %) of it, whatever
the data and however many histograms were merged. Values below :data:`MIN_S` (0.1 ms) are counted
in bucket 0 and values at or above :data:`MAX_S` (about 10,700 s, 3 h) in the last: outside that range
the bound does not hold.

Bounded: at most :data:`BUCKETS` (194) counters, from the lowest bucket hit to the highest. The
wire form (:meth:`LogHistogram.to_json`) is ``[first, count_first, count_first+1, ...]``:
the index of the lowest bucket hit, then the counts up to the highest one hit (``[]`` when empty).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from typing import Any

MIN_S = 1e-4
"""The lower edge of bucket 0 (seconds); smaller values are counted there."""
RATIO = 1.1
"""Upper edge ÷ lower edge of every bucket."""
BUCKETS = 194
"""Buckets in all: ``MIN_S·RATIO^194`` is about 10,700 s."""
MAX_S = MIN_S * RATIO**BUCKETS
"""The upper edge of the last bucket (seconds); larger values are counted there."""
RELATIVE_ERROR = (RATIO - 1.0) / (RATIO + 1.0)
"""Most a quantile differs from the exact nearest-rank one, relative to it (within MIN_S..MAX_S)."""
_LOG_RATIO = math.log(RATIO)
_MID = 2.0 * RATIO / (1.0 + RATIO)


def bucket_of(value: float) -> int:
    """The bucket ``value`` (finite, ≥ 0) is counted in."""
    if value < MIN_S:
        return 0
    index = int(math.log(value / MIN_S) / _LOG_RATIO)
    return min(index, BUCKETS - 1)


def bucket_value(index: int) -> float:
    """The value bucket ``index`` stands for (its harmonic mid-point)."""
    return MIN_S * RATIO**index * _MID


class LogHistogram:
    """Counts of values per bucket (see the module docstring), held dense from the lowest bucket hit
    to the highest (at most :data:`BUCKETS` integers), so merging is adding two runs of counts."""

    __slots__ = ("counts", "first", "total")

    def __init__(self) -> None:
        self.first = 0
        """The bucket ``counts[0]`` counts."""
        self.counts: list[int] = []
        """Values counted per bucket, from bucket :attr:`first` on (empty: none counted)."""
        self.total = 0
        """Values counted in all."""

    def add(self, value: float) -> None:
        """Count ``value``; a value that is not finite or is negative is ignored."""
        if not math.isfinite(value) or value < 0:
            return
        self._count(bucket_of(value), 1)

    def _count(self, index: int, count: int) -> None:
        counts = self.counts
        if not counts:
            self.first = index
            counts.append(0)
        elif index < self.first:
            counts[:0] = [0] * (self.first - index)
            self.first = index
        elif index >= self.first + len(counts):
            counts.extend([0] * (index - self.first - len(counts) + 1))
        counts[index - self.first] += count
        self.total += count

    def merge(self, other: LogHistogram) -> None:
        """Add ``other``'s counts to these."""
        if not other.counts:
            return
        if not self.counts:
            self.first, self.counts, self.total = other.first, list(other.counts), other.total
            return
        self._count(other.first, 0)  # widen the run to cover other's
        self._count(other.first + len(other.counts) - 1, 0)
        start = other.first - self.first
        end = start + len(other.counts)
        self.counts[start:end] = map(operator.add, self.counts[start:end], other.counts)
        self.total += other.total

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile (0..1) of the values counted, within
        :data:`RELATIVE_ERROR`; ``None`` when none were."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs: tuple[float, ...]) -> list[float | None]:
        """:meth:`quantile` of each of ``qs``, from one pass over the counts."""
        if self.total == 0:
            return [None] * len(qs)
        running = list(itertools.accumulate(self.counts))
        last = len(running) - 1
        return [
            bucket_value(
                self.first + min(last, bisect.bisect_left(running, max(1, math.ceil(q * self.total))))
            )
            for q in qs
        ]

    def to_json(self) -> list[int]:
        """The wire form: ``[first, counts from bucket first to the highest bucket hit...]``."""
        return [self.first, *self.counts] if self.counts else []

    @classmethod
    def from_json(cls, wire: Any) -> LogHistogram:
        """The histogram :meth:`to_json` gave; ``ValueError`` for anything else."""
        made = cls()
        if not isinstance(wire, list) or len(wire) == 1 or len(wire) > BUCKETS + 1:
            raise ValueError("a histogram is [first bucket, counts...]: a list of at most 195 integers")
        if not wire:
            return made
        first = wire[0]
        try:
            total = sum(wire) - first
            ok = type(first) is int and type(total) is int and min(wire) >= 0
        except TypeError:
            ok = False
        if not ok or first + len(wire) - 1 > BUCKETS:
            raise ValueError("a histogram is [first bucket, counts...] of integers >= 0 within the buckets")
        made.first, made.counts, made.total = first, wire[1:], total
        return made
