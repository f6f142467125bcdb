"""The aiohttp application (I/O): assembles the routes and serves the operational endpoints.

* ``GET /healthz``: 200 while the process runs (liveness).
* ``GET /readyz``: 200 once every pool has a healthy replica and the event sources run (and, with
  Redis, every mirror is warm); else 503 with the reasons (readiness). ``degraded`` lists what
  still works around a problem, e.g. Redis unreachable while routing goes on from the mirrors.
* ``GET /metrics``: Prometheus text of the injected registry (point-in-time gauges refreshed first),
  rendered by :class:`balancer.exposition.Exposition`. Both run in steps of a few ms, the loop
  serving other requests between two (:func:`balancer.tasks.stepwise`): at 200 replicas a scrape
  writes some 30,000 samples.
* ``GET /openapi.json``: the API description.
* ``GET /ui/``: the web console's static page (:mod:`balancer.api.webui`), unless
  ``console.ui_enabled`` is off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from balancer import strict_json
from balancer.api.admin import add_admin_routes
from balancer.api.body_memo import BodyMemo
from balancer.api.console import add_console_routes
from balancer.api.cors import CorsPolicy
from balancer.api.inflight import InflightRequests
from balancer.api.middleware import BODY_MEMO, CORS, PREFIX_MEMO, STATE, add_cors_headers, kvlb_middleware
from balancer.api.openai import add_openai_routes
from balancer.api.openapi import openapi_document
from balancer.api.prefix_memo import PrefixMemo
from balancer.api.webui import add_ui_routes
from balancer.exposition import Exposition
from balancer.service.state import ServiceState
from balancer.tasks import stepwise

EXPOSITION: web.AppKey[Exposition] = web.AppKey("exposition", Exposition)
"""The renderer of ``/metrics`` (:mod:`balancer.exposition`: keeps each series' text between scrapes)."""


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"}, dumps=strict_json.dumps)


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    now = state.monotonic()
    problems = state.readiness(now)
    degraded = state.degraded(now)
    extra = {"degraded": degraded} if degraded else {}
    if problems:
        return web.json_response(
            {"ready": False, "reasons": problems, **extra}, status=503, dumps=strict_json.dumps
        )
    return web.json_response({"ready": True, **extra}, dumps=strict_json.dumps)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await stepwise(refresh_steps(state))
    body = await stepwise(request.app[EXPOSITION].steps())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


REFRESH_STEP_REPLICAS: Final = 50
"""Replicas whose gauges :func:`refresh_steps` sets between two yields (about 10 gauges each)."""


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(), dumps=strict_json.dumps)


def refresh_gauges(state: ServiceState) -> None:
    """:func:`refresh_steps` at once."""
    for _ in refresh_steps(state):
        pass


def refresh_steps(state: ServiceState) -> Generator[None, None, None]:
    """Set the gauges that are views of current state: index size, replica load and health, and the
    event loop's task count (on the loop, by the ``/metrics`` handler); yields after every
    :data:`REFRESH_STEP_REPLICAS` replicas. A pool's figures are read before its first replica's
    gauges are set; after a yield, a replica that left its pool meanwhile is skipped (its series
    were removed with it: setting one would bring it back for good)."""
    metrics = state.metrics
    child = metrics.children.of
    done = 0
    metrics.process_asyncio_tasks.set(len(asyncio.all_tasks()))
    now = state.monotonic()
    unique = held = speculative = 0
    for pool in list(state.pools.values()):
        by_replica = dict.fromkeys(pool.replicas, 0)
        for space in pool.router.spaces.values():
            stats = space.table.stats()
            unique += stats.unique_blocks
            held += stats.held_blocks
            speculative += stats.speculative_entries
            for replica, blocks in stats.blocks_by_replica.items():
                by_replica[replica] = by_replica.get(replica, 0) + blocks
        for replica, blocks in by_replica.items():
            child(metrics.index_replica_blocks, replica).set(blocks)
        snapshot = pool.router.tracker().snapshot(now)  # this worker's own: summable over workers
        shared = pool.router.load_snapshot(now) if pool.router.peer_load is not None else None
        routable = set(state.health.routable(now, pool.replicas))
        metrics.pool_routable_replicas.labels(pool.model).set(len(routable))
        yielded = False
        for replica in list(pool.replicas):
            if yielded and (replica not in pool.replicas or state.pools.get(pool.model) is not pool):
                continue
            load = snapshot.of(replica)
            metrics.set_replica_load(replica, "inflight", pool.router.in_flight(replica))
            if shared is not None:
                metrics.set_replica_load(replica, "peer_inflight", shared.of(replica).peer_seqs)
            metrics.set_replica_load(replica, "pending_prefill_tokens", load.pending_prefill_tokens)
            metrics.set_replica_load(replica, "decode_blocks", load.active_decode_blocks)
            if load.waiting_reqs is not None:
                metrics.set_replica_load(replica, "waiting", load.waiting_reqs)
            if load.kv_usage is not None:
                metrics.set_replica_load(replica, "kv_usage", load.kv_usage)
            child(metrics.replica_healthy, replica).set(1 if replica in routable else 0)
            breaker = state.health.breaker_state(replica, now)
            child(metrics.replica_breaker_open, replica).set(0 if breaker in (None, "closed") else 1)
            record = state.health.replicas.get(replica)
            mismatch = record is not None and record.model_mismatch is not None
            child(metrics.replica_model_mismatch, replica).set(1 if mismatch else 0)
            refused = record is not None and record.key_refused is not None
            child(metrics.replica_key_refused, replica).set(1 if refused else 0)
            done += 1
            if done % REFRESH_STEP_REPLICAS == 0:
                yield
                yielded = True
    metrics.index_blocks.labels("unique").set(unique)
    metrics.index_blocks.labels("held").set(held)
    metrics.index_blocks.labels("speculative").set(speculative)


def build_web_app(state: ServiceState, inflight: InflightRequests | None = None) -> web.Application:
    """The web application for ``state``; lifecycle (tasks, sessions) belongs to the caller, which
    passes ``inflight`` to have every request's task kept there (its shutdown cancels them)."""
    cors = CorsPolicy.of(state.settings.listen, state.settings.tenant_header)
    app = web.Application(
        middlewares=[kvlb_middleware(state, cors, inflight)],
        client_max_size=state.settings.limits.max_body_bytes,
    )
    app[STATE] = state
    app[EXPOSITION] = Exposition(state.metrics.registry)
    limits = state.settings.limits
    body_memo = app[BODY_MEMO] = BodyMemo(limits.body_memo_entries, limits.body_memo_bytes)
    state.metrics.body_memo.source = body_memo.counts
    prefix_memo = app[PREFIX_MEMO] = PrefixMemo(limits.prefix_memo_entries, limits.prefix_memo_bytes)
    state.metrics.prefix_memo.source = prefix_memo.counts
    if cors is not None:
        app[CORS] = cors
        app.on_response_prepare.append(add_cors_headers)
    add_openai_routes(app)
    add_admin_routes(app)
    add_console_routes(app)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    if state.settings.console.ui_enabled:
        add_ui_routes(app)
    return app
