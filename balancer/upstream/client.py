"""Talking to replicas (I/O): kvlb's own pooled HTTP/1.1 client, stage timeouts, chunk relay.

The balancer never re-parses the upstream body while relaying it: chunks go to the client as they
arrive. It keeps only a small tail of the bytes so that, once the stream ends, it can read
``usage.prompt_tokens_details.cached_tokens`` (the engine's own report of prefix reuse) for metrics.

Retries are the caller's business; this module classifies failures: :class:`RetryableUpstream`
(connect error, timeout before headers, 429/503) may be retried elsewhere because nothing reached the
client yet; anything after the first byte is final.

The client is kvlb's own (:mod:`~balancer.upstream.http1` parses, :mod:`~balancer.upstream.connections`
keeps the connections): a request is one write of its head and body on a keep-alive connection,
with no URL objects, header multidicts or per-request timers beyond the stage timeouts. What it
sends: ``POST <path> HTTP/1.1``, ``Host``, ``Content-Length``, the headers it is given (the
allow-list below), ``Authorization: Bearer`` with the replica's own API key when it has one
(``replicas[].api_key_file``/``api_key_env``; never the client's) and the body, nothing else.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from balancer.config import TimeoutConfig, UpstreamConfig
from balancer.config.settings import Secret
from balancer.errors import UpstreamError, UpstreamTimeout
from balancer.upstream.auth import REFUSED_CALLER_STATUSES, engine_auth_headers, refused_caller
from balancer.upstream.connections import Connection, ConnectionPool, HostKey
from balancer.upstream.http1 import PARSE_ERROR_REASONS, HttpParseError, ParserLimits, ResponseHead
from balancer.upstream.sse import DONE

FORWARDED_REQUEST_HEADERS = frozenset({"content-type", "accept", "x-request-id", "traceparent", "tracestate"})
"""Client headers passed to replicas; everything else (auth, cookies, hop-by-hop) stays here."""
RETRYABLE_STATUSES = frozenset({429, 503})
_TAIL_BYTES = 4096
_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


class RetryableUpstream(UpstreamError):
    """The replica failed before sending anything to the client; another replica may serve it."""

    def __init__(self, reason: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.status = status


def forwardable_headers(headers: Mapping[str, str], request_id: str) -> dict[str, str]:
    """The allow-listed subset of client headers, plus the request id."""
    out = {k: v for k, v in headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
    out["x-request-id"] = request_id
    return out


@dataclass(slots=True)
class UsageTail:
    """What the end of a response said about usage (``None`` when it did not say)."""

    cached_tokens: int | None = None
    prompt_tokens: int | None = None


def read_usage(tail: bytes) -> UsageTail:
    """Last ``cached_tokens`` / ``prompt_tokens`` values in the tail of a response body."""
    cached = _CACHED_RE.findall(tail)
    prompt = _PROMPT_RE.findall(tail)
    return UsageTail(
        cached_tokens=int(cached[-1]) if cached else None,
        prompt_tokens=int(prompt[-1]) if prompt else None,
    )


@dataclass(frozen=True, slots=True)
class _Target:
    key: HostKey
    host_header: str
    prefix: str
    """The base URL's path, without its trailing slash."""


_HOP_HEADERS: Final = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade"})
_MAX_TARGETS: Final = 4096
"""Parsed base URLs kept (one per replica URL); the memo starts over when full."""


@dataclass(slots=True)
class UpstreamCounters:
    """What the client counts (exported as ``kvlb_upstream_*`` by
    :class:`~balancer.counter_collectors.UpstreamCountersCollector`)."""

    protocol_errors: dict[str, int]
    """Responses that could not be framed, by :data:`~balancer.upstream.http1.PARSE_ERROR_REASONS`."""
    stale_retries: int = 0
    """Requests resent on a fresh connection because a reused one closed before any response byte."""
    pool_waits: int = 0
    """Requests that found ``max_connections`` in use and waited for one."""
    usage_events_dropped: int = 0
    """Usage-only events taken out of streams whose client did not ask for usage
    (:class:`~balancer.upstream.stream_usage.UsageStrip`)."""
    usage_unfiltered_events: int = 0
    """Stream events passed on unfiltered: longer than the filter's bound before their end."""


class UpstreamStream:
    """An open upstream response: status and headers are known, the body is relayed chunk by chunk."""

    __slots__ = (
        "_conn", "_counters", "_done", "_ended", "_head", "_idle_s", "_pool", "_tail", "bytes_relayed",
    )  # fmt: skip

    def __init__(
        self,
        conn: Connection,
        head: ResponseHead,
        pool: ConnectionPool,
        idle_s: float,
        counters: UpstreamCounters,
    ) -> None:
        self._conn = conn
        self._counters = counters
        self._head = head
        self._pool = pool
        self._idle_s = idle_s
        self._tail = bytearray()
        self.bytes_relayed = 0
        self._ended = False
        self._done = False  # released or closed: the connection is no longer this stream's

    @property
    def finished(self) -> bool:
        """The whole body was read (its end reached): :meth:`usage` is the engine's last word. Also
        when the relay stopped iterating at the last chunk because the end had already arrived."""
        return self._ended or (not self._done and self._conn.body_done)

    @property
    def answered(self) -> bool:
        """The engine's answer is all in, so :meth:`usage` is its last word: the body was read to its
        end, or an event stream's last event (``data: [DONE]``) arrived, whose end may follow in
        another read (a client that leaves on that event does not wait for it)."""
        return self.finished or self._tail.rstrip().endswith(DONE)

    @property
    def status(self) -> int:
        return self._head.status

    @property
    def content_type(self) -> str:
        return self._head.headers.get("content-type", "application/json") or ""

    async def chunks(self, first_wait_s: float | None = None) -> AsyncGenerator[bytes, None]:
        """Yield body chunks as they arrive; an idle gap over ``idle_s`` raises UpstreamTimeout.
        ``first_wait_s``: the bound of the wait for the first chunk instead (a stream's first token
        comes after the engine's queueing and prefill; its caller passes what is left of
        ``timeouts.total_s``)."""
        conn = self._conn
        wait_s = self._idle_s if first_wait_s is None else first_wait_s
        while True:
            # What has arrived already is taken without a wait (or its timer: one per chunk
            # otherwise); asyncio.timeout, not wait_for: on Python 3.11 wait_for makes a task
            chunk = conn.take()
            if not chunk:
                if conn.body_ended:
                    self._ended = True
                    return
                if conn.error is not None or conn.lost or self._done:
                    error = conn.error or ConnectionResetError()
                    if isinstance(error, HttpParseError):
                        self._counters.protocol_errors[error.reason] += 1
                    raise UpstreamError(f"replica stream broke: {_describe(error)}")
                try:
                    async with asyncio.timeout(wait_s):
                        await conn.wait_body()
                except TimeoutError:
                    if first_wait_s is not None and not self.bytes_relayed:
                        raise UpstreamTimeout(
                            f"no first token within what was left of timeouts.total_s ({first_wait_s:.1f}s)"
                        ) from None
                    raise UpstreamTimeout(f"no data from replica for {self._idle_s:.1f}s") from None
                continue
            self.bytes_relayed += len(chunk)
            wait_s = self._idle_s
            self._tail += chunk
            if len(self._tail) > 2 * _TAIL_BYTES:
                del self._tail[:-_TAIL_BYTES]
            yield chunk

    def usage(self) -> UsageTail:
        return read_usage(bytes(self._tail[-_TAIL_BYTES:]))

    def close(self) -> None:
        """Drop the connection (used when the client went away, so the replica stops generating)."""
        if self._let_go():
            self._conn.close()

    def release(self) -> None:
        """Hand the connection back: to the pool if the body was read to its end, else closed."""
        if self._let_go():
            self._pool.release(self._conn)

    def _let_go(self) -> bool:
        """Keep what the stream knows of the body's end and stop reading the connection's state,
        which may belong to another request from now on; False if it was let go already."""
        if self._done:
            return False
        self._ended = self._ended or self._conn.body_done
        self._done = True
        return True


class UpstreamClient:
    """kvlb's pooled HTTP/1.1 client for all replicas, owned by the app (closed on shutdown).

    :attr:`counters` are exported by :class:`~balancer.counter_collectors.UpstreamCountersCollector`.
    ``ssl_context`` verifies ``https://`` replicas (default: the system's CAs, with host name checks)."""

    def __init__(
        self,
        timeouts: TimeoutConfig,
        config: UpstreamConfig | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._timeouts = timeouts
        self._config = config if config is not None else UpstreamConfig()
        self._ssl = ssl_context
        self._pool: ConnectionPool | None = None
        self._targets: dict[str, _Target] = {}
        self.counters = UpstreamCounters({reason: 0 for reason in PARSE_ERROR_REASONS})

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None or self._pool.closed:
            config = self._config
            self._pool = ConnectionPool(
                config.max_connections,
                config.max_idle_per_host,
                config.idle_ttl_s,
                ParserLimits(config.max_header_bytes, config.max_headers),
                self._ssl,
            )
        return self._pool

    async def open(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        whole_answer_s: float | None = None,
        api_key: Secret | None = None,
    ) -> UpstreamStream:
        """POST ``body`` and wait for the response headers; failures before them are retryable.

        ``whole_answer_s``: the request asks for a whole (non-streaming) answer, whose headers an
        engine sends only with it, once it has generated every token: they are waited for this
        long (what is left of ``timeouts.total_s``) instead of ``timeouts.first_byte_s``, and
        running out is :class:`UpstreamTimeout`, not retryable (the engine was generating; another
        replica would start over).

        ``api_key``: the replica's own key, sent as ``Authorization: Bearer`` (the client's
        ``Authorization`` is never in ``headers``)."""
        target = self._target(base_url)
        if api_key is not None:
            headers = {**headers, **engine_auth_headers(api_key)}
        request_head = _request_head(target, path, len(body), headers)
        pool = self.pool
        wait_s = self._timeouts.first_byte_s if whole_answer_s is None else whole_answer_s
        try:
            async with asyncio.timeout(wait_s):
                conn, head = await self._exchange(pool, target, request_head, body, base_url)
        except TimeoutError:
            if whole_answer_s is not None:
                raise UpstreamTimeout(
                    f"no answer within timeouts.total_s = {self._timeouts.total_s}s"
                ) from None
            raise RetryableUpstream(
                "timeout", f"no response headers within {self._timeouts.first_byte_s}s"
            ) from None
        if head.status in RETRYABLE_STATUSES:
            pool.release(conn)
            raise RetryableUpstream("status", f"replica answered {head.status}", head.status)
        if head.status in REFUSED_CALLER_STATUSES:
            pool.release(conn)
            if api_key is not None:
                api_key.refused()  # re-read a rotated key now
            raise RetryableUpstream("status", refused_caller(head.status, api_key), head.status)
        return UpstreamStream(conn, head, pool, self._timeouts.idle_s, self.counters)

    async def _exchange(
        self, pool: ConnectionPool, target: _Target, request_head: bytes, body: bytes, base_url: str
    ) -> tuple[Connection, ResponseHead]:
        fresh = False
        while True:
            conn, reused = await self._acquire(pool, target, base_url, fresh)
            try:
                conn.send(request_head, body)
                return conn, await conn.wait_head()
            except (HttpParseError, ConnectionError) as exc:
                conn.close()
                received = conn.parser.received if conn.parser is not None else 0
                if reused and received == 0:  # the replica closed it while it was idle
                    self.counters.stale_retries += 1
                    fresh = True
                    continue
                if isinstance(exc, HttpParseError) and received:
                    self.counters.protocol_errors[exc.reason] += 1
                raise RetryableUpstream("connect", f"{_describe(exc)} from {base_url}") from None
            except BaseException:
                conn.close()
                raise

    async def _acquire(
        self, pool: ConnectionPool, target: _Target, base_url: str, fresh: bool
    ) -> tuple[Connection, bool]:
        waits = pool.waits
        try:
            return await pool.acquire(target.key, self._timeouts.connect_s, fresh)
        except TimeoutError:
            raise RetryableUpstream(
                "timeout", f"cannot connect to {base_url} within {self._timeouts.connect_s}s"
            ) from None
        except OSError as exc:
            raise RetryableUpstream("connect", f"cannot connect to {base_url}: {exc}") from None
        finally:
            self.counters.pool_waits += pool.waits - waits

    def _target(self, base_url: str) -> _Target:
        target = self._targets.get(base_url)
        if target is None:
            parts = urlsplit(base_url)
            scheme = parts.scheme.lower()
            host = parts.hostname
            if scheme not in ("http", "https") or not host:
                raise UpstreamError(f"replica url must be http(s)://host[:port], got {base_url!r}")
            default = 443 if scheme == "https" else 80
            port = parts.port or default
            shown = f"[{host}]" if ":" in host else host
            host_header = shown if port == default else f"{shown}:{port}"
            target = _Target((scheme, host, port), host_header, parts.path.rstrip("/"))
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            self._targets[base_url] = target
        return target

    async def aclose(self) -> None:
        """Close every connection, idle or in use (their replicas see them close)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
            await asyncio.sleep(0)  # let the transports report their loss


def _request_head(target: _Target, path: str, length: int, headers: Mapping[str, str]) -> bytes:
    """``POST`` head: request line, Host, Content-Length and ``headers`` (none with CR or LF)."""
    parts = [
        f"POST {target.prefix}{path} HTTP/1.1\r\nHost: {target.host_header}\r\nContent-Length: {length}\r\n"
    ]
    fields: dict[str, str] = {}  # one field per name, whatever its case; the last value wins
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HOP_HEADERS or _unsafe(name) or _unsafe(value):
            continue
        fields.pop(lower, None)
        fields[lower] = f"{name}: {value}\r\n"
    parts += fields.values()
    parts.append("\r\n")
    return "".join(parts).encode("utf-8", "surrogateescape")


def _unsafe(text: str) -> bool:
    """Would end or split a header line (a client's header value never may)."""
    return "\r" in text or "\n" in text or "\0" in text


def _describe(exc: BaseException) -> str:
    if isinstance(exc, HttpParseError):
        return str(exc)
    return exc.__class__.__name__
