"""``GET /admin/replicas``' JSON views as ``kvlb.v1.Admin/ListReplicas`` messages (pure).

Each replica is sent whole as ``details`` (a ``Struct``: numbers as doubles) and as typed fields read
from the same view (:func:`replica_message`), so a gRPC client reads the facts an SRE looks at
(routability and why not, health, key refusal, drain, load, prediction, events, scrape) with their
types; an HTTP ``null`` is an unset field. What is not typed (the event sources' replay and transport
counters, the ingest queue, the scraper's last figures) stays in ``details``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.grpc.messages import fill_struct, struct_of


def replica_message(view: Mapping[str, Any], into: pb.Replica | None = None) -> pb.Replica:
    """One replica as ``GET /admin/replicas`` shows it (:func:`~balancer.api.admin_replicas.replica_views`):
    the typed fields read from that view, and the whole view as ``details``; made in ``into`` (an
    empty message: an answer's ``replicas.add()``) when given, so that ``details``, most of its
    bytes, is set where it is sent rather than copied there."""
    health: Mapping[str, Any] = view.get("health") or {}
    events: Mapping[str, Any] = view.get("events") or {}
    message = pb.Replica(
        id=view["id"],
        model=view["model"],
        url=view["url"],
        engine=view["engine"],
        block_size=view["block_size"],
        routable=view["routable"],
        draining=bool(health.get("draining", False)),
        inflight=view["inflight"],
        index_blocks=view["index"]["blocks"],
        unroutable=view.get("unroutable"),
        model_mismatch=health.get("model_mismatch"),
        drain_kept=health.get("drain_kept"),
        api_key_source=view.get("api_key"),
        breaker=health.get("breaker") or "",
        health_last_error=health.get("last_error"),
        dp_size=view.get("dp_size") or 1,
        events_hint=events.get("hint"),
        event_sources=[_source_message(source) for source in events.get("sources") or ()],
        key_refused=health.get("key_refused"),
        events_stalled_s=events.get("stalled_s"),
        probe_ok=health.get("probe_ok"),
        consecutive_failures=health.get("consecutive_failures") or 0,
        events_last_lag_s=events.get("last_lag_s"),
        events_last_resync_age_s=events.get("last_resync_age_s"),
    )
    if health.get("drain") is not None:
        message.drain.CopyFrom(struct_of(health["drain"]))
    if view.get("load") is not None:
        message.load.CopyFrom(load_message(view["load"]))
    if view.get("prediction") is not None:
        message.prediction.CopyFrom(prediction_message(view["prediction"]))
    if view.get("scrape") is not None:
        message.scrape.CopyFrom(scrape_message(view["scrape"]))
    if into is not None:
        into.MergeFrom(message)  # the typed fields: a small copy
        message = into
    message.details.SetInParent()  # present, as a copied Struct was, even if empty
    fill_struct(message.details, view)
    return message


def load_message(load: Mapping[str, Any]) -> pb.ReplicaLoad:
    """A replica's ``load`` (:class:`~balancer.load.tracker.ReplicaLoad` as a dict)."""
    return pb.ReplicaLoad(
        pending_prefill_seqs=load["pending_prefill_seqs"],
        pending_prefill_tokens=load["pending_prefill_tokens"],
        pending_prefill_blocks=load["pending_prefill_blocks"],
        active_decode_seqs=load["active_decode_seqs"],
        active_decode_blocks=load["active_decode_blocks"],
        waiting_reqs=_reported(load.get("waiting_reqs")),
        running_reqs=_reported(load.get("running_reqs")),
        kv_usage=load.get("kv_usage"),
        stats_age_s=load.get("stats_age_s"),
        capacity_blocks=load.get("capacity_blocks"),
        peer_seqs=load.get("peer_seqs") or 0,
    )


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _reported(count: int | None) -> int | None:
    """An engine's count as it reported it (a scraped gauge is not checked: it may be negative or
    huge), within ``int64`` so that an odd report never fails the call."""
    return None if count is None else min(INT64_MAX, max(INT64_MIN, int(count)))


def prediction_message(prediction: Mapping[str, Any]) -> pb.Prediction:
    """A replica's ``prediction`` (:func:`~balancer.api.admin_replicas.prediction_view`)."""
    return pb.Prediction(
        receipts=prediction["receipts"],
        accuracy=prediction.get("accuracy"),
        within_one_block=prediction.get("within_one_block"),
        mean_error_blocks=prediction.get("mean_error_blocks"),
    )


def scrape_message(scrape: Mapping[str, Any]) -> pb.ScrapeStatus:
    """A replica's ``scrape`` (:class:`~balancer.load.scraper.ScraperStatus` with its ages), but its
    last scraped figures (``last``: in ``details``; ``load`` has what routing read of them)."""
    message = pb.ScrapeStatus(
        url=scrape["url"],
        scrapes=scrape["scrapes"],
        errors=scrape["errors"],
        last_ok_age_s=scrape.get("last_ok_age_s"),
        last_error=scrape.get("last_error"),
        rejected_values=scrape.get("rejected_values") or 0,
        last_rejection_age_s=scrape.get("last_rejection_age_s"),
    )
    rejection: Mapping[str, Any] | None = scrape.get("last_rejection")
    if rejection is not None:
        message.last_rejection.CopyFrom(
            pb.ScrapeRejection(gauge=rejection["gauge"], value=rejection["value"], reason=rejection["reason"])
        )
    return message


def kept_drain_message(view: Mapping[str, Any]) -> pb.KeptDrain:
    """One kept drain as ``GET /admin/replicas``' ``kept_drains`` shows it
    (:func:`~balancer.api.admin_replicas.kept_drain_view`)."""
    message = pb.KeptDrain(
        id=view["id"],
        removed_at_wall_ts=view["removed_at_wall_ts"],
        removed_at_age_s=view["removed_at_age_s"],
        expires_at_wall_ts=view["expires_at_wall_ts"],
        expires_in_s=view["expires_in_s"],
        source=view["source"],
        text=view["text"],
    )
    if view.get("drain") is not None:
        message.drain.CopyFrom(struct_of(view["drain"]))
    return message


def _source_message(source: Mapping[str, Any]) -> pb.EventSourceStatus:
    return pb.EventSourceStatus(
        kind=source["kind"],
        endpoint=source["endpoint"],
        dp_rank=source.get("dp_rank"),
        connected=source.get("connected"),
        last_error=source.get("last_error"),
        last_error_age_s=source.get("last_error_age_s"),
        last_event_age_s=source.get("last_event_age_s"),
        messages=source["messages"],
        gaps=source["gaps"],
        resyncs=source["resyncs"],
        decode_errors=source["decode_errors"],
    )
