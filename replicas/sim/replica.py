"""One emulated replica: engine loop + personality + HTTP server + admin endpoints (I/O shell).

Lifecycle: ``await Replica.start()`` binds every socket and starts every task; ``await stop()`` undoes
it in reverse order. All tasks are owned here (or by the engine and the personality, which this class
owns) and cancelled on stop.

Admin endpoints (for tests and the demo; not part of any engine's API):

* ``GET /admin/faults``; ``POST /admin/faults`` with any of the keys of
  :class:`replicas.sim.faults.FaultSettings` and the one-shot actions ``stall_s``, ``refuse_s``,
  ``restart``; ``DELETE /admin/faults`` clears the standing faults.
* ``GET /admin/requests``: modelled timings of recently finished requests (``?clear=1`` empties it).
* ``GET /admin/stats``: per-rank cache and queue figures, event counters, and the generation requests
  open now and at most at once (``open_requests``, ``peak_open_requests``).
* ``GET /admin/blocks?limit=``: per rank, the pages the cache holds (``PrefixCache.listing``: each
  page's parent position and tokens, parents first), at most ``limit`` a rank (default and most
  :data:`MAX_LISTED_BLOCKS`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, cast

import zmq.asyncio
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from replicas.sim.config import ZMQ_ENGINES, ReplicaConfig
from replicas.sim.context import ReplicaContext, json_error, rank_stats
from replicas.sim.engine import Engine
from replicas.sim.faults import FaultSettings, FaultState, parse_fault_request
from replicas.sim.http import add_openai_routes
from replicas.sim.personality_sglang import SglangPersonality
from replicas.sim.personality_trtllm import TrtllmPersonality
from replicas.sim.personality_vllm import VllmPersonality
from replicas.sim.ports import free_port_run
from replicas.sim.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 1.0
"""How long stopping waits for open HTTP connections (streams are cut after that)."""

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body accepted."""


MAX_LISTED_BLOCKS = 65_536
"""Most pages ``GET /admin/blocks`` lists per rank (its ``limit``, and the default)."""


BIND_ATTEMPTS = 5
"""Listen attempts of a replica whose HTTP port was picked free (another pick after each refusal)."""


def resolve_ports(config: ReplicaConfig) -> ReplicaConfig:
    """``config`` with every port 0 replaced by free ports (consecutive per DP rank)."""
    http_port = config.http_port or free_port_run(config.host, 1)
    event_port, replay_port = config.event_port, config.replay_port
    if config.engine in ZMQ_ENGINES and (event_port == 0 or replay_port == 0):
        base = free_port_run(config.host, 2 * config.dp_size)
        event_port = event_port or base
        replay_port = replay_port or base + config.dp_size
    return replace(config, http_port=http_port, event_port=event_port, replay_port=replay_port)


class Replica:
    """An emulated SGLang, vLLM or TRT-LLM engine endpoint."""

    def __init__(self, config: ReplicaConfig, tokenizer: PromptTokenizer, zctx: zmq.asyncio.Context) -> None:
        self._auto_http_port = config.http_port == 0
        self.config = config = resolve_ports(config)
        self.faults = FaultState(config.faults, random.Random(config.seed))
        self.personality: SglangPersonality | VllmPersonality | TrtllmPersonality
        if config.engine == "sglang":
            self.personality = SglangPersonality(zctx, config, self.faults)
        elif config.engine == "vllm":
            self.personality = VllmPersonality(zctx, config, self.faults)
        else:
            self.personality = TrtllmPersonality(config, self.faults)
        vocab = int(getattr(tokenizer, "vocab_size", config.profile.vocab_size))
        self.engine = Engine(config, self.faults, self.personality, vocab)
        self.ctx = ReplicaContext(config, self.engine, self.faults, tokenizer, vocab)
        middlewares = (
            [] if config.api_key is None else [_api_key_middleware(config.api_key, self.personality)]
        )
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        self.ctx.refuses_other_models = self.personality.REFUSES_OTHER_MODELS
        add_openai_routes(self.app, self.ctx)
        self.personality.add_routes(self.app, self.ctx)
        self._add_admin_routes()
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        self._site: web.TCPSite | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

    async def start(self) -> None:
        await self.personality.start()
        self.engine.start()
        await self._runner.setup()
        for attempt in range(BIND_ATTEMPTS):
            try:
                await self._listen()
                return
            except OSError as exc:
                # a free port picked at construction may be taken by another process by now
                if exc.errno != errno.EADDRINUSE or not self._auto_http_port or attempt == BIND_ATTEMPTS - 1:
                    raise
                log.info("replica %s: port %d taken, trying another", self.config.name, self.config.http_port)
                self.config = replace(self.config, http_port=free_port_run(self.config.host, 1))
                self.ctx.config = self.config

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._runner.cleanup()
        self._site = None
        await self.engine.stop()
        await self.personality.close()

    def describe(self) -> dict[str, Any]:
        """What a client needs to reach this replica (the fleet prints it)."""
        return {
            "name": self.config.name,
            "engine": self.config.engine,
            "url": self.url,
            "model": self.ctx.model,
            "profile": self.config.profile.name,
            "dp_size": self.config.dp_size,
            "block_size": self.config.block_size,
            **self.personality.describe(),
        }

    def restart(self) -> None:
        """The engine process restarts: requests aborted, cache emptied, events start over."""
        self.engine.restart()
        self.personality.restart()

    async def refuse_connections(self, wall_s: float, spare: object = None) -> None:
        """Close the listener and every open connection now (as a dead HTTP server would), and
        reopen the listener after ``wall_s`` seconds (in an owned task). The event sockets stay.
        ``spare`` is the connection handler asking for it, left to answer (and then close)."""
        if self._site is not None:
            await self._site.stop()
            self._site = None
        server = self._runner.server
        for handler in list(server.connections if server is not None else ()):
            if handler is not spare:
                handler.force_close()
        self._spawn(self._reopen_after(wall_s))

    async def _listen(self) -> None:
        self._site = web.TCPSite(self._runner, self.config.host, self.config.http_port, reuse_address=True)
        await self._site.start()

    async def _reopen_after(self, wall_s: float) -> None:
        await asyncio.sleep(wall_s)
        if self._site is None:
            await self._listen()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------------------------- admin

    def _add_admin_routes(self) -> None:
        router = self.app.router
        router.add_get("/admin/faults", self._get_faults)
        router.add_post("/admin/faults", self._post_faults)
        router.add_delete("/admin/faults", self._clear_faults)
        router.add_get("/admin/requests", self._requests)
        router.add_get("/admin/stats", self._stats)
        router.add_get("/admin/blocks", self._blocks)

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.describe())

    async def _post_faults(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            settings, actions = parse_fault_request(self.faults.settings, body)
        except ValueError as exc:
            return json_error(400, str(exc))
        self.faults.settings = settings
        if actions.restart:
            self.restart()
        if actions.stall_s > 0:
            self.engine.stall(actions.stall_s)
        if actions.refuse_s > 0:
            await self.refuse_connections(actions.refuse_s, spare=request.protocol)
        log.info("replica %s faults now %s, actions %s", self.config.name, settings, actions)
        response = web.json_response({**self.faults.describe(), "actions": asdict(actions)})
        if actions.refuse_s > 0:
            response.force_close()  # the server is "down": this connection ends with the answer
        return response

    async def _clear_faults(self, request: web.Request) -> web.Response:
        self.faults.settings = FaultSettings()
        return web.json_response(self.faults.describe())

    async def _requests(self, request: web.Request) -> web.Response:
        records = list(self.engine.finished_log)
        if request.query.get("clear") in ("1", "true"):
            self.engine.finished_log.clear()
        return web.json_response(records)

    async def _blocks(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit", str(MAX_LISTED_BLOCKS))
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 6) or int(raw) > MAX_LISTED_BLOCKS:
            return json_error(400, f"'limit' must be an integer in 0..{MAX_LISTED_BLOCKS}")
        ranks = []
        for rank, engine_rank in enumerate(self.engine.ranks):
            cache = engine_rank.scheduler.cache
            pages, truncated = cache.listing(int(raw))
            ranks.append(
                {
                    "dp_rank": rank,
                    "blocks": cache.tree_blocks,
                    "truncated": truncated,
                    "pages": [[parent, list(tokens)] for parent, tokens in pages],
                }
            )
        return web.json_response(
            {"name": self.config.name, "block_size": self.config.block_size, "ranks": ranks}
        )

    async def _stats(self, request: web.Request) -> web.Response:
        stats: dict[str, Any] = {
            "name": self.config.name,
            "ranks": [rank_stats(self.ctx, r) for r in range(self.config.dp_size)],
            "faults": self.faults.describe(),
            "requests_total": self.engine.requests_total,
            "open_requests": self.ctx.open_requests,
            "peak_open_requests": self.ctx.peak_open_requests,
        }
        personality = self.personality
        if isinstance(personality, SglangPersonality | VllmPersonality):
            stats["seq"] = [p.seq for p in personality.publishers]
            stats["epoch"] = [p.epoch for p in personality.publishers]
        else:
            stats["events_buffered"] = len(personality.buffer.events)
            stats["events_overflow_dropped"] = personality.buffer.overflow_dropped
            stats["events_fault_dropped"] = personality.buffer.fault_dropped
        return web.json_response(stats)


def _api_key_middleware(
    api_key: str, personality: SglangPersonality | VllmPersonality | TrtllmPersonality
) -> Middleware:
    """The engine's ``--api-key``: a guarded path (:meth:`guards_path`) without ``Authorization: Bearer
    <key>`` gets 401 ``{"error": "Unauthorized"}``, as vLLM and SGLang answer; ``OPTIONS`` and the
    emulator's own ``/admin`` paths pass."""
    expected = f"Bearer {api_key}"
    guards = cast(Callable[[str], bool], personality.guards_path)

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if request.method == "OPTIONS" or path.startswith("/admin") or not guards(path):
            return await handler(request)
        if request.headers.get("Authorization") != expected:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check_key
