"""The console's admin API (I/O): what-if replays, recent decisions, the audit log.

Behind ``auth.admin_token`` like every ``/admin`` path (the middleware).

* ``POST /admin/whatif`` ``{"pool"?, "weights"?, "policy"?, "last"?, "sample"?}``: re-run a policy
  with proposed weights on the pool's recorded decisions (:mod:`balancer.service.whatif`), in a
  worker thread over a copy of the ring; commits nothing. At most :data:`MAX_CONCURRENT_WHATIF` run
  at once (more → 429), counted until their thread ends; a cancelled request (client gone, shutdown)
  stops its thread at its next pause.
* ``GET /admin/decisions?pool=&replica=&tenant=&since_id=&limit=``: recent decisions, newest first,
  and ``next_since_id``, the ``since_id`` of the next poll (:func:`since_ids`).
* ``GET /admin/decisions/{id}``: one decision with its full explanation and inputs.
* ``GET /admin/audit?limit=``: policy changes, newest first.

:func:`run_whatif`, :func:`decisions_json` and :func:`audit_json` take no aiohttp object, so the gRPC
admin service calls the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from balancer import strict_json
from balancer.api.errors import ApiError
from balancer.api.middleware import STATE, expect_continue
from balancer.api.openai import read_body
from balancer.api.parsing import NO_QUERY, check_query, decimal_integer, parse_json_object, weights_from
from balancer.errors import ConfigError
from balancer.policy import make_policy
from balancer.routing.left_out import left_out_names
from balancer.service.decisions import (
    MAX_TENANT_CHARS,
    DecisionRecord,
    next_since,
    own_since,
    terms_by_replica,
)
from balancer.service.state import ServiceState
from balancer.service.whatif import WhatIfResult, replay

WHATIF_KEYS = frozenset({"pool", "weights", "policy", "last", "sample"})
MAX_SAMPLE = 100
"""Most changed decisions one what-if describes (``sample``; default :data:`DEFAULT_SAMPLE`)."""
DEFAULT_SAMPLE = 10
MAX_CONCURRENT_WHATIF = 2
"""What-if replays running at once per balancer; one more is refused with 429."""
WHATIF_RETRY_AFTER_S = 1.0
MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
MAX_FILTER_CHARS = 256
MAX_SINCE_ENTRIES = 1024
"""At most this many comma-separated ids in ``since_id`` (one per worker of ``kvlb serve --workers``)."""
MAX_ID = 2**62
WORK_SLICE_S = 200e-6
"""A replay lets go of the GIL (for :data:`PAUSE_S`) after every this much CPU time, so that the
event loop's thread waits about that long at most for it, rather than the interpreter's 5 ms switch
interval."""
PAUSE_S = 50e-6


WHATIF_BODY = web.RequestKey("kvlb_whatif_body", bytes)
"""The what-if body as read (the other workers of ``kvlb serve --workers N`` replay it too)."""


class Abandoned(Exception):
    """Raised in the replay's thread when its request was cancelled."""


class ReplayPacer:
    """The ``pause`` of a replay in a worker thread: after every :data:`WORK_SLICE_S` of work it
    sleeps :data:`PAUSE_S` (letting go of the GIL), and it raises :class:`Abandoned` once
    ``cancelled`` is set."""

    def __init__(self, cancelled: threading.Event) -> None:
        self.cancelled = cancelled
        self.slice_end = 0.0

    def __call__(self) -> None:
        if time.perf_counter() < self.slice_end:
            return
        if self.cancelled.is_set():
            raise Abandoned
        time.sleep(PAUSE_S)
        self.slice_end = time.perf_counter() + WORK_SLICE_S


def _int_field(body: Mapping[str, Any], name: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be an integer in {low}..{high} or null")
    return value


async def run_whatif(state: ServiceState, body: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a what-if body (400 with the reason) and replay it off the event loop."""
    unknown = sorted(set(body) - WHATIF_KEYS)
    if unknown:
        raise ApiError(400, f"unknown key(s) {unknown}; expected {sorted(WHATIF_KEYS)}")
    pool = body.get("pool")
    if pool is None:
        if len(state.pools) != 1:
            raise ApiError(400, f"'pool' is required: one of {sorted(state.pools)}")
        pool = next(iter(state.pools))
    if not isinstance(pool, str):
        raise ApiError(400, "'pool' must be a string (a model name) or null")
    if pool not in state.pools:
        raise ApiError(404, f"unknown pool {pool!r}; known: {', '.join(sorted(state.pools)) or 'none'}")
    changes = body.get("weights")
    if changes is None:
        changes = {}
    if not isinstance(changes, dict):
        raise ApiError(400, "'weights' must be an object of weight names to numbers, or null")
    view = state.policy.view
    weights = weights_from(changes, view.weights, "weights")
    name = body.get("policy")
    if name is None:
        name = view.name
    if not isinstance(name, str):
        raise ApiError(400, "'policy' must be a policy name or null")
    try:
        policy = make_policy(name)
    except ConfigError as exc:
        raise ApiError(400, str(exc)) from None
    limit = state.settings.console.whatif_max_entries
    last = _int_field(body, "last", 1, limit, limit)
    sample = _int_field(body, "sample", 0, MAX_SAMPLE, DEFAULT_SAMPLE)
    assert sample is not None
    if state.whatif_running >= MAX_CONCURRENT_WHATIF:
        raise ApiError(
            429,
            f"{MAX_CONCURRENT_WHATIF} what-if replays are running; retry shortly",
            headers={"Retry-After": str(int(WHATIF_RETRY_AFTER_S))},
        )
    records = state.decisions.ring(pool).snapshot(last)
    loop = asyncio.get_running_loop()
    cancelled = threading.Event()

    def finished() -> None:
        state.whatif_running -= 1

    pause = ReplayPacer(cancelled)

    def work() -> WhatIfResult:
        try:
            return replay(
                pool,
                records,
                policy,
                weights,
                sample=sample,
                pause=pause,
                pause_every=1,
                live=(view.name, view.weights),
                max_cache_marks=state.settings.console.whatif_max_cache_marks,
            )
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody counts any more
                loop.call_soon_threadsafe(finished)

    state.whatif_running += 1  # until the thread ends, not until this handler does
    started = time.perf_counter()
    try:
        result = await loop.run_in_executor(None, work)
    except asyncio.CancelledError:
        cancelled.set()  # the client went away or kvlb stops: the thread ends at its next pause
        raise
    state.metrics.console_whatif_seconds.observe(time.perf_counter() - started)
    if result.tallies["unmodelled"]:
        state.metrics.console_whatif_unmodelled_decisions_total.labels(pool).inc(result.tallies["unmodelled"])
    if result.tallies["load_unmodelled"]:
        unmoved = state.metrics.console_whatif_unmoved_load_decisions_total
        unmoved.labels(pool).inc(result.tallies["load_unmodelled"])
    answer = result.to_json()
    answer["elapsed_s"] = round(time.perf_counter() - started, 6)
    return answer


async def whatif(request: web.Request) -> web.Response:
    check_query(request.query, NO_QUERY)
    state = request.app[STATE]
    limits = state.settings.limits
    raw = await read_body(request, limits.max_body_bytes, state.settings.timeouts)
    request[WHATIF_BODY] = raw
    return web.json_response(await run_whatif(state, parse_json_object(raw)), dumps=strict_json.dumps)


def record_summary(record: DecisionRecord) -> dict[str, Any]:
    """One decision as ``/admin/decisions`` lists it."""
    return {
        "id": record.id,
        "ts": record.wall_ts,
        "pool": record.pool,
        "replica": record.decision.replica,
        "tenant": record.tenant,
        "request_id": record.inputs.request.request_id,
        "policy": record.policy,
        "prefill_tokens": record.prompt_tokens,
        "predicted_cached_tokens": record.cached_tokens,
        "reason": record.decision.reason,
        "terms": terms_by_replica(record.decision.terms),
    }


def record_detail(record: DecisionRecord) -> dict[str, Any]:
    """One decision as ``/admin/explain`` shows a dry run, plus its id, time, tenant and inputs."""
    inputs = record.inputs
    return {
        "id": record.id,
        "ts": record.wall_ts,
        "pool": record.pool,
        "model": record.pool,
        "tenant": record.tenant,
        "request_id": record.inputs.request.request_id,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "sequences": record.sequences,
        "decode_blocks": record.decode_blocks,
        "prefill_s": record.prefill_s,
        "held_s": record.held_s,
        "weights": record.weights.to_dict(),
        "decision": dataclasses.asdict(record.decision),
        "left_out": left_out_names(record.left_out),
        "inputs": {
            "candidates": list(inputs.request.candidates),
            "request_blocks": inputs.request.request_blocks,
            "overlap_blocks": dict(inputs.overlap.blocks),
            "speculative_blocks": dict(inputs.overlap.speculative_blocks),
            "held_blocks": dict(inputs.overlap.held_blocks),
            "held_roots": dict(inputs.overlap.held_roots),
            "ramp_share": inputs.request.ramp_share,
            "ramp_at_s": inputs.request.ramp_at_s,
            "ramp_last_share": inputs.request.ramp_last_share,
            "block_size_tokens": inputs.load.block_size_tokens,
            "load": {r: dataclasses.asdict(load) for r, load in inputs.load.replicas.items()},
        },
    }


DECISIONS_PARAMS = frozenset({"pool", "replica", "tenant", "since_id", "limit"})
AUDIT_PARAMS = frozenset({"limit"})


def _text_filter(query: Mapping[str, str], name: str) -> str | None:
    value = query.get(name)
    if value is None or value == "":
        return None
    if len(value) > MAX_FILTER_CHARS:
        raise ApiError(400, f"'{name}' is longer than {MAX_FILTER_CHARS} characters")
    return value


def _tenant_filter(query: Mapping[str, str]) -> str | None:
    """``tenant``, cut as a decision's tenant is kept (:data:`MAX_TENANT_CHARS`): the value of a
    longer tenant header finds the requests sent with it."""
    tenant = _text_filter(query, "tenant")
    return None if tenant is None else tenant[:MAX_TENANT_CHARS]


def _int_param(query: Mapping[str, str], name: str, low: int, high: int, default: int) -> int:
    """A query parameter of decimal digits only (no sign, no spaces, not empty) in ``low..high``."""
    raw = query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18) or not low <= int(raw) <= high:
        raise ApiError(400, f"'{name}' must be an integer in {low}..{high}")
    return int(raw)


def since_ids(query: Mapping[str, str]) -> tuple[int, ...]:
    """``since_id``: one id (every worker lists its ids above it: one process's form), or one id per
    worker, comma-separated, entry ``i`` worker ``i``'s (an answer's ``next_since_id``); 400 when bad."""
    raw = query.get("since_id")
    if raw is None:
        return (0,)
    parts = raw.split(",")
    if len(parts) > MAX_SINCE_ENTRIES or not all(
        p.isascii() and p.isdigit() and len(p) <= 18 and int(p) <= MAX_ID for p in parts
    ):
        raise ApiError(
            400,
            f"'since_id' must be an integer in 0..{MAX_ID}, or at most {MAX_SINCE_ENTRIES} of them "
            "comma-separated (an answer's next_since_id)",
        )
    return tuple(int(p) for p in parts)


def decisions_json(state: ServiceState, query: Mapping[str, str]) -> dict[str, Any]:
    """``/admin/decisions`` for the query parameters in ``query`` (400 when one is bad)."""
    check_query(query, DECISIONS_PARAMS)
    pool = _text_filter(query, "pool")
    if pool is not None and pool not in state.pools:
        raise ApiError(404, f"unknown pool {pool!r}; known: {', '.join(sorted(state.pools)) or 'none'}")
    since_id = own_since(since_ids(query), state.decisions.worker_index)
    found = state.decisions.query(
        pool=pool,
        replica=_text_filter(query, "replica"),
        tenant=_tenant_filter(query),
        since_id=since_id,
        limit=_int_param(query, "limit", 1, MAX_LIMIT, DEFAULT_LIMIT),
    )
    # this process's own cursor; a gathered answer's holds every worker's (balancer.api.gathered)
    cursor = next_since((since_id,), 1, ((0, r.id) for r in found))
    return {"decisions": [record_summary(r) for r in found], "next_since_id": cursor}


async def list_decisions(request: web.Request) -> web.Response:
    return web.json_response(decisions_json(request.app[STATE], request.query), dumps=strict_json.dumps)


def decision_json(state: ServiceState, raw_id: str) -> dict[str, Any]:
    record_id = decimal_integer(raw_id)
    if record_id is None:
        raise ApiError(400, f"decision id must be an integer in decimal digits, got {raw_id[:40]!r}")
    record = state.decisions.find(record_id)
    if record is None:
        raise ApiError(404, f"decision {record_id} is not in the ring (evicted, or never made)")
    return record_detail(record)


async def get_decision(request: web.Request) -> web.Response:
    check_query(request.query, NO_QUERY)
    body = decision_json(request.app[STATE], request.match_info["id"])
    return web.json_response(body, dumps=strict_json.dumps)


def audit_json(state: ServiceState, limit: int) -> dict[str, Any]:
    return {"entries": [entry.to_json() for entry in state.audit.newest(limit)]}


async def audit(request: web.Request) -> web.Response:
    check_query(request.query, AUDIT_PARAMS)
    limit = _int_param(request.query, "limit", 1, MAX_LIMIT, DEFAULT_LIMIT)
    return web.json_response(audit_json(request.app[STATE], limit), dumps=strict_json.dumps)


def add_console_routes(app: web.Application) -> None:
    app.router.add_post("/admin/whatif", whatif, expect_handler=expect_continue)
    app.router.add_get("/admin/decisions", list_decisions)
    app.router.add_get("/admin/decisions/{id}", get_decision)
    app.router.add_get("/admin/audit", audit)
