"""Processes for the end-to-end tests: ``kvlb emulate`` replicas and ``kvlb serve``, on 127.0.0.1.

Every process is started with a bounded wait for its "ready" JSON line and always stopped (SIGTERM,
then SIGKILL) by :func:`stop`; stderr goes to a file under the test's ``tmp_path`` so a failure can
show it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

START_TIMEOUT_S = 60.0
"""How long a child may take to announce itself. A loaded machine (CPU burners, load 9-13) took
26 s from ``kvlb serve``'s first log line to listening, and over 30 s more than once."""
STOP_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 30.0
"""How long ``kvlb serve`` may take, after it listens, to find a replica healthy (a loaded CI
machine once answered a chat sent the moment it listened with 503: no healthy replica yet)."""
MODEL = "sim-test"


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    stderr: Path
    info: dict[str, Any]

    def log_tail(self, lines: int = 30) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


async def _spawn(name: str, args: list[str], tmp: Path, key: str) -> Child:
    stderr = tmp / f"{name}.stderr"
    with stderr.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "balancer", *args, stdout=asyncio.subprocess.PIPE, stderr=err
        )
    child = Child(name, process, stderr, {})
    assert process.stdout is not None
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while line := await process.stdout.readline():
                text = line.decode().strip()
                if text.startswith("{") and key in text:
                    child.info = json.loads(text)
                    return child
    except TimeoutError:
        pass
    await stop(child)
    raise AssertionError(f"{name} did not start:\n{child.log_tail()}")


async def start_sim(index: int, tmp: Path, time_scale: float = 0.5) -> Child:
    """One emulated SGLang replica named ``sim-<index>`` in its own process, with the default
    tokenizer (the same one ``kvlb serve`` uses for a pool without ``tokenizer``)."""
    args = [
        "emulate", "--replicas", "1", "--index-offset", str(index), "--engine", "sglang",
        "--profile", "cpu-test", "--time-scale", str(time_scale),
    ]  # fmt: skip
    child = await _spawn(f"sim-{index}", args, tmp, '"replicas"')
    child.info = child.info["replicas"][0]
    return child


def write_config(tmp: Path, sims: list[Child], **top: Any) -> Path:
    """A ``kvlb.yaml`` for one pool over ``sims`` (tokenizer: the default DeepSeek-V3)."""
    replicas = [
        {
            "id": sim.info["name"],
            "url": sim.info["url"],
            "engine": "sglang",
            "block_size": sim.info["block_size"],
            "events": sim.info["events"][0],
            "replay": sim.info["replay"][0],
        }
        for sim in sims
    ]
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": replicas}],
        "policy": {"seed": 3},
        **top,
    }
    path = tmp / "kvlb.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def start_serve(tmp: Path, config: Path, *extra: str) -> Child:
    child = await _spawn("serve", ["serve", "--config", str(config), *extra], tmp, '"serving"')
    return child


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    """Poll ``url``'s ``/readyz`` until 200: every pool has a healthy replica (bounded)."""
    async with asyncio.timeout(READY_TIMEOUT_S):
        while True:
            async with session.get(url + "/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.05)


async def stop(child: Child) -> int:
    """SIGTERM, wait (bounded), SIGKILL if needed; returns the exit code."""
    process = child.process
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode


async def kill(child: Child) -> None:
    """SIGKILL: the process dies without closing anything gracefully."""
    if child.process.returncode is None:
        child.process.kill()
        await child.process.wait()


class HoldingEngine:
    """A stand-in engine (a real HTTP server, not a kvlb part): answers probes and quick chats at
    once, and holds a chat that says ``hold`` after its first SSE chunk until :attr:`let_go` is set,
    so that the request stays in flight on the worker that took it."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.let_go = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/{tail:.*}", self.ok)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "x", "object": "chat.completion.chunk", "model": body["model"]}
        chunk["choices"] = [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if "hold" in json.dumps(body["messages"]):
            self.held.set()
            await self.let_go.wait()
        await response.write(b"data: [DONE]\n\n")
        return response

    async def stop(self) -> None:
        self.let_go.set()
        if self.runner is not None:
            await self.runner.cleanup()
