"""Small aiohttp helpers shared by the HTTP sources (does I/O)."""

from __future__ import annotations

import aiohttp


class BodyTooLarge(Exception):
    """A response body exceeded the caller's byte limit."""


async def read_capped(resp: aiohttp.ClientResponse, limit_bytes: int) -> bytes:
    """The whole body of ``resp``, or :class:`BodyTooLarge` past ``limit_bytes`` (read no further)."""
    if resp.content_length is not None and resp.content_length > limit_bytes:
        raise BodyTooLarge(f"body of {resp.content_length} bytes exceeds {limit_bytes}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(65536):
        size += len(chunk)
        if size > limit_bytes:
            raise BodyTooLarge(f"body exceeds {limit_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
