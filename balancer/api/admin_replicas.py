"""The admin API's replica views (I/O): ``GET /admin/replicas`` and ``GET /admin/replicas/{id}/blocks``.

Behind ``auth.admin_token`` like every ``/admin`` path (the middleware).

* ``GET /admin/replicas``: health, breaker, draining, load, index blocks, prediction accuracy (the
  last receipts), event status (lag, last resync) and scrape status; and ``kept_drains``, the drains
  kept for replicas discovery removed (:func:`kept_drain_views`). Made and encoded
  :data:`VIEWS_PER_STEP` replicas (:data:`KEPT_PER_STEP` kept drains) at a time with the event loop
  let run in between, from a copy of the replica list (:func:`replicas_body`; a replica removed
  meanwhile is left out).
* ``GET /admin/replicas/{id}/blocks?limit=``: the block keys the index routing reads holds for one
  replica, per DP rank (confirmed blocks only, no speculative entry; at most ``limit`` a rank,
  default :data:`DEFAULT_BLOCKS_LIMIT`, at most :data:`MAX_BLOCKS_LIMIT`), as 16 hex digits: what
  kvlb thinks the replica caches, key for key (the fault rig compares them with the engine's own
  listing).

:func:`replicas_answer` (in steps: :func:`replicas_in_steps`) does the work without aiohttp, so the
gRPC admin service (:mod:`balancer.api.grpc.admin`) calls the same code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from balancer import strict_json
from balancer.api.errors import ApiError
from balancer.api.middleware import STATE
from balancer.api.parsing import NO_QUERY, check_query
from balancer.api.plain import plain_dict
from balancer.config import ReplicaConfig
from balancer.health.book import KeptDrainListing, kept_text
from balancer.routing.receipts import ComputedMarks
from balancer.service.state import Pool, ServiceState
from balancer.sources.base import SourceStatus, last_batch_wall_s, silent_stream_hint, stalled_stream_hint
from balancer.tasks import stepwise
from balancer.types import ReplicaId


async def list_replicas(request: web.Request) -> web.Response:
    check_query(request.query, NO_QUERY)
    return web.json_response(text=await replicas_body(request.app[STATE]))


def replicas_answer(state: ServiceState) -> dict[str, Any]:
    """``GET /admin/replicas``' answer: the replicas listed, and the drains kept for those no pool
    lists (:func:`kept_drain_views`)."""
    kept, total = kept_drain_views(state)
    return {"replicas": replica_views(state), "kept_drains": kept, "kept_drains_total": total}


MAX_LISTED_KEPT_DRAINS = 1_000
"""Most kept drains ``GET /admin/replicas`` lists (the newest removals; ``kept_drains_total`` counts
them all): about 400 B of JSON each."""


def kept_drain_views(state: ServiceState) -> tuple[list[dict[str, Any]], int]:
    """The drains kept for replicas not listed (drained, then removed by discovery): each replica
    added again under its id before ``expires_at_wall_ts`` comes back drained. A replica being
    removed (its health record gone, its pool entry not yet) is listed here, as :func:`replica_views`
    leaves it out: a replica is in one of the two lists, never in neither (h-keptdrains). This process's own
    (``source: memory``) and, in fleet mode, the fleet's in Redis (``source: redis``, which wins: the
    fleet's are the ones applied), newest removal first, at most :data:`MAX_LISTED_KEPT_DRAINS`; and
    how many there are."""
    now, wall = state.monotonic(), state.wall_clock()
    ordered = _kept_ordered(state, state.health.kept_listing(now, wall))
    return [kept_drain_view(kept, wall) for kept in ordered[:MAX_LISTED_KEPT_DRAINS]], len(ordered)


KEPT_PER_STEP = 50
"""Kept drains :func:`kept_drain_views_in_steps` lists, or makes the views of, between two turns of
the loop: 1,000 took 1.3 ms of CPU to list, 5.0 ms for their views and 5.5 ms to encode in one go
(median, load 24 on 2 cores; 4,096 listed: 5.4 ms; scratch script, 2026-12-01, h-workersmerge)."""


async def kept_drain_views_in_steps(state: ServiceState) -> tuple[list[dict[str, Any]], int]:
    """:func:`kept_drain_views` with the loop let run between every :data:`KEPT_PER_STEP` kept
    drains listed (from a copy of the book's table, at the first step's instant) and views made; the
    fleet's listing and the sort in one go."""
    now, wall = state.monotonic(), state.wall_clock()
    book = list(state.health.kept_drains.items())
    own: list[KeptDrainListing] = []
    for start in range(0, len(book), KEPT_PER_STEP):
        if start:
            await asyncio.sleep(0)
        own += state.health.kept_listing(now, wall, book[start : start + KEPT_PER_STEP])
    ordered = _kept_ordered(state, own)
    views: list[dict[str, Any]] = []
    for start in range(0, min(len(ordered), MAX_LISTED_KEPT_DRAINS), KEPT_PER_STEP):
        await asyncio.sleep(0)
        views += [kept_drain_view(kept, wall) for kept in ordered[start : start + KEPT_PER_STEP]]
    return views, len(ordered)


def _kept_ordered(state: ServiceState, own: list[KeptDrainListing]) -> list[KeptDrainListing]:
    """This process's kept drains ``own`` and the fleet's, but for replicas listed, newest first."""
    listed = {kept.replica: kept for kept in own}
    if state.fleet_kept_drains is not None:
        listed.update((kept.replica, kept) for kept in state.fleet_kept_drains())
    for pool in state.pools.values():
        for replica in pool.replicas:
            if replica in state.health.replicas:  # one being removed is listed here, not as a view
                listed.pop(replica, None)
    return sorted(listed.values(), key=lambda kept: kept.removed_at_wall_ts, reverse=True)


def kept_drain_view(kept: KeptDrainListing, wall: float) -> dict[str, Any]:
    """One kept drain: ``id``, its ``drain`` note, ``removed_at_wall_ts`` and its age,
    ``expires_at_wall_ts`` and ``expires_in_s``, ``source`` and the ``text`` the log shows."""
    now = wall + kept.clock_offset_s  # on the clock the times are on
    return {
        "id": kept.replica,
        "drain": None if kept.note is None else with_ages(kept.note.to_json(), now),
        "removed_at_wall_ts": kept.removed_at_wall_ts,
        "removed_at_age_s": round(now - kept.removed_at_wall_ts, 3),
        "expires_at_wall_ts": kept.expires_at_wall_ts,
        "expires_in_s": round(kept.expires_at_wall_ts - now, 3),
        "source": kept.source,
        "text": kept_text(kept.note, kept.removed_at_wall_ts),
    }


Listed = tuple[Pool, ReplicaConfig]
"""A replica as a listing walks it: its pool and its entry there."""


def listed_replicas(state: ServiceState) -> list[Listed]:
    """The replicas the pools list now, in their order: a copy, which a listing made in steps
    (:func:`replicas_in_steps`) walks while discovery may change the pools."""
    return [(pool, config) for pool in state.pools.values() for config in pool.replicas.values()]


def replica_views(state: ServiceState, listed: Sequence[Listed] | None = None) -> list[dict[str, Any]]:
    """``GET /admin/replicas``' view of each replica of ``listed`` (``None``: all the pools list now),
    each whole at one instant. A replica its pool no longer lists (removed since ``listed`` was
    copied) is left out, and so is one whose health record is gone (being removed:
    :class:`~balancer.service.lifecycle.ReplicaLifecycle` removes the record first and the pool's
    entry last), as if listed after its removal; the pool's entry as it is now is shown."""
    now = state.monotonic()
    wall = state.wall_clock()
    current: dict[str, tuple[Pool, list[ReplicaConfig]]] = {}
    names: list[ReplicaId] = []
    for pool, config in listed_replicas(state) if listed is None else listed:
        replica_id = ReplicaId(config.id)
        entry = pool.replicas.get(replica_id)
        if entry is not None and replica_id in state.health.replicas:
            current.setdefault(pool.model, (pool, []))[1].append(entry)
            names.append(replica_id)
    ingest = state.ingest_status(None if listed is None else names)
    views = []
    for pool, configs in current.values():
        among = [ReplicaId(config.id) for config in configs]
        snapshot = pool.router.load_snapshot(now, None if listed is None else among)
        spaces = list(pool.router.spaces.values())
        routable = set(state.health.routable(now, among))
        for replica_id, config in zip(among, configs, strict=True):
            view = _replica_view(state, pool, config, now, wall)
            view["routable"] = replica_id in routable
            view["unroutable"] = (
                None if replica_id in routable else state.health.unroutable_reason(replica_id, now)
            )
            view["load"] = plain_dict(snapshot.of(replica_id))
            view["index"] = {"blocks": sum(space.table.held_blocks(replica_id) for space in spaces)}
            view["prediction"] = prediction_view(pool, replica_id)
            status = ingest.get(replica_id)
            view["events"] = None if status is None else with_ages(plain_dict(status), wall)
            if status is not None:
                receipts = pool.router.receipts
                view["events"]["hint"] = silent_stream_hint(
                    status.sources, receipts.stats(replica_id).receipts
                )
                view["events"]["stalled_s"] = None
                stalled = _stalled(state, receipts.computed, replica_id, status.sources, wall)
                if stalled is not None and view["events"]["hint"] is None:
                    view["events"]["stalled_s"], view["events"]["hint"] = stalled
            scraper = state.scrapers.get(replica_id)
            view["scrape"] = None if scraper is None else with_ages(plain_dict(scraper.status()), wall)
            views.append(view)
    return views


VIEWS_PER_STEP = 5
"""Replica views :func:`replicas_in_steps` makes (and ``GET /admin/replicas`` encodes) in one go
before it lets the event loop run other work: about 0.04 ms of CPU each (0.2 ms for five, 0.4 ms
for ten, and 0.18 ms to encode ten as JSON, median, at load 11 on a 2-core machine), where the 100
views of the bench made in one go took 3.8 ms (at load 2; 2026-12-01, h-listreplicas)."""


async def view_steps(state: ServiceState) -> AsyncIterator[list[dict[str, Any]]]:
    """:func:`replica_views` of the replicas listed now (copied first), :data:`VIEWS_PER_STEP` at a
    time with the loop let run in between two: each view is whole at its step's instant, and a
    replica removed meanwhile is left out (:func:`replica_views`)."""
    listed = listed_replicas(state)
    for start in range(0, len(listed), VIEWS_PER_STEP):
        if start:
            await asyncio.sleep(0)
        yield replica_views(state, listed[start : start + VIEWS_PER_STEP])


async def replica_views_in_steps(state: ServiceState) -> list[dict[str, Any]]:
    """Every step's views of :func:`view_steps`, in order."""
    return [view async for views in view_steps(state) for view in views]


async def replicas_in_steps(state: ServiceState) -> dict[str, Any]:
    """:func:`replicas_answer`, its replica views made a few at a time
    (:func:`replica_views_in_steps`); the kept drains after them, as many
    (:func:`kept_drain_views_in_steps`)."""
    views = await replica_views_in_steps(state)
    kept, total = await kept_drain_views_in_steps(state)
    return {"replicas": views, "kept_drains": kept, "kept_drains_total": total}


async def replicas_body(state: ServiceState) -> str:
    """``GET /admin/replicas``' body: ``strict_json.dumps`` of :func:`replicas_answer`, the same
    text, its replicas made and encoded :data:`VIEWS_PER_STEP` at a time with the loop let run in
    between (:func:`view_steps`), and its kept drains made (:func:`kept_drain_views_in_steps`) and
    encoded (:func:`~balancer.strict_json.dumps_steps`) in steps too."""
    parts: list[str] = []
    async for views in view_steps(state):  # each step's views encoded in the step
        if views:
            parts.append(strict_json.dumps(views)[1:-1])  # the list's items, without its brackets
    kept, total = await kept_drain_views_in_steps(state)
    rest = await stepwise(strict_json.dumps_steps({"kept_drains": kept, "kept_drains_total": total}))
    return '{"replicas": [' + ", ".join(parts) + "], " + rest[1:]


def _stalled(
    state: ServiceState,
    computed: ComputedMarks,
    replica: ReplicaId,
    sources: Sequence[SourceStatus],
    wall: float,
) -> tuple[float, str] | None:
    """``(seconds, hint)`` when ``replica`` computed new blocks in requests decided after its last
    event batch, the first longer than ``events_stalled_hint_s`` ago (a publisher that stopped)."""
    bound_s = state.settings.events_stalled_hint_s
    last_batch = last_batch_wall_s(sources)
    if bound_s <= 0 or last_batch is None:
        return None  # never published: silent_stream_hint's case
    since = computed.since(replica, last_batch)
    if since is None:
        return None
    hint = stalled_stream_hint(since.blocks, since.first_wall_s, wall, bound_s)
    return None if hint is None else (round(wall - since.first_wall_s, 3), hint)


BLOCKS_PARAMS = frozenset({"limit"})
DEFAULT_BLOCKS_LIMIT = 1_000
"""Keys ``GET /admin/replicas/{id}/blocks`` lists per DP rank when ``limit`` is not given."""
MAX_BLOCKS_LIMIT = 10_000
"""Most keys it lists per DP rank (about 190 kB of JSON); a rank holding more says ``truncated``."""


async def replica_blocks(request: web.Request) -> web.Response:
    check_query(request.query, BLOCKS_PARAMS)
    raw = request.query.get("limit")
    limit = DEFAULT_BLOCKS_LIMIT
    if raw is not None:
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 6) or not 0 <= int(raw) <= MAX_BLOCKS_LIMIT:
            raise ApiError(400, f"'limit' must be an integer in 0..{MAX_BLOCKS_LIMIT}, got {raw[:40]!r}")
        limit = int(raw)
    view = held_keys_view(request.app[STATE], ReplicaId(request.match_info["replica"]), limit)
    return web.json_response(view, dumps=strict_json.dumps)


def held_keys_view(state: ServiceState, replica: ReplicaId, limit: int) -> dict[str, Any]:
    """The keys ``replica``'s caches hold in the table routing reads (the embedded index's, or the
    fleet mirror's), at most ``limit`` per DP rank (404 naming the known replicas when unknown).
    O(the keys listed), plus the stale engine-hash entries walked past (at most ``2 × held + 64``)."""
    for pool in state.pools.values():
        if replica not in pool.replicas:
            continue
        space = pool.router.space_of.get(replica)
        listed = [] if space is None else space.table.held_keys(replica, limit)
        return {
            "replica": replica,
            "model": pool.model,
            "limit": limit,
            "ranks": [
                {
                    "dp_rank": held.dp_rank,
                    "blocks": held.held_blocks,
                    "truncated": held.truncated,
                    "keys": [f"{key:016x}" for key in held.keys],
                }
                for held in listed
            ],
        }
    known = ", ".join(sorted(r for pool in state.pools.values() for r in pool.replicas))
    raise ApiError(404, f"unknown replica {replica!r}; known: {known}")


def prediction_view(pool: Pool, replica: ReplicaId) -> dict[str, Any]:
    """The replica's last receipts: how often the router predicted its cached blocks exactly."""
    stats = pool.router.receipts.stats(replica)
    mean = stats.mean_error_blocks
    return {
        "receipts": stats.receipts,
        "accuracy": stats.accuracy,
        "within_one_block": stats.within_one_block_share,
        "mean_error_blocks": None if mean is None else round(mean, 3),
    }


def _replica_view(
    state: ServiceState, pool: Pool, config: ReplicaConfig, now: float, wall: float
) -> dict[str, Any]:
    replica = ReplicaId(config.id)
    record = state.health.replicas.get(replica)
    health: dict[str, Any] | None = None
    if record is not None:
        health = {
            "probe_ok": record.probe_ok,
            "draining": record.draining,
            "drain": None if record.drain is None else with_ages(record.drain.to_json(), wall),
            "drain_kept": None
            if record.kept_from_removal_wall_ts is None or not record.draining
            else kept_text(record.drain, record.kept_from_removal_wall_ts),
            "breaker": record.state(now, state.health.config),
            "consecutive_failures": record.consecutive_failures,
            "last_error": record.last_error,
            "model_mismatch": record.model_mismatch,
            "key_refused": record.key_refused,
            "last_probe_age_s": None
            if record.last_probe_at is None
            else round(now - record.last_probe_at, 3),
        }
    return {
        "id": config.id,
        "model": pool.model,
        "url": config.url,
        "engine": config.engine,
        "block_size": config.block_size,
        "dp_size": config.dp_size,
        "api_key": None if config.api_key is None else config.api_key.source,  # where from, never the key
        "inflight": pool.router.in_flight_total(replica),  # every worker's, as the cap counts
        "health": health,
    }


def with_ages(record: dict[str, Any], wall: float) -> dict[str, Any]:
    """Adds ``*_age_s`` next to every ``*_wall_ts`` field (recursively into lists of records)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, (list, tuple)):  # a tuple: faster than list | tuple here
            value = [with_ages(v, wall) if isinstance(v, dict) else v for v in value]
        out[key] = value
        if key.endswith("_wall_ts"):
            out[key[: -len("_wall_ts")] + "_age_s"] = None if value is None else round(wall - value, 3)
    return out
