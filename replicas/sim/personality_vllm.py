"""vLLM 0.32 personality: ZMQ KV events, replay, and vLLM's HTTP endpoints (I/O shell).

Per DP rank a PUB socket and a ROUTER replay socket (:mod:`replicas.sim.zmq_events`, the same framing
as SGLang's, replay answered in 4 frames). Events are shaped as in the real vLLM 0.32 CPU captures
(``tests/golden/real/vllm-0.32.0-cpu``):

* nothing is published at start-up, nor after a restart (a restarted vLLM starts again at seq 0,
  silently, docs/reference/real-engines.md);
* one ``BlockStored`` per new chain of blocks (a step's newly cached blocks under one parent):
  ``block_hashes`` are vLLM's ``sha256`` block hashes (:mod:`replicas.wire.vllm`, **unsigned** u64),
  ``parent_block_hash`` the hash of the block it hangs from (``None`` for a request's first block),
  ``token_ids`` the blocks' tokens, ``block_size`` the block size (128 by default), then ``lora_id:
  null``, ``medium: "GPU"``, ``lora_name: null``, ``extra_keys`` (``[null]`` per block), ``group_idx:
  0`` and ``kv_cache_spec_kind: "full_attention"``;
* every evicted block is its own ``BlockRemoved`` (``block_hashes`` of one, ``medium: "GPU"``,
  ``group_idx: 0``), tail block first, as in ``vllm2-frame007``…``012``;
* ``POST /reset_prefix_cache`` publishes ``AllBlocksCleared`` (``vllm2-frame035``).

HTTP, besides the shared OpenAI API (``/v1/chat/completions``, ``/v1/completions`` with
``usage.prompt_tokens_details.cached_tokens``, ``/v1/models``, ``/health``, ``/tokenize``, the render
endpoints): ``/metrics`` with vLLM's metric names and labels (``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits_total``, ``vllm:cache_config_info``, ... as in
``tests/fixtures/metrics/vllm-0.32.0-cpu.txt``), ``/reset_prefix_cache``, ``/kv_event_sources``,
``/load``, ``/version`` and ``/ping``.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq
import zmq.asyncio
from aiohttp import web

from replicas.sim.cache import CacheCleared, CacheRecord, PagesRemoved, PagesStored
from replicas.sim.config import ReplicaConfig
from replicas.sim.context import ReplicaContext, Sample, prometheus_text, rank_stats
from replicas.sim.faults import FaultState
from replicas.sim.zmq_events import ZmqPersonality, ZmqRankPublisher
from replicas.wire.sglang import KvEventEncoder
from replicas.wire.vllm import block_hash

VLLM_VERSION = "0.32.0"
"""The vLLM release whose behaviour the vLLM personality copies."""

FLUSH_PATH = "/reset_prefix_cache"
"""vLLM's cache reset (``POST``; a dev-mode endpoint on a real engine)."""


class VllmRankPublisher(ZmqRankPublisher):
    """vLLM's publisher of one DP rank: silent start, chained ``BlockStored``, one ``BlockRemoved`` per
    evicted block, ``AllBlocksCleared`` on a reset."""

    def __init__(
        self, zctx: zmq.asyncio.Context, config: ReplicaConfig, rank: int, faults: FaultState
    ) -> None:
        encoder = KvEventEncoder(flavor="vllm", encoding=config.event_encoding)
        super().__init__(zctx, config, rank, faults, encoder)

    def encode(self, records: Sequence[CacheRecord]) -> list[object]:
        events: list[object] = []
        for record in records:
            if isinstance(record, PagesStored):
                events.append(self._stored(record))
            elif isinstance(record, PagesRemoved):
                gone = (self._hashes.pop(page.page_id, None) for page in record.pages)
                events.extend(self._encoder.block_removed([entry[0]]) for entry in gone if entry is not None)
            else:
                assert isinstance(record, CacheCleared)
                self._hashes.clear()
                events.append(self._encoder.all_blocks_cleared())
        return events

    def _stored(self, record: PagesStored) -> object:
        parent = None if record.parent is None else self._hashes.get(record.parent.page_id)
        prior = None if parent is None else parent[1]
        hashes: list[int] = []
        tokens: list[int] = []
        for page in record.pages:
            value, prior = block_hash(prior, page.tokens)
            self._hashes[page.page_id] = (value, prior)
            hashes.append(value)
            tokens.extend(page.tokens)
        parent_hash = None if parent is None else parent[0]
        return self._encoder.block_stored(hashes, parent_hash, tokens, self.config.block_size)


class VllmPersonality(ZmqPersonality):
    """Step observer and HTTP routes of a vLLM replica."""

    flush_path = FLUSH_PATH
    REFUSES_OTHER_MODELS = True  # vLLM's _check_model: "The model `x` does not exist." (404)

    @staticmethod
    def guards_path(path: str) -> bool:
        """vLLM's ``--api-key`` guards only the ``/v1`` paths (its ``AuthenticationMiddleware``):
        ``/health``, ``/metrics``, ``/load`` and ``/reset_prefix_cache`` stay open."""
        return path.startswith("/v1")

    def publisher(
        self, zctx: zmq.asyncio.Context, config: ReplicaConfig, rank: int, faults: FaultState
    ) -> VllmRankPublisher:
        return VllmRankPublisher(zctx, config, rank, faults)

    def add_routes(self, app: web.Application, ctx: ReplicaContext) -> None:
        routes = _VllmRoutes(ctx)
        app.router.add_get("/metrics", routes.metrics)
        app.router.add_post(FLUSH_PATH, routes.reset_prefix_cache)
        app.router.add_get("/kv_event_sources", routes.kv_event_sources)
        app.router.add_get("/load", routes.load)
        app.router.add_get("/version", routes.version)
        app.router.add_get("/ping", routes.ping)
        app.router.add_post("/ping", routes.ping)


class _VllmRoutes:
    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx

    async def metrics(self, request: web.Request) -> web.Response:
        ctx, config = self.ctx, self.ctx.config
        per_rank = [rank_stats(ctx, r) for r in range(config.dp_size)]

        def family(name: str, kind: str, text: str, key: str) -> tuple[str, str, str, list[Sample]]:
            samples: list[Sample] = [
                (name, {"engine": str(stats["dp_rank"]), "model_name": ctx.model}, float(stats[key]))
                for stats in per_rank
            ]
            return (name, kind, text, samples)

        info: list[Sample] = [
            (
                "vllm:cache_config_info",
                {
                    "block_size": str(config.block_size),
                    "enable_prefix_caching": "True",
                    "engine": str(stats["dp_rank"]),
                    "num_gpu_blocks": str(stats["capacity_blocks"]),
                    "prefix_caching_hash_algo": "sha256",
                },
                1.0,
            )
            for stats in per_rank
        ]
        families = [
            family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   "num_running_reqs"),
            family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   "num_waiting_reqs"),
            family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   "token_usage"),
            family("vllm:prefix_cache_queries_total", "counter",
                   "Prefix cache queries, in terms of number of queried tokens.", "prompt_tokens_total"),
            family("vllm:prefix_cache_hits_total", "counter",
                   "Prefix cache hits, in terms of number of cached tokens.", "cached_tokens_total"),
            family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                   "prompt_tokens_total"),
            family("vllm:prompt_tokens_cached_total", "counter",
                   "Number of cached prompt tokens (local + external).", "cached_tokens_total"),
            family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                   "generation_tokens_total"),
            ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", info),
        ]  # fmt: skip
        return web.Response(text=prometheus_text(families), content_type="text/plain", charset="utf-8")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Empty every rank's cache (``AllBlocksCleared``); refused with 400 while requests run."""
        if self.ctx.engine.flush():
            return web.json_response({"success": True})
        return web.json_response({"success": False, "error": "requests are running"}, status=400)

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """The per-rank KV-event config, as vLLM lists it for router discovery."""
        config = self.ctx.config
        sources = {
            str(rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{config.event_port + rank}",
                "replay_endpoint": f"tcp://*:{config.replay_port + rank}",
                "buffer_steps": config.buffer_steps,
                "hwm": config.hwm,
                "max_queue_size": 100_000,
                "topic": config.topic,
            }
            for rank in range(config.dp_size)
        }
        return web.json_response(sources)

    async def load(self, request: web.Request) -> web.Response:
        """``{"server_load": 0}``: a vLLM started without ``--enable-server-load-tracking``."""
        return web.json_response({"server_load": 0})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def ping(self, request: web.Request) -> web.Response:
        if self.ctx.faults.settings.fail_health:
            return web.Response(status=503)
        return web.Response(status=200)
