"""``loadtests.fleet.child_process``, the one child process of the load tools, with real
subprocesses: the announcement is read, a child that exits or stays silent is stopped and named in
:class:`ChildFailed` with its stderr tail, and a child that ignores SIGTERM is killed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from loadtests.fleet.child_process import ChildFailed, python_module, spawn, stop_all

ANNOUNCE = """
import json, signal, sys, time
print("noise", flush=True)
print(json.dumps({"kvlb": "serving", "url": "http://127.0.0.1:1"}), flush=True)
time.sleep(60)
"""


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def test_the_announcement_is_read_and_stop_ends_the_child(tmp_path: Path) -> None:
    child = await spawn("announcer", _python(ANNOUNCE), tmp_path / "announcer.stderr", ready_key="kvlb")
    assert child.info == {"kvlb": "serving", "url": "http://127.0.0.1:1"}
    assert child.alive
    assert await child.stop() == -15  # SIGTERM
    assert not child.alive
    assert await child.stop() == -15  # a second stop is a no-op


async def test_a_child_that_exits_first_fails_with_its_code_and_stderr(tmp_path: Path) -> None:
    code = "import sys; print('bad flag', file=sys.stderr); sys.exit(3)"
    with pytest.raises(ChildFailed) as failed:
        await spawn("quitter", _python(code), tmp_path / "quitter.stderr", ready_key="kvlb")
    message = str(failed.value)
    assert message.startswith("quitter did not start (pid ")
    assert "exited with code 3 before announcing itself" in message
    assert message.endswith("bad flag")
    # one line for a command's last word (h-capfollow2): the child, its exit code, its stderr's end
    assert failed.value.exit_code == 3
    line = failed.value.one_line()
    assert "\n" not in line
    pid = failed.value.pid
    assert line == (
        f"quitter (pid {pid}): exited with code 3 before announcing itself; "
        f"its stderr ({tmp_path / 'quitter.stderr'}) ends: bad flag"
    )


async def test_a_silent_child_is_stopped_after_the_start_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ChildFailed, match=r"no announcement within 0\.5 s"):
        await spawn(
            "mute",
            _python("import time; time.sleep(60)"),
            tmp_path / "m.err",
            ready_key="kvlb",
            timeout_s=0.5,
        )
    assert time.monotonic() - started < 10.0


async def test_sigterm_ignored_means_sigkill_after_the_stop_timeout(tmp_path: Path) -> None:
    code = ANNOUNCE.replace(
        "time.sleep(60)",
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('{\"up\": 1}', flush=True); time.sleep(60)",
    )
    child = await spawn("stubborn", _python(code), tmp_path / "stubborn.stderr", ready_key="up")
    started = time.monotonic()
    assert await child.stop(timeout_s=0.5) == -9  # SIGKILL
    assert 0.5 <= time.monotonic() - started < 10.0


async def test_without_a_ready_key_stdout_goes_to_the_log_and_stop_all_stops_in_reverse(
    tmp_path: Path,
) -> None:
    first = await spawn(
        "first", python_module("http.server", "--help"), tmp_path / "first.log", ready_key=None
    )
    second = await spawn(
        "second", _python("import time; time.sleep(60)"), tmp_path / "second.log", ready_key=None
    )
    await first.process.wait()
    assert "usage" in first.log_tail()
    await stop_all([first, second])
    assert first.process.returncode == 0
    assert second.process.returncode == -15


async def test_append_keeps_the_earlier_starts_stderr(tmp_path: Path) -> None:
    log = tmp_path / "restart.stderr"
    for attempt in range(2):
        code = f"import sys; print('attempt {attempt}', file=sys.stderr); sys.exit(1)"
        with pytest.raises(ChildFailed):
            await spawn("restart", _python(code), log, ready_key="kvlb", append=attempt > 0)
    assert log.read_text().splitlines() == ["attempt 0", "attempt 1"]
