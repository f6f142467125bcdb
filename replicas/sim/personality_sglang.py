"""SGLang 0.5.23 personality: ZMQ KV events, replay, and SGLang's HTTP endpoints (I/O shell).

Per DP rank: a PUB socket on ``event_port + rank`` sending ``[topic, seq8, msgpack([ts, events,
rank])]`` and a ROUTER replay socket on ``replay_port + rank`` keeping the last ``buffer_steps`` batches,
answering ``[b"", topic, seq8, payload]`` per batch and ``[b"", b"", ff×8, b""]`` at the end, as 0.5.23's
own ``ZmqEventPublisher`` does.
Events behave as in the real 0.5.23 captures:

* ``AllBlocksCleared`` is the first batch (seq 0) at start-up, and the answer to ``/flush_cache``;
* one ``BlockStored`` per new radix node, coalescing its pages (``block_hashes`` = one SHA-256 chained
  i64 per page, ``token_ids`` concatenated, ``block_size`` = the page size), parent = the hash of the
  page it hangs from (``None`` at the root);
* evictions in one step coalesce into one ``BlockRemoved``, root-most page first within each node;
* one batch per scheduler step that changed the cache, sent when the step completes.

HTTP: ``/server_info`` and ``/get_server_info`` (with ``page_size`` and the ``kv_events`` descriptor),
``/get_model_info`` and ``/model_info``, ``/get_load``, ``/v1/loads``, ``/metrics`` (``sglang:`` or
``sglang_`` gauges), ``/flush_cache`` and ``/health_generate``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from replicas.sim.cache import CacheCleared, CacheRecord, PagesRemoved, PagesStored, coalesce_removals
from replicas.sim.config import ReplicaConfig
from replicas.sim.context import (
    SGLANG_VERSION,
    ReplicaContext,
    Sample,
    health_generate,
    prometheus_text,
    rank_stats,
)
from replicas.sim.faults import FaultState
from replicas.sim.zmq_events import ZmqPersonality, ZmqRankPublisher
from replicas.wire.sglang import KvEventEncoder, digest_to_i64, page_digest


class RankPublisher(ZmqRankPublisher):
    """SGLang 0.5.23's publisher of one DP rank: ``AllBlocksCleared`` first, one ``BlockStored`` per
    new radix node (signed i64 SHA-256 page hashes), a step's evictions in one ``BlockRemoved``."""

    def __init__(
        self, zctx: zmq.asyncio.Context, config: ReplicaConfig, rank: int, faults: FaultState
    ) -> None:
        encoder = KvEventEncoder(flavor="sglang", encoding=config.event_encoding)
        super().__init__(zctx, config, rank, faults, encoder)

    def startup_events(self) -> list[object]:
        return [self._encoder.all_blocks_cleared()]

    def encode(self, records: Sequence[CacheRecord]) -> list[object]:
        return [event for record in coalesce_removals(records) for event in self._encode(record)]

    def _encode(self, record: CacheRecord) -> list[object]:
        if isinstance(record, PagesStored):
            parent = None if record.parent is None else self._hashes.get(record.parent.page_id)
            prior = None if parent is None else parent[1]
            hashes: list[int] = []
            tokens: list[int] = []
            for page in record.pages:
                prior = page_digest(prior, page.tokens)
                self._hashes[page.page_id] = (digest_to_i64(prior), prior)
                hashes.append(digest_to_i64(prior))
                tokens.extend(page.tokens)
            parent_hash = None if parent is None else parent[0]
            return [self._encoder.block_stored(hashes, parent_hash, tokens, self.config.block_size)]
        if isinstance(record, PagesRemoved):
            gone = [
                self._hashes.pop(page.page_id)[0] for page in record.pages if page.page_id in self._hashes
            ]
            return [self._encoder.block_removed(gone)] if gone else []
        assert isinstance(record, CacheCleared)
        self._hashes.clear()
        return [self._encoder.all_blocks_cleared()]


class SglangPersonality(ZmqPersonality):
    """Step observer and HTTP routes of an SGLang replica."""

    flush_path = "/flush_cache"

    def publisher(
        self, zctx: zmq.asyncio.Context, config: ReplicaConfig, rank: int, faults: FaultState
    ) -> RankPublisher:
        return RankPublisher(zctx, config, rank, faults)

    @staticmethod
    def guards_path(path: str) -> bool:
        """SGLang's ``--api-key`` guards every path but ``/health*`` and ``/metrics*``
        (``add_api_key_middleware``): ``/v1/*``, ``/get_load``, ``/v1/loads``, ``/flush_cache``..."""
        return not path.startswith(("/health", "/metrics"))

    def add_routes(self, app: web.Application, ctx: ReplicaContext) -> None:
        routes = _SglangRoutes(ctx, self)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, routes.server_info)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, routes.model_info)
        app.router.add_get("/get_load", routes.get_load)
        app.router.add_get("/v1/loads", routes.loads)
        app.router.add_get("/metrics", routes.metrics)
        app.router.add_post("/flush_cache", routes.flush_cache)
        app.router.add_get("/flush_cache", routes.flush_cache)
        app.router.add_get("/health_generate", routes.health_generate)


class _SglangRoutes:
    def __init__(self, ctx: ReplicaContext, personality: SglangPersonality) -> None:
        self.ctx = ctx
        self.personality = personality

    def _kv_events_config(self) -> str:
        config = self.ctx.config
        return json.dumps(
            {
                "publisher": "zmq",
                "endpoint": f"tcp://*:{config.event_port}",
                "replay_endpoint": f"tcp://*:{config.replay_port}",
                "buffer_steps": config.buffer_steps,
                "hwm": config.hwm,
                "topic": config.topic,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        ctx, config = self.ctx, self.ctx.config
        profile = config.profile
        info = {
            "model_path": config.model_path or profile.model,
            "tokenizer_path": config.model_path or profile.model,
            "served_model_name": ctx.model,
            "host": config.host,
            "port": config.http_port,
            "page_size": config.block_size,
            "dp_size": config.dp_size,
            "tp_size": 1,
            "dcp_size": 1,
            "enable_dp_attention": False,
            "context_length": profile.max_context_tokens,
            "max_running_requests": profile.max_running_requests,
            "chunked_prefill_size": profile.chunk_prefill_tokens,
            "speculative_algorithm": None,
            "enable_metrics": True,
            "enable_cache_report": True,
            "kv_events_config": self._kv_events_config(),
            "max_total_num_tokens": config.capacity_blocks * config.block_size,
            "internal_states": [{"dp_rank": r, "load": _load(ctx, r)} for r in range(config.dp_size)],
            "version": SGLANG_VERSION,
            "kv_events": {
                "publisher": "zmq",
                "endpoint_host": "*",
                "endpoint_port_base": config.event_port,
                "replay_endpoint_port_base": config.replay_port,
                "topic": config.topic,
                "block_size": config.block_size,
                "dp_size": config.dp_size,
            },
        }
        return web.json_response(info)

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.ctx.config
        path = config.model_path or config.profile.model
        return web.json_response(
            {
                "model_path": path,
                "tokenizer_path": path,
                "served_model_name": self.ctx.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        loads = []
        for rank in range(self.ctx.config.dp_size):
            stats = rank_stats(self.ctx, rank)
            loads.append(
                {
                    "dp_rank": rank,
                    "num_reqs": stats["num_running_reqs"] + stats["num_waiting_reqs"],
                    "num_waiting_reqs": stats["num_waiting_reqs"],
                    "num_tokens": stats["num_used_tokens"],
                    "num_pending_tokens": stats["num_pending_prefill_tokens"],
                }
            )
        return web.json_response(loads)

    async def loads(self, request: web.Request) -> web.Response:
        ranks = range(self.ctx.config.dp_size)
        wanted = request.query.get("dp_rank")
        if wanted is not None:
            ranks = range(int(wanted), int(wanted) + 1) if wanted.isdigit() else range(0)
        loads = [_v1_load(rank_stats(self.ctx, r)) for r in ranks if r < self.ctx.config.dp_size]
        summed = ("num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens")
        aggregate = {key: sum(load[key] for load in loads) for key in summed}
        body = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": SGLANG_VERSION,
            "dp_rank_count": self.ctx.config.dp_size,
            "loads": loads,
            "aggregate": aggregate,
        }
        return web.json_response(body)

    async def metrics(self, request: web.Request) -> web.Response:
        prefix = self.ctx.config.metrics_prefix
        gauges = {
            "num_running_reqs": "The number of running requests.",
            "num_queue_reqs": "The number of requests in the waiting queue.",
            "num_used_tokens": "The number of used tokens.",
            "token_usage": "The token usage.",
            "cache_hit_rate": "The prefix cache hit rate.",
            "gen_throughput": "The generation throughput (token/s).",
            "utilization": "The utilization.",
            "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
            "page_size": "The page size of the KV cache.",
        }
        counters = {
            "prompt_tokens_total": "Number of prefill tokens processed.",
            "generation_tokens_total": "Number of generation tokens processed.",
            "cached_tokens_total": "Number of cached prompt tokens.",
            "num_requests_total": "Number of requests processed.",
        }
        per_rank = [rank_stats(self.ctx, r) for r in range(self.ctx.config.dp_size)]
        families = [
            (prefix + name, "gauge", text, self._samples(prefix + name, per_rank, name))
            for name, text in gauges.items()
        ] + [
            (prefix + name, "counter", text, self._samples(prefix + name, per_rank, name))
            for name, text in counters.items()
        ]
        return web.Response(text=prometheus_text(families), content_type="text/plain", charset="utf-8")

    def _samples(self, full_name: str, per_rank: list[dict[str, Any]], name: str) -> list[Sample]:
        source = {
            "num_queue_reqs": "num_waiting_reqs",
            "page_size": None,
            "num_requests_total": "requests_total",
        }.get(name, name)
        samples: list[Sample] = []
        for stats in per_rank:
            labels = {"model_name": self.ctx.model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
            if self.ctx.config.dp_size > 1:
                labels["dp_rank"] = str(stats["dp_rank"])
            value = float(self.ctx.config.block_size if source is None else stats[source])
            samples.append((full_name, labels, value))
        return samples

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.ctx.engine.flush():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. ")
        return web.Response(status=400, text="Cache not flushed because there are pending requests.")

    async def health_generate(self, request: web.Request) -> web.Response:
        ok = await health_generate(self.ctx)
        return web.Response(status=200 if ok else 503)


def _load(ctx: ReplicaContext, rank: int) -> int:
    stats = rank_stats(ctx, rank)
    return int(stats["num_used_tokens"])


def _v1_load(stats: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "utilization",
        "max_running_requests",
    )
    load = {key: stats[key] for key in keys}
    load["num_total_reqs"] = stats["num_running_reqs"] + stats["num_waiting_reqs"]
    load["num_waiting_uncached_tokens"] = stats["num_pending_prefill_tokens"]
    return load
