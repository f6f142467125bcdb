"""SIGTERM in the first tenths of a second of ``kvlb serve`` (real processes).

Before 2026-12-01 ``kvlb serve`` took SIGTERM only once its event loop ran, after its imports and
the jemalloc re-execution (1.0–1.6 s measured with ``--workers 1``): one sent before ended it with
the default action, exit 143 (-15 to a parent). Now the first thing it does is take SIGTERM and
SIGINT and exit 0, and the re-execution keeps both blocked until the new image takes them.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

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
