"""A sibling worker's answer is read up to ``Siblings.max_answer_bytes``: a larger one, declared or
sent, leaves that sibling out (as one that does not answer) and is counted, so a gathered read
holds at most that much a sibling whatever it sends. Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web

from balancer.api.siblings import SiblingAnswerTooLarge, Siblings

LIMIT = 64 * 1024


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _declared(request: web.Request) -> web.Response:
    return web.Response(body=b"x" * int(request.query["size"]))


async def _chunked(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    for _ in range(int(request.query["chunks"])):
        await response.write(b"y" * 16 * 1024)
    await response.write_eof()
    return response


async def test_answers_over_the_cap_are_refused_counted_and_the_rest_read_whole(tmp_path: Path) -> None:
    app = web.Application()
    app.router.add_get("/declared", _declared)
    app.router.add_get("/chunked", _chunked)
    oversize: list[int] = []
    async with serving(app) as url:
        (tmp_path / "worker-1.url").write_text(url)
        siblings = Siblings(
            str(tmp_path), 0, 2, max_answer_bytes=LIMIT, on_oversize=lambda: oversize.append(1)
        )
        await siblings.open()
        try:
            small = await siblings.call("GET", f"/declared?size={LIMIT}")
            assert small[1] == (200, b"x" * LIMIT)  # at the cap: read whole
            declared = await siblings.call("GET", f"/declared?size={LIMIT + 1}")
            assert isinstance(declared[1], SiblingAnswerTooLarge)
            sent = await siblings.call("GET", "/chunked?chunks=64")  # 1 MiB, no Content-Length
            assert isinstance(sent[1], SiblingAnswerTooLarge)
            within = await siblings.call("GET", "/chunked?chunks=3")
            assert within[1] == (200, b"y" * 3 * 16 * 1024)
        finally:
            await siblings.aclose()
    assert len(oversize) == 2
