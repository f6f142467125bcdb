"""TRT-LLM (``trtllm-serve``) personality: drained KV events, iteration stats, endpoints (I/O shell).

* ``POST /kv_cache_events`` returns and **removes** every buffered event (one consumer only), as JSON
  shaped like ``KVCacheEventSerializer``. The buffer holds ``event_buffer_max_size`` events; on overflow
  the **oldest** are dropped, which leaves ``event_id`` gaps, as the engine does.
* ``event_id`` counts per attention-DP rank from 0; each rank's first event is ``created``. Events carry
  ``window_size`` (the context length) and, with ``dp_size`` > 1, ``attention_dp_rank``.
* ``stored`` chains blocks under ``parent_hash`` with TRT-LLM's V1 block-key hash; the last block may be
  partial (the cache stores ``prompt[:-1]`` at the end of the context phase and the sequence minus its
  last token at release). Evictions become one ``removed`` per step; with a host tier they become
  ``updated`` (``cache_level`` 0→1) and are ``removed`` when the host tier overflows.
* ``GET /metrics`` drains iteration stats (JSON, with ``kvCacheStats``, ``numQueuedRequests``, ...);
  ``GET /prometheus/metrics`` is Prometheus text; ``/health``; ``/health_generate``; ``/version``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from aiohttp import web

from replicas.sim.cache import CacheCleared, CacheRecord, PagesRemoved, PagesStored, coalesce_removals
from replicas.sim.config import ReplicaConfig
from replicas.sim.context import ReplicaContext, Sample, health_generate, prometheus_text, rank_stats
from replicas.sim.faults import FaultState
from replicas.sim.scheduler import StepResult
from replicas.wire import trtllm as wire

TRTLLM_VERSION = "1.2.1"
"""The ``trtllm-serve`` release reported by ``/version``."""

JsonDict = dict[str, Any]


class EventBuffer:
    """The bounded, drained TRT-LLM event queue and the per-rank state that builds its events."""

    def __init__(self, config: ReplicaConfig, faults: FaultState) -> None:
        self.config = config
        self._faults = faults
        self.window_size = config.profile.max_context_tokens
        self.events: deque[JsonDict] = deque(maxlen=config.event_buffer_max_size)
        self.overflow_dropped = 0
        self.fault_dropped = 0
        ranks = range(config.dp_size)
        self._next_id = [0 for _ in ranks]
        self._hashes: list[dict[int, int]] = [{} for _ in ranks]  # page id -> block hash, bounded by pool
        self._host: list[OrderedDict[int, None]] = [OrderedDict() for _ in ranks]

    def start(self) -> None:
        for rank in range(self.config.dp_size):
            levels = [self.config.capacity_blocks, self.config.host_cache_blocks]
            self._emit(rank, wire.created, levels, self.window_size, self._dp(rank))

    def restart(self) -> None:
        """A new engine: nothing buffered survives, ids restart at 0 with ``created``."""
        self.events.clear()
        for rank in range(self.config.dp_size):
            self._next_id[rank] = 0
            self._hashes[rank].clear()
            self._host[rank].clear()
        self.start()

    def drain(self) -> list[JsonDict]:
        drained = list(self.events)
        self.events.clear()
        return drained

    def on_records(self, rank: int, records: Sequence[CacheRecord]) -> None:
        for record in coalesce_removals(records):
            if isinstance(record, PagesStored):
                self._stored(rank, record)
            elif isinstance(record, PagesRemoved):
                self._removed(rank, [page.page_id for page in record.pages])
            else:
                assert isinstance(record, CacheCleared)
                self._removed(rank, list(self._hashes[rank]))

    def _dp(self, rank: int) -> int | None:
        return rank if self.config.dp_size > 1 else None

    def _emit(self, rank: int, build: Callable[..., JsonDict], *args: Any, **kwargs: Any) -> None:
        """Take the rank's next ``event_id`` and buffer ``build(event_id, *args, **kwargs)``."""
        event_id = self._next_id[rank]
        self._next_id[rank] += 1
        if event_id > 0 and self._faults.drop_batch():
            self.fault_dropped += 1
            return
        if len(self.events) == self.events.maxlen:
            self.overflow_dropped += 1  # deque(maxlen) drops the oldest on append
        self.events.append(build(event_id, *args, **kwargs))

    def _stored(self, rank: int, record: PagesStored) -> None:
        hashes = self._hashes[rank]
        parent = None if record.parent is None else hashes.get(record.parent.page_id)
        blocks: list[tuple[int, Sequence[int]]] = []
        prior = parent
        for page in record.pages:
            prior = wire.block_key_hash(page.tokens, prior)
            hashes[page.page_id] = prior
            self._host[rank].pop(prior, None)  # back on the GPU: no longer a host-tier block
            blocks.append((prior, page.tokens))
        self._emit(rank, wire.stored, parent, blocks, self.window_size, dp_rank=self._dp(rank))

    def _removed(self, rank: int, page_ids: list[int]) -> None:
        gone = [self._hashes[rank].pop(pid) for pid in page_ids if pid in self._hashes[rank]]
        if not gone:
            return
        dp = self._dp(rank)
        if self.config.host_cache_blocks == 0:
            self._emit(rank, wire.removed, gone, self.window_size, dp)
            return
        host = self._host[rank]
        for block_hash in gone:  # offloaded to the host tier rather than dropped
            host[block_hash] = None
            self._emit(rank, wire.updated, block_hash, self.window_size, cache_level=(0, 1), dp_rank=dp)
        spilled = [
            host.popitem(last=False)[0] for _ in range(max(0, len(host) - self.config.host_cache_blocks))
        ]
        if spilled:
            self._emit(rank, wire.removed, spilled, self.window_size, dp)


class TrtllmPersonality:
    """Step observer and HTTP routes of a TRT-LLM replica."""

    REFUSES_OTHER_MODELS: ClassVar[bool] = False
    """trtllm-serve's chat and completion handlers do not read the request's ``model``."""

    def __init__(self, config: ReplicaConfig, faults: FaultState) -> None:
        self.config = config
        self.buffer = EventBuffer(config, faults)
        self.iterations: deque[JsonDict] = deque(maxlen=config.iter_stats_max)
        self._iter = 0
        self._ctx: ReplicaContext | None = None

    def on_step(self, rank: int, result: StepResult | None, records: Sequence[CacheRecord]) -> None:
        self.buffer.on_records(rank, records)
        if result is not None and self._ctx is not None:
            self.iterations.append(self._iteration_stats(rank, result, self._ctx))

    async def start(self) -> None:
        self.buffer.start()

    async def close(self) -> None:
        return None

    def restart(self) -> None:
        self.buffer.restart()
        self.iterations.clear()

    def describe(self) -> dict[str, Any]:
        return {"events": ["POST /kv_cache_events"], "tokens_per_block": self.config.block_size}

    @staticmethod
    def guards_path(path: str) -> bool:
        """What ``--api-key`` guards in TRT-LLM mode: every path but ``/health`` (``/kv_cache_events``,
        ``/metrics``, ``/prometheus/metrics``, ``/v1/models`` included), as a key-checking proxy
        before ``trtllm-serve`` would. ``trtllm-serve`` itself checks no client key: it has no
        ``--api-key`` option (``tensorrt_llm/commands/serve.py`` at 00209af1), its FastAPI app adds
        no auth middleware to any route (``tensorrt_llm/serve/openai_server.py`` at e7f7345e), and
        NVIDIA/TensorRT-LLM#9950 (asking for one) was closed without it; its later HMAC checks
        (``TRTLLM_RUNTIME_CONTROL_API_KEY`` for the sleep-mode routes, ``x-trtllm-disagg-auth`` for
        disaggregated parameters) cover none of the paths kvlb calls. So a keyed TRT-LLM replica is
        one behind a proxy, and which paths that proxy guards is the proxy's choice: the strictest
        one that still lets an orchestrator's liveness probe through is emulated."""
        return path != "/health"

    def add_routes(self, app: web.Application, ctx: ReplicaContext) -> None:
        self._ctx = ctx
        app.router.add_post("/kv_cache_events", self._kv_cache_events)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/prometheus/metrics", self._prometheus)
        app.router.add_get("/health_generate", self._health_generate)
        app.router.add_get("/version", self._version)

    def _iteration_stats(self, rank: int, result: StepResult, ctx: ReplicaContext) -> JsonDict:
        self._iter += 1
        stats = rank_stats(ctx, rank)
        plan = result.plan
        context_requests = len(plan.prefill)
        element: JsonDict = {
            "iter": self._iter,
            "iterLatencyMS": (plan.end_s - plan.start_s) * 1000.0,
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "gpuMemUsage": 0,
            "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
            "numActiveRequests": stats["num_running_reqs"],
            "numQueuedRequests": stats["num_waiting_reqs"],
            "numCompletedRequests": len(result.finished),
            "numNewActiveRequests": sum(1 for r, _ in plan.prefill if r.admitted_s == plan.start_s),
            "maxNumActiveRequests": stats["max_running_requests"],
            "maxBatchSizeStatic": stats["max_running_requests"],
            "maxNumTokensStatic": ctx.config.profile.chunk_prefill_tokens,
            "newActiveRequestsQueueLatencyMS": 0.0,
            "kvCacheStats": {
                "maxNumBlocks": stats["capacity_blocks"],
                "freeNumBlocks": stats["capacity_blocks"] - stats["used_blocks"],
                "usedNumBlocks": stats["used_blocks"],
                "tokensPerBlock": ctx.config.block_size,
                "allocTotalBlocks": stats["stored_blocks_total"],
                "allocNewBlocks": stats["stored_blocks_total"],
                "reusedBlocks": stats["cached_tokens_total"] // ctx.config.block_size,
                "missedBlocks": (stats["prompt_tokens_total"] - stats["cached_tokens_total"])
                // ctx.config.block_size,
                "cacheHitRate": stats["cache_hit_rate"],
            },
            "inflightBatchingStats": {
                "numScheduledRequests": context_requests + len(plan.decode),
                "numContextRequests": context_requests,
                "numGenRequests": len(plan.decode),
                "numPausedRequests": 0,
                "numCtxTokens": plan.prefill_tokens,
                "microBatchId": 0,
                "avgNumDecodedTokensPerIter": 1.0,
            },
        }
        if ctx.config.dp_size > 1:
            element["attentionDpRank"] = rank
        return element

    async def _kv_cache_events(self, request: web.Request) -> web.Response:
        body = wire.encode_drain(self.buffer.drain())
        return web.Response(body=body, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        drained = list(self.iterations)
        self.iterations.clear()
        return web.json_response(drained)

    async def _prometheus(self, request: web.Request) -> web.Response:
        assert self._ctx is not None
        ctx = self._ctx
        per_rank = [rank_stats(ctx, r) for r in range(ctx.config.dp_size)]

        def family(name: str, kind: str, text: str, key: str) -> tuple[str, str, str, list[Sample]]:
            samples: list[Sample] = []
            for stats in per_rank:
                labels = {"model_name": ctx.model, "engine_type": "trtllm", "dp_rank": str(stats["dp_rank"])}
                samples.append((f"trtllm_{name}", labels, float(stats[key])))
            return (f"trtllm_{name}", kind, text, samples)

        families = [
            family("num_requests_running", "gauge", "Requests in the batch.", "num_running_reqs"),
            family("num_requests_waiting", "gauge", "Requests in the queue.", "num_waiting_reqs"),
            family("kv_cache_utilization", "gauge", "Used KV blocks / all KV blocks.", "token_usage"),
            family("kv_cache_hit_rate", "gauge", "Prompt tokens served from the cache.", "cache_hit_rate"),
            family("prompt_tokens_total", "counter", "Prompt tokens admitted.", "prompt_tokens_total"),
            family("generation_tokens_total", "counter", "Tokens generated.", "generation_tokens_total"),
        ]
        return web.Response(text=prometheus_text(families), content_type="text/plain", charset="utf-8")

    async def _health_generate(self, request: web.Request) -> web.Response:
        assert self._ctx is not None
        ok = await health_generate(self._ctx)
        return web.Response(status=200 if ok else 500)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": TRTLLM_VERSION})
