"""Prefix marks (pure): a prompt's chained block keys at a bounded set of prefix lengths.

The router keeps them with each decision (``RouteRequest.prefix_marks``) so that a what-if replay
(:mod:`balancer.service.replay_cache`) can tell which earlier requests shared a prefix with this one
without keeping every block key: each key of a chained hash stands for its whole prefix, and every
prompt is marked at the same lengths, so two prompts sharing a prefix share its marks.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from operator import itemgetter

from balancer.types import BlockKey

EXACT_MARKS = 16
"""Prefix lengths (reference blocks) 1..16 each get a mark (a power of two: the doublings start at it)."""
MARKS_PER_DOUBLING = 8
"""Past :data:`EXACT_MARKS`, marks per doubling of the prefix length (so a replayed match is at most
1/8 short of the true one); with the full prompt's mark, at most 16 + 8·log2(blocks/16) + 1 marks
(89 for 128k tokens in 16-token blocks)."""


def mark_positions(blocks: int) -> list[int]:
    """The prefix lengths (1-based block counts) marked for a prompt of ``blocks`` full blocks: the
    same lengths for every prompt (so two prompts sharing a prefix share its marks), plus the last.
    Built from ranges, not a step at a time: the router marks every request it routes."""
    positions = list(range(1, min(blocks, EXACT_MARKS - 1) + 1))
    start = EXACT_MARKS
    while start <= blocks:  # [start, 2·start) in MARKS_PER_DOUBLING steps
        positions.extend(range(start, min(2 * start, blocks + 1), max(1, start // MARKS_PER_DOUBLING)))
        start *= 2
    if blocks > 0 and positions[-1] != blocks:
        positions.append(blocks)
    return positions


SHARED_MARKS_BLOCKS = 2**32
"""Prompts of up to this many blocks cut their marked lengths from :data:`_SHARED_POSITIONS` (longer
ones, none in practice, build them with :func:`mark_positions`)."""
_SHARED_POSITIONS = tuple(mark_positions(SHARED_MARKS_BLOCKS))
"""The lengths every prompt of up to :data:`SHARED_MARKS_BLOCKS` blocks is marked at, up to its own
length (then its own length, unless it is one of them): 240 ints (``SHARED_MARKS_BLOCKS`` is one)."""
_SHARED_INDEXES = tuple(p - 1 for p in _SHARED_POSITIONS)


def marked_positions(blocks: int) -> tuple[int, ...]:
    """:func:`mark_positions` as a tuple, cut from the shared sequence (a search and a slice, about
    a third of the instructions of building it: 33,000 for 510 blocks)."""
    if blocks > SHARED_MARKS_BLOCKS:
        return tuple(mark_positions(blocks))
    if blocks <= 0:
        return ()
    positions = _SHARED_POSITIONS[: bisect_right(_SHARED_POSITIONS, blocks)]
    return positions if positions[-1] == blocks else (*positions, blocks)


def prefix_marks(
    keys: Sequence[BlockKey], key_block_tokens: int, reference_block_tokens: int
) -> tuple[tuple[int, int], ...]:
    """``(reference blocks, key)`` pairs of a request's chained block ``keys`` (each stands for its
    whole prefix), at :func:`mark_positions` of the prompt in the keys' own blocks; the length is
    given in reference blocks (the unit of ``Overlap.blocks``). The keys are picked by one
    ``itemgetter`` (76,000 instructions for 510 keys built position by position, 38,000 so)."""
    if not keys or key_block_tokens <= 0 or reference_block_tokens <= 0:
        return ()
    positions = marked_positions(len(keys))
    marked: Sequence[BlockKey]
    if len(positions) > 2 and len(keys) <= SHARED_MARKS_BLOCKS:  # all but the last are shared
        marked = (*itemgetter(*_SHARED_INDEXES[: len(positions) - 1])(keys), keys[-1])
    else:
        marked = [keys[p - 1] for p in positions]
    if key_block_tokens == reference_block_tokens:
        return tuple(zip(positions, marked, strict=True))
    lengths = [p * key_block_tokens // reference_block_tokens for p in positions]
    return tuple(zip(lengths, marked, strict=True))
