"""Whether a ZMQ publisher that dropped its connection came back as the same process (logs only).

When the SUB's connection drops, :class:`~balancer.sources.zmq_sub.ZmqEventSource` drops the rank's
blocks at once and catches up from seq 0 at the next connection: right whatever happened. Which it
was, a restarted engine or the same one reconnected, is told to the operator once a batch shows it:
a batch at the old last seq with another payload, a seq below it, or a new epoch means a new
process ("restarted"); the same payload at that seq means the same one ("reconnected"); a batch
above it cannot tell ("whether it restarted is unknown"). :class:`Incarnation` keeps the old
connection's last batch until then. It decides nothing for the stream.
"""

from __future__ import annotations

import logging

from balancer.engines import DecodedBatch
from balancer.types import ReplicaId


class Incarnation:
    """The last batch of a lost connection, until a batch shows whether the publisher restarted."""

    def __init__(self, replica: ReplicaId, dp_rank: int, log: logging.Logger) -> None:
        """``log``: the source's logger (what is said here is said as the source's)."""
        self.replica = replica
        self.dp_rank = dp_rank
        self._log = log
        self.lost: tuple[int, int | None, str | None] | None = None
        """(last seq, its payload digest, epoch) when the connection dropped, until a batch shows
        whether the publisher restarted."""

    def disconnected(self, last_seq: int, digest: int | None, epoch: str | None) -> None:
        """The connection dropped after batch ``last_seq`` (``digest``: of its payload, ``None``
        when it was shed)."""
        self.lost = (last_seq, digest, epoch)

    def restarted(self, why: str) -> None:
        """The publisher is a new process (``why``: what showed it)."""
        self.lost = None
        self._log.info("replica %s rank %d: publisher restarted (%s)", self.replica, self.dp_rank, why)

    def note(self, batch: DecodedBatch, digest: int | None, *, live: bool) -> None:
        """After a lost connection: log whether the publisher restarted, once a batch shows it (a
        shed batch at the old last seq cannot: the next batch decides)."""
        assert self.lost is not None and batch.seq is not None
        old_seq, old_digest, old_epoch = self.lost
        if batch.epoch is not None and old_epoch is not None and batch.epoch != old_epoch:
            self.restarted("a new epoch after the disconnect")
        elif batch.seq == old_seq and (digest is None or old_digest is None):
            pass
        elif batch.seq == old_seq and digest != old_digest:
            self.restarted(f"seq {old_seq} holds another batch than before the disconnect")
        elif batch.seq == old_seq:
            self.lost = None
            self._log.info(
                "replica %s rank %d: publisher reconnected, same process (seq %d unchanged)",
                self.replica,
                self.dp_rank,
                old_seq,
            )
        elif batch.seq < old_seq and live:
            self.restarted(f"live seq {batch.seq}, it had reached {old_seq}")
        elif batch.seq > old_seq:
            self.lost = None
            self._log.info(
                "replica %s rank %d: publisher reconnected at seq %d (it had reached %d; whether it "
                "restarted is unknown)",
                self.replica,
                self.dp_rank,
                batch.seq,
                old_seq,
            )
