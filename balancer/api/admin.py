"""The admin API (I/O): its routes, and the changes it makes: policy tuning and draining.

Behind ``auth.admin_token`` when it is set (checked by the middleware). Every change is applied at
once and logged at INFO with who made it (the ``x-kvlb-actor`` header, :func:`actor_of`), from where
and why (``reason``); a policy change also bumps the version and goes to the
audit log. One worker of ``kvlb serve --workers N`` sends each change on to the others
(:mod:`balancer.api.siblings`, :data:`SIBLING_HEADER`).

* ``GET /admin/policy`` (with the policy names and every weight's range) / ``PUT /admin/policy``
  ``{"name"?: str, "weights"?: {...}, "reason"?: str}`` (the ``x-kvlb-actor`` header names who, for
  the audit log; ``GET /admin/audit`` lists changes).
* ``POST /admin/replicas/{id}/drain`` and ``/undrain``.
* ``GET /admin/fleet``: with Redis, this balancer's fleet view (members, its leases, mirrors);
  ``{"fleet": null}`` when embedded.

The other admin routes, added here (:func:`add_admin_routes`) from where they live:

* ``POST /admin/explain``: the dry run of a request, :mod:`balancer.api.admin_explain`.
* ``GET /admin/replicas`` and ``GET /admin/replicas/{id}/blocks``: the replica views,
  :mod:`balancer.api.admin_replicas`.
* ``GET /admin/series?minutes=``: the console's time series, :mod:`balancer.api.admin_series`.
* ``POST /admin/whatif``, ``GET /admin/decisions``, ``GET /admin/audit``: :mod:`balancer.api.console`
  (its own routes).

:func:`change_policy` and :func:`set_draining` do the work without aiohttp, so the gRPC admin
service (:mod:`balancer.api.grpc.admin`) calls the same code.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from balancer import strict_json
from balancer.api.admin_explain import explain
from balancer.api.admin_replicas import list_replicas, replica_blocks, with_ages
from balancer.api.admin_series import series
from balancer.api.errors import ApiError
from balancer.api.middleware import STATE, caller, expect_continue
from balancer.api.openai import read_body
from balancer.api.parsing import NO_QUERY, check_query, parse_json_object, weights_from
from balancer.errors import ConfigError, DrainCommitError
from balancer.health.book import DrainNote
from balancer.policy import POLICY_NAMES
from balancer.policy.base import OPTIONAL_WEIGHTS, WEIGHT_RANGES
from balancer.service.audit import DEFAULT_ACTOR, MAX_ACTOR_CHARS, MAX_REASON_CHARS, AuditEntry
from balancer.service.policy_control import PolicyCommitError, PolicyView
from balancer.service.state import ServiceState
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

_POLICY_KEYS = frozenset({"name", "weights", "reason"})
_DRAIN_KEYS = frozenset({"reason"})
_SIBLING_DRAIN_KEYS = frozenset({"caller", "at_wall_ts"})
ACTOR_HEADER = "x-kvlb-actor"
"""Who makes an admin change, as the audit log names them (``admin`` when absent)."""
SIBLING_HEADER = "x-kvlb-sibling"
"""Marks an admin change one worker of ``kvlb serve --workers N`` sends on to the others
(:mod:`balancer.api.siblings`): applied there, not sent on again."""
POLICY_REASON = web.RequestKey("kvlb_policy_reason", object)
"""Where ``PUT /admin/policy`` leaves the change's reason on the request (for the sibling workers of
``kvlb serve --workers N``, :mod:`balancer.api.siblings`)."""


def actor_of(value: str | None) -> str:
    """The ``x-kvlb-actor`` value checked (printable, at most ``MAX_ACTOR_CHARS``; 400 otherwise)."""
    if value is None or not value.strip():
        return DEFAULT_ACTOR
    value = value.strip()
    if len(value) > MAX_ACTOR_CHARS or not value.isprintable():
        raise ApiError(400, f"{ACTOR_HEADER} must be printable and at most {MAX_ACTOR_CHARS} characters")
    return value


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
    return with_ages(note.to_json(), wall)


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
