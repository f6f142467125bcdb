"""Request-by-request agreement of two runs of the same stream (pure: no I/O, no clock).

``kvlb capacity --confirm`` runs the same requests in the simulator and on the emulated fleet. Their
TTFT percentiles can differ for two reasons: the router decided differently (it saw events and
loads at other times), or the replicas served the same decisions differently (cache, scheduler,
timing). :func:`compare` separates them, per request:

* ``same_replica_share``: requests placed on the same replica in both runs, under the relabelling of
  replicas that maximizes it (the replicas are identical and start empty, so which one a router
  calls ``r0`` is arbitrary; a replay keeps the labels and scores 1.0);
* ``first_divergence``: the first request (in arrival order) placed differently under that relabelling;
* ``same_cached_share``: requests whose cached prompt tokens agree within one block, and the shares
  with more or fewer cached tokens in the second run;
* TTFT: the median and p90 of the per-request difference (second − first, model seconds) and the
  share of requests more than ``slow_s`` slower in the second run.

:func:`followers` classifies one run's requests by where they went against their group's previous
request (a tenant's next question follows its context, or not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtests.stats import RequestRecord, percentile

MAX_RELABEL_REPLICAS = 16
"""Replica labels matched exactly (bitmask DP, O(n·2ⁿ)); larger fleets keep their labels as they are."""


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One request of one run, in model time; ``index`` is its position in the stream."""

    index: int
    replica: str | None
    ttft_s: float | None
    cached_tokens: int | None


def rows_of(
    records: Sequence[RequestRecord], index_of: Mapping[str, int], time_scale: float = 1.0
) -> list[RequestRow]:
    """``records`` as rows: ``index_of`` maps a record's ``request_id`` to the stream position (records
    not in it are left out); TTFTs are multiplied by ``time_scale`` (fleet wall → model seconds)."""
    rows = []
    for record in records:
        index = index_of.get(record.request_id)
        if index is None:
            continue
        ttft = None if record.ttft_s is None else record.ttft_s * time_scale
        rows.append(RequestRow(index, record.replica, ttft, record.cached_tokens))
    return sorted(rows, key=lambda r: r.index)


def best_relabelling(pairs: Sequence[tuple[str, str]]) -> tuple[dict[str, str], int]:
    """The one-to-one map of first-run labels to second-run labels that maximizes the pairs it keeps
    equal, and that count. Exact for up to :data:`MAX_RELABEL_REPLICAS` labels per side."""
    left = sorted({a for a, _ in pairs})
    right = sorted({b for _, b in pairs})
    counts: dict[tuple[str, str], int] = {}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    if len(left) > MAX_RELABEL_REPLICAS or len(right) > MAX_RELABEL_REPLICAS:
        same = {a: a for a in left}
        return same, sum(n for (a, b), n in counts.items() if a == b)
    size = max(len(left), len(right))
    lefts: list[str | None] = [*left, *[None] * (size - len(left))]
    rights: list[str | None] = [*right, *[None] * (size - len(right))]
    # best[mask]: the most pairs kept by mapping the first popcount(mask) left labels onto the right
    # labels in mask; choice[mask]: the right label the last of them took
    best = [-1] * (1 << size)
    choice = [0] * (1 << size)
    best[0] = 0
    for mask in range(1 << size):
        i = mask.bit_count()
        if best[mask] < 0 or i == size:
            continue
        for j in range(size):
            if mask >> j & 1:
                continue
            a, b = lefts[i], rights[j]
            value = best[mask] + (0 if a is None or b is None else counts.get((a, b), 0))
            if value > best[mask | 1 << j]:
                best[mask | 1 << j] = value
                choice[mask | 1 << j] = j
    mapping: dict[str, str] = {}
    mask = (1 << size) - 1
    while mask:
        j = choice[mask]
        a, b = lefts[mask.bit_count() - 1], rights[j]
        if a is not None and b is not None:
            mapping[a] = b
        mask &= ~(1 << j)
    return mapping, best[(1 << size) - 1]


def compare(
    first: Sequence[RequestRow],
    second: Sequence[RequestRow],
    *,
    block_tokens: int,
    slow_s: float = 0.5,
) -> dict[str, Any]:
    """How ``second`` agrees with ``first`` request by request (module docstring). Only requests
    present and answered in both count; ``requests`` says how many."""
    by_index = {r.index: r for r in first}
    both = [(by_index[r.index], r) for r in second if r.index in by_index]
    placed = [(a, b) for a, b in both if a.replica is not None and b.replica is not None]
    mapping, kept = best_relabelling([(str(a.replica), str(b.replica)) for a, b in placed])
    diverged = [a.index for a, b in placed if mapping.get(str(a.replica)) != b.replica]
    cached = [
        (a.cached_tokens, b.cached_tokens)
        for a, b in both
        if a.cached_tokens is not None and b.cached_tokens is not None
    ]
    within = sum(1 for x, y in cached if abs(x - y) < block_tokens)
    more = sum(1 for x, y in cached if y - x >= block_tokens)
    diffs = sorted(b.ttft_s - a.ttft_s for a, b in both if a.ttft_s is not None and b.ttft_s is not None)
    same_placed = [(a, b) for a, b in placed if mapping.get(str(a.replica)) == b.replica]
    same_place_diffs = sorted(
        b.ttft_s - a.ttft_s for a, b in same_placed if a.ttft_s is not None and b.ttft_s is not None
    )
    return {
        "requests": len(both),
        "same_replica_share": kept / len(placed) if placed else None,
        "same_replica_share_as_labelled": (
            sum(1 for a, b in placed if a.replica == b.replica) / len(placed) if placed else None
        ),
        "first_divergence": min(diverged) if diverged else None,
        "same_cached_share": within / len(cached) if cached else None,
        "more_cached_share": more / len(cached) if cached else None,
        "fewer_cached_share": (len(cached) - within - more) / len(cached) if cached else None,
        "ttft_diff_p50_s": percentile(diffs, 50),
        "ttft_diff_p90_s": percentile(diffs, 90),
        "ttft_diff_p10_s": percentile(diffs, 10),
        "slower_share": sum(1 for d in diffs if d > slow_s) / len(diffs) if diffs else None,
        "faster_share": sum(1 for d in diffs if d < -slow_s) / len(diffs) if diffs else None,
        "same_replica_ttft_diff_p50_s": percentile(same_place_diffs, 50),
    }


def followers(
    rows: Sequence[RequestRow],
    group_of: Sequence[str | None],
    arrival_s: Sequence[float],
    *,
    block_tokens: int,
) -> dict[str, dict[str, int]]:
    """Where each request of a group (a tenant, a session) went relative to the group's previous
    request, and whether it hit the cache (at least one block cached). Four classes: the previous
    request was still before its first token when this one arrived (``pending``: only the
    router's speculative entry can send it to the same replica) or not (``served``), crossed with
    ``same`` or ``other`` replica. ``group_of`` and ``arrival_s`` are by stream position (model s)."""
    by_index = {r.index: r for r in rows}
    last: dict[str, int] = {}
    classes: dict[str, dict[str, int]] = {}
    for index in sorted(by_index):
        row, group = by_index[index], group_of[index]
        if group is None:
            continue
        previous = by_index.get(last.get(group, -1))
        last[group] = index
        if previous is None or previous.ttft_s is None or row.replica is None:
            continue
        pending = arrival_s[index] < arrival_s[previous.index] + previous.ttft_s
        name = (
            f"{'pending' if pending else 'served'}_{'same' if row.replica == previous.replica else 'other'}"
        )
        counts = classes.setdefault(name, {"requests": 0, "hits": 0})
        counts["requests"] += 1
        counts["hits"] += int((row.cached_tokens or 0) >= block_tokens)
    return dict(sorted(classes.items()))
