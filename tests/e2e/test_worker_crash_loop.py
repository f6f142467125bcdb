"""A worker of ``kvlb serve --workers N`` that cannot start again (real worker processes; the
supervisor in this process, with short delays so that the loop takes seconds); and a worker whose
supervisor died before the worker asked the kernel to die with it.

The pool's tokenizer file is removed while the workers serve (an error only a restarted worker
finds), then a worker is killed: it exits 2 at every restart. The supervisor counts it, the worker that
serves says so (``/metrics``, ``/readyz``), and once every worker is in that loop the supervisor gives
up (``kvlb serve`` then exits 2: the orchestrator sees the pod crash-loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tokenizers
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import HoldingEngine, start_serve, stop

from balancer.cli.workers import Supervisor
from balancer.config import Settings, WorkersConfig, jemalloc_found, load_with_source

FAST = WorkersConfig(
    restart_backoff_s=0.05,
    max_restart_backoff_s=0.2,
    restart_window_s=0.001,
    crash_loop_exits=2,
    kill_after_s=2.0,
)
"""Short delays, and a crash loop from the second failed start in a row (each takes a worker's
imports; the window is too short for two exits: tests/e2e/test_serve_worker_restarts.py covers it)."""


def holding_config(tmp: Path, engine: HoldingEngine, **pool: Any) -> Path:
    replicas = [{"id": "h-0", "url": engine.url}]
    pools = [{"model": "sim-test", "kv_events": False, "replicas": replicas, **pool}]
    config = tmp / "kvlb.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, "pools": pools}))
    return config


def supervised(config: Path) -> Supervisor:
    """A supervisor of two workers reading ``config`` (the bytes it parsed), with :data:`FAST`."""
    settings, source = load_with_source(str(config), [])
    return Supervisor(settings, 2, [], supervisor=FAST, config_source=source)


def samples(text: str, name: str) -> dict[str, float]:
    return {
        sample.labels.get("worker", ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


async def wait_for(check: Any, timeout_s: float = 30.0) -> Any:
    """Poll the coroutine function ``check`` until it returns something true (bounded)."""
    async with asyncio.timeout(timeout_s):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                if found := await check():
                    return found
            await asyncio.sleep(0.1)


async def test_a_worker_that_cannot_start_is_counted_and_all_of_them_make_the_supervisor_give_up(
    tmp_path: Path,
) -> None:
    """Before 2026-12-01 worker 1 exported nothing while it failed (it never served), ``/readyz`` said
    nothing of it, and the supervisor restarted every worker for ever."""
    engine = HoldingEngine()
    await engine.start()
    tokenizer = tmp_path / "tokenizer.json"  # a small one: the workers load it at every start
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(tokenizer))
    config = holding_config(tmp_path, engine, tokenizer=str(tokenizer))
    supervisor = supervised(config)
    try:
        async with asyncio.timeout(60):
            await supervisor.start()
        url = supervisor.url
        tokenizer.unlink()  # what a restarted worker loads
        os.kill(supervisor.pids()[1], signal.SIGKILL)
        async with aiohttp.ClientSession(headers={"Connection": "close"}) as session:

            async def worker_1_loops() -> dict[str, float] | None:
                async with session.get(url + "/metrics") as response:
                    text = await response.text()
                restarts = samples(text, "kvlb_process_restarts_total")
                looping = samples(text, "kvlb_process_workers_crash_looping")
                return restarts if restarts.get("1", 0) >= 2 and looping.get("0") == 1 else None

            restarts = await wait_for(worker_1_loops)
            assert restarts["0"] == 0
            async with session.get(url + "/readyz") as response:
                ready = await response.json()
            assert response.status == 200, ready  # worker 0 serves: not a reason to restart the pod
            assert any("worker 1 is in a crash loop" in reason for reason in ready["degraded"]), ready
        assert not supervisor.gave_up.is_set()
        os.kill(supervisor.pids()[0], signal.SIGKILL)
        async with asyncio.timeout(30):
            await supervisor.gave_up.wait()
        error = supervisor.give_up_error()
        assert error.exit_status == 2, error  # settings errors, as `kvlb serve` exits on its own
        assert "every worker exited 2 times in a row before serving" in str(error)
    finally:
        await supervisor.stop()
        await engine.stop()


ORPHANING_SUPERVISOR = """
import os, socket, subprocess, sys
config, run_dir, out = sys.argv[1:4]
sock = socket.create_server(("127.0.0.1", 0))
sock.set_inheritable(True)
argv = [sys.executable, "-m", "balancer", "serve", "--config", config, "--workers", "2",
        "--worker-index", "1", "--listen-fd", str(sock.fileno()), "--run-dir", run_dir,
        "--supervisor-pid", str(os.getpid())]
with open(out, "wb") as stdout:
    worker = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT, pass_fds=(sock.fileno(),))
print(worker.pid, flush=True)
os._exit(0)  # dies at once: long before the worker asks the kernel to die with it
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def test_a_worker_whose_supervisor_died_before_it_asked_to_die_with_it_does_not_serve(
    tmp_path: Path,
) -> None:
    """A supervisor that dies between spawning a worker and the worker's ``prctl(PR_SET_PDEATHSIG)``
    (made to here): the worker exits before serving. Before 2026-12-01 it served on as an orphan
    (its output a file here; on the supervisor's pipe it died as it announced itself)."""
    engine = HoldingEngine()
    await engine.start()
    config = holding_config(tmp_path, engine)
    run_dir, out = tmp_path / "run", tmp_path / "worker.out"
    run_dir.mkdir()
    supervisor = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ORPHANING_SUPERVISOR, str(config), str(run_dir), str(out),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out_text, _ = await supervisor.communicate()
    worker_pid = int(out_text)
    try:
        async with asyncio.timeout(20):
            while alive(worker_pid):  # noqa: ASYNC110 (not our child: no wait() for it)
                await asyncio.sleep(0.05)
        said = out.read_text(errors="replace")
        assert "the supervisor (pid" in said and "is gone" in said, said
        assert "serving" not in said and not (run_dir / "worker-1.url").exists(), said
    finally:
        if alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)
        await engine.stop()


async def test_a_restarted_worker_reads_the_settings_its_supervisor_started_with(tmp_path: Path) -> None:
    """The settings file is edited in place while the workers serve (a ConfigMap updated under a
    running pod: here a pool added), then worker 1 is killed. Its new process must serve what worker
    0 serves. Before 2026-12-01 it read the edited file: the two workers served different pools, and
    a chat for the new model got 200 or 404 by the worker that took the connection."""
    engine = HoldingEngine()
    await engine.start()
    config = holding_config(tmp_path, engine)
    supervisor = supervised(config)
    try:
        async with asyncio.timeout(60):
            await supervisor.start()
        edited = yaml.safe_load(config.read_text())
        added = [{**edited["pools"][0]["replicas"][0], "id": "h-1"}]
        edited["pools"].append({**edited["pools"][0], "model": "added-later", "replicas": added})
        config.write_text(yaml.safe_dump(edited))
        killed = supervisor.pids()[1]
        os.kill(killed, signal.SIGKILL)
        async with asyncio.timeout(60):
            while supervisor.pids()[1] in (0, killed):  # noqa: ASYNC110 (no event for a respawn)
                await asyncio.sleep(0.05)
            await supervisor.workers[1].ready.wait()  # the new process's
        models: dict[int, list[str]] = {}
        async with aiohttp.ClientSession() as session:
            for index in (0, 1):
                private = (Path(supervisor.run_dir) / f"worker-{index}.url").read_text()
                async with session.get(private + "/v1/models", headers={"x-kvlb-sibling": "1"}) as response:
                    models[index] = sorted(m["id"] for m in (await response.json())["data"])
        assert models == {0: ["sim-test"], 1: ["sim-test"]}
    finally:
        await supervisor.stop()
        await engine.stop()


def feed_fifo(fifo: Path, first: bytes, later: bytes, opens: int) -> None:
    """Answer each of the next ``opens`` readers of ``fifo``: ``first`` to the first, ``later`` to
    the others (blocks until a reader opens it; the test unblocks it at its end). Before the second,
    waits (bounded) until the first reader closed its end, so that it reads ``first`` alone."""
    for index in range(opens):
        with contextlib.suppress(BrokenPipeError), fifo.open("wb") as file:  # the test's unblocking
            file.write(first if index == 0 else later)
        for _ in range(3000 if index == 0 else 0):  # 30 s at most
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader still has it open
            except OSError:  # ENXIO: no reader
                break
            time.sleep(0.01)


@pytest.mark.parametrize("allocator", ["system", "auto"])
async def test_the_workers_read_the_bytes_the_supervisor_parsed_not_the_file_again(
    tmp_path: Path, allocator: str
) -> None:
    """The settings file gives other bytes at each read (a FIFO: ``--config <(...)``, or a file edited
    between the supervisor's read and its copy, here made certain). Every worker must serve what was
    read first. Before 2026-12-01 (h-lifecycle3) the supervisor copied the file again at its start:
    here that failed (``cannot read config``, exit 2); a regular file edited in those milliseconds
    gave the workers the edit. With ``allocator: auto`` and jemalloc installed ``kvlb serve``
    re-executes itself, and the new image read the file again: the later bytes (from a pipe,
    nothing: it served no pool, on the default port)."""
    if allocator == "auto" and not jemalloc_found(Settings().jemalloc_library):
        pytest.skip("jemalloc is not installed: kvlb serve does not re-execute itself")
    engine = HoldingEngine()
    await engine.start()
    fifo = tmp_path / "kvlb.yaml"
    os.mkfifo(fifo)
    replicas = [{"id": "h-0", "url": engine.url}]

    def settings(model: str) -> bytes:
        pools = [{"model": model, "kv_events": False, "replicas": replicas}]
        top = {"listen": {"host": "127.0.0.1", "port": 0}, "allocator": allocator, "pools": pools}
        return yaml.safe_dump(top).encode()

    feeder = asyncio.create_task(
        asyncio.to_thread(feed_fifo, fifo, settings("first-read"), settings("later-read"), 4)
    )
    serve = None
    try:
        serve = await start_serve(tmp_path, fifo, "--workers", "2")
        models: dict[int, list[str]] = {}
        async with aiohttp.ClientSession() as session:
            for index, pid in enumerate(serve.info["worker_pids"]):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")  # noqa: ASYNC240
                run_dir = Path(argv[argv.index(b"--run-dir") + 1].decode())
                private = (run_dir / f"worker-{index}.url").read_text()
                async with session.get(private + "/v1/models", headers={"x-kvlb-sibling": "1"}) as response:
                    models[index] = sorted(m["id"] for m in (await response.json())["data"])
        assert models == {0: ["first-read"], 1: ["first-read"]}
    finally:
        if serve is not None:
            await stop(serve)
        for _ in range(200):  # let the feeder's pending opens through (bounded)
            if feeder.done():
                break
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            await asyncio.sleep(0.02)
        async with asyncio.timeout(5):
            await feeder
        await engine.stop()
