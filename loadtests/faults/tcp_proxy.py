"""A loopback TCP proxy with adjustable latency, to make Redis slow or cut a replica's replay path
(fault-rig helper, I/O).

Every chunk read from either side is held ``delay_s`` before it is written on (each direction in
order), so one Redis round trip costs about twice the delay. ``cut()`` closes every open connection.
``pause()`` holds every chunk (connections are still accepted) until ``resume()``: a network partition
whose packets get through once it heals, as TCP retransmits them.
"""

from __future__ import annotations

import asyncio
import contextlib


class DelayProxy:
    def __init__(self, target_port: int, delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._open = asyncio.Event()
        self._open.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def pause(self) -> None:
        """Hold every chunk from now on until :meth:`resume`."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def cut(self) -> None:
        for writer in list(self._writers):
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while chunk := await source.read(65536):
                if self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                await self._open.wait()
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(sink)
            with contextlib.suppress(Exception):
                sink.close()
