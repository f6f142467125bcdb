"""The parts of one ZMQ source that its shell and its replays share (no I/O of its own).

:class:`~balancer.sources.zmq_sub.ZmqEventSource` (the shell: the SUB, its monitor, the live
messages) and :class:`~balancer.sources.zmq_replay_merge.ReplayMerge` (its replays) work on one
stream: the same order, read-ahead, message reader, publisher incarnation, poll schedule, engine
watch, counters and warnings. :class:`ZmqSourceParts` holds them, built once per source by
:meth:`ZmqSourceParts.build`, so that each takes the one object instead of each part by name; so do
the replays' client (:class:`~balancer.sources.zmq_replay.ReplayClient`) and the SUB's connection
(:class:`~balancer.sources.zmq_connection.SubConnection`), which report under the source's counters,
warnings and logger.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from balancer.engines import Decoder
from balancer.log_limit import LimitedWarnings
from balancer.metrics import Metrics
from balancer.sources.base import SourceCounters
from balancer.sources.read_ahead import ReadAhead
from balancer.sources.replay_poll import ReplayPollSchedule
from balancer.sources.replay_watch import ReplayWatch
from balancer.sources.zmq_incarnation import Incarnation
from balancer.sources.zmq_messages import MessageReader
from balancer.sources.zmq_order import StreamOrder
from balancer.sources.zmq_settings import ZmqSourceSettings
from balancer.types import ReplicaId


@dataclasses.dataclass(frozen=True, slots=True)
class ZmqSourceParts:
    """One source's shared parts (one replica, one DP rank); they live on the ingest loop."""

    replica: ReplicaId
    """The replica the publisher belongs to."""
    dp_rank: int
    """The publisher's DP rank."""
    settings: ZmqSourceSettings
    """The source's settings (validated)."""
    metrics: Metrics
    """The process's metrics."""
    log: logging.Logger
    """The source's logger: what its parts say is said under it, as the source's."""
    counters: SourceCounters
    """The source's counters (its ``/admin/replicas`` status)."""
    warnings: LimitedWarnings
    """The source's rate-limited warnings."""
    order: StreamOrder
    """The stream's position and what each message does to it (pure)."""
    ahead: ReadAhead
    """What was read off the SUB and not yet handled, and why the last message was shed."""
    messages: MessageReader
    """Each message decoded, shed or counted as unusable."""
    incarnation: Incarnation
    """After a lost connection: whether the publisher restarted, logged once a batch shows it."""
    polls: ReplayPollSchedule
    """When the silent live stream's next replay poll is due."""
    watch: ReplayWatch
    """What ends a replay before its timeout: the publisher's disconnect, the probe's verdict."""

    @classmethod
    def build(
        cls,
        replica: ReplicaId,
        dp_rank: int,
        *,
        decoder: Decoder,
        metrics: Metrics,
        settings: ZmqSourceSettings,
        want: int,
        log: logging.Logger,
    ) -> ZmqSourceParts:
        """A source's parts, its stream wanting seq ``want`` first (0, or the resume point), its
        poll schedule starting now."""
        warnings = LimitedWarnings(
            log,
            metrics.log_suppressed_total,
            clock=time.monotonic,
            forgotten=metrics.log_causes_forgotten_total,
        )
        counters = SourceCounters()
        return cls(
            replica=replica,
            dp_rank=dp_rank,
            settings=settings,
            metrics=metrics,
            log=log,
            counters=counters,
            warnings=warnings,
            order=StreamOrder(want),
            ahead=ReadAhead(settings),
            messages=MessageReader(
                replica, decoder, metrics=metrics, counters=counters, warnings=warnings, log=log
            ),
            incarnation=Incarnation(replica, dp_rank, log),
            polls=ReplayPollSchedule(
                settings.replay_poll_min_s,
                settings.replay_poll_max_s,
                settings.replay_poll_busy_s,
                time.monotonic(),
            ),
            watch=ReplayWatch(),
        )
