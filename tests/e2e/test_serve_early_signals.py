"""SIGTERM in the first tenths of a second of ``kvlb serve`` (real processes).

Before 2026-12-01 ``kvlb serve`` took SIGTERM only once its event loop ran, after its imports and
the jemalloc re-execution (1.0–1.6 s measured with ``--workers 1``): one sent before ended it with
the default action, exit 143 (-15 to a parent). Now the first thing it does is take SIGTERM and
SIGINT and exit 0, and the re-execution keeps both blocked until the new image takes them. And
SIGHUP (kvlb has no reload) is ignored, with a warning once the event loop runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import yaml
from serve_harness import HoldingEngine

CONSOLE_SCRIPT = "import sys; from balancer.cli.main import main; sys.argv[0] = 'kvlb'; sys.exit(main())"
"""What the installed ``kvlb`` command runs."""


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` of /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


async def test_a_sigterm_as_soon_as_serve_takes_it_ends_it_with_0_before_it_serves(tmp_path: Path) -> None:
    """The SIGTERM is sent the moment the process catches it: before the fix that was once its
    event loop ran, and it then started serving before it stopped."""
    engine = HoldingEngine()
    await engine.start()
    pool = {"model": "sim-test", "kv_events": False, "replicas": [{"id": "h-0", "url": engine.url}]}
    config = tmp_path / "kvlb.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, "pools": [pool]}))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CONSOLE_SCRIPT, "serve", "--config", str(config), "--workers", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        started = time.monotonic()
        async with asyncio.timeout(30):
            while process.returncode is None and not catches(process.pid, signal.SIGTERM):  # noqa: ASYNC110
                await asyncio.sleep(0.002)  # (no event tells a parent its child installed a handler)
        caught_after_s = time.monotonic() - started
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            out, err = await process.communicate()
        assert process.returncode == 0, (caught_after_s, err.decode(errors="replace")[-2000:])
        assert b"serving" not in out, (caught_after_s, out)
        assert b"Traceback" not in err, err.decode(errors="replace")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await engine.stop()


async def test_the_reexecution_keeps_a_sigterm_until_the_new_image_takes_it() -> None:
    """The first image takes SIGTERM, then re-executes itself: a SIGTERM that arrives while the new
    image starts (here: before it installs its handler, 0.5 s after it said so) waits, blocked,
    and ends it with 0 once the handler is in. A plain ``os.execve`` left the new image with the
    default action: -15."""
    new_image = (
        "import sys, time\n"
        "print('started', flush=True)\n"
        "time.sleep(0.5)\n"
        "from balancer.cli import early_signals\n"
        "early_signals.install()\n"
        "time.sleep(10)\n"
        "raise SystemExit(3)\n"
    )
    first_image = (
        "import os, sys\n"
        "from balancer.cli import early_signals\n"
        "early_signals.install()\n"
        "argv = [sys.executable, '-c', sys.argv[1]]\n"
        "early_signals.exec_keeping_signals(sys.executable, argv, os.environ)\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", first_image, new_image, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            assert await process.stdout.readline() == b"started\n"
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = await process.wait()
        assert code == 0
        assert time.monotonic() - sent < 5  # at the handler's install, not at the end of the sleep
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


DEFAULT_SIGHUP = (
    "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'balancer', *sys.argv[1:]])"
)
"""``kvlb serve`` with SIGHUP's default action, as from a shell (a test run under ``nohup`` would
hand its children SIGHUP ignored, and the test would pass without the fix)."""


async def test_sighup_leaves_every_process_serving_and_the_stream_whole(tmp_path: Path) -> None:
    """SIGHUP to the supervisor of ``--workers 2`` and to its workers, a stream in flight: no
    process dies, the stream ends with ``[DONE]``, and SIGTERM still stops them with 0. Before
    2026-12-01 SIGHUP's default action killed the supervisor, the kernel then SIGKILLed the workers,
    and every stream in flight was cut (6 of 6 within 0.5 s when walked)."""
    engine = HoldingEngine()
    await engine.start()
    pool = {"model": "sim-test", "kv_events": False, "replicas": [{"id": "h-0", "url": engine.url}]}
    config = tmp_path / "kvlb.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, "pools": [pool]}))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DEFAULT_SIGHUP, "serve", "--config", str(config), "--workers", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    try:
        async with asyncio.timeout(60):
            info = json.loads(await process.stdout.readline())
        body = {"model": "sim-test", "stream": True, "messages": [{"role": "user", "content": "hold"}]}
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(30):  # a healthy replica first
                while True:
                    async with session.get(info["url"] + "/readyz") as response:
                        if response.status == 200:
                            break
                    await asyncio.sleep(0.1)
            async with session.post(info["url"] + "/v1/chat/completions", json=body) as response:
                async with asyncio.timeout(10):
                    await engine.held.wait()
                for pid in (process.pid, *info["worker_pids"]):
                    os.kill(pid, signal.SIGHUP)
                await asyncio.sleep(0.5)
                assert process.returncode is None
                assert all(alive(pid) for pid in info["worker_pids"])
                engine.let_go.set()
                async with asyncio.timeout(10):
                    streamed = await response.read()
        assert streamed.rstrip().endswith(b"data: [DONE]"), streamed
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await process.communicate()
        assert process.returncode == 0, err.decode(errors="replace")[-2000:]
        assert err.count(b"SIGHUP ignored") == 3, err.decode(errors="replace")[-2000:]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await engine.stop()
