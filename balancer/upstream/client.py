"""Talking to replicas (I/O): one pooled HTTP client, stage timeouts, chunk relay.

The balancer never re-parses the upstream body while relaying it: chunks go to the client as they
arrive. It keeps only a small tail of the bytes so that, once the stream ends, it can read
``usage.prompt_tokens_details.cached_tokens`` (the engine's own report of prefix reuse) for metrics.

Retries are the caller's business; this module classifies failures: :class:`RetryableUpstream`
(connect error, timeout before headers, 429/503) may be retried elsewhere because nothing reached the
client yet; anything after the first byte is final.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass

import aiohttp

from balancer.config import TimeoutConfig
from balancer.errors import UpstreamError, UpstreamTimeout
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


class UpstreamStream:
    """An open upstream response: status and headers are known, the body is relayed chunk by chunk."""

    def __init__(self, response: aiohttp.ClientResponse, idle_s: float) -> None:
        self._response = response
        self._idle_s = idle_s
        self._tail = bytearray()
        self.bytes_relayed = 0
        self._ended = False

    @property
    def finished(self) -> bool:
        """The whole body was read (its end reached): :meth:`usage` is the engine's last word. Also
        when the relay stopped iterating at the last chunk because the end had already arrived."""
        return self._ended or self._response.content.at_eof()

    @property
    def answered(self) -> bool:
        """The engine's answer is all in, so :meth:`usage` is its last word: the body was read to its
        end, or an event stream's last event (``data: [DONE]``) arrived, whose end may follow in
        another read (a client that leaves on that event does not wait for it)."""
        return self.finished or self._tail.rstrip().endswith(DONE)

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def content_type(self) -> str:
        return self._response.headers.get("content-type", "application/json")

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """Yield body chunks as they arrive; an idle gap over ``idle_s`` raises UpstreamTimeout."""
        content = self._response.content
        while True:
            try:
                # What has arrived already is taken without a wait (or its timer: one per chunk
                # otherwise); asyncio.timeout, not wait_for: on Python 3.11 wait_for makes a task
                chunk = content.read_nowait()
                if not chunk and not content.at_eof():
                    async with asyncio.timeout(self._idle_s):
                        chunk = await content.readany()
            except TimeoutError:
                raise UpstreamTimeout(f"no data from replica for {self._idle_s:.1f}s") from None
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise UpstreamError(f"replica stream broke: {exc.__class__.__name__}") from None
            if not chunk:
                if not content.is_eof():  # pragma: no cover - readany returns b"" only at EOF
                    continue
                self._ended = True
                return
            self.bytes_relayed += len(chunk)
            self._tail += chunk
            if len(self._tail) > 2 * _TAIL_BYTES:
                del self._tail[:-_TAIL_BYTES]
            yield chunk

    def usage(self) -> UsageTail:
        return read_usage(bytes(self._tail[-_TAIL_BYTES:]))

    def close(self) -> None:
        """Drop the connection (used when the client went away, so the replica stops generating)."""
        self._response.close()

    def release(self) -> None:
        self._response.release()


class UpstreamClient:
    """One pooled ``aiohttp.ClientSession`` for all replicas, owned by the app (closed on shutdown)."""

    def __init__(self, timeouts: TimeoutConfig, max_connections: int = 2048) -> None:
        self._timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None
        self._max_connections = max_connections
        self._request_timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=None)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, ttl_dns_cache=60)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, connect=self._timeouts.connect_s),
                auto_decompress=False,
                # no cookie jar: a replica's Set-Cookie must not ride along on other clients'
                # requests, and filtering an empty jar cost every request a little
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def open(self, base_url: str, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamStream:
        """POST ``body`` and wait for the response headers; failures before them are retryable."""
        url = base_url.rstrip("/") + path
        try:
            async with asyncio.timeout(self._timeouts.first_byte_s):
                response = await self.session.post(
                    url, data=body, headers=headers, timeout=self._request_timeout
                )
        except TimeoutError:
            raise RetryableUpstream(
                "timeout", f"no response headers within {self._timeouts.first_byte_s}s"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise RetryableUpstream("connect", f"cannot connect to {base_url}: {exc.os_error}") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise RetryableUpstream("connect", f"{exc.__class__.__name__} from {base_url}") from None
        if response.status in RETRYABLE_STATUSES:
            response.release()
            raise RetryableUpstream("status", f"replica answered {response.status}", response.status)
        return UpstreamStream(response, self._timeouts.idle_s)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
