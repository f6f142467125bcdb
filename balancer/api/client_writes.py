"""Writing an answer to a client that may stop reading it (I/O): the relay's deadline and the
write-stall bound (``timeouts.client_write_stall_s``), for both faces.

A relay writes each chunk of its answer to the client; a write waits while the client's connection
holds more than its transport's limit (the client reads slower than the replica answers, or not at
all). Without a bound, a client that stops reading held its admission slot, the answer's bytes,
its replica's stream and its load until ``timeouts.total_s`` (600 s by default), and its connection
after that: many of them took every slot (a slow-loris on the answer side).

:class:`ClientWrites` is one relay's ``async with``: ``timeouts.total_s``'s deadline (the
``asyncio.timeout_at`` the relays had) plus a watchdog on the writes that may wait. A write is
marked with :meth:`~ClientWrites.begin` and :meth:`~ClientWrites.end`; while one is in progress a
timer checks, every quarter of the bound, whether the client took any byte since the last check
(:meth:`~ClientWrites.taken`: on HTTP the bytes the client's TCP has acknowledged, Linux's
``tcpi_bytes_acked``, which counts through every buffer, TLS's included; without it, the write's
completion is the only progress). When it has taken nothing for
``client_write_stall_s`` the deadline is brought forward to now: the relay ends with
``TimeoutError`` and :attr:`~ClientWrites.stalled` says why, so the face drops the client (the
HTTP face aborts the connection, which also drops the kernel's queue) and gives everything back.

So a client that took no byte for the bound is dropped within 1.25 times it (the check's period);
one that takes bytes at least every three quarters of it never is, however slowly it reads. No
task is made, and no timer is armed for a write that cannot wait: the HTTP face calls
:meth:`~ClientWrites.begin` only when its transport holds more than its low-water mark
(:class:`HttpWrites`); one timer then serves every write of the answer for a quarter of the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable
from types import TracebackType

from aiohttp import web

CHECKS_PER_BOUND = 4
"""How often, per ``client_write_stall_s``, a write in progress is checked for progress."""
_TCP_INFO = getattr(socket, "TCP_INFO", None)
"""``getsockopt`` option of Linux's ``struct tcp_info`` (``None`` elsewhere)."""
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_OFFSET = 120
"""Offset of ``tcpi_bytes_acked`` (u64, Linux 4.1 on) in ``struct tcp_info``: the bytes of the
connection the peer has acknowledged, so far."""


class ClientWrites:
    """One relay's deadline (``timeouts.total_s``) and write-stall bound, as an ``async with`` that
    raises ``TimeoutError`` when either passes. :meth:`taken` says how much the client has taken,
    read at each check (any rise is progress); here ``None``: only a write's end tells (the gRPC
    face)."""

    __slots__ = (
        "_handle",
        "_loop",
        "_period_s",
        "_progress_at",
        "_since",
        "_stall_s",
        "_taken",
        "_timeout",
        "stalled",
        "writing",
    )

    def __init__(self, deadline: float, stall_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = asyncio.timeout_at(deadline)
        self._stall_s = stall_s
        self._period_s = stall_s / CHECKS_PER_BOUND
        self._handle: asyncio.TimerHandle | None = None
        self._since: float | None = None
        self._taken: int | None = None
        self._progress_at = 0.0
        self.stalled = False
        """The stall bound ended the relay (the client took no byte for ``client_write_stall_s``)."""
        self.writing = False
        """A write was waiting when the relay ended by a ``TimeoutError``: the client's fault (the
        stall bound, or the deadline while the client was not reading), not the replica's."""

    async def __aenter__(self) -> ClientWrites:
        await self._timeout.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.writing = self._since is not None
        await self._timeout.__aexit__(exc_type, exc, tb)

    def begin(self) -> None:
        """A write that may wait starts."""
        self._since = self._progress_at = self._loop.time()
        self._taken = None
        if self._handle is None:
            self._handle = self._loop.call_at(self._since + self._period_s, self._check)

    def end(self) -> None:
        """The write started by :meth:`begin` is done: the client took its bytes."""
        self._since = None

    def taken(self) -> int | None:
        """A count that rises whenever the client takes bytes of the answer (its value means
        nothing else), or ``None`` when not known."""
        return None

    def _check(self) -> None:
        self._handle = None
        if self._since is None or self._timeout.expired():
            return  # no write waits: the next one arms the timer again
        now = self._loop.time()
        taken = self.taken()
        if taken is not None and (self._taken is None or taken > self._taken):
            # bytes taken since the last check (or the first check of this write: counted as
            # progress, since bytes may have been taken before it)
            self._taken = taken
            self._progress_at = now
        if now - self._progress_at >= self._stall_s:
            self.stalled = True
            self._timeout.reschedule(now)  # ends the relay: TimeoutError at the ``async with``
            return
        self._handle = self._loop.call_at(now + self._period_s, self._check)


class HttpWrites(ClientWrites):
    """:class:`ClientWrites` for an aiohttp response: its writes, marked only when the transport
    holds more than its low-water mark (aiohttp's writer waits, in ``drain``, only while the
    transport is paused, which it is only above it), and what the client took read from its TCP
    connection's acknowledged bytes (where the platform tells them; else from the transport's buffer
    going down, which moves only when the kernel's send queue has room)."""

    __slots__ = ("_low", "_socket", "_transport")

    def __init__(self, request: web.Request, deadline: float, stall_s: float) -> None:
        super().__init__(deadline, stall_s)
        transport = request.transport
        self._transport = transport
        self._low = transport.get_write_buffer_limits()[0] if transport is not None else 0
        self._socket: object = None  # looked up at the first check

    def _may_wait(self, size: int) -> bool:
        transport = self._transport
        return transport is not None and transport.get_write_buffer_size() + size > self._low

    def write(self, response: web.StreamResponse, chunk: bytes) -> Awaitable[None]:
        """``response.write(chunk)``, marked as a write that may wait when it may: a plain function
        handing back aiohttp's own coroutine otherwise, so the usual write costs one check and no
        coroutine of its own."""
        if self._may_wait(len(chunk)):
            return self._marked(response.write(chunk))
        return response.write(chunk)

    def write_eof(self, response: web.StreamResponse, chunk: bytes = b"") -> Awaitable[None]:
        """``response.write_eof(chunk)``, marked as :meth:`write` marks a write."""
        if self._may_wait(len(chunk)):
            return self._marked(response.write_eof(chunk))
        return response.write_eof(chunk)

    async def _marked(self, write: Awaitable[None]) -> None:
        self.begin()
        await write
        self.end()

    def taken(self) -> int | None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return None
        acked = self._bytes_acked(transport)
        return acked if acked is not None else -transport.get_write_buffer_size()

    def _bytes_acked(self, transport: asyncio.BaseTransport) -> int | None:
        if _TCP_INFO is None or self._socket is False:
            return None
        sock = self._socket
        if sock is None:
            sock = self._socket = transport.get_extra_info("socket") or False
            if sock is False:
                return None
        end = _BYTES_ACKED_OFFSET + _BYTES_ACKED.size
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, end)  # type: ignore[attr-defined]
        except OSError:
            info = b""
        if len(info) < end:  # not TCP, or a kernel without the field
            self._socket = False
            return None
        acked: int = _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_OFFSET)[0]
        return acked


def drop_connection(request: web.Request) -> None:
    """Close the client's connection at once, dropping what is buffered for it: a client that
    stopped reading its answer. ``SO_LINGER`` of 0 makes the close a reset, so the kernel drops its
    send queue too (a plain close keeps it, megabytes, while it tries to deliver it to a client
    that reads nothing). Left open, the connection kept the unsent bytes and its aiohttp task,
    waiting to finish the answer, for as long as the client kept it open."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
