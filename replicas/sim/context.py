"""What the HTTP handlers of one emulated replica share, and small helpers they all use (I/O shell).

Includes a minimal Prometheus text renderer: the emulator writes the engines' metric names and labels
itself rather than through a registry, because the names are the engines' (``sglang:...``), not ours.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from replicas.sim.config import ReplicaConfig
from replicas.sim.engine import Engine
from replicas.sim.faults import FaultState
from replicas.sim.scheduler import SimRequest
from replicas.sim.tokenizer import PromptTokenizer

HEALTH_GENERATE_TIMEOUT_S = 5.0
"""How long ``/health_generate`` waits for its one-token generation before failing."""

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose behaviour the SGLang personality copies."""


@dataclass(slots=True)
class ReplicaContext:
    """The live parts of one replica, handed to every route module."""

    config: ReplicaConfig
    engine: Engine
    faults: FaultState
    tokenizer: PromptTokenizer
    vocab_size: int
    started_wall: float = field(default_factory=time.time)
    request_counter: int = 0
    open_requests: int = 0
    """Generation requests (``/v1/chat/completions``, ``/v1/completions``) whose handler is running:
    what a balancer has in flight on this replica."""
    peak_open_requests: int = 0
    """The most :attr:`open_requests` seen at once since start (``/admin/stats``)."""
    refuses_other_models: bool = False
    """Whether a generation request naming another model than :attr:`model` is answered 404, as
    vLLM does (SGLang and trtllm-serve do not read the request's ``model``)."""

    @property
    def model(self) -> str:
        """The served model name: the ``served_model`` fault's, else the profile's."""
        return self.faults.settings.served_model or self.config.profile.model

    def unserved_model(self, body: Mapping[str, Any]) -> web.Response | None:
        """vLLM's 404 for a request naming a model this replica does not serve (``None``: served, or
        an engine that serves any name). A request without ``model`` is served, as vLLM does."""
        asked = body.get("model")
        if not self.refuses_other_models or asked is None or asked == self.model:
            return None
        return json_error(404, f"The model `{asked}` does not exist.", "NotFoundError")

    def next_request_id(self, prefix: str) -> str:
        self.request_counter += 1
        return f"{prefix}-{self.config.name}-{self.request_counter}"


def json_error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """An OpenAI-style error body."""
    return web.json_response(
        {"object": "error", "error": {"message": message, "type": kind, "code": status}}, status=status
    )


async def health_generate(ctx: ReplicaContext) -> bool:
    """Run a one-token generation through the engine, as the engines' ``/health_generate`` does."""
    if ctx.faults.settings.fail_health:
        return False
    request = SimRequest(ctx.next_request_id("health"), [1, 2, 3, 4], 1, arrival_s=0.0)
    handle = ctx.engine.submit(request)
    if handle is None:
        return False
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            while await handle.next() is not None:
                pass
    except TimeoutError:
        return False
    finally:
        if request.finish_reason is None:
            ctx.engine.abort(handle)
    return request.finish_reason == "length"


def gen_throughput(ctx: ReplicaContext, rank: int) -> float:
    """Generated tokens per model second over the rank's recent steps."""
    samples = ctx.engine.ranks[rank].throughput_samples
    if len(samples) < 2:
        return 0.0
    (start_s, start_tokens), (end_s, end_tokens) = samples[0], samples[-1]
    if ctx.engine.clock.now() - end_s > 5.0 or end_s <= start_s:
        return 0.0
    return (end_tokens - start_tokens) / (end_s - start_s)


Sample = tuple[str, Mapping[str, str], float]


def prometheus_text(families: Iterable[tuple[str, str, str, list[Sample]]]) -> str:
    """Render ``(name, type, help, samples)`` families in the Prometheus text format 0.0.4."""
    lines: list[str] = []
    for name, kind, help_text, samples in families:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for sample_name, labels, value in samples:
            rendered = ",".join(f'{key}="{_escape(val)}"' for key, val in sorted(labels.items()))
            lines.append(f"{sample_name}{{{rendered}}} {float(value)!r}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def rank_stats(ctx: ReplicaContext, rank: int) -> dict[str, Any]:
    """Engine-neutral load figures of one DP rank (tokens, requests, ratios)."""
    scheduler = ctx.engine.ranks[rank].scheduler
    cache = scheduler.cache
    counters = scheduler.counters
    block = ctx.config.block_size
    capacity_tokens = cache.capacity_blocks * block
    return {
        "dp_rank": rank,
        "num_running_reqs": len(scheduler.running),
        "num_waiting_reqs": len(scheduler.waiting),
        "num_used_tokens": cache.active_blocks * block,
        "num_cached_tokens": cache.tree_blocks * block,
        "max_total_num_tokens": capacity_tokens,
        "token_usage": cache.active_blocks / cache.capacity_blocks,
        "cache_hit_rate": counters.cached_tokens / counters.prompt_tokens if counters.prompt_tokens else 0.0,
        "gen_throughput": gen_throughput(ctx, rank),
        "utilization": len(scheduler.running) / ctx.config.profile.max_running_requests,
        "max_running_requests": ctx.config.profile.max_running_requests,
        "num_pending_prefill_tokens": scheduler.pending_prefill_tokens(),
        "prompt_tokens_total": counters.prompt_tokens,
        "cached_tokens_total": counters.cached_tokens,
        "generation_tokens_total": counters.generated_tokens,
        "requests_total": counters.requests_admitted,
        "free_blocks": cache.free_blocks,
        "used_blocks": cache.active_blocks,
        "evictable_blocks": cache.evictable_blocks,
        "capacity_blocks": cache.capacity_blocks,
        "evicted_blocks_total": cache.stats.evicted_blocks,
        "stored_blocks_total": cache.stats.stored_blocks,
        **ctx.engine.ranks[rank].timing.to_dict(),
    }
