"""The what-if's model of the load the replayed decisions would have put on replicas (pure).

Each :class:`~balancer.service.decisions.DecisionRecord` keeps the load snapshot the policy read:
the router-tracked load of the decisions actually made. A replay that sends a request elsewhere
would, in a real run, have made its new replica busier and its old one idler for as long as that
request's load was held, and the next decisions would have read that (a replica that gains traffic
looks busier and pushes back). Read as recorded, nothing pushed back: the largest error of a
predicted replica share on a small ``tenants`` stream was 25.5 points (docs/operations.md, "What-if").

:class:`ReplayLoad` moves each replayed decision's load from the recorded replica to the replayed
one for the span the real request held it, as the router's :class:`~balancer.load.tracker.LoadTracker`
counts it: its uncached prompt tokens as pending prefill until its first token
(:attr:`DecisionRecord.prefill_s <balancer.service.decisions.DecisionRecord.prefill_s>`), then its
KV blocks as decode load until its release (``held_s``), as its OpenAI ``n`` sequences
(:attr:`DecisionRecord.sequences <balancer.service.decisions.DecisionRecord.sequences>`) in both
phases, as the tracker and the baselines' ``seq_load`` count them; its recorded decode blocks
already hold ``n × max_tokens``. Each later decision reads the recorded
snapshot with those moves applied (:meth:`ReplayLoad.load`, at the snapshot's own ``now``). The
sizes on the replayed side follow the replayed prediction: a request that finds less of its prompt
cached there prefills (and holds) that many more tokens. A decision replayed as recorded moves
nothing, so the weights in force still reproduce every decision.

What it cannot know: how long the request would have taken on its new replica (the recorded spans
are kept: a busier replica would have been slower), and the engines' scraped gauges (waiting
requests, KV usage), which stay as recorded. A request still in flight when the replay was asked
(no ``held_s``) holds its moved load to the end of the window.

Bounded: at most ``max_moves`` moves are held at once (:data:`MAX_LOAD_MOVES`); a decision past
that bound is not moved, counted in :attr:`ReplayLoad.unmodelled`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.types import Decision, ReplicaId

MAX_LOAD_MOVES = 65_536
"""Moves held at once at most (about 440 B a move traced with its two events, 8 B of them the
``sequences`` slot: 29 MB at the bound). A move is held while its request's load was (its
``held_s``), so this bounds the requests in flight at once whose placement the replay changed; the
default of the tracker's ``max_tracked_requests``."""


@dataclass(slots=True)
class _Counts:
    """One replica's load change (replayed minus recorded), in the tracker's units."""

    prefill_seqs: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    decode_blocks: int = 0

    def is_zero(self) -> bool:
        return not (self.prefill_seqs or self.prefill_tokens or self.decode_seqs or self.decode_blocks)


@dataclass(frozen=True, slots=True)
class LoadMove:
    """One decision's load, as recorded and as replayed, and when it changed phase (the replay's
    clock: the records' load snapshot seconds)."""

    recorded: ReplicaId
    replayed: ReplicaId
    recorded_prefill_tokens: int
    replayed_prefill_tokens: int
    recorded_decode_blocks: int
    replayed_decode_blocks: int
    sequences: int
    """OpenAI's ``n`` of the request: the sequences it counts in either phase (at least 1)."""
    first_token_at: float
    """When its prefill load became decode load (``inf``: never within the window)."""
    released_at: float
    """When its load left (``inf``: in flight at the end of the window)."""


@dataclass(slots=True)
class ReplayLoad:
    """The replay's load changes along the records (module docstring). For each record, call
    :meth:`load` on its snapshot, decide on what it returns, then :meth:`move` its decision."""

    max_moves: int = MAX_LOAD_MOVES
    """The bound on :attr:`held`."""
    changes: dict[ReplicaId, _Counts] = field(default_factory=dict)
    """Per replica, the load the replay adds (negative: removes) at the current time."""
    events: list[tuple[float, int, bool, LoadMove]] = field(default_factory=list)
    """A heap of ``(at, seq, released, move)``: first tokens and releases still to apply."""
    held: int = 0
    """Moves whose load is still changed (released ones are not)."""
    unmodelled: int = 0
    """Decisions with a load to move that were not moved, :attr:`max_moves` being held."""
    moved: int = 0
    """Decisions whose load was moved (the count of :meth:`move` calls that changed something)."""
    moved_seqs: int = 0
    """Sequences of those decisions (each counts its OpenAI ``n``)."""
    _seq: int = 0

    def advance(self, now: float) -> None:
        """Apply the first tokens and releases up to ``now`` (inclusive)."""
        events = self.events
        while events and events[0][0] <= now:
            _, _, released, move = heapq.heappop(events)
            if released:
                self._apply(move, decoding=move.first_token_at < move.released_at, sign=-1)
                self.held -= 1
            else:  # the prefill part leaves, the decode part comes
                self._apply(move, decoding=False, sign=-1)
                self._apply(move, decoding=True, sign=+1)

    def load(self, snapshot: LoadSnapshot) -> LoadSnapshot:
        """``snapshot`` with the load the replay moved up to its ``now`` (the snapshot itself when
        nothing is moved then)."""
        self.advance(snapshot.now)
        if not self.changes:
            return snapshot
        replicas = dict(snapshot.replicas)
        block_size = snapshot.block_size_tokens
        for replica, change in self.changes.items():
            base = snapshot.of(replica)
            tokens = max(0, base.pending_prefill_tokens + change.prefill_tokens)
            replicas[replica] = ReplicaLoad(
                replica=replica,
                pending_prefill_seqs=max(0, base.pending_prefill_seqs + change.prefill_seqs),
                pending_prefill_tokens=tokens,
                pending_prefill_blocks=tokens / block_size,
                active_decode_seqs=max(0, base.active_decode_seqs + change.decode_seqs),
                active_decode_blocks=max(0, base.active_decode_blocks + change.decode_blocks),
                waiting_reqs=base.waiting_reqs,
                running_reqs=base.running_reqs,
                kv_usage=base.kv_usage,
                stats_age_s=base.stats_age_s,
                capacity_blocks=base.capacity_blocks,
                peer_seqs=base.peer_seqs,
            )
        return LoadSnapshot(now=snapshot.now, block_size_tokens=block_size, replicas=replicas)

    def move(
        self,
        now: float,
        recorded: Decision,
        replayed: Decision,
        *,
        prefill_tokens: int,
        decode_blocks: int,
        block_size: int,
        prefill_s: float | None,
        held_s: float | None,
        sequences: int = 1,
    ) -> bool:
        """Move a decision made at ``now`` from ``recorded`` to ``replayed``. ``prefill_tokens`` and
        ``decode_blocks``: what the router reserved for the recorded decision (uncached prompt
        tokens; KV blocks of ``block_size`` tokens); the replayed side's differ by the tokens its
        prediction finds cached more or less. ``prefill_s``/``held_s``: the recorded spans (``None``:
        not reached in the window). ``sequences``: the request's OpenAI ``n`` (the recorded
        ``decode_blocks`` count its ``n × max_tokens``), moved as that many sequences in the
        prefill and decode counts. ``False`` when nothing moves (the same replica and sizes, or a
        load already gone), or when :attr:`max_moves` are held (counted)."""
        shift = recorded.cached_tokens - replayed.cached_tokens
        if recorded.replica == replayed.replica and shift == 0:
            return False
        replayed_prefill = max(0, prefill_tokens + shift)
        extra_blocks = _ceil_div(replayed_prefill, block_size) - _ceil_div(prefill_tokens, block_size)
        replayed_decode = max(0, decode_blocks + extra_blocks)
        released_at = math.inf if held_s is None else now + held_s
        first_token_at = math.inf if prefill_s is None else now + prefill_s
        if released_at <= now:
            return False
        if self.held >= self.max_moves:
            self.unmodelled += 1
            return False
        seqs = max(1, sequences)
        entry = LoadMove(
            recorded.replica,
            replayed.replica,
            prefill_tokens,
            replayed_prefill,
            decode_blocks,
            replayed_decode,
            seqs,
            first_token_at,
            released_at,
        )
        decoding = first_token_at <= now
        self._apply(entry, decoding=decoding, sign=+1)
        self.held += 1
        self.moved += 1
        self.moved_seqs += seqs
        if not decoding and first_token_at < released_at:
            self._push(first_token_at, False, entry)
        if released_at < math.inf:
            self._push(released_at, True, entry)
        return True

    def _push(self, at: float, released: bool, entry: LoadMove) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, self._seq, released, entry))

    def _apply(self, entry: LoadMove, *, decoding: bool, sign: int) -> None:
        """Add (``sign`` +1) or take back (-1) ``entry``'s change in one phase: its replayed load
        on the replayed replica, less its recorded load on the recorded one."""
        seqs = sign * entry.sequences
        if decoding:
            self._change(entry.replayed, 0, 0, seqs, sign * entry.replayed_decode_blocks)
            self._change(entry.recorded, 0, 0, -seqs, -sign * entry.recorded_decode_blocks)
        else:
            self._change(entry.replayed, seqs, sign * entry.replayed_prefill_tokens, 0, 0)
            self._change(entry.recorded, -seqs, -sign * entry.recorded_prefill_tokens, 0, 0)

    def _change(
        self, replica: ReplicaId, prefill_seqs: int, tokens: int, decode_seqs: int, blocks: int
    ) -> None:
        counts = self.changes.get(replica)
        if counts is None:
            counts = self.changes[replica] = _Counts()
        counts.prefill_seqs += prefill_seqs
        counts.prefill_tokens += tokens
        counts.decode_seqs += decode_seqs
        counts.decode_blocks += blocks
        if counts.is_zero():
            del self.changes[replica]


def _ceil_div(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))
