"""What kvlb needs to know about one engine kind (pure): :class:`EngineSpec`.

Every engine-specific choice made outside a decoder reads the engine's spec: the event sources
(:mod:`balancer.sources.build`) pick the decoder and the transport, the router's key spaces take the
hash alignment, the load scraper (:mod:`balancer.load.scraper`) tries the scrape targets, a fleet
lease takeover (:mod:`balancer.fleet.leases`) asks whether to resync, and Kubernetes discovery
(:mod:`balancer.discovery.k8s_objects`) takes the annotation value and the default block size. Each
engine module defines its ``SPEC``; :mod:`balancer.engines.registry` lists them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from balancer.engines import DecoderFactory
from balancer.errors import ConfigError
from balancer.index.hashing import AlignMode
from balancer.load.scrape import ScrapeTarget
from balancer.types import EngineHash
from balancer.upstream.stream_usage import UnaskedUsage

if TYPE_CHECKING:
    from balancer.config import EngineKind

BlockHashes = Callable[[Sequence[int], int], "list[EngineHash]"]
"""``(token_ids, tokens_per_block) -> engine hashes`` of the full blocks, chained from the root."""

EventTransport = Literal["zmq", "http_drain"]
"""How an engine publishes KV events.

* ``zmq``: one ZMQ PUB socket per DP rank (rank ``r`` on the configured port ``+ r``), each batch
  numbered, with an optional ROUTER replay socket per rank that resends missed batches. A replica
  configured without an events endpoint has no event source.
* ``http_drain``: one ``POST /kv_cache_events`` on the replica's HTTP URL returns (and forgets) every
  event since the last call, for every rank; one consumer only, nothing to replay.
"""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything engine-specific outside the decoder itself, for one engine kind."""

    name: EngineKind
    """The engine's name: the ``engine`` value of a replica's config and of the ``kvlb.io/engine``
    pod annotation, and the key of :data:`balancer.engines.registry.ENGINE_SPECS`."""
    decoder: DecoderFactory
    """Builds the decoder of one event stream for the replica's tokens per block (one event per
    engine event: the decoder contract)."""
    align_mode: AlignMode
    """How the engine aligns its cached blocks on the prompt (``trtllm``: ``prompt[:-1]``)."""
    bigram_align_mode: AlignMode
    """The alignment when the engine runs EAGLE speculative decoding with bigram pages (pages of token
    pairs); an engine whose alignment does not change says its ``align_mode`` again."""
    default_block_size: int
    """Tokens per KV block when the replica does not say (the engine's own default). Must be > 0."""
    transport: EventTransport
    """How the engine's KV events reach kvlb."""
    scrape_targets: tuple[ScrapeTarget, ...]
    """Load endpoints in the order they are tried; a 404 moves to the next one. Must not be empty."""
    resync_on_unclean_takeover: bool
    """Whether a balancer taking this replica's ingest lease over from a holder that did not stop
    cleanly must resync the ranks it cannot check: true when the transport cannot replay the events
    the previous holder consumed but never applied. A rank whose last applied event id Redis holds
    is checked by its decoder instead (:class:`~balancer.engines.ResumableDecoder`: a gap resyncs
    it); the others are resynced first."""
    chain_decoder: DecoderFactory | None = None
    """Builds the decoder the replica's event sources use when it differs from ``decoder``: one that
    merges runs of one-block stores into ``chained`` events (:class:`balancer.events.Stored`), which
    the index applies as it would the runs' events, at a fraction of the cost. ``None``: ``decoder``."""
    checks_model_name: bool = False
    """Whether the engine refuses a request naming another model than it serves (vLLM: 404), so
    that a pool's model missing from its ``GET /v1/models`` takes the replica out of routing until
    the engine lists it (:class:`balancer.health.prober.HealthProber`). SGLang and trtllm-serve
    answer any name (their chat and completion handlers do not read the request's ``model``), and
    list their model under a name the pool need not use (SGLang: the model path unless
    ``--served-model-name``): a mismatch there says nothing."""
    unasked_stream_usage: UnaskedUsage = "absent"
    """How the engine writes a stream's chunk without usage: no ``usage`` member (``absent``: vLLM,
    whose chunks are dumped with ``exclude_unset``, and TensorRT-LLM, ``exclude_none``) or
    ``"usage":null`` (``null``: SGLang, which dumps every field). kvlb asks every stream for usage
    (``pools[].stream_usage``) and writes a chunk that carries usage the client did not ask for back
    this way (:class:`~balancer.upstream.stream_usage.UsageStrip`)."""
    block_hashes: BlockHashes | None = None
    """The engine's own hashes of the full blocks of a plain token sequence (no LoRA, no salt, text
    only), when kvlb can reproduce them; the router uses them only for a replica whose events agreed
    with them (receipts then teach the index blocks with their engine hashes). ``None``: cannot."""

    drain_path: str | None = None
    """The path (on the replica's HTTP URL) of the ``http_drain`` transport's ``POST`` endpoint
    (TRT-LLM: ``/kv_cache_events``); required with that transport, ``None`` with another."""

    def __post_init__(self) -> None:
        if (self.transport == "http_drain") != bool(self.drain_path):
            raise ConfigError(f"engine {self.name}: drain_path is needed with the http_drain transport only")
        if self.default_block_size <= 0:
            raise ConfigError(f"engine {self.name}: default_block_size must be > 0")
        if not self.scrape_targets:
            raise ConfigError(f"engine {self.name}: no scrape targets")

    def alignment(self, bigram: bool = False) -> AlignMode:
        """The hash alignment of a replica of this engine; ``bigram``: it runs EAGLE bigram pages."""
        return self.bigram_align_mode if bigram else self.align_mode
