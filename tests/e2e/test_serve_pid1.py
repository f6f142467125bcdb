"""``kvlb serve`` as PID 1 of a PID namespace, as in its container: directly and under tini (real
processes in a namespace made by ``unshare``; no Docker).

The kernel gives PID 1 of a PID namespace no signal it has no handler for, from a sender in an
ancestor namespace too (the container runtime's ``docker stop``, the kubelet's SIGTERM); only SIGKILL
and SIGSTOP are forced. ``kvlb serve`` takes SIGTERM 30–74 ms after its spawn (the interpreter's
start): as PID 1 it lost a SIGTERM sent before then, started and served until the SIGKILL at the end
of the grace. And PID 1 inherits every process orphaned in the namespace (a ``docker exec``'s or
``kubectl exec``'s background child) and must reap it: kvlb waits for its own workers only, so each
such orphan stayed a zombie. The image runs kvlb under Debian's ``tini`` (the Dockerfile's
``ENTRYPOINT``, since 2026-12-01): tini blocks every signal before it spawns kvlb, forwards each to
kvlb (not to its process group: the supervisor of ``--workers N`` signals its workers itself) and
reaps every orphan.

The tests need ``unshare`` (util-linux) to be allowed to make a PID namespace (as root, else in a user
namespace of its own) and ``tini`` (``make tini``); without either they are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from serve_harness import START_TIMEOUT_S, HoldingEngine, wait_ready

CONSOLE_SCRIPT = "import sys; from balancer.cli.main import main; sys.argv[0] = 'kvlb'; sys.exit(main())"
"""What the installed ``kvlb`` command runs."""

NAMESPACE_FORMS = (
    ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"),
    ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"),
)
"""A new PID namespace whose PID 1 is the command (as root; else in a user namespace of its own).
``--kill-child``: the namespace dies with ``unshare``, even one killed with SIGKILL."""

SPAWN_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 15.0
ATTEMPTS = 5
"""Spawns the first test may make until one SIGTERM verifiably arrives before kvlb's handler."""
ORPHAN_SLEEP_S = 0.3
"""How long the orphan lives (seconds) before it exits and must be reaped."""


@functools.cache
def namespace_form() -> tuple[tuple[str, ...] | None, str]:
    """The first of :data:`NAMESPACE_FORMS` allowed here, else ``None`` and why not."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return None, "unshare and nsenter (util-linux) are not installed"
    refusals = []
    for form in NAMESPACE_FORMS:
        try:
            result = subprocess.run([*form, "true"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            refusals.append(f"{' '.join(form)}: {exc}")
            continue
        if result.returncode == 0:
            return form, ""
        refusals.append(f"{' '.join(form)}: {result.stderr.strip() or result.returncode}")
    return None, "no PID namespace can be made here (" + "; ".join(refusals) + ")"


def unshare() -> tuple[str, ...]:
    form, reason = namespace_form()
    if form is None:
        pytest.skip(reason)
    return form


def tini() -> str:
    path = shutil.which("tini")
    if path is None:
        pytest.skip("tini is not installed (make tini installs Debian's)")
    return path


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` of /proc/<pid>/status)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def executes(pid: int, path: str) -> bool:
    """Whether process ``pid`` runs the program ``path`` (it has exec'd it)."""
    try:
        return os.readlink(f"/proc/{pid}/exe") == path
    except OSError:
        return False


def name_and_state(pid: int) -> tuple[str, str]:
    """(command name, state letter) of process ``pid``; ("", "") once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", ""
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.0001) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(poll_s)


@dataclass
class Pid1:
    """A command run as PID 1 of a new PID namespace."""

    outer: subprocess.Popen[bytes]
    """``unshare``, outside: its exit status is the command's."""
    init: int
    """The command's process id outside the namespace (1 inside)."""
    spawned: float
    stdout: Path
    stderr: Path

    def out(self) -> str:
        return self.stdout.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.stderr.read_text(errors="replace").splitlines()[-lines:])

    def finish(self) -> None:
        """SIGKILL (forced into PID 1 from outside) if still running, and wait for ``unshare``."""
        if self.outer.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init, signal.SIGKILL)
            try:
                self.outer.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.outer.kill()
                self.outer.wait()


def spawn_pid1(argv: Sequence[str], tmp: Path, name: str) -> Pid1:
    stdout, stderr = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        spawned = time.monotonic()
        outer = subprocess.Popen([*unshare(), *argv], stdout=out, stderr=err)
    try:
        wait_until(lambda: bool(children(outer.pid)) or outer.poll() is not None, SPAWN_TIMEOUT_S, "fork")
    except AssertionError:
        outer.kill()
        outer.wait()
        raise
    kids = children(outer.pid)
    assert kids, f"unshare exited with {outer.returncode}: {stderr.read_text(errors='replace')}"
    return Pid1(outer, kids[0], spawned, stdout, stderr)


def kvlb_serve(config: Path, workers: int) -> list[str]:
    return [sys.executable, "-c", CONSOLE_SCRIPT, "serve", "--config", str(config), "--workers", str(workers)]


def write_config(tmp: Path, url: str = "http://127.0.0.1:9") -> Path:
    """One pool of one replica (by default on the discard port: nothing answers, kvlb serves anyway)."""
    pool = {"model": "sim-test", "kv_events": False, "replicas": [{"id": "h-0", "url": url}]}
    config = tmp / "kvlb.yaml"
    config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": 0}, "pools": [pool]}))
    return config


def serving(pid1: Pid1, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
    """kvlb's ``serving`` line (bounded; fails if the namespace ends first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid1.outer.poll() is None:
        for line in pid1.out().splitlines():
            if '"serving"' in line:
                info: dict[str, Any] = json.loads(line)
                return info
        time.sleep(0.05)
    raise AssertionError(f"not serving (exit {pid1.outer.poll()}):\n{pid1.log_tail()}")


def orphan_in(pid1: Pid1) -> int:
    """Leave a process orphaned in the namespace, as a ``docker exec`` whose shell backgrounded it and
    exited: it is re-parented to PID 1 and exits :data:`ORPHAN_SLEEP_S` later. Its pid outside."""
    before = set(children(pid1.init))
    shell = f"sleep {ORPHAN_SLEEP_S} & exit 0"
    subprocess.run(
        ["nsenter", "--target", str(pid1.init), "--all", "sh", "-c", shell], check=True, timeout=30
    )
    (orphan,) = set(children(pid1.init)) - before  # the shell has exited: its child is PID 1's now
    return orphan


def test_kvlb_as_pid1_loses_an_early_sigterm_and_leaves_orphans_unreaped(tmp_path: Path) -> None:
    """What the image's init is for: ``kvlb serve --workers 1`` itself as PID 1. A SIGTERM sent once
    it runs Python but before its handler (checked: no handler right after the signal was sent) is
    lost: it goes on to serve. An orphan re-parented to it stays a zombie. A SIGTERM once it
    handles it still stops it with 0."""
    config = write_config(tmp_path)
    python = os.path.realpath(sys.executable)
    for attempt in range(ATTEMPTS):
        pid1 = spawn_pid1(kvlb_serve(config, 1), tmp_path, f"direct-{attempt}")
        try:
            runs_python = functools.partial(executes, pid1.init, python)
            wait_until(runs_python, SPAWN_TIMEOUT_S, "exec of python")
            os.kill(pid1.init, signal.SIGTERM)
            sent_ms = (time.monotonic() - pid1.spawned) * 1000
            if catches(pid1.init, signal.SIGTERM):  # its handler may have been in first: not this case
                continue
            info = serving(pid1)
            assert pid1.outer.poll() is None, f"SIGTERM {sent_ms:.1f} ms after spawn:\n{pid1.log_tail()}"
            assert info["url"].startswith("http://127.0.0.1:")
            orphan = orphan_in(pid1)
            time.sleep(ORPHAN_SLEEP_S + 1.0)
            assert name_and_state(orphan) == ("sleep", "Z")  # never reaped
            assert orphan in children(pid1.init)
            os.kill(pid1.init, signal.SIGTERM)  # handled now
            assert pid1.outer.wait(timeout=STOP_TIMEOUT_S) == 0, pid1.log_tail()
            return
        finally:
            pid1.finish()
    pytest.fail(f"kvlb had its SIGTERM handler before the signal in each of {ATTEMPTS} spawns")


def kvlb_spawned(pid1: Pid1, python: str) -> int:
    """kvlb's pid once it is spawned: PID 1 itself once it runs Python, else PID 1's child (tini's,
    in its first instructions). 0 until then."""
    if executes(pid1.init, python):
        return pid1.init
    kids = children(pid1.init)
    return kids[0] if kids else 0


def test_under_tini_a_sigterm_before_kvlbs_handler_ends_it_at_once(tmp_path: Path) -> None:
    """The image's ``tini -- kvlb serve``: tini blocks every signal before it spawns kvlb, so a SIGTERM
    sent as soon as kvlb is spawned (before its handler: checked right after the signal was sent) is
    kept and forwarded. kvlb ends at once: 143 (killed by the forwarded SIGTERM in its interpreter's
    start) or 0 (its early handler), and never serves. Without tini the same signal is lost (the test
    above)."""
    config = write_config(tmp_path)
    python = os.path.realpath(sys.executable)
    for attempt in range(ATTEMPTS):
        pid1 = spawn_pid1([tini(), "--", *kvlb_serve(config, 1)], tmp_path, f"tini-{attempt}")
        try:
            spawned = functools.partial(kvlb_spawned, pid1, python)
            wait_until(spawned, SPAWN_TIMEOUT_S, "the spawn of kvlb")
            kvlb = spawned()
            os.kill(pid1.init, signal.SIGTERM)
            sent = time.monotonic()
            if catches(kvlb, signal.SIGTERM):  # its handler may have been in first: not this case
                continue
            sent_ms = (sent - pid1.spawned) * 1000
            try:
                code = pid1.outer.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            took_s = time.monotonic() - sent
            context = f"SIGTERM {sent_ms:.1f} ms after spawn, exit {code} {took_s:.2f} s later:\n"
            assert code in (143, 0), context + pid1.log_tail()
            assert '"serving"' not in pid1.out(), context + pid1.log_tail()
            assert took_s < 5, context + pid1.log_tail()
            return
        finally:
            pid1.finish()
    pytest.fail(f"kvlb had its SIGTERM handler before the signal in each of {ATTEMPTS} spawns")


async def test_workers_under_tini_drain_on_sigterm_and_orphans_are_reaped(tmp_path: Path) -> None:
    """``tini -- kvlb serve --workers 2`` as PID 1, a stream in flight: an orphan re-parented to
    tini is reaped once it exits; a SIGTERM to PID 1 reaches the supervisor, which stops its workers:
    the stream still ends with ``[DONE]``, and kvlb exits 0 (tini passes the status on)."""
    init = [tini(), "--"]
    engine = HoldingEngine()
    await engine.start()
    config = write_config(tmp_path, engine.url)
    pid1 = spawn_pid1([*init, *kvlb_serve(config, 2)], tmp_path, "workers")
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while '"serving"' not in pid1.out():
                assert pid1.outer.returncode is None and pid1.outer.poll() is None, pid1.log_tail()
                await asyncio.sleep(0.05)
        info = serving(pid1, 1)
        assert len(info["worker_pids"]) == 2
        orphan = orphan_in(pid1)
        async with asyncio.timeout(5 + ORPHAN_SLEEP_S):  # reaped: gone, not a zombie
            while name_and_state(orphan)[0]:  # noqa: ASYNC110 (no event tells of a reaping)
                await asyncio.sleep(0.01)
        body = {"model": "sim-test", "stream": True, "messages": [{"role": "user", "content": "hold"}]}
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, info["url"])
            async with session.post(info["url"] + "/v1/chat/completions", json=body) as response:
                async with asyncio.timeout(10):
                    await engine.held.wait()
                os.kill(pid1.init, signal.SIGTERM)
                await asyncio.sleep(0.5)  # the stop has begun and waits for the stream
                assert pid1.outer.poll() is None, pid1.log_tail()
                engine.let_go.set()
                async with asyncio.timeout(10):
                    streamed = await response.read()
        assert streamed.rstrip().endswith(b"data: [DONE]"), streamed
        async with asyncio.timeout(STOP_TIMEOUT_S):
            while pid1.outer.poll() is None:  # noqa: ASYNC110 (a Popen has no awaitable exit)
                await asyncio.sleep(0.05)
        assert pid1.outer.returncode == 0, pid1.log_tail()
        log = pid1.stderr.read_text(errors="replace")
        assert "signal received: stopping 2 workers" in log, pid1.log_tail()
        assert log.count("signal received: draining") == 2, pid1.log_tail()
    finally:
        pid1.finish()
        await engine.stop()
