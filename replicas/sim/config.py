"""Settings of one emulated replica (pure, frozen).

Ports: ``http_port`` serves the OpenAI API and the engine's own endpoints. An SGLang or vLLM replica
publishes KV events on ``event_port + rank`` (ZMQ PUB) and serves replay on ``replay_port + rank`` (ZMQ
ROUTER), one of each per data-parallel rank, as both engines do. Port 0 means "pick free ports"
(consecutive ones for the DP ranks). Everything binds ``host`` (loopback by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from replicas.sim.faults import FaultSettings
from replicas.sim.profiles import Profile

EngineKind = Literal["sglang", "trtllm", "vllm"]
ZMQ_ENGINES: tuple[EngineKind, ...] = ("sglang", "vllm")
"""The engines that publish KV events over ZMQ PUB sockets with a ROUTER replay socket."""
EventEncoding = Literal["map", "array"]
Eviction = Literal["node", "block"]

TRTLLM_TOKENS_PER_BLOCK = 32
"""TRT-LLM's default ``kv_cache_config.tokens_per_block``."""
VLLM_BLOCK_SIZE = 128
"""vLLM's block size when none is given, as the captured vLLM 0.32 CPU build runs
(``vllm:cache_config_info{block_size="128"}``, tests/golden/real/README.md)."""


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """Everything one emulated replica needs besides its tokenizer."""

    name: str
    """Replica label (logs, ``/admin`` views, the fleet listing)."""

    engine: EngineKind
    """Which engine to impersonate: its events, endpoints, metrics and caching rules."""

    profile: Profile
    """Timing and capacity model (:mod:`replicas.sim.profiles`)."""

    host: str = "127.0.0.1"
    """Address every socket binds."""

    http_port: int = 0
    """HTTP port (0: any free port)."""

    event_port: int = 0
    """SGLang/vLLM: PUB port of DP rank 0; rank ``r`` uses ``event_port + r`` (0: free consecutive ports)."""

    replay_port: int = 0
    """SGLang/vLLM: ROUTER replay port of DP rank 0, ``+ r`` per rank (0: free consecutive ports)."""

    dp_size: int = 1
    """Data-parallel ranks: independent caches and schedulers behind one HTTP endpoint (1..64)."""

    time_scale: float = 1.0
    """Model seconds per wall second (> 0); 10 runs ten times faster than the modelled GPU."""

    page_size: int | None = None
    """Tokens per KV page; ``None``: the profile's page size (SGLang), 32 (TRT-LLM) or 128 (vLLM)."""

    event_encoding: EventEncoding = "map"
    """SGLang events as tagged maps (0.5.23) or positional arrays (older msgspec ``array_like``)."""

    topic: str = ""
    """SGLang ZMQ topic (frame 1); SGLang's default is empty."""

    buffer_steps: int = 10_000
    """SGLang replay ring size in batches; older batches cannot be replayed."""

    hwm: int = 100_000
    """SGLang PUB send high-water mark in messages; beyond it ZMQ drops (a real seq gap)."""

    epoch_in_topic: bool = False
    """Append SGLang's ``\\x00sgl-kv-epoch=<id>`` to the topic (newest SGLang with snapshots)."""

    event_buffer_max_size: int = 16_384
    """TRT-LLM event buffer (``kv_cache_config.event_buffer_max_size``); overflow drops the oldest."""

    host_cache_blocks: int = 0
    """TRT-LLM secondary (host) tier in blocks: evicted GPU blocks move there (``updated`` events,
    cache level 0→1) and are ``removed`` when it overflows. 0 disables it."""

    iter_stats_max: int = 1000
    """TRT-LLM iteration-stats buffer drained by ``GET /metrics``; overflow drops the oldest."""

    metrics_prefix: str = "sglang:"
    """Prometheus prefix of SGLang gauges: ``sglang:`` (≤ v0.5.3 and 0.5.23 as captured) or ``sglang_``."""

    max_waiting: int = 4096
    """Waiting-queue cap per DP rank; a full queue answers 503."""

    default_max_tokens: int = 64
    """Tokens generated when a request gives no ``max_tokens``."""

    seed: int = 0
    """Seed of the fault-injection randomness."""

    model_path: str = ""
    """Reported as ``model_path``/``tokenizer_path`` (routers load a tokenizer from it: keep it local)."""

    request_log_size: int = 4096
    """Finished-request timing records kept for ``GET /admin/requests``."""

    faults: FaultSettings = field(default_factory=FaultSettings)
    """Faults active from start-up."""

    api_key: str | None = None
    """``--api-key``: calls without ``Authorization: Bearer <key>`` get 401 ``{"error": "Unauthorized"}``
    on the paths the engine guards (:meth:`guards_path` of its personality); ``None``: none are."""

    eviction: Eviction | None = None
    """What a short KV pool evicts: ``node``, whole least-recently-used radix leaves (SGLang), or
    ``block``, only the pages needed, tail first (vLLM; keeps the head of a long prefix cached).
    ``None``: the engine's own (``block`` for vLLM, ``node`` otherwise); see :attr:`eviction_mode`."""

    def __post_init__(self) -> None:
        if self.engine not in ("sglang", "trtllm", "vllm"):
            raise ValueError(f"engine must be sglang, trtllm or vllm, got {self.engine!r}")
        if not 1 <= self.dp_size <= 64:
            raise ValueError(f"dp_size must be in 1..64, got {self.dp_size}")
        if self.page_size is not None and self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.event_encoding not in ("map", "array"):
            raise ValueError(f"event_encoding must be map or array, got {self.event_encoding!r}")
        if self.eviction not in (None, "node", "block"):
            raise ValueError(f"eviction must be node or block, got {self.eviction!r}")
        if self.metrics_prefix not in ("sglang:", "sglang_"):
            raise ValueError(f"metrics_prefix must be sglang: or sglang_, got {self.metrics_prefix!r}")
        for name in ("buffer_steps", "hwm", "event_buffer_max_size", "iter_stats_max", "max_waiting"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.default_max_tokens <= 0 or self.host_cache_blocks < 0 or self.request_log_size <= 0:
            raise ValueError("default_max_tokens and request_log_size must be > 0, host_cache_blocks >= 0")

    @property
    def block_size(self) -> int:
        """Tokens per KV page (SGLang page size) or block (TRT-LLM ``tokens_per_block``, vLLM
        ``--block-size``)."""
        if self.page_size is not None:
            return self.page_size
        defaults = {"sglang": self.profile.page_size, "trtllm": TRTLLM_TOKENS_PER_BLOCK}
        return defaults.get(self.engine, VLLM_BLOCK_SIZE)

    @property
    def eviction_mode(self) -> Eviction:
        """:attr:`eviction`, or the engine's own when it is ``None``: vLLM's block pool frees single
        blocks, SGLang's radix cache whole leaves (TRT-LLM is modelled like SGLang)."""
        if self.eviction is not None:
            return self.eviction
        return "block" if self.engine == "vllm" else "node"

    @property
    def capacity_blocks(self) -> int:
        """KV pool pages per DP rank."""
        return max(1, self.profile.kv_capacity_tokens // self.block_size)
