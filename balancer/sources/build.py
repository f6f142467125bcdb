"""Builds the event sources of one configured replica (no I/O itself: sockets open in ``run``).

The engine's spec (:mod:`balancer.engines`) says which transport and decoder. ``zmq`` (SGLang, vLLM):
one :class:`ZmqEventSource` per DP rank, rank ``r`` on the configured endpoint's port ``+ r`` (replay
likewise), none when the replica has no ``events`` endpoint. ``http_drain`` (TRT-LLM): one
:class:`TrtllmPoller` on the replica's HTTP URL. Every source gets its own decoder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import assert_never

import aiohttp
import zmq.asyncio

from balancer.config import LimitConfig, ReplicaConfig
from balancer.engines import ResumableDecoder
from balancer.engines.registry import engine_spec
from balancer.metrics import Metrics
from balancer.sources.base import EventSource
from balancer.sources.pipeline import IngestSettings
from balancer.sources.trtllm_poll import PollSettings, TrtllmPoller
from balancer.sources.trtllm_relay import RelayPublisher, RelaySource, relay_endpoint
from balancer.sources.zmq_settings import ZmqSourceSettings, endpoint_for_rank
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId


@dataclass(frozen=True, slots=True)
class RelayRole:
    """How a worker of ``kvlb serve --workers N`` gets TRT-LLM events (see :mod:`.trtllm_relay`)."""

    run_dir: str
    """The supervisor's directory, where the relay's ``ipc://`` endpoints live."""
    drains: bool
    """``True``: drain the engine and republish; ``False``: follow the relay."""
    history_bytes: int = 32 * 1024 * 1024
    """The drained bodies the drainer keeps per replica for later followers' catch-ups (bytes,
    ``limits.relay_history_bytes``)."""


def zmq_settings_for(limits: LimitConfig) -> ZmqSourceSettings:
    """The ZMQ source settings the configured limits ask for (``limits.event_message_bytes``,
    ``limits.event_max_behind_s``)."""
    backlog = max(ZmqSourceSettings().max_backlog_bytes, limits.event_message_bytes)
    return ZmqSourceSettings(
        max_message_bytes=limits.event_message_bytes,
        max_backlog_bytes=backlog,
        max_behind_s=limits.event_max_behind_s,
    )


def ingest_settings_for(limits: LimitConfig) -> IngestSettings:
    """Each replica's ingestion queue and CPU budget as the configured limits ask
    (``limits.event_queue_*``, ``limits.max_event_blocks``, ``limits.event_ingest_cpu_*``); used by
    the embedded ingest and by each key space of fleet mode alike."""
    return IngestSettings(
        queue_max_batches=limits.event_queue_size,
        queue_max_bytes=limits.event_queue_bytes,
        max_event_blocks=limits.max_event_blocks,
        cpu_share=limits.event_ingest_cpu_share,
        cpu_burst_s=limits.event_ingest_cpu_burst_s,
    )


def poll_settings_for(limits: LimitConfig) -> PollSettings:
    """The TRT-LLM drain settings the configured limits ask for (``limits.event_message_bytes``
    caps a drain body)."""
    return PollSettings(max_body_bytes=limits.event_message_bytes)


def build_sources(
    replica: ReplicaConfig,
    *,
    zmq_ctx: zmq.asyncio.Context,
    session: aiohttp.ClientSession,
    metrics: Metrics,
    zmq_settings: ZmqSourceSettings | None = None,
    poll_settings: PollSettings | None = None,
    resume: Mapping[int, int] | None = None,
    relay: RelayRole | None = None,
) -> list[EventSource]:
    """The sources feeding ``replica``'s pipeline (possibly none). ``resume`` maps a DP rank to the
    last sequence number already applied (from Redis): that rank's source resumes right after it; a
    rank missing from a given ``resume`` starts at seq 0. Either way, and without ``resume`` too, it
    asks the replay socket for everything from there as soon as it connects (a fresh kvlb, an
    ingester taking a replica over, or the fleet's first one). A drain (TRT-LLM) has nothing to
    replay: its decoder checks each rank's first ``event_id`` against ``resume`` instead, and
    resyncs the rank when events were drained that never reached the index.

    ``relay`` (the workers of ``kvlb serve --workers N``, embedded mode): a TRT-LLM replica is drained
    by the worker whose role ``drains`` (it republishes each body) and followed through the relay by
    the others."""
    replica_id = ReplicaId(replica.id)
    spec = engine_spec(replica.engine)
    if spec.transport == "http_drain":
        decoder = spec.decoder(replica.block_size)
        if resume and isinstance(decoder, ResumableDecoder):
            decoder.resume_after(resume)  # the drained events cannot be replayed: only checked
        tap = None
        if relay is not None:
            endpoint = relay_endpoint(relay.run_dir, replica_id)
            if not relay.drains:
                max_bytes = (poll_settings or PollSettings()).max_body_bytes
                follower = RelaySource(
                    replica_id,
                    endpoint,
                    ctx=zmq_ctx,
                    decoder=decoder,
                    metrics=metrics,
                    max_message_bytes=max_bytes,
                )
                return [follower]
            tap = RelayPublisher(
                endpoint, zmq_ctx, replica=replica_id, metrics=metrics, history_bytes=relay.history_bytes
            )
        assert spec.drain_path is not None  # EngineSpec checks it with the http_drain transport
        poller = TrtllmPoller(
            replica_id,
            replica.url,
            path=spec.drain_path,
            session=session,
            decoder=decoder,
            metrics=metrics,
            settings=poll_settings,
            tap=tap,
            api_key=replica.api_key,
        )
        return [poller]
    if spec.transport != "zmq":
        assert_never(spec.transport)
    if replica.events is None:
        return []
    sources: list[EventSource] = []
    for rank in range(replica.dp_size):
        replay = None if replica.replay is None else endpoint_for_rank(replica.replay, rank)
        source = ZmqEventSource(
            replica_id,
            endpoint_for_rank(replica.events, rank),
            ctx=zmq_ctx,
            decoder=(spec.chain_decoder or spec.decoder)(replica.block_size),
            metrics=metrics,
            dp_rank=rank,
            topic=replica.topic.encode("utf-8"),
            replay_endpoint=replay,
            resume_seq=None if resume is None else resume.get(rank, -1) + 1,
            settings=zmq_settings,
        )
        sources.append(source)
    return sources
