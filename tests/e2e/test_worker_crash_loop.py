"""A worker of ``kvlb serve --workers N`` that cannot start again (real worker processes; the
supervisor in this process, with short delays so that the loop takes seconds); and a worker whose
supervisor died before the worker asked the kernel to die with it.

The config file is broken while the workers serve (a settings error only a restarted worker finds),
then a worker is killed: it exits 2 at every restart. The supervisor counts it, the worker that
serves says so (``/metrics``, ``/readyz``), and once every worker is in that loop the supervisor gives
up (``kvlb serve`` then exits 2: the orchestrator sees the pod crash-loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import HoldingEngine

from balancer.cli.workers import Supervisor, SupervisorSettings
from balancer.config import load

FAST = SupervisorSettings(
    restart_backoff_s=0.05, max_restart_backoff_s=0.2, give_up_after_failed_starts=2, kill_after_s=2.0
)


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
    pool = {"model": "sim-test", "kv_events": False, "replicas": [{"id": "h-0", "url": engine.url}]}
    config = tmp_path / "kvlb.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, "pools": [pool]}))
    supervisor = Supervisor(load(str(config), []), 2, ["--config", str(config)], supervisor=FAST)
    try:
        async with asyncio.timeout(60):
            await supervisor.start()
        url = supervisor.url
        config.write_text("listen: {port: not-a-port}\n")  # what a restarted worker reads
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
    pool = {"model": "sim-test", "kv_events": False, "replicas": [{"id": "h-0", "url": engine.url}]}
    config = tmp_path / "kvlb.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, "pools": [pool]}))
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
