"""The HTTP face (I/O): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and
``/v1/models/{model}``.

A chat request reads top-down here: its tenant's request rate (``limits.tenant_rate_per_s``, from
the tenant header alone: 429 with Retry-After, :func:`balancer.service.admitted.tenant_rate_refusal`;
with ``Expect: 100-continue`` before the 100, :func:`rate_before_body`),
a declared length over ``limits.max_body_bytes`` → 413, then
admission (:func:`balancer.service.admitted.admitted`: a slot of ``limits.max_inflight`` and the
declared length's bytes of ``limits.max_inflight_body_bytes``, full queue → 429, waited
``limits.queue_timeout_s`` → 503), a bounded body read (``limits.max_body_bytes`` → 413,
``timeouts.body_read_s`` → 408, and 408 at once for a body behind
``timeouts.body_min_rate_bytes_per_s`` after ``timeouts.body_rate_grace_s``, :func:`body_due`; a
body without a declared length, or with a ``Content-Encoding``, holds its bytes chunk by chunk as
it is read, :func:`held_length`; one aiohttp cannot decode → 400), parsing
(:mod:`balancer.api.parsing`, 400; a body of 256 KiB or more holds the estimate of its parse's memory
meanwhile, :func:`hold_parse`), the pool by ``model`` (404 listing the known models), tokenizing
with the pool's tokenizer (long prompts in a thread, the request holding the estimated bytes of its
parsed form and of the tokenizer's work meanwhile: :func:`tokenizing_hold_bytes`, one piece's work
for a text or chat the tokenizer encodes in pieces, :func:`tokenize_held`; the ids' bytes are then held
instead), a wait in the
same queue while every replica is full, then :func:`balancer.service.dispatch.dispatch` (route →
open → retry → release) with :func:`relay` as its delivery. The slot and every byte held are given
back when the request ends, however it ends.

**Relay**: the client response is not started until the replica's first body chunk arrives (so a
replica failing before it is retried elsewhere). SSE chunks are written as they arrive, never
re-parsed; a replica failing mid-stream ends the stream with one ``data: {"error": ...}`` event; a
client going away closes the upstream response, so the replica stops generating. A non-streaming
answer is at most ``MAX_RESPONSE_BYTES`` (larger → 502) and is written to the client while the
request holds its slot. A client that stops reading its answer (a stream or not) loses its
connection once it has taken no byte for ``timeouts.client_write_stall_s``, or when the request's
deadline (``timeouts.total_s``) finds a write to it still waiting (:class:`HttpWrites`,
:func:`client_stalled`: the connection reset, counted as 499 and in
``kvlb_http_client_write_stalls_total``); the request then gives back its slot, bytes and load and
closes the replica's stream like any other that ends.

**Non-streaming answers** hold their bytes of ``limits.max_inflight_body_bytes`` while kvlb holds
them (:func:`_relay_whole`): each chunk read from the replica is held if the budget has room for it
now (:meth:`~balancer.service.admitted.Admitted.try_hold`, which never waits), and given back once
it is written to the client (or however the request ends). An answer buffered whole is written
with its ``Content-Length``, and a replica failing before its end is a clean 502, as before. The
first chunk that does not fit switches the answer to being relayed as it arrives (counted in
``kvlb_admission_answer_overflow_total``): the status and headers go out, then what was buffered,
then each chunk as it comes, one at a time (counted while it is written, even over the budget: at
most one chunk of the replica's, about 256 kB, per answer over it). Why not wait for room, or fail:
the answer already cost GPU time, and answers holding part of the budget while each waits for more
could wait for each other until their deadline, all thrown away; a 502 throws away finished work
too. Nothing here needs the whole body: the usage and ``cached_tokens`` a receipt reads come from
the stream's bounded tail (:meth:`~balancer.upstream.client.UpstreamStream.usage`, 4 kB), and the
replica's status is known from its head. What a relayed answer loses is the clean error: a replica
failing after the switch (or the answer passing ``MAX_RESPONSE_BYTES``) cuts the client's
connection mid-body (an incomplete chunked body, counted as ``stream_error``) instead of a 502.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import logging
from array import array
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Protocol

from aiohttp import web
from aiohttp.http import HttpProcessingError
from aiohttp.http_exceptions import TransferEncodingError

from balancer import strict_json
from balancer.api.client_writes import ClientWrites, HttpWrites, drop_connection
from balancer.api.errors import ApiError, refusal_response, retry_after, too_large
from balancer.api.middleware import (
    BODY_MEMO,
    OUTCOME,
    PREFIX_MEMO,
    RATE_TAKEN,
    REQUEST_ID,
    STATE,
    expect_continue,
)
from balancer.api.parse_cost import json_parse_bytes
from balancer.api.parsing import (
    ParsedRequest,
    RequestKind,
    json_text_ascii,
    parse_request,
    parse_weights_header,
)
from balancer.config import TimeoutConfig
from balancer.engines.registry import engine_spec
from balancer.errors import UpstreamError
from balancer.index.hashing import TOKEN_ID_BYTES, compact_ids
from balancer.policy import PolicyWeights
from balancer.routing.router import Lease
from balancer.service.admitted import Admitted, admitted, tenant_rate_refusal
from balancer.service.dispatch import (
    Forward,
    Opened,
    dispatch,
    failure_message,
    on_answered,
    on_first_chunk,
    on_relayed,
    relay_deadline,
)
from balancer.service.state import Pool, ServiceState
from balancer.tokenizer.cuts import LongPiece
from balancer.tokenizer.tokenizer import TokenizeError, Tokenizer
from balancer.upstream.client import forwardable_headers
from balancer.upstream.stream_usage import UsageStrip, with_stream_usage

log = logging.getLogger(__name__)

TOKENIZER_BYTES_PER_CHAR = 720
"""Estimate of the tokenizer's working memory (its peak RSS rise) while it encodes a text in a thread,
in bytes per character of a text that is not all ASCII: the worst of the shapes measured by ``python
-m loadtests.memory_figures tokenizer``, plus 10% (``docs/reliability.md``, "Memory": random emoji
439–656 B a character, the most for the shortest texts; CJK 370–481, random latin-1 bytes 331–490;
4,500 to 6 M characters). It is held, with the parsed form, until the tokenizer returns
(:func:`tokenizing_hold_bytes`)."""
TOKENIZER_BYTES_PER_ASCII_CHAR = 340
"""The same for a text that is all ASCII (every string of the prompt or chat, keys included): the
worst ASCII shape measured, random printable ASCII (202–307 B a character; digits 116–202, ASCII
words 90–120, runs of whitespace 52–71), plus 10%. Most traffic is ASCII, and the estimate for any
text (:data:`TOKENIZER_BYTES_PER_CHAR`) is 6–8 times what English text costs."""
PIECE_HOLD_FACTOR = 2
"""A text the tokenizer encodes in pieces (:mod:`balancer.tokenizer.cuts`: over ``piece_chars``,
65,536 characters by default, on a tokenizer the proof covers) holds the tokenizer's work for pieces
of at most this many times ``piece_chars`` (:func:`piece_hold_chars`; a longer piece, a text with no
safe cut for that long, makes the thread stop before it encodes anything, and the request holds the
whole encode's estimate instead: :func:`tokenize_held`)."""
TOKEN_ID_LIST_BYTES = 56
"""Bytes per token id that a text encoded in pieces accumulates in the thread, at most: the list's
int (32 B with the allocator's rounding; 39.8 B an id of the list in all, ``python -m
loadtests.memory_figures ids``), its slot (8 B, up to 2.125 times while the list grows by
``+=``: over-allocation and the old array during a ``realloc``), and the ``array('I')`` made of it
before the list is dropped (4 B)."""
CHAT_TOKEN_ID_BYTES = TOKEN_ID_LIST_BYTES + 34
"""The same for a chat encoded in pieces: its ids come segment by segment through the tokenizer's
segment cache, which makes of a segment's list a tuple of shared ints (8 B an id) through
``itemgetter(*ids)``, whose argument tuple is another 8 B an id while the list lives, and appends
them to the chat's list (8 B a slot, up to 2.125 times while it grows): 56 + 8 + 8 + 17 = 89, as 90."""
RENDER_BYTES_PER_CHAR = 16
"""What rendering a chat costs in a thread encoding it in pieces, in bytes per character of its
text (:attr:`~balancer.api.parsing.ParsedRequest.text_chars`) when it is not all ASCII: the
template's output chunks, the rendered string they are joined into and its segments between added
tokens, about three copies of the text at its ``str`` width (4 B a character at most). Measured
with ``tracemalloc`` on the default template (one message, and nine with two system prompts and
content parts): 12.0 B a character for emoji, 6.0 for CJK, 6.0–7.1 for latin-1, 70,000 to 1 M
characters; 16 is four copies at 4 B. Kept beside one piece's work: the rendered text and its
segments live while the pieces are encoded."""
RENDER_BYTES_PER_ASCII_CHAR = 8
"""The same for a chat that is all ASCII (1 B a character a copy): 5.0 B a character measured."""
MAX_TOKENS_PER_CHAR = 4
"""Most tokens a character of a text that is not all ASCII may give (its UTF-8 bytes: a byte-level
BPE's token covers at least one byte, the other models' at least one character); an ASCII character
gives at most one."""
INLINE_TOKENIZE_CHARS = 4096
"""Requests whose text (:attr:`~balancer.api.parsing.ParsedRequest.text_chars`: the prompt, or all of
a chat's messages, content parts, tools and a per-message allowance) is at most this many characters
are tokenized on the event loop (about a millisecond); larger ones in a thread."""
PRECHECK_CHARS = 262_144
"""Chats up to this many characters are rendered and split on the event loop to see how much of them
misses the segment cache (about 0.1 ms per 8k tokens, 1 ms at this size): at most
:data:`INLINE_TOKENIZE_CHARS` new characters are then tokenized there too, which costs less CPU than
a thread's hand-offs (measured: 0.25 against 0.37 ms per 8k-token chat with a cached system prompt).
A chat mostly new is rendered again in the thread: that much more on top of a full encode."""
YIELD_EVERY_CHUNKS = 256
"""A body's read lets other requests run after this many HTTP chunks: chunks already received are
read without a wait, so a body of small ones would hold the event loop for all of them (about 20 µs
each, up to ``limits.max_body_chunks``)."""
WEIGHTS_HEADER = "x-kvlb-weights"
CONTENT_ENCODING = "Content-Encoding"
SSE_CONTENT_TYPE = "text/event-stream"
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Largest non-streaming replica answer buffered before relaying; larger → 502."""
ERROR_EVENT_TIMEOUT_S = 1.0
"""How long writing the final error event to a slow client may take."""


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat", "/v1/chat/completions")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions", "/v1/completions")


async def models(request: web.Request) -> web.Response:
    """Every pool's model (the balancer's configuration, not a query of the replicas)."""
    state = request.app[STATE]
    data = [model_card(model, pool) for model, pool in state.pools.items()]
    return web.json_response({"object": "list", "data": data}, dumps=strict_json.dumps)


async def model(request: web.Request) -> web.Response:
    """One pool's model, as OpenAI's ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``); the
    name may hold ``/`` (``meta-llama/Llama-3.1-8B``). An unknown one: 404 listing the known ones."""
    state = request.app[STATE]
    name = request.match_info["model"]
    return web.json_response(model_card(name, find_pool(state, name)), dumps=strict_json.dumps)


def model_card(model: str, pool: Pool) -> dict[str, object]:
    """A model's entry in ``GET /v1/models``, and the answer of ``GET /v1/models/{model}``."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "kvlb", "replicas": len(pool.replicas)}


def check_sequences(parsed: ParsedRequest, max_n: int) -> None:
    """400 naming ``n`` when the request asks for more sequences than ``limits.max_n`` (HTTP and
    gRPC: its ``extra_json``)."""
    if parsed.sequences > max_n:
        raise ApiError(400, f"'n' must be at most {max_n} (limits.max_n), got {parsed.sequences}")


async def _serve(request: web.Request, kind: RequestKind, path: str) -> web.StreamResponse:
    state = request.app[STATE]
    arrived = state.monotonic()
    tenant = request.headers.get(state.settings.tenant_header)
    if state.tenant_rates is not None and RATE_TAKEN not in request:  # first (off: one check)
        refused = tenant_rate_refusal(state, tenant, arrived)
        if refused is not None:
            return refusal_response(refused, request[REQUEST_ID])
    limits = state.settings.limits
    max_bytes = limits.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > max_bytes:  # before it takes a slot and bytes
        raise too_large(declared, max_bytes)
    held = held_length(request)
    async with admitted(state, held or 0, tenant) as admission:
        hold = admission.hold if held is None else None
        body = await read_body(request, max_bytes, state.settings.timeouts, hold)
        body_memo = request.app[BODY_MEMO]
        body_key = body_memo.key(body, kind)
        remembered = body_memo.find(body_key)  # the same bytes parsed and tokenized before
        known = request.app[PREFIX_MEMO].decode_known  # a chat's known prefix not decoded again
        if remembered is not None:
            parsed = remembered.parsed
            check_sequences(parsed, limits.max_n)
            pool = find_pool(state, parsed.model)
            if pool.tokenizer is not remembered.tokenizer:  # the pool was built again since
                remembered = None
        if remembered is None:
            parse_bytes = json_parse_bytes(body)  # 0 under 256 KiB: nothing counted, nothing held
            if parse_bytes:
                await hold_parse(admission, parse_bytes, state, "http")
                try:
                    parsed = parse_request(body, kind, state.token_id_memo, known)
                finally:
                    admission.give_back_tokenizing()
            else:
                parsed = parse_request(body, kind, state.token_id_memo, known)
            check_sequences(parsed, limits.max_n)  # before the tokenizer's work
            pool = find_pool(state, parsed.model)
        weights = request_weights(request, state)
        if remembered is not None:
            token_ids: array[int] | None = _checked(remembered.token_ids, limits.max_prompt_tokens)
        else:
            token_ids = tokenize_inline(pool, parsed, limits.max_prompt_tokens)
            if token_ids is not None:
                body_memo.note(body_key, parsed, pool.tokenizer, token_ids)
        if token_ids is None:  # to a thread: its parsed form and the tokenizer's work are held
            form = Reparsed(parsed, functools.partial(parse_request, body, kind, state.token_id_memo, known))
            del parsed  # only ``form`` holds it: dropped while it waits for its bytes, parsed again after
            token_ids = await tokenize_held(admission, pool, form, limits.max_prompt_tokens)
            parsed = form.take()
            del form  # it holds the body as it came
        admission.add(TOKEN_ID_BYTES * len(token_ids))
        usage_added = False
        if pool.stream_usage and parsed.stream_usage in ("missing", "merge"):
            asked = with_stream_usage(body, parsed.stream_usage)
            if asked is not None:
                body, usage_added = asked, True
        request_id = request[REQUEST_ID]
        job = Forward(
            pool,
            token_ids,
            weights,
            parsed.session_key,
            parsed.max_tokens,
            body,
            path,
            request_id,
            arrived,
            tenant,
            whole_answer=not parsed.stream,
            sequences=parsed.sequences,
            usage_added=usage_added,
        )
        # Parsed tiny chat messages keep up to 8.7 times their bytes (docs/reliability.md, "Memory"):
        # nothing below reads them, so they must not live as long as the answer streams.
        del parsed
        if state.admission.limits.max_inflight_prompt_tokens_per_tenant is not None:  # off: no await
            await admission.take_prompt_tokens(len(token_ids))
        await admission.wait_for_replica(pool)
        if admission.prompt_tokens and job.whole_answer:
            release_after_prefill(state, admission)
        headers = forwardable_headers(request.headers, request_id)
        deliver = functools.partial(relay, request, state, job, admission)
        return await dispatch(state, job, headers, request[OUTCOME], deliver)


def release_after_prefill(state: ServiceState, admission: Admitted) -> None:
    """A request whose answer comes whole (no first token is seen before its end) gives back its
    prompt tokens of its tenant's ``limits.max_inflight_prompt_tokens_per_tenant`` at the estimated
    end of its prefill: ``prompt tokens / limits.prefill_tokens_per_s`` seconds from now, as it is
    sent to a replica (unset: at its end). An estimate: a replica with a queue ahead of it prefills
    it later, and the tenant's next prompt may then go before this one is prefilled."""
    rate = state.settings.limits.prefill_tokens_per_s
    if rate:
        admission.give_back_prompt_tokens_after(admission.prompt_tokens / rate)


def rate_before_body(request: web.Request) -> None:
    """With ``Expect: 100-continue``: take the request's token of its tenant's
    ``limits.tenant_rate_per_s`` before ``100 Continue`` is sent, so that a tenant over it is
    answered 429 instead and never sends its body (:func:`~balancer.api.middleware.expect_continue`;
    the handler then takes no second token)."""
    state = request.app[STATE]
    if state.tenant_rates is None:
        return
    request[RATE_TAKEN] = True
    refused = tenant_rate_refusal(state, request.headers.get(state.settings.tenant_header), state.monotonic())
    if refused is not None:
        raise ApiError(refused.status, refused.message, headers=retry_after(refused.retry_after_s))


def held_length(request: web.Request) -> int | None:
    """The bytes a body holds of ``limits.max_inflight_body_bytes`` from its admission: its declared
    ``Content-Length``, or ``None`` (its bytes are held as they are read) when it declares none or
    when it has a ``Content-Encoding``: aiohttp decodes gzip, deflate, br and zstd bodies, and the
    decoded body, what kvlb keeps, may be up to ``limits.max_body_bytes`` whatever the length
    declared (a 1 kB gzip body of a megabyte of spaces)."""
    if CONTENT_ENCODING in request.headers:
        return None
    return request.content_length


async def read_body(
    request: web.Request,
    max_bytes: int,
    timeouts: TimeoutConfig,
    hold: Callable[[int], Awaitable[None]] | None = None,
) -> bytes:
    """The request body, at most ``max_bytes`` (413) read within ``timeouts.body_read_s`` and at the
    pace of :func:`body_due` (408, counted in ``kvlb_http_body_timeouts_total`` by the limit it
    missed). ``hold``: called with each chunk's size before the chunk is kept (a body without a
    declared length holds its bytes of ``limits.max_inflight_body_bytes`` as it is read; it may
    wait, or refuse with :class:`~balancer.service.admission.AdmissionRefused`). A body aiohttp
    cannot decode (a ``Content-Encoding`` whose bytes are not that coding, a chunk it cannot frame)
    is a 400 naming what is wrong, with ``Connection: close``: aiohttp closes the connection after
    it (what is left of the body cannot be read), so the client must not send another request on it."""
    try:
        return await _read_body(request, max_bytes, timeouts, hold)
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        # aiohttp's compiled parser wraps a body's framing or coding error in RequestPayloadError;
        # its pure-Python one (AIOHTTP_NO_EXTENSIONS=1) hands over the parser's own error (a
        # TransferEncodingError for a bad chunk), which was a 500 here.
        message = f"the request body is malformed: {payload_error_text(exc)}"
        raise ApiError(400, message, headers={"Connection": "close"}) from None


def payload_error_text(exc: web.RequestPayloadError | HttpProcessingError) -> str:
    """What aiohttp found wrong with a body: the message of the error it wrapped ("Can not decode
    content-encoding: gzip"), without the wrapper's status prefix; for a chunk it cannot frame, the
    error's kind and the bytes it stopped at."""
    inner = exc.__cause__ if isinstance(exc, web.RequestPayloadError) and exc.__cause__ else exc
    message = getattr(inner, "message", None)
    if not isinstance(message, str) or not message:
        return str(inner)
    if isinstance(inner, TransferEncodingError):
        return f"bad chunked framing at {message[:80]!r}"
    return message


async def _read_body(
    request: web.Request,
    max_bytes: int,
    timeouts: TimeoutConfig,
    hold: Callable[[int], Awaitable[None]] | None,
) -> bytes:
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise too_large(declared, max_bytes)
    content = request.content
    if content.is_eof() and content.exception() is None:  # all of it arrived already: take it as is
        body = content.read_nowait()
        if len(body) > max_bytes:
            raise ApiError(413, f"request body exceeds limits.max_body_bytes = {max_bytes}")
        if hold is not None:
            await hold(len(body))
        return body
    buffer = bytearray()
    clock = asyncio.get_running_loop().time
    started = clock()
    final = started + timeouts.body_read_s
    paced = timeouts.body_min_rate_bytes_per_s > 0
    held_s = 0.0  # time spent waiting for bytes of the budget: the client is not late for it
    chunks = content.iter_chunks()
    state = request.app[STATE]
    max_chunks, chunk_ends = state.settings.limits.max_body_chunks, 0
    due = body_due(started, 0, held_s, timeouts)
    while True:
        try:
            async with asyncio.timeout_at(due) as deadline:
                async for chunk, chunk_end in chunks:
                    chunk_ends += chunk_end
                    if chunk_end and chunk_ends % YIELD_EVERY_CHUNKS == 0:
                        await asyncio.sleep(0)  # small chunks already here come without a wait
                    if chunk_ends > max_chunks:
                        state.metrics.body_chunk_overflow_total.inc()
                        raise ApiError(
                            400,
                            f"request body arrived in more than limits.max_body_chunks = {max_chunks} "
                            "chunks; send it in fewer, larger chunks",
                            close=True,
                        )
                    if len(buffer) + len(chunk) > max_bytes:
                        raise ApiError(413, f"request body exceeds limits.max_body_bytes = {max_bytes}")
                    if hold is not None:
                        if paced:
                            deadline.reschedule(final)
                        waited = clock()
                        await hold(len(chunk))
                        held_s += clock() - waited
                    buffer += chunk
                    if paced:
                        deadline.reschedule(body_due(started, len(buffer), held_s, timeouts))
            return bytes(buffer)
        except TimeoutError:
            when = deadline.when()
            total = when is not None and when >= final
            if not total and content.total_bytes > len(buffer):
                # The client had sent bytes that kvlb had not read yet (its event loop was busy):
                # the client is not behind. The bytes waiting count, and it gets the grace again.
                paced_due = body_due(started, content.total_bytes, held_s, timeouts)
                due = min(final, max(paced_due, clock() + timeouts.body_rate_grace_s))
                continue
            state.metrics.body_timeouts_total.labels(
                "body_read_s" if total else "body_min_rate_bytes_per_s"
            ).inc()
            if total:
                raise ApiError(408, f"request body not received within {timeouts.body_read_s}s") from None
            raise ApiError(
                408,
                f"request body arrived slower than timeouts.body_min_rate_bytes_per_s = "
                f"{timeouts.body_min_rate_bytes_per_s} ({len(buffer)} bytes received)",
            ) from None


def body_due(started: float, received: int, held_s: float, timeouts: TimeoutConfig) -> float:
    """When a body whose read began at ``started`` is late, with ``received`` bytes so far and
    ``held_s`` seconds spent waiting for budget bytes (kvlb's wait, not the client's): the earlier
    of ``started + body_read_s`` and, with a pace set, ``started + held_s + body_rate_grace_s +
    received / body_min_rate_bytes_per_s`` (each byte buys the time the pace allows for it)."""
    final = started + timeouts.body_read_s
    rate = timeouts.body_min_rate_bytes_per_s
    if rate <= 0:
        return final
    return min(final, started + held_s + timeouts.body_rate_grace_s + received / rate)


def find_pool(state: ServiceState, model: str) -> Pool:
    pool = state.pools.get(model)
    if pool is None:
        known = ", ".join(sorted(state.pools)) or "none"
        raise ApiError(
            404, f"model {model!r} is not served here; known models: {known}", kind="model_not_found"
        )
    return pool


def request_weights(request: web.Request, state: ServiceState) -> PolicyWeights:
    """The policy weights in force, or the ``x-kvlb-weights`` override when it is allowed (else 403)."""
    base = state.policy.view.weights
    header = request.headers.get(WEIGHTS_HEADER)
    if header is None:
        return base
    if not state.settings.auth.allow_weight_override:
        raise ApiError(403, f"{WEIGHTS_HEADER} is not allowed here (auth.allow_weight_override is off)")
    return parse_weights_header(header, base)


class TokenizingHold(Protocol):
    """What holds a request's bytes while it is tokenized in a thread
    (:class:`~balancer.service.admitted.Admitted`)."""

    def try_enter_tokenizer(self) -> bool: ...

    async def enter_tokenizer(self) -> None: ...

    def leave_tokenizer(self) -> None: ...

    def try_hold_tokenizing(self, tokenizing_bytes: int) -> bool: ...

    async def hold_tokenizing(self, tokenizing_bytes: int) -> None: ...

    def give_back_tokenizing(self) -> None: ...


class Reparsed:
    """A request's parsed form under one reference (:attr:`parsed`), so that :func:`tokenize_held`
    can drop it while the request waits for its bytes and make it again (:attr:`make`) once they
    are held; :attr:`drop` is called as it is dropped (to drop what holds it besides)."""

    __slots__ = ("drop", "make", "parsed")

    def __init__(
        self,
        parsed: ParsedRequest,
        make: Callable[[], ParsedRequest],
        drop: Callable[[], None] | None = None,
    ) -> None:
        self.parsed: ParsedRequest | None = parsed
        self.make = make
        self.drop = drop

    def take(self) -> ParsedRequest:
        """The parsed form (made again if it was dropped)."""
        parsed = self.parsed
        return self.make() if parsed is None else parsed


async def tokenize_held(
    admission: TokenizingHold, pool: Pool, form: Reparsed, max_prompt_tokens: int
) -> array[int]:
    """:func:`tokenize_in_thread` of ``form``'s request, within a turn of its tenant in the
    tokenizer's threads (``limits.max_tokenizing_per_tenant``: taken first, waiting without its
    parsed form when the tenant has none free; given back once the thread returns), holding
    :func:`tokenizing_hold_bytes` meanwhile (from the admission queue's tokenizing holds: at
    once, else waiting without its parsed form, made again once the bytes are held), given back
    once the thread returns. A text or chat the tokenizer encodes in pieces first holds for
    pieces of :func:`piece_hold_chars`; if one of its pieces would be longer
    (:class:`~balancer.tokenizer.cuts.LongPiece`, raised before the thread encoded that text or
    segment; for a chat also a rendered text longer than its ``text_chars``), it gives that back
    and holds the whole encode's estimate, queued again as any hold (its turn comes once the holds
    taken before are given back: every such hold is a request in a
    tokenizer thread, which waits for nothing here)."""
    if not admission.try_enter_tokenizer():
        form.parsed = None  # not kept while it waits for its tenant's turn: parsed again after
        if form.drop is not None:
            form.drop()
        await admission.enter_tokenizer()
    try:
        parsed = form.take()
        form.parsed = parsed
        max_piece_chars = piece_hold_chars(pool.tokenizer, parsed)
        tokenizer_max_tokens = pool.tokenizer.limits.max_prompt_tokens
        while True:
            hold_bytes = tokenizing_hold_bytes(parsed, max_piece_chars, tokenizer_max_tokens)
            if not admission.try_hold_tokenizing(hold_bytes):
                del parsed  # not kept while it waits for its bytes: parsed again once they are held
                form.parsed = None
                if form.drop is not None:
                    form.drop()
                await admission.hold_tokenizing(hold_bytes)
                parsed = form.parsed = form.make()
            try:
                token_ids = await tokenize_in_thread(pool, parsed, max_prompt_tokens, max_piece_chars)
            except LongPiece:
                admission.give_back_tokenizing()
                max_piece_chars = None
                continue
            admission.give_back_tokenizing()
            return token_ids
    finally:
        admission.leave_tokenizer()


async def hold_parse(admission: TokenizingHold, parse_bytes: int, state: ServiceState, face: str) -> None:
    """Hold ``parse_bytes`` (:mod:`balancer.api.parse_cost`'s estimate of a parse about to run on the
    event loop) in the queue of tokenizing holds, as a request to be tokenized in a thread holds its
    work: at once if the budget lets it in, else waiting (served first, in order; alone when no other
    such hold is taken, so a parse estimated over what is left still runs once nothing else is in a
    thread), refused as any wait for bytes (503 past the request's deadline). The caller parses, then
    gives it back (``give_back_tokenizing``) whatever the parse raised; nothing awaits in between.
    Counted in ``kvlb_admission_parse_holds_total{face, waited}``."""
    waited = "no"
    if not admission.try_hold_tokenizing(parse_bytes):
        waited = "yes"
        await admission.hold_tokenizing(parse_bytes)
    state.metrics.admission_parse_holds_total.labels(face, waited).inc()


def piece_hold_chars(tokenizer: Tokenizer, parsed: ParsedRequest) -> int | None:
    """The longest piece a request's text may be encoded in, for what it holds
    (:func:`tokenizing_hold_bytes`): :data:`PIECE_HOLD_FACTOR` times the tokenizer's
    ``limits.piece_chars`` for a text prompt it encodes in pieces, and for a chat whose text
    (:attr:`~balancer.api.parsing.ParsedRequest.text_chars`) is longer than that on a tokenizer that
    encodes a rendered chat's long segments in pieces (the thread renders it and stops, before
    encoding, at a segment's piece longer than that or a rendered chat longer than its
    ``text_chars``: :meth:`~balancer.tokenizer.tokenizer.Tokenizer.encode_chat_in_pieces`);
    ``None`` (the whole text) for any other (a tokenizer :mod:`balancer.tokenizer.cuts` does not
    cover, a short text, token ids). A few comparisons: no look at the text, no rendering."""
    if parsed.kind == "chat":
        if not tokenizer.encodes_in_pieces(parsed.text_chars, add_special_tokens=False):
            return None
    elif not isinstance(parsed.prompt, str) or not tokenizer.encodes_in_pieces(len(parsed.prompt)):
        return None
    return PIECE_HOLD_FACTOR * tokenizer.limits.piece_chars


def tokenizing_hold_bytes(
    parsed: ParsedRequest, max_piece_chars: int | None = None, max_prompt_tokens: int = 0
) -> int:
    """What ``parsed`` holds of ``limits.max_inflight_body_bytes`` while it waits for a tokenizer
    thread and is tokenized in it (:func:`tokenize_in_thread`; one tokenized on the event loop holds
    nothing: no other request runs meanwhile): the estimate of its parsed form
    (:attr:`~balancer.api.parsing.ParsedRequest.parsed_bytes`) plus that of the tokenizer's working
    memory, :data:`TOKENIZER_BYTES_PER_ASCII_CHAR` per character of its text
    (:attr:`~balancer.api.parsing.ParsedRequest.text_chars`, already counted by the parse) when all of
    it is ASCII, else :data:`TOKENIZER_BYTES_PER_CHAR`. Whether it is ASCII is a flag of each ``str``
    (:func:`~balancer.api.parsing.json_text_ascii`: one look per string, made only for a request
    that goes to a thread).

    With ``max_piece_chars`` (:func:`piece_hold_chars`: a text encoded in pieces of at most that
    many characters, the thread stopping before a longer one), the tokenizer's work is one piece's
    (the same rate a character, for at most ``max_piece_chars`` characters) plus the ids the
    pieces accumulate, :data:`TOKEN_ID_LIST_BYTES` each: at most one a character of ASCII text,
    :data:`MAX_TOKENS_PER_CHAR` of any other, and never more than ``max_prompt_tokens`` (the
    tokenizer's own limit, past which it stops) plus one piece's; or the whole encode's estimate
    when that is smaller (a text of a piece or two: the pieces' encodes make a part of what the
    whole encode makes, the same ids list included). A chat encoded in pieces holds, besides, its
    rendering (:data:`RENDER_BYTES_PER_ASCII_CHAR` / :data:`RENDER_BYTES_PER_CHAR` a character, the
    rendered text being at most ``text_chars``: the thread checks) and its ids at
    :data:`CHAT_TOKEN_ID_BYTES`."""
    if isinstance(parsed.prompt, str):
        ascii_only = parsed.prompt.isascii()
    else:
        ascii_only = json_text_ascii(parsed.messages) and json_text_ascii(parsed.chat_kwargs)
    per_char = TOKENIZER_BYTES_PER_ASCII_CHAR if ascii_only else TOKENIZER_BYTES_PER_CHAR
    chars = parsed.text_chars
    whole = parsed.parsed_bytes + per_char * chars
    if max_piece_chars is None:
        return whole
    piece_chars = min(max_piece_chars, chars)
    tokens_per_char = 1 if ascii_only else MAX_TOKENS_PER_CHAR
    ids = min(tokens_per_char * chars, max_prompt_tokens + tokens_per_char * piece_chars)
    if parsed.kind == "chat":
        render = (RENDER_BYTES_PER_ASCII_CHAR if ascii_only else RENDER_BYTES_PER_CHAR) * chars
        work = render + per_char * piece_chars + CHAT_TOKEN_ID_BYTES * ids
    else:
        work = per_char * piece_chars + TOKEN_ID_LIST_BYTES * ids
    return min(whole, parsed.parsed_bytes + work)


async def tokenize(pool: Pool, parsed: ParsedRequest, max_prompt_tokens: int) -> array[int]:
    """:func:`tokenize_inline`, else :func:`tokenize_in_thread` (without holding any bytes)."""
    token_ids = tokenize_inline(pool, parsed, max_prompt_tokens)
    if token_ids is None:
        token_ids = await tokenize_in_thread(pool, parsed, max_prompt_tokens)
    return token_ids


def tokenize_inline(pool: Pool, parsed: ParsedRequest, max_prompt_tokens: int) -> array[int] | None:
    """The prompt's token ids as the engine will compute them, as an ``array('I')``
    (:func:`~balancer.index.hashing.compact_ids`), when they are computed on the event loop; else
    ``None``: the caller holds :func:`tokenizing_hold_bytes` and awaits :func:`tokenize_in_thread`.
    400 when it cannot be tokenized or has more than ``max_prompt_tokens``. Ids the decoder already
    checked are not checked again.

    On the event loop: token ids, a request whose text is short (:data:`INLINE_TOKENIZE_CHARS`), or
    a chat whose text is at most :data:`PRECHECK_CHARS` and all but that many characters of it are
    in the tokenizer's segment cache (a shared system prompt). A text prompt over the tokenizer's
    ``max_prompt_chars`` is refused here (400), before it would hold bytes for a thread."""
    tokenizer = pool.tokenizer
    token_ids: Sequence[int] | None = None
    try:
        if parsed.ids_checked:
            assert parsed.prompt is not None and not isinstance(parsed.prompt, str)
            token_ids = parsed.packed if parsed.packed is not None else parsed.prompt
        elif parsed.kind == "chat":
            assert parsed.messages is not None
            if parsed.text_chars <= INLINE_TOKENIZE_CHARS:
                token_ids = tokenizer.encode_chat(parsed.messages, **parsed.chat_kwargs)
            elif parsed.text_chars <= PRECHECK_CHARS:
                cached = tokenizer.encode_chat_if_cached
                token_ids = cached(parsed.messages, parsed.chat_kwargs, INLINE_TOKENIZE_CHARS)
        else:
            assert parsed.prompt is not None
            if isinstance(parsed.prompt, str) and parsed.text_chars > INLINE_TOKENIZE_CHARS:
                # the thread's first check, made here: a text it would refuse holds nothing
                tokenizer.limits.check_chars(parsed.prompt)
                return None
            token_ids = tokenizer.encode_prompt(parsed.prompt)
    except TokenizeError as exc:
        raise ApiError(400, str(exc)) from None
    return None if token_ids is None else _checked(token_ids, max_prompt_tokens)


async def tokenize_in_thread(
    pool: Pool, parsed: ParsedRequest, max_prompt_tokens: int, max_piece_chars: int | None = None
) -> array[int]:
    """:func:`tokenize_inline`'s ids, computed in a thread of the default executor. Cancelled, it
    still waits for the thread to end (once; a second cancellation ends the wait), so that what the
    request holds for the tokenizer's work is given back only once that work is over.
    ``max_piece_chars``: as ``Tokenizer.encode_prompt`` takes it for a text prompt, as
    ``Tokenizer.encode_chat_in_pieces`` for a chat (its rendered text at most ``text_chars``)
    (:class:`~balancer.tokenizer.cuts.LongPiece` passes through)."""
    tokenizer = pool.tokenizer
    call: Callable[[], Sequence[int]]
    if parsed.kind == "chat":
        assert parsed.messages is not None
        if max_piece_chars is None:
            call = functools.partial(tokenizer.encode_chat, parsed.messages, **parsed.chat_kwargs)
        else:
            call = functools.partial(
                tokenizer.encode_chat_in_pieces,
                parsed.messages,
                parsed.chat_kwargs,
                max_piece_chars,
                parsed.text_chars,
            )
    else:
        assert parsed.prompt is not None
        call = functools.partial(tokenizer.encode_prompt, parsed.prompt, max_piece_chars=max_piece_chars)
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(None, contextvars.copy_context().run, call)  # as asyncio.to_thread
    try:
        token_ids = await asyncio.shield(work)
    except asyncio.CancelledError:
        if not work.done():  # the thread cannot be stopped: the bytes stay held until it ends
            await asyncio.wait([work])
        raise
    except TokenizeError as exc:
        raise ApiError(400, str(exc)) from None
    return _checked(token_ids, max_prompt_tokens)


def _checked(token_ids: Sequence[int], max_prompt_tokens: int) -> array[int]:
    """``token_ids`` as an ``array('I')``; 400 when there are more than ``max_prompt_tokens``."""
    if len(token_ids) > max_prompt_tokens:
        raise ApiError(
            400, f"prompt has {len(token_ids)} tokens, over limits.max_prompt_tokens = {max_prompt_tokens}"
        )
    # Kept compact while the request is in flight: a list of 8k ids is 8k references (and ints)
    # that every young garbage collection walks; the router hashes the array's bytes as they are.
    try:
        return compact_ids(token_ids)
    except (OverflowError, TypeError):  # pragma: no cover - every tokenizer checks its ids
        raise ApiError(400, "prompt token ids must be integers in [0, 2**32)") from None


async def relay(
    request: web.Request, state: ServiceState, job: Forward, admission: Admitted, lease: Lease, opened: Opened
) -> web.StreamResponse:
    """Send the replica's answer to the client; closes the upstream if the client goes away. A
    non-streaming answer holds its bytes of ``admission``'s budget while kvlb holds them."""
    outcome = request[OUTCOME]
    stream = opened.stream
    on_first_chunk(state, job, lease, stream)
    if admission.prompt_tokens:  # its prefill is done: the tenant's allowance passes on
        admission.give_back_prompt_tokens()
    content_type = stream.content_type
    headers = {
        "Content-Type": content_type,
        "x-request-id": job.request_id,
        "x-kvlb-replica": lease.replica,
        "x-kvlb-cached-tokens": str(lease.plan.cached_tokens),
    }
    try:
        if content_type.startswith(SSE_CONTENT_TYPE):
            headers["Cache-Control"] = "no-cache"
            response = await _relay_stream(request, state, job, lease, opened, headers)
        else:
            deadline = relay_deadline(state, job)
            response = await _relay_whole(request, state, admission, lease, opened, headers, deadline)
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        stream.close()
        outcome.status = "499"
        on_answered(state, lease, stream)  # it may leave on the last event, before the body's end
        raise
    except BaseException:
        stream.close()
        raise
    finally:
        await opened.chunks.aclose()
    on_relayed(state, job, lease, stream, complete=outcome.status is None)
    return response


async def _relay_stream(
    request: web.Request,
    state: ServiceState,
    job: Forward,
    lease: Lease,
    opened: Opened,
    headers: dict[str, str],
) -> web.StreamResponse:
    outcome = request[OUTCOME]
    stream = opened.stream
    response = _DeferredHeadResponse(status=stream.status, headers=headers)
    writes = HttpWrites(request, relay_deadline(state, job), state.settings.timeouts.client_write_stall_s)
    strip = usage_strip(job, lease) if job.usage_added and stream.status == 200 else None
    try:
        await response.prepare(request)
        try:
            async with writes:
                first = opened.first if strip is None else strip.feed(opened.first)
                if stream.finished:  # the whole answer is in: headers, body and its end in one write
                    await writes.write_eof(response, first if strip is None else first + strip.close())
                    return response
                if first:
                    await writes.write(response, first)
                async for chunk in opened.chunks:
                    if strip is not None:
                        chunk = strip.feed(chunk)
                    if stream.finished:  # the last chunk goes out with the end of the stream
                        await writes.write_eof(response, chunk if strip is None else chunk + strip.close())
                        return response
                    if chunk:
                        await writes.write(response, chunk)
                await writes.write_eof(response, b"" if strip is None else strip.close())
                return response
        except (UpstreamError, TimeoutError) as exc:
            if writes.writing:  # the client stopped reading: nothing more can reach it
                client_stalled(request, state, writes)
                return response
            message = failure_message(state, lease, exc)
            log.warning(
                "request %s: replica %s broke mid-stream: %s", headers["x-request-id"], lease.replica, message
            )
            outcome.status = "stream_error"
            async with asyncio.timeout(ERROR_EVENT_TIMEOUT_S):
                await response.write(sse_error_event(f"replica {lease.replica} failed mid-stream: {message}"))
                await response.write_eof()
    except ConnectionResetError:  # the client went away
        outcome.status = "499"
    except TimeoutError:  # the error event or the end not taken within ERROR_EVENT_TIMEOUT_S
        outcome.status = "499"
        drop_connection(request)
    finally:
        if strip is not None:
            counters = state.upstream.counters
            counters.usage_events_dropped += strip.dropped_events
            counters.usage_unfiltered_events += strip.unfiltered_events
    return response


def usage_strip(job: Forward, lease: Lease) -> UsageStrip:
    """The filter of a stream whose usage kvlb asked for and its client did not: the usage goes,
    written as the replica's engine writes a chunk without it."""
    replica = job.pool.replicas.get(lease.replica)
    unasked = engine_spec(replica.engine).unasked_stream_usage if replica is not None else "absent"
    return UsageStrip(unasked)


def client_stalled(request: web.Request, state: ServiceState, writes: ClientWrites) -> None:
    """Give up on a client that stopped reading its answer (:attr:`ClientWrites.writing`): its
    connection is aborted, the request counted as 499 and, in
    ``kvlb_http_client_write_stalls_total``, by the limit that ended it."""
    request[OUTCOME].status = "499"
    limit = "client_write_stall_s" if writes.stalled else "total_s"
    metrics = state.metrics
    metrics.children.of(metrics.client_write_stalls_total, "http", limit).inc()
    drop_connection(request)


class _DeferredHeadResponse(web.StreamResponse):
    """An answer written in parts whose headers go out with its first part, in one write (aiohttp's
    ``web.Response`` does the same; ``StreamResponse`` writes them alone at ``prepare``): an event
    stream, or a non-streaming answer written from its buffered parts or relayed as it arrives."""

    _send_headers_immediately = False


async def _relay_whole(
    request: web.Request,
    state: ServiceState,
    admission: Admitted,
    lease: Lease,
    opened: Opened,
    headers: dict[str, str],
    deadline: float,
) -> web.StreamResponse:
    """A non-streaming answer, read (at most :data:`MAX_RESPONSE_BYTES`) and written to the client
    by ``deadline``, its bytes held of ``limits.max_inflight_body_bytes`` while kvlb holds them
    ("Non-streaming answers" in the module docstring). Buffered whole while the budget has room,
    then written with its ``Content-Length``; relayed as it arrives from the chunk that does not
    fit. The request keeps its slot until the client has it, and a client that does not read it by
    then loses its connection (499). Every byte held is given back as it is written, and the rest
    however the relay ends."""
    outcome = request[OUTCOME]
    parts: collections.deque[bytes] = collections.deque()
    held = 0
    size = 0
    response: web.StreamResponse | None = None  # once set, relayed as it arrives
    writes = HttpWrites(request, deadline, state.settings.timeouts.client_write_stall_s)
    try:
        async with contextlib.aclosing(_answer_chunks(opened)) as chunks, writes:
            async for chunk in chunks:
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise UpstreamError(f"answer larger than {MAX_RESPONSE_BYTES} bytes")
                if response is None:
                    if admission.try_hold(len(chunk)):
                        held += len(chunk)
                        parts.append(chunk)
                        continue
                    state.metrics.admission_answer_overflow_total.inc()
                    response = _DeferredHeadResponse(status=opened.stream.status, headers=headers)
                    await response.prepare(request)
                    while parts:  # what was buffered goes first, given back as it is written
                        part = parts.popleft()
                        await writes.write(response, part)
                        held -= len(part)
                        admission.give_back(len(part))
                admission.add(len(chunk))  # one chunk at a time, even over the budget
                held += len(chunk)
                await writes.write(response, chunk)
                held -= len(chunk)
                admission.give_back(len(chunk))
            if response is not None:
                await writes.write_eof(response)
                return response
            response = _DeferredHeadResponse(status=opened.stream.status, headers=headers)
            response.content_length = size
            await response.prepare(request)
            last = parts.pop() if parts else b""
            while parts:
                part = parts.popleft()
                await writes.write(response, part)
                held -= len(part)
                admission.give_back(len(part))
            await writes.write_eof(response, last)  # a one-chunk answer: headers and body in one write
    except (UpstreamError, TimeoutError) as exc:
        if writes.writing:  # the client stopped reading
            client_stalled(request, state, writes)
        elif response is None or not response.prepared:
            message = failure_message(state, lease, exc)
            raise ApiError(502, f"replica {lease.replica} failed while answering: {message}") from None
        else:  # relayed in part already: the client sees its connection cut, not a whole answer
            message = failure_message(state, lease, exc)
            log.warning(
                "request %s: replica %s broke mid-answer: %s", headers["x-request-id"], lease.replica, message
            )
            outcome.status = "stream_error"
            drop_connection(request)
    except ConnectionResetError:  # the client went away
        outcome.status = "499"
    finally:
        parts.clear()
        if held:
            admission.give_back(held)
    assert response is not None
    return response


async def _answer_chunks(opened: Opened) -> AsyncGenerator[bytes, None]:
    """The answer's first chunk (read before the relay started), then the rest as they arrive."""
    yield opened.first
    async for chunk in opened.chunks:
        yield chunk


def sse_error_event(message: str, status: int = 502) -> bytes:
    payload = {"error": {"message": message, "type": "upstream_error", "param": None, "code": status}}
    return b"data: " + strict_json.dumps(payload).encode("utf-8") + b"\n\n"


def add_openai_routes(app: web.Application) -> None:
    expect = functools.partial(expect_continue, admit=rate_before_body)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect)
    app.router.add_post("/v1/completions", completions, expect_handler=expect)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
