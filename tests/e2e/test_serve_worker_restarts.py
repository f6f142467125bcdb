"""A worker of a real ``kvlb serve --workers 2`` that serves and then keeps dying (SIGKILLed by pid
from the test, as an OOM kill or a crashing request would): its restart delay grows with its exits
within ``workers.restart_window_s``, it is a crash loop after ``workers.crash_loop_exits`` of them
(``/readyz`` ``degraded``, ``kvlb_process_workers_crash_looping``), a quiet window resets both, the
other worker serves throughout, and once both keep dying ``kvlb serve`` exits 1.

Small settings keep it short; it still takes about 20-30 s: four starts of worker 1 (1-5 s each on
a loaded machine), and the quiet window, which must outlast a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tokenizers
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import Child, HoldingEngine, start_serve, stop

BACKOFF_S = 0.3
WINDOW_S = 10.0
WORKERS = {
    "restart_backoff_s": BACKOFF_S,
    "max_restart_backoff_s": 2.0,
    "restart_window_s": WINDOW_S,
    "crash_loop_exits": 2,
    "kill_after_s": 2.0,
}


def write_config(tmp: Path, engine: HoldingEngine) -> Path:
    tokenizer = tmp / "tokenizer.json"  # a small one: a worker starts faster than with the default
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(tokenizer))
    replicas = [{"id": "h-0", "url": engine.url}]
    pools = [{"model": "sim-test", "kv_events": False, "tokenizer": str(tokenizer), "replicas": replicas}]
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": pools,
        "allocator": "system",
        "workers": WORKERS,
    }
    path = tmp / "kvlb.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def worker_pids(supervisor: int) -> dict[int, int]:
    """The supervisor's live children by worker index (``--worker-index``), read from /proc."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != supervisor or fields[0] == "Z":
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            found[int(argv[argv.index(b"--worker-index") + 1])] = int(entry)
    return found


def run_dir_of(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"--run-dir") + 1].decode())


async def respawned(supervisor: int, index: int, old: int, timeout_s: float = 30.0) -> int:
    """The pid of worker ``index``'s new process, once the supervisor spawned it (polled, bounded)."""
    async with asyncio.timeout(timeout_s):
        while (pid := worker_pids(supervisor).get(index, old)) == old:  # noqa: ASYNC110 (no event)
            await asyncio.sleep(0.01)
    return pid


async def serving(session: aiohttp.ClientSession, run_dir: Path, index: int, old_url: str) -> str:
    """Worker ``index``'s private URL once its new process announced itself (bounded)."""
    async with asyncio.timeout(60):
        while True:
            with contextlib.suppress(OSError, aiohttp.ClientError):
                url = (run_dir / f"worker-{index}.url").read_text().strip()
                if url and url != old_url:
                    async with session.get(url + "/healthz") as response:
                        if response.status == 200:
                            return url
            await asyncio.sleep(0.05)


async def readiness(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any], float]:
    async with session.get(url + "/readyz") as response:
        ready = await response.json()
        status = response.status
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    looping = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvlb_process_workers_crash_looping"
    ]
    return status, ready, max(looping)


def logged_delays(serve: Child) -> list[tuple[float, int]]:
    """The supervisor's ``restarting in X s (restart N)`` lines for worker 1."""
    text = serve.stderr.read_text(errors="replace")
    line = re.compile(r"worker 1 \(pid \d+\) exited .*?restarting in ([\d.]+)s \(restart (\d+)\)")
    return [(float(m[1]), int(m[2])) for m in line.finditer(text)]


@pytest.mark.faults_long  # make faults: 14 s of worker starts, past make test's budget
async def test_a_worker_that_serves_then_keeps_dying_backs_off_is_a_crash_loop_and_recovers(
    tmp_path: Path,
) -> None:
    """Before 2026-12-01 (h-lifecycle3) such a worker was restarted for ever, never counted as a
    crash loop (only exits before serving were), and ``kvlb serve`` never gave up."""
    engine = HoldingEngine()
    await engine.start()
    serve = await start_serve(tmp_path, write_config(tmp_path, engine), "--workers", "2")
    supervisor = serve.info["pid"]
    answered, failed, stop_client = 0, 0, asyncio.Event()
    try:
        run_dir = run_dir_of(serve.info["worker_pids"][0])
        url = serve.info["url"]
        async with aiohttp.ClientSession(headers={"Connection": "close"}) as session:
            worker_0 = await serving(session, run_dir, 0, "")

            async def client() -> None:  # on worker 0's own port: none of its requests may be lost
                nonlocal answered, failed
                chat = {"model": "sim-test", "messages": [{"role": "user", "content": "hi"}], "stream": True}
                for _ in range(10_000):
                    if stop_client.is_set():
                        return
                    try:
                        async with session.post(worker_0 + "/v1/chat/completions", json=chat) as response:
                            await response.read()
                            answered += response.status == 200
                            failed += response.status != 200
                    except aiohttp.ClientError:
                        failed += 1
                    await asyncio.sleep(0.02)

            client_task = asyncio.create_task(client())
            spawn_delays: list[float] = []
            worker_1 = await serving(session, run_dir, 1, "")
            kills: list[float] = []
            for exits in (1, 2):  # serves, dies: two exits within the window
                pid = worker_pids(supervisor)[1]
                os.kill(pid, signal.SIGKILL)
                kills.append(time.monotonic())
                await respawned(supervisor, 1, pid)
                spawn_delays.append(time.monotonic() - kills[-1])
                if exits == 1:
                    worker_1 = await serving(session, run_dir, 1, worker_1)
            status, ready, looping = await readiness(session, url)  # within the window
            assert status == 200 and looping == 1, (status, ready, looping)
            loop_reason = "worker 1 is in a crash loop: it exited 2 times in the last 10 s"
            assert any(loop_reason in reason for reason in ready["degraded"]), ready
            assert logged_delays(serve) == [(BACKOFF_S, 1), (0.6, 2)], serve.log_tail()
            wanted = (0.3, 0.6)
            assert all(d >= want - 0.02 for d, want in zip(spawn_delays, wanted, strict=True)), spawn_delays
            assert "2 exits in the last 10 s: a crash loop" in serve.stderr.read_text(), serve.log_tail()
            worker_1 = await serving(session, run_dir, 1, worker_1)
            async with asyncio.timeout(WINDOW_S + 15):  # the first exit left the window: out of the loop
                while (await readiness(session, url))[2] != 0:  # noqa: ASYNC110 (a scrape)
                    await asyncio.sleep(0.2)
            status, ready, looping = await readiness(session, url)
            assert status == 200 and not ready.get("degraded") and looping == 0, ready
            await asyncio.sleep(max(0.0, kills[-1] + WINDOW_S + 0.2 - time.monotonic()))
            pid = worker_pids(supervisor)[1]
            os.kill(pid, signal.SIGKILL)  # a quiet window after its last exit: the first delay again
            kills.append(time.monotonic())
            await respawned(supervisor, 1, pid)
            assert logged_delays(serve)[-1] == (BACKOFF_S, 3), serve.log_tail()
            await serving(session, run_dir, 1, worker_1)
            stop_client.set()
            await client_task
        assert failed == 0 and answered > 20, (answered, failed)
        assert kills[2] - kills[1] >= WINDOW_S, kills
        # both workers keep dying (killed as soon as the supervisor spawns them): it gives up
        async with asyncio.timeout(60):
            while serve.process.returncode is None:
                for pid in worker_pids(supervisor).values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await serve.process.wait()
        assert serve.process.returncode == 1, serve.log_tail()
        assert "giving up" in serve.stderr.read_text(), serve.log_tail()
    finally:
        stop_client.set()
        await stop(serve)
        await engine.stop()
