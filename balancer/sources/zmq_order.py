"""The order of one ZMQ publisher's stream (pure: no I/O, no clock; the shell applies the actions).

:class:`~balancer.sources.zmq_sub.ZmqEventSource` (the shell: sockets, polls, reconnects) hands
every message of one publisher (one DP rank) to a :class:`StreamOrder` by its seq and payload
digest (``None``: shed, its payload unknown) and does what it answers. It decides:

* **Which seq is next** (:meth:`StreamOrder.expected`): the wanted seq (0, or the resume point)
  before the first batch taken, then the last taken + 1.
* **A live message** (:meth:`StreamOrder.live`): a duplicate of a batch already taken (from a
  replay); a gap, asking the shell to replay from the next wanted seq (then
  :meth:`StreamOrder.delivered` says whether the replay brought the message itself); or the next
  batch, to :meth:`StreamOrder.accept`. A live seq that does not exceed the previous live seq, one
  below the catch-up's start, or a seq the catch-up replayed with another payload is a restarted
  publisher (``Resync(rank, "restart")``, a fresh start); a new epoch the same (``"epoch"``).
  After a dropped flood the next live seq says how many messages went with it: counted as shed,
  taken in order, without a gap.
* **A batch taken** (:meth:`StreamOrder.accept`): what it skips is lost (``Resync(rank, "gap")``);
  a shed one resyncs the rank once per run of shed messages (``"overflow"``), at the stream position
  of the run's first one taken. A shed message's payload is unknown, so it cannot tell a duplicate
  from a restarted publisher's batch at a seq the catch-up replayed: such a message resyncs too.
* **A replayed batch** (:meth:`StreamOrder.replayed`): taken when at or after the next wanted seq;
  a catch-up keeps the newest ``MAX_REPLAYED_DIGESTS`` digests, to tell the first live message's
  duplicate from a restarted publisher's batch at the same seq.
* **A catch-up's merge** (:func:`reads_queued_live`, :func:`queued_live`): when the publisher's
  buffer no longer reaches back to the next wanted seq, the live messages queued on the SUB below
  the answer's first seq are taken first (they are older), the first at or above it is held for
  after the answer.
* **A lost connection** (:meth:`StreamOrder.disconnected`): the rank's blocks dropped
  (``"disconnect"``), the next batch a fresh start from seq 0.

The outputs are :data:`Action` values, in the order the shell must apply them (count, resync);
what the shell does with the batch itself (decode, emit, lag) stays the shell's.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

from balancer.events import ResyncReason

MAX_REPLAYED_DIGESTS = 4096
"""Payload digests a catch-up keeps (its newest batches), to tell a live duplicate from a batch of a
restarted publisher at the same seq; dropped at the first live message."""


@dataclasses.dataclass(frozen=True, slots=True)
class Resynced:
    """Emit ``Resync(rank, reason)`` (and count it)."""

    reason: ResyncReason


@dataclasses.dataclass(frozen=True, slots=True)
class Restarted:
    """The stream shows a new incarnation of the publisher (``why``): say so (a ``Resynced``
    follows)."""

    why: str


@dataclasses.dataclass(frozen=True, slots=True)
class ShedRunStarted:
    """A run of shed messages starts: count it by its cause, warn (a ``Resynced("overflow")``
    follows)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FloodLost:
    """``messages`` went with a dropped flood: count them as shed."""

    messages: int


@dataclasses.dataclass(frozen=True, slots=True)
class Duplicate:
    """A live message already taken from a replay: count it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Gap:
    """A live seq beyond the next wanted one: count the gap."""


Action = Resynced | Restarted | ShedRunStarted | FloodLost | Duplicate | Gap
"""What the shell does for the stream, in order."""

NO_ACTIONS: tuple[Action, ...] = ()


class Live(Enum):
    """What a live message is, once its actions are applied."""

    TAKE = "take"
    """The next batch: :meth:`StreamOrder.accept` it."""
    DUPLICATE = "duplicate"
    """Already taken: drop it."""
    REPLAY = "replay"
    """After a gap: replay from :meth:`StreamOrder.expected`, then accept it unless
    :meth:`StreamOrder.delivered`."""


TAKE, DUPLICATE, REPLAY = Live.TAKE, Live.DUPLICATE, Live.REPLAY
"""The verdicts as module constants (a hot path's comparison need not look up the enum)."""


class Queued(Enum):
    """Where a live message queued on the SUB goes when a catch-up's (or poll's) answer starts above
    the next wanted seq (:func:`reads_queued_live`)."""

    BEFORE = "before"
    """Older than the answer's first batch: taken now, before the answer (a gap before it is not
    replayed: the answer is under way)."""
    AFTER = "after"
    """At or above the answer's first batch: held for after the answer; the messages queued behind
    it stay on the SUB."""


def reads_queued_live(expected: int, answer_first: int) -> bool:
    """Whether the live messages queued on the SUB are read before a catch-up's (or poll's) answer
    whose first batch is ``answer_first``, the stream wanting ``expected`` next: only when the
    publisher's buffer no longer reaches back to ``expected``, so that queued live messages may be
    older than the answer (otherwise the answer comes first and their live copies are duplicates)."""
    return answer_first > expected


def queued_live(seq: int, answer_first: int) -> Queued:
    """A queued live message's place (:func:`reads_queued_live`): taken before an answer whose
    first batch is ``answer_first`` when it is older, else held for after it."""
    return Queued.BEFORE if seq < answer_first else Queued.AFTER


class StreamOrder:
    """The stream position of one publisher (one replica, one DP rank) and what each message does
    to it."""

    def __init__(self, want: int = 0) -> None:
        """``want``: the next seq the index still needs (0: it holds nothing of this rank)."""
        self._want = want
        self.last_seq: int | None = None
        """The last batch taken (``None``: none since the start or the last fresh start)."""
        self.last_digest: int | None = None
        """The payload digest of the last batch taken (``None``: none, or it was shed)."""
        self.live_last: int | None = None
        """The last live seq (``None``: none since the start or the last fresh start)."""
        self.epoch: str | None = None
        """The publisher's epoch (SGLang's topic metadata), once a batch names one."""
        self._caught_up_from: int | None = None
        """The seq a catch-up replay started at, until the first live message: a live seq below it
        means the engine restarted meanwhile (everything published since we subscribed is newer)."""
        self.catching_up = False
        """A catch-up replay is under way."""
        self._replayed: dict[int, int] = {}
        """seq → payload digest of the current catch-up's batches (at most ``MAX_REPLAYED_DIGESTS``)."""
        self._shedding = False
        """The last batch taken was shed: the run's resync is done."""
        self.backlog_dropped = False
        """A flood was dropped with the SUB: the next live seq shows how many messages went with it."""

    def expected(self) -> int:
        """The next seq wanted."""
        return self._want if self.last_seq is None else self.last_seq + 1

    def live(
        self, seq: int, digest: int | None, epoch: str | None, *, may_replay: bool
    ) -> tuple[tuple[Action, ...], Live]:
        """One live message, in the order the SUB received it (``digest`` ``None``: shed;
        ``may_replay``: a gap may be replayed now)."""
        live_last, last_seq = self.live_last, self.last_seq
        if (
            live_last is not None
            and last_seq is not None
            and seq == live_last + 1 == last_seq + 1
            and (epoch is None or epoch == self.epoch)
            and not self.backlog_dropped
            and self._caught_up_from is None
            and not self._replayed
        ):  # the common case, the next batch in order: nothing below can apply
            self.live_last = seq
            return NO_ACTIONS, Live.TAKE
        out: list[Action] = []
        dropped, self.backlog_dropped = self.backlog_dropped, False
        if epoch is not None:
            if self.epoch is not None and epoch != self.epoch:
                self._restart(out, "epoch")
            self.epoch = epoch
        caught_up_from, self._caught_up_from = self._caught_up_from, None
        went_back = self.live_last is not None and seq <= self.live_last
        below_catch_up = caught_up_from is not None and self.last_seq is not None and seq < caught_up_from
        replayed = self._replayed.get(seq) if self.live_last is None else None
        self._replayed = {}
        changed = replayed is not None and digest is not None and replayed != digest
        if went_back or below_catch_up or changed:
            self._restart(out, "restart")
        self.live_last = seq
        expected = self.expected()
        if dropped and seq > expected and self.last_seq is not None:
            # The messages before it went with the dropped flood (its run resynced the rank).
            out.append(FloodLost(seq - expected))
            self.last_seq = seq - 1
            expected = seq
        if seq < expected:
            if self.last_seq is not None:
                out.append(Duplicate())  # already taken from a replay
                if digest is None and replayed is not None:
                    # Shed: its payload cannot tell a duplicate from a restarted publisher's batch.
                    self._shed_run(out)
                return tuple(out), Live.DUPLICATE
            # No state, and the engine is behind our resume point: it restarted meanwhile.
            out.append(Resynced("restart"))
            self._want = expected = seq
        if seq > expected:
            if self.last_seq is not None:
                out.append(Gap())
            if may_replay:
                return tuple(out), Live.REPLAY
        return (tuple(out) if out else NO_ACTIONS), Live.TAKE

    def delivered(self, seq: int) -> bool:
        """After a gap's replay: whether it brought batch ``seq`` (the live copy is then dropped)."""
        return seq < self.expected()

    def accept(self, seq: int, digest: int | None) -> tuple[Action, ...]:
        """Take batch ``seq`` as the next in order; anything skipped before it is lost: resync.
        ``digest`` ``None``: a shed message (no events), whose run resyncs here."""
        out: list[Action] | None = None
        if seq > self.expected():
            out = [Resynced("gap")]
        if digest is None:
            if out is None:
                out = []
            self._shed_run(out)
        else:
            self._shedding = False
        self.last_seq = seq
        self.last_digest = digest
        return NO_ACTIONS if out is None else tuple(out)

    def replayed(self, seq: int, digest: int) -> bool:
        """A replayed batch: whether to take it (:meth:`accept`); a catch-up keeps its digest."""
        if self.catching_up:
            if len(self._replayed) >= MAX_REPLAYED_DIGESTS:
                del self._replayed[next(iter(self._replayed))]
            self._replayed[seq] = digest
        return seq >= self.expected()

    def catch_up_started(self) -> int:
        """A new connection's catch-up replay starts: returns the seq it asks from."""
        start = self.expected()
        self._caught_up_from = start
        self.catching_up = True
        self._replayed = {}
        return start

    def catch_up_ended(self) -> None:
        """The catch-up's replay is over (its digests stay until the first live message)."""
        self.catching_up = False

    def shed_run(self) -> tuple[Action, ...]:
        """A shed message not taken in order (a flood's first, already counted): its run resyncs
        unless it already did."""
        out: list[Action] = []
        self._shed_run(out)
        return tuple(out)

    def drop_backlog(self) -> tuple[Action, ...]:
        """A flood is dropped with the SUB: its run resyncs (once); the next live seq shows how many
        messages went with it."""
        out = self.shed_run()
        self.backlog_dropped = True
        return out

    def disconnected(self) -> tuple[tuple[int, int | None, str | None] | None, tuple[Action, ...]]:
        """The connection dropped: the last batch taken, its digest and the epoch (``None``: none
        taken), and the actions (a ``"disconnect"`` resync when the stream had begun; then a
        fresh start)."""
        if self.live_last is None and self.last_seq is None:
            return None, NO_ACTIONS
        lost = None if self.last_seq is None else (self.last_seq, self.last_digest, self.epoch)
        out: list[Action] = []
        self._forget(out, "disconnect")
        return lost, tuple(out)

    def _restart(self, out: list[Action], reason: ResyncReason) -> None:
        """The stream shows a new incarnation of the publisher (seq regression, new epoch)."""
        out.append(Restarted(f"{reason} after seq {self.last_seq}"))
        self._forget(out, reason)

    def _forget(self, out: list[Action], reason: ResyncReason) -> None:
        """Drop the rank's blocks and stream state: the next batch is taken as a fresh start."""
        out.append(Resynced(reason))
        self.last_seq = None
        self.live_last = None
        self.last_digest = None
        self._replayed = {}
        self._want = 0
        self.backlog_dropped = False  # the next batch is a fresh start, not a dropped flood's next

    def _shed_run(self, out: list[Action]) -> None:
        """A shed message: the first of a run resyncs the rank (its lost removals could otherwise
        leave stale blocks), the rest of the run need not."""
        if self._shedding:
            return
        self._shedding = True
        out.append(ShedRunStarted())
        out.append(Resynced("overflow"))
