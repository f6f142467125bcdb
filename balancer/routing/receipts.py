"""Receipts: every response's cached-token report checked against the route's prediction (pure).

An engine that answers with ``usage.prompt_tokens_details.cached_tokens`` says how much of the
prompt it found in its prefix cache when it admitted the request. The router predicted that figure
when it chose the replica (:attr:`RoutePlan.cached_tokens <balancer.routing.router.RoutePlan>`,
kept on the :class:`~balancer.routing.router.Lease`). :func:`read_receipt` compares the two in the
replica's blocks and names the keys they disagree on:

* **fewer** reported than predicted: ``stale`` is the request's keys from the reported point to the
  predicted one, which the index said the replica held and the engine did not have;
* **more** reported than predicted: ``unseen`` is the request's keys from the predicted point to the
  reported one, which the engine had and the index did not know of.

What the router does with them is :meth:`PoolRouter.settle_receipt
<balancer.routing.router.PoolRouter.settle_receipt>`. :class:`ReceiptBook` keeps the last
``window`` errors of each replica for ``/admin/replicas`` (bounded: one window per replica of the
pool, forgotten with the replica), and when the replica last computed new prompt blocks
(:class:`ComputedMarks`), which tells a publisher that stopped from an engine that had nothing to
publish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from balancer.types import BlockKey, ReplicaId

RECEIPT_WINDOW = 256
"""Receipts kept per replica for its accuracy in ``/admin/replicas`` (the last ones)."""
COMPUTED_MARKS = 16
"""Marks :class:`ComputedMarks` keeps per replica (the newest; each spans at least its spacing)."""


@dataclass(frozen=True, slots=True)
class Receipt:
    """One response's report against the route's prediction, in the replica's own blocks."""

    replica: ReplicaId
    block_size: int
    """Tokens per block of the replica (its key space)."""
    predicted_blocks: int
    """Blocks the router predicted cached on the replica at route time (speculative ones included)."""
    reported_blocks: int
    """Full blocks of the engine's ``cached_tokens``."""
    stale: tuple[BlockKey, ...] = ()
    """The request's keys ``[reported, predicted)`` (empty unless fewer were reported)."""
    unseen: tuple[BlockKey, ...] = ()
    """The request's keys ``[predicted, reported)`` (empty unless more were reported)."""

    @property
    def error_blocks(self) -> int:
        """Reported minus predicted blocks: negative when the index promised blocks the engine did
        not have, positive when the engine had blocks the index did not know of."""
        return self.reported_blocks - self.predicted_blocks

    @property
    def exact(self) -> bool:
        return self.reported_blocks == self.predicted_blocks

    @property
    def within_one_block(self) -> bool:
        return abs(self.reported_blocks - self.predicted_blocks) <= 1


def read_receipt(
    replica: ReplicaId,
    keys: tuple[BlockKey, ...],
    block_size: int,
    predicted_tokens: int,
    reported_tokens: int,
) -> Receipt:
    """Compare ``reported_tokens`` (the engine's ``cached_tokens``) with ``predicted_tokens`` for a
    request whose block keys on ``replica`` are ``keys``. Token counts are cut to full blocks; keys
    beyond the request's own are never named."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    predicted = max(0, predicted_tokens) // block_size
    reported = max(0, reported_tokens) // block_size
    stale: tuple[BlockKey, ...] = ()
    unseen: tuple[BlockKey, ...] = ()
    if reported < predicted:
        stale = keys[reported:predicted]
    elif reported > predicted:
        unseen = keys[predicted:reported]
    return Receipt(replica, block_size, predicted, reported, stale, unseen)


@dataclass(frozen=True, slots=True)
class Settled:
    """What one receipt changed: the comparison, and the index corrections it made."""

    receipt: Receipt
    dropped_blocks: int = 0
    """Real holdings of the replica dropped (stale keys the engine has not stored again since)."""
    learned_blocks: int = 0
    """Keys the engine had and the index did not know of, added as speculative entries."""
    confirmed_blocks: int = 0
    """Suspect holdings of the replica (after an event gap) that the receipt confirmed, and suspect
    blocks dropped unconfirmed that it showed still cached (held again)."""
    taught_blocks: int = 0
    """Blocks the index lacked and now holds under the engine's own hashes, computed by kvlb."""


@dataclass(frozen=True, slots=True)
class ReceiptStats:
    """A replica's last receipts (at most :data:`RECEIPT_WINDOW`)."""

    receipts: int
    exact: int
    within_one_block: int
    mean_error_blocks: float | None
    """Mean of reported minus predicted blocks (``None`` with no receipt)."""

    @property
    def accuracy(self) -> float | None:
        """Share of the window's receipts whose prediction was exact (``None`` with no receipt)."""
        return self.exact / self.receipts if self.receipts else None

    @property
    def within_one_block_share(self) -> float | None:
        return self.within_one_block / self.receipts if self.receipts else None


class ReceiptBook:
    """The last ``window`` prediction errors of each replica (bounded per replica).

    Each replica's window keeps running totals (receipts exact, within one block, the errors' sum)
    updated as errors enter and leave it, so :meth:`stats` and :meth:`accuracy` (read on every receipt
    for ``kvlb_route_prediction_accuracy_ratio``) cost the same whatever the window."""

    def __init__(self, window: int = RECEIPT_WINDOW) -> None:
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        self.window = window
        self._errors: dict[ReplicaId, _Window] = {}
        self.computed = ComputedMarks()
        """When each replica last computed new prompt blocks (its own receipts)."""

    def record(self, receipt: Receipt) -> None:
        errors = self._errors.get(receipt.replica)
        if errors is None:
            errors = self._errors[receipt.replica] = _Window(self.window)
        errors.add(receipt.error_blocks)

    def stats(self, replica: ReplicaId) -> ReceiptStats:
        errors = self._errors.get(replica)
        if errors is None or not errors.values:
            return ReceiptStats(receipts=0, exact=0, within_one_block=0, mean_error_blocks=None)
        count = len(errors.values)
        return ReceiptStats(
            receipts=count,
            exact=errors.exact,
            within_one_block=errors.within_one_block,
            mean_error_blocks=errors.total / count,
        )

    def accuracy(self, replica: ReplicaId) -> float | None:
        """``stats(replica).accuracy`` without building the stats (read on every receipt)."""
        errors = self._errors.get(replica)
        if errors is None or not errors.values:
            return None
        return errors.exact / len(errors.values)

    def forget(self, replica: ReplicaId) -> None:
        self._errors.pop(replica, None)
        self.computed.forget(replica)


class _Window:
    """One replica's last errors and their running totals (what :meth:`ReceiptBook.stats` reads)."""

    __slots__ = ("exact", "total", "values", "within_one_block")

    def __init__(self, size: int) -> None:
        self.values: deque[int] = deque(maxlen=size)
        self.exact = 0
        self.within_one_block = 0
        self.total = 0

    def add(self, error: int) -> None:
        values = self.values
        if len(values) == values.maxlen:
            self._count(values[0], -1)  # the oldest leaves as this one enters
        values.append(error)
        self._count(error, 1)

    def _count(self, error: int, sign: int) -> None:
        self.total += sign * error
        if error == 0:
            self.exact += sign
        if -1 <= error <= 1:
            self.within_one_block += sign


@dataclass(frozen=True, slots=True)
class ComputedSince:
    """What a replica computed in the requests decided after a moment (:meth:`ComputedMarks.since`)."""

    first_wall_s: float
    """Wall-clock seconds of the earliest of those decisions kept (at most one spacing late)."""
    blocks: int
    """New prompt blocks those requests computed (at least: a mark that began before the moment is
    not counted)."""


class ComputedMarks:
    """When each replica was given requests that computed new prompt blocks (their receipts' reported
    ``cached_tokens`` below the prompt's reusable blocks): marks of ``(decision wall time, blocks)``,
    a new one only once the newest is ``spacing_s`` old, the newest :data:`COMPUTED_MARKS` kept per
    replica. An engine that computed blocks stores them and publishes them: no event batch after such
    a decision, for long, means its publisher stopped. The marks kept span at least
    ``(COMPUTED_MARKS - 1) × spacing_s``, so the earliest decision after a batch is found at most one
    spacing late while the batch is younger than that."""

    def __init__(self, max_marks: int = COMPUTED_MARKS) -> None:
        if max_marks <= 0:
            raise ValueError(f"max_marks must be > 0, got {max_marks}")
        self.max_marks = max_marks
        self._marks: dict[ReplicaId, deque[list[float]]] = {}

    def add(self, replica: ReplicaId, decided_wall_s: float, blocks: int, spacing_s: float) -> None:
        """A request decided at ``decided_wall_s`` computed ``blocks`` new prompt blocks on ``replica``."""
        if blocks <= 0:
            return
        marks = self._marks.get(replica)
        if marks is None:
            marks = self._marks[replica] = deque(maxlen=self.max_marks)
        if marks and decided_wall_s - marks[-1][0] < spacing_s:
            marks[-1][1] += blocks  # within the newest mark's span (or decided before it: later is safe)
        else:
            marks.append([decided_wall_s, float(blocks)])

    def since(self, replica: ReplicaId, after_wall_s: float) -> ComputedSince | None:
        """The marks of ``replica`` that began after ``after_wall_s``; ``None``: none."""
        marks = self._marks.get(replica)
        if not marks:
            return None
        later = [mark for mark in marks if mark[0] > after_wall_s]
        if not later:
            return None
        return ComputedSince(first_wall_s=later[0][0], blocks=int(sum(mark[1] for mark in later)))

    def forget(self, replica: ReplicaId) -> None:
        self._marks.pop(replica, None)
