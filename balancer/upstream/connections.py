"""Keep-alive HTTP/1.1 connections to replicas (I/O): an ``asyncio.Protocol`` per connection and a
bounded pool of them per ``(scheme, host, port)``.

A connection carries one request at a time: :meth:`Connection.send` writes its head and body in one
``transport.writelines``; what comes back goes through a :class:`~balancer.upstream.http1.ResponseParser`
into a buffer of body chunks that the relay drains (reading pauses while more than
``HIGH_WATER_BYTES`` wait). The pool holds at most ``max_connections`` connections in all (a request
that finds none free waits, within the caller's timeout) and at most ``max_idle_per_host`` idle ones
per host, each for at most ``idle_ttl_s`` (expired ones, of any host, are closed by the next request
at most once per ``idle_ttl_s``); a connection whose response was not read to its end is
closed, never reused. The protocol itself knows nothing of timeouts: the caller's ``asyncio.timeout``
bounds every wait.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import Callable
from typing import Final, cast

from balancer.upstream.http1 import HttpParseError, ParserLimits, ResponseHead, ResponseParser

HIGH_WATER_BYTES: Final = 256 * 1024
"""Body bytes buffered for the relay before reading from the replica pauses (it resumes when the
relay takes them: :meth:`Connection.take` takes all)."""

HostKey = tuple[str, str, int]
"""``(scheme, host, port)``."""


class Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; one request in flight at a time."""

    def __init__(self, key: HostKey, limits: ParserLimits, on_lost: Callable[[Connection], None]) -> None:
        self.key = key
        self._limits = limits
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        """Why the response cannot go on (a parse error or the connection's loss)."""
        self.lost = False
        self.idle_since = 0.0
        self.requests = 0
        """Requests sent on this connection (>1: it was reused)."""

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None or self.error is not None:  # nothing asked for: a confused peer
            if parser is None:
                self.close()
            return
        try:
            chunks = parser.feed(data)
        except HttpParseError as exc:
            self._fail(exc)
            return
        if chunks:
            for chunk in chunks:
                self._chunks.append(chunk)
                self._buffered += len(chunk)
            if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        if chunks or parser.head is not None or parser.complete:
            self._wake()

    def eof_received(self) -> bool:
        parser = self.parser
        if parser is not None and self.error is None:
            try:
                parser.feed_eof()
            except HttpParseError as exc:
                self.error = exc
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        parser = self.parser
        if parser is not None and self.error is None and not parser.complete:
            try:
                parser.feed_eof()
            except HttpParseError as parse_error:
                self.error = parse_error if exc is None else ConnectionError(str(exc) or type(exc).__name__)
        self._wake()
        self._on_lost(self)

    # --- the request's side -------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        """Write one request; its response is read into a fresh parser."""
        assert self.transport is not None and self.parser is None
        self.parser = ResponseParser(self._limits)
        self.requests += 1
        self.transport.writelines((head, body))

    async def wait_head(self) -> ResponseHead:
        """The response's headers; raises the parse error or the loss that came first."""
        parser = self.parser
        assert parser is not None
        while parser.head is None:
            if self.error is not None:
                raise self.error
            if self.lost:
                raise ConnectionResetError("the connection closed before the response")
            await self._wait()
        return parser.head

    def take(self) -> bytes:
        """Every body byte buffered so far, joined (``b""``: none yet)."""
        chunks = self._chunks
        if not chunks:
            return b""
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    @property
    def buffered(self) -> int:
        """Body bytes read from the replica that the relay has not taken yet."""
        return self._buffered

    @property
    def body_done(self) -> bool:
        """The body's end was read and every byte of it taken."""
        return self.parser is not None and self.parser.complete and not self._chunks

    @property
    def body_ended(self) -> bool:
        """The body's end was read (some of it may still wait in the buffer)."""
        return self.parser is not None and self.parser.complete

    async def wait_body(self) -> None:
        """Until more body, the body's end or a failure."""
        if self._chunks or self.error is not None or self.lost or self.body_ended:
            return
        await self._wait()

    def reusable(self) -> bool:
        return (
            not self.lost
            and self.error is None
            and self.parser is not None
            and self.parser.reusable
            and not self._chunks
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def recycle(self, now: float) -> None:
        """Ready for the next request (only after :meth:`reusable`)."""
        self.parser = None
        self.idle_since = now
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Drop the connection: the replica sees it close (and stops generating)."""
        self._chunks.clear()
        self._buffered = 0
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self._wake()
        self.close()

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ConnectionPool:
    """Connections to every replica: at most ``max_connections`` open, ``max_idle_per_host`` idle."""

    def __init__(
        self,
        max_connections: int,
        max_idle_per_host: int,
        idle_ttl_s: float,
        limits: ParserLimits,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._max_connections = max_connections
        self._max_idle_per_host = max_idle_per_host
        self._idle_ttl_s = idle_ttl_s
        self._limits = limits
        self._idle: dict[HostKey, collections.deque[Connection]] = {}
        self._open: set[Connection] = set()
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ssl = ssl_context
        self._swept_at = 0.0
        self.closed = False
        self.waits = 0
        """Requests that found every connection busy and waited for one."""

    @property
    def open_connections(self) -> int:
        return len(self._open) + self._connecting

    def _take_idle(self, key: HostKey, now: float) -> Connection | None:
        """The most recently used live idle connection to ``key`` (stale ones are closed)."""
        idle = self._idle.get(key)
        if not idle:
            return None
        while idle:
            conn = idle.pop()
            if conn.lost or now - conn.idle_since > self._idle_ttl_s:
                conn.close()
                continue
            return conn
        return None

    async def acquire(self, key: HostKey, connect_s: float, fresh: bool = False) -> tuple[Connection, bool]:
        """An idle connection to ``key`` (unless ``fresh``) or a new one once the total allows it
        (the caller's timeout bounds the wait); True when it was idle (reused)."""
        while True:
            if self.closed:
                raise ConnectionError("the upstream client is closed")
            now = asyncio.get_running_loop().time()
            self._sweep(now)
            conn = None if fresh else self._take_idle(key, now)
            if conn is not None:
                return conn, True
            if self.open_connections < self._max_connections or self._drop_one_idle():
                return await self._connect(key, connect_s), False
            self.waits += 1
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._notify()  # the slot it was woken for goes to the next waiter
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise

    async def _connect(self, key: HostKey, connect_s: float) -> Connection:
        scheme, host, port = key
        context = None
        if scheme == "https":
            if self._ssl is None:  # the system's CAs, verified, host names checked: read once, off the loop
                self._ssl = await asyncio.to_thread(ssl.create_default_context)
            context = self._ssl
        self._connecting += 1
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: Connection(key, self._limits, self._lost),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
        finally:
            self._connecting -= 1
            self._notify()
        self._open.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        """Back to the idle set if its response was read to the end, else closed."""
        if self.closed or not conn.reusable():
            conn.close()
            return
        idle = self._idle.setdefault(conn.key, collections.deque())
        if len(idle) >= self._max_idle_per_host:
            idle.popleft().close()
        conn.recycle(asyncio.get_running_loop().time())
        idle.append(conn)
        self._notify()

    def close(self) -> None:
        """Close every connection (idle or in use) and wake every waiter."""
        self.closed = True
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _lost(self, conn: Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]
        self._notify()

    def _drop_one_idle(self) -> bool:
        """Close the oldest idle connection of any host to make room; False when none is idle."""
        oldest: collections.deque[Connection] | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest[0].idle_since):
                oldest = idle
        if oldest is None:
            return False
        conn = oldest.popleft()
        self._open.discard(conn)  # its slot is free now, whenever its loss is reported
        conn.close()
        return True

    def _notify(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self, now: float) -> None:
        """At most once per ``idle_ttl_s``: close every idle connection past its time, whatever its
        host (a replica that left gets no request that would find its connections stale)."""
        if now - self._swept_at < self._idle_ttl_s:
            return
        self._swept_at = now
        for key, idle in list(self._idle.items()):
            while idle and now - idle[0].idle_since > self._idle_ttl_s:
                idle.popleft().close()
            if not idle:
                del self._idle[key]
