"""The admin API (I/O): policy tuning, dry-run explanations, replica views, draining.

Behind ``auth.admin_token`` when it is set (checked by the middleware). Every policy change is
applied at once, bumps the version and is logged at INFO with who made it and what changed.

* ``GET /admin/policy`` (with the policy names and every weight's range) / ``PUT /admin/policy``
  ``{"name"?: str, "weights"?: {...}, "reason"?: str}`` (the ``x-kvlb-actor`` header names who, for
  the audit log; ``GET /admin/audit`` lists changes).
* ``POST /admin/whatif``, ``GET /admin/decisions``, ``GET /admin/audit``: :mod:`balancer.api.console`.
* ``POST /admin/explain``: the body of a chat or completions request (``messages`` decides which);
  returns the full decision with every replica's cost terms. Nothing is committed. The
  ``x-kvlb-weights`` header is honoured here whatever ``auth.allow_weight_override`` says.
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
* ``POST /admin/replicas/{id}/drain`` and ``/undrain``.
* ``GET /admin/series?minutes=``: the console's time series per interval (requests per replica,
  predicted and reported hit rate, TTFT p50/p90), from :mod:`balancer.service.series`.
* ``GET /admin/fleet``: with Redis, this balancer's fleet view (members, its leases, mirrors);
  ``{"fleet": null}`` when embedded.

:func:`change_policy`, :func:`explain_raw`, :func:`replicas_answer` (in steps:
:func:`replicas_in_steps`) and :func:`set_draining` do the work without aiohttp, so the gRPC admin
service (:mod:`balancer.api.grpc.admin`) calls the same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from balancer import strict_json
from balancer.api.errors import ApiError
from balancer.api.middleware import REQUEST_ID, STATE, caller, expect_continue
from balancer.api.openai import WEIGHTS_HEADER, find_pool, read_body, tokenize
from balancer.api.parsing import (
    NO_QUERY,
    RequestKind,
    check_query,
    decimal_number,
    parse_json_object,
    parse_request,
    parse_weights_header,
    weights_from,
)
from balancer.api.plain import plain_dict
from balancer.config import ReplicaConfig
from balancer.errors import ConfigError, DrainCommitError
from balancer.health.book import DrainNote, KeptDrainListing, kept_text
from balancer.policy import POLICY_NAMES, PolicyWeights
from balancer.policy.base import OPTIONAL_WEIGHTS, WEIGHT_RANGES
from balancer.routing.left_out import left_out_names
from balancer.routing.receipts import ComputedMarks
from balancer.routing.router import RoutePlan
from balancer.service.audit import DEFAULT_ACTOR, MAX_ACTOR_CHARS, MAX_REASON_CHARS, AuditEntry
from balancer.service.dispatch import Forward, select
from balancer.service.policy_control import PolicyCommitError, PolicyView
from balancer.service.state import Pool, ServiceState
from balancer.sources.base import SourceStatus, last_batch_wall_s, silent_stream_hint, stalled_stream_hint
from balancer.tasks import stepwise
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

_POLICY_KEYS = frozenset({"name", "weights", "reason"})
_DRAIN_KEYS = frozenset({"reason"})
_SIBLING_DRAIN_KEYS = frozenset({"caller", "at_wall_ts"})
ACTOR_HEADER = "x-kvlb-actor"
SIBLING_HEADER = "x-kvlb-sibling"
"""Marks an admin change one worker of ``kvlb serve --workers N`` sends on to the others
(:mod:`balancer.api.siblings`): applied there, not sent on again."""
POLICY_REASON = web.RequestKey("kvlb_policy_reason", object)
"""Where ``PUT /admin/policy`` leaves the change's reason on the request (for the sibling workers of
``kvlb serve --workers N``, :mod:`balancer.api.siblings`)."""
"""Who makes an admin change, as the audit log names them (``admin`` when absent)."""


def actor_of(value: str | None) -> str:
    """The ``x-kvlb-actor`` value checked (printable, at most ``MAX_ACTOR_CHARS``; 400 otherwise)."""
    if value is None or not value.strip():
        return DEFAULT_ACTOR
    value = value.strip()
    if len(value) > MAX_ACTOR_CHARS or not value.isprintable():
        raise ApiError(400, f"{ACTOR_HEADER} must be printable and at most {MAX_ACTOR_CHARS} characters")
    return value


async def get_policy(request: web.Request) -> web.Response:
    check_query(request.query, NO_QUERY)
    body = {**request.app[STATE].policy.view.to_json(), **policy_choices()}
    return web.json_response(body, dumps=strict_json.dumps)


def policy_choices() -> dict[str, Any]:
    """What ``GET /admin/policy`` adds to the policy in force: the policy names, and every weight's
    documented range (:data:`~balancer.policy.base.WEIGHT_RANGES`) as ``{"low", "high",
    "low_open", "nullable"}``."""
    ranges = {
        name: {
            "low": weight_range.low,
            "high": weight_range.high,
            "low_open": weight_range.low_open,
            "nullable": name in OPTIONAL_WEIGHTS,
        }
        for name, weight_range in WEIGHT_RANGES.items()
    }
    return {"policies": list(POLICY_NAMES), "ranges": ranges}


async def put_policy(request: web.Request) -> web.Response:
    check_query(request.query, NO_QUERY)
    state = request.app[STATE]
    limits = state.settings.limits
    body = parse_json_object(await read_body(request, limits.max_body_bytes, state.settings.timeouts))
    actor = actor_of(request.headers.get(ACTOR_HEADER))
    view, changes = await change_policy(state, body, caller(request), actor)
    request[POLICY_REASON] = body.get("reason")  # sent on to the sibling workers with the change
    return web.json_response(
        {**view.to_json(), "changed": {k: [o, n] for k, (o, n) in changes.items()}}, dumps=strict_json.dumps
    )


async def change_policy(
    state: ServiceState, body: Mapping[str, Any], who: str, actor: str = DEFAULT_ACTOR
) -> tuple[PolicyView, dict[str, tuple[object, object]]]:
    """Validate and apply ``{"name"?, "weights"?, "reason"?}`` (400 when invalid); returns the
    policy now in force and ``{field: (old, new)}``, logs who changed what and why once, and adds
    the change to the audit log. In fleet mode the change is stored in Redis first; when that fails
    it is applied nowhere (503 with the reason)."""
    reason = _checked_reason(body, _POLICY_KEYS, "'name', 'weights' and/or 'reason'")
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'name' must be a string")
    changes_in = body.get("weights", {})
    if not isinstance(changes_in, dict):
        raise ApiError(400, "'weights' must be an object of weight names to numbers")
    weights = weights_from(changes_in, state.policy.view.weights, "weights")
    try:
        changes = await state.policy.change(name, weights, who, state.wall_clock(), actor, reason)
    except ConfigError as exc:
        raise ApiError(400, str(exc)) from None
    except PolicyCommitError as exc:
        raise ApiError(503, str(exc)) from None
    view = state.policy.view
    if changes:
        summary = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changes.items())
        log.info(
            "policy v%d set by %s: %s; actor: %s; reason: %s",
            view.version,
            who,
            summary,
            actor,
            reason or "-",
        )
        state.audit.add(
            AuditEntry(
                wall_ts=view.updated_at_wall,
                actor=actor,
                caller=who,
                reason=reason,
                version=view.version,
                before={k: old for k, (old, _) in changes.items()},
                after={k: new for k, (_, new) in changes.items()},
            )
        )
    return view, changes


@dataclass(frozen=True, slots=True)
class Explained:
    """The decision a request would get now, and what it was computed with."""

    model: str
    kind: RequestKind
    weights: PolicyWeights
    plan: RoutePlan
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)
    """The pool's replicas that were not candidates, and why (``draining``, ``failing health
    probes``, ``breaker open``, ``breaker trial in flight``, or ``full``: at
    ``limits.max_inflight_per_replica``), as the router's selection found them
    (:attr:`RoutePlan.left_out <balancer.routing.router.RoutePlan.left_out>`): they have no row in
    the terms."""

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "kind": self.kind,
            "prompt_tokens": self.plan.prompt_tokens,
            "cached_tokens": self.plan.cached_tokens,
            "sequences": self.plan.sequences,
            "decode_blocks": self.plan.decode_blocks,
            "weights": self.weights.to_dict(),
            "decision": dataclasses.asdict(self.plan.decision),
            "left_out": self.left_out,
        }


async def explain(request: web.Request) -> web.Response:
    """Dry-run routing of a request body: the decision and all its terms, without committing."""
    check_query(request.query, NO_QUERY)
    state = request.app[STATE]
    limits = state.settings.limits
    raw = await read_body(request, limits.max_body_bytes, state.settings.timeouts)
    explained = await explain_raw(state, raw, request.headers.get(WEIGHTS_HEADER), request[REQUEST_ID])
    return web.json_response(explained.to_json(), dumps=strict_json.dumps)


async def explain_raw(
    state: ServiceState, raw: bytes, weights_header: str | None, request_id: str
) -> Explained:
    """Dry-run routing of a chat or completions body (``messages`` decides which); commits nothing.
    ``weights_header`` is an ``x-kvlb-weights`` value laid over the policy's weights."""
    kind: RequestKind = "chat" if "messages" in parse_json_object(raw) else "completions"
    parsed = parse_request(raw, kind)
    pool = find_pool(state, parsed.model)
    weights = state.policy.view.weights
    if weights_header is not None:
        weights = parse_weights_header(weights_header, weights)
    token_ids = await tokenize(pool, parsed, state.settings.limits.max_prompt_tokens)
    job = Forward(
        pool,
        token_ids,
        weights,
        parsed.session_key,
        parsed.max_tokens,
        raw,
        "",
        request_id,
        0.0,
        sequences=parsed.sequences,
    )
    plan = select(state, job)
    return Explained(pool.model, kind, weights, plan, left_out_names(plan.left_out))


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
        "drain": None if kept.note is None else _ages(kept.note.to_json(), now),
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
            view["events"] = None if status is None else _ages(plain_dict(status), wall)
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
            view["scrape"] = None if scraper is None else _ages(plain_dict(scraper.status()), wall)
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
            "drain": None if record.drain is None else _ages(record.drain.to_json(), wall),
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


def _ages(record: dict[str, Any], wall: float) -> dict[str, Any]:
    """Adds ``*_age_s`` next to every ``*_wall_ts`` field (recursively into lists of records)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, (list, tuple)):  # a tuple: faster than list | tuple here
            value = [_ages(v, wall) if isinstance(v, dict) else v for v in value]
        out[key] = value
        if key.endswith("_wall_ts"):
            out[key[: -len("_wall_ts")] + "_age_s"] = None if value is None else round(wall - value, 3)
    return out


async def drain(request: web.Request) -> web.Response:
    return await _set_draining(request, True)


async def undrain(request: web.Request) -> web.Response:
    return await _set_draining(request, False)


async def _set_draining(request: web.Request, draining: bool) -> web.Response:
    check_query(request.query, NO_QUERY)
    state = request.app[STATE]
    replica = ReplicaId(request.match_info["replica"])
    raw = await read_body(request, state.settings.limits.max_body_bytes, state.settings.timeouts)
    body = parse_json_object(raw) if raw.strip() else {}
    actor = actor_of(request.headers.get(ACTOR_HEADER))
    note = drain_note(state, body, caller(request), actor, sibling=bool(request.headers.get(SIBLING_HEADER)))
    sibling = bool(request.headers.get(SIBLING_HEADER))
    if sibling and state.drain_committer is None and replica not in state.health.replicas:
        keep_drain(state, replica, draining, note)  # this worker has not discovered it yet
    else:
        await set_draining(state, replica, draining, note)
    view: dict[str, Any] = {"replica": replica, "draining": draining}
    if draining:
        view["drain"] = drain_view(note, state.wall_clock())
    return web.json_response(view, dumps=strict_json.dumps)


def drain_view(note: DrainNote, wall: float) -> dict[str, Any]:
    """A drain's note as the drain's answer and ``health.drain`` show it (with ``at_age_s``)."""
    return _ages(note.to_json(), wall)


def _checked_reason(body: Mapping[str, Any], allowed: frozenset[str], expected: str) -> str | None:
    """``body``'s ``reason`` (``None`` when absent); 400 for a key outside ``allowed`` (the message
    lists the ``expected`` ones) or a reason that is not a string of at most 500 characters."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown key(s) {unknown}; expected {expected}")
    reason = body.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS):
        raise ApiError(400, f"'reason' must be a string of at most {MAX_REASON_CHARS} characters")
    return reason


def drain_note(
    state: ServiceState, body: Mapping[str, Any], who: str, actor: str, *, sibling: bool = False
) -> DrainNote:
    """A drain's note from its body ``{"reason"?}`` (400 when invalid). A sibling worker's replay
    (``sibling``) also carries the ``caller`` and ``at_wall_ts`` of the worker that took the call,
    so that every worker shows the same note."""
    _checked_reason(body, _DRAIN_KEYS | (_SIBLING_DRAIN_KEYS if sibling else frozenset()), "'reason'")
    replayed = DrainNote.from_json({"by": actor, "caller": who, "at_wall_ts": state.wall_clock(), **body})
    if replayed is None:
        raise ApiError(400, "'caller' must be a string and 'at_wall_ts' a number")
    return replayed


def keep_drain(state: ServiceState, replica: ReplicaId, draining: bool, note: DrainNote) -> None:
    """A sibling worker's drain (or undrain) of a replica this worker has not discovered yet (each
    worker discovers on its own): kept, and applied if the replica comes within
    :data:`~balancer.health.book.PENDING_DRAIN_S` (an undrain forgets it)."""
    health = state.health
    dropped = health.pending_drains_dropped
    health.keep_drain(replica, draining, note if draining else None, state.monotonic())
    state.metrics.replica_pending_drains_dropped_total.inc(health.pending_drains_dropped - dropped)
    if draining:
        log.info("replica %s not discovered here yet: its drain by %s is kept for it", replica, note.by)
    else:
        log.info(
            "replica %s not listed here: undrained by %s (a drain kept for it, if any, is forgotten)",
            replica,
            note.by,
        )


async def set_draining(state: ServiceState, replica: ReplicaId, draining: bool, note: DrainNote) -> None:
    """Drain or undrain ``replica``, by whom, when and why (``note``: kept with a drain, logged with
    an undrain); 404 naming the known replicas when it is unknown. In fleet mode it is stored in
    Redis first, for every balancer; when that fails it is applied nowhere (503 with the reason)."""
    if replica not in state.health.replicas:
        if not draining and await _undrain_kept(state, replica, note):
            return
        known = ", ".join(sorted(str(r) for r in state.health.replicas))
        kept = "" if draining else " (listed in no pool here, and no drain is kept for it)"
        raise ApiError(404, f"unknown replica {replica!r}{kept}; known: {known}")
    if state.drain_committer is not None:
        try:
            await state.drain_committer(replica, note if draining else None)
        except DrainCommitError as exc:
            raise ApiError(503, str(exc)) from None
    state.health.set_draining(replica, draining, note)
    action = "draining" if draining else "undrained"
    log.info(
        "replica %s %s by %s (%s); reason: %s", replica, action, note.by, note.caller, note.reason or "-"
    )


async def _undrain_kept(state: ServiceState, replica: ReplicaId, note: DrainNote) -> bool:
    """Undrain a replica no pool lists here whose drain was kept at its removal (here, or in fleet
    mode in Redis by any balancer); ``False`` when there was none (then 404)."""
    kept = state.health.forget_kept(replica) is not None
    if state.drain_committer is not None:
        try:
            kept = await state.drain_committer(replica, None) or kept
        except DrainCommitError as exc:
            raise ApiError(503, str(exc)) from None
    if kept:
        log.info(
            "replica %s (not listed) undrained by %s (%s): its drain kept from before its removal is "
            "forgotten; reason: %s",
            replica,
            note.by,
            note.caller,
            note.reason or "-",
        )
    return kept


SERIES_DEFAULT_MINUTES = 10.0
SERIES_PARAMS = frozenset({"minutes", "ttft_histograms"})
SERIES_HISTOGRAMS = web.RequestKey("kvlb_series_histograms", bool)
"""Set on a ``GET /admin/series`` being gathered from every worker (:mod:`balancer.api.gathered`):
this worker's answer then has each row's ``ttft_histogram``, as the siblings' have."""


async def series(request: web.Request) -> web.Response:
    """``GET /admin/series?minutes=&ttft_histograms=``: the console's time series
    (:mod:`balancer.service.series`) over the last ``minutes`` (default 10, at most what the ring
    holds; 400 unless a decimal number > 0 in ASCII digits: :func:`~balancer.api.parsing.decimal_number`),
    each row with its ``ttft_histogram`` when ``ttft_histograms=1`` (``0``, the default: without;
    400 for anything else)."""
    state = request.app[STATE]
    check_query(request.query, SERIES_PARAMS)
    raw = request.query.get("minutes")
    minutes = SERIES_DEFAULT_MINUTES
    if raw is not None:
        given = decimal_number(raw)
        if given is None or not math.isfinite(given) or given <= 0:
            raise ApiError(400, f"'minutes' must be a decimal number > 0 (as 10 or 0.5), got {raw[:40]!r}")
        minutes = given
    histograms = series_histograms(request.query)
    sampler = state.series
    if sampler is None:
        raise ApiError(404, "the series sampler is not running on this balancer")
    minutes = min(minutes, sampler.span_s / 60.0)
    answer = sampler.series(
        minutes, state.wall_clock(), ttft_histograms=histograms or request.get(SERIES_HISTOGRAMS, False)
    )
    return web.json_response(answer, dumps=strict_json.dumps)


def series_histograms(query: Mapping[str, str]) -> bool:
    """The ``ttft_histograms`` of a ``GET /admin/series`` query: ``1`` or ``0`` (400 otherwise)."""
    raw = query.get("ttft_histograms", "0")
    if raw not in ("0", "1"):
        raise ApiError(400, f"'ttft_histograms' must be 0 or 1, got {raw[:40]!r}")
    return raw == "1"


async def fleet_view(request: web.Request) -> web.Response:
    check_query(request.query, NO_QUERY)
    status = request.app[STATE].fleet_status
    return web.json_response({"fleet": None if status is None else status()}, dumps=strict_json.dumps)


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_put("/admin/policy", put_policy, expect_handler=expect_continue)
    app.router.add_post("/admin/explain", explain, expect_handler=expect_continue)
    app.router.add_get("/admin/replicas", list_replicas)
    app.router.add_get("/admin/fleet", fleet_view)
    app.router.add_get("/admin/series", series)
    app.router.add_get("/admin/replicas/{replica}/blocks", replica_blocks)
    app.router.add_post("/admin/replicas/{replica}/drain", drain, expect_handler=expect_continue)
    app.router.add_post("/admin/replicas/{replica}/undrain", undrain, expect_handler=expect_continue)
