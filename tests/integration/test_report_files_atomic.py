"""A signal while a loadtest tool writes a report file leaves the old file or the whole new one
(:mod:`loadtests.atomic_files`, which every report writer of ``loadtests/`` goes through).

A real Python process writes a report slowly (a line every few milliseconds, as a large
``requests.jsonl`` is written record by record) over an old one, says when it is part-way, and is
sent SIGINT or SIGTERM (with SIGTERM taken as SIGINT, as ``kvlb capacity --target`` does); then the
same write runs to its end. Until 2026-12-01 (h-smallfollow) the signal left the file as far as the
write got (``kvlb capacity``: exit 130 or 143 with a cut ``capacity.json``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtests.atomic_files import write_text_atomic

REPO = Path(__file__).resolve().parents[2]
LINES = 2000
"""Lines of the new report, about 1 kB each (2 MB), one every ``pause_s``."""
SIGNAL_AFTER = 100
"""Lines written when the writer says it is part-way (and the test sends the signal)."""
LIMIT_S = 30.0
"""How long the writer may take to start, and to stop after the signal."""

WRITER = """
import contextlib, signal, sys, time
from pathlib import Path
from loadtests.atomic_files import write_lines_atomic

path, lines, signal_after, pause_s = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
# a shell without job control starts background commands with SIGINT ignored, and Python then
# keeps it ignored: a test run from such a job would see the signal do nothing
signal.signal(signal.SIGINT, signal.default_int_handler)
if signal_after >= 0:
    from loadtests.capacity.target import sigterm_as_sigint
else:  # the run to the end: no signal comes (and the import costs a second on a loaded machine)
    sigterm_as_sigint = lambda: contextlib.nullcontext([])

def report():
    for number in range(lines):
        if number == signal_after:
            print("part-way", flush=True)
        yield f'{{"line": {number}, "pad": "{"x" * 1000}"}}\\n'
        time.sleep(pause_s)

with sigterm_as_sigint() as received:
    try:
        write_lines_atomic(path, report())
    except KeyboardInterrupt:
        sys.exit(128 + (received[0] if received else signal.SIGINT).value)
print("written", flush=True)
"""


def _writer(path: Path, pause_s: float, signal_after: int) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", WRITER, str(path), str(LINES), str(signal_after), str(pause_s)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pipe = subprocess.PIPE
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=pipe, stderr=pipe, text=True)


def _new_report() -> str:
    return "".join(f'{{"line": {n}, "pad": "{"x" * 1000}"}}\n' for n in range(LINES))


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_report_is_written_leaves_the_old_file_then_the_whole_new_one(
    tmp_path: Path, sent: signal.Signals
) -> None:
    path = tmp_path / "requests.jsonl"
    old = '{"line": "the previous run"}\n'
    path.write_text(old, "utf-8")
    writer = _writer(path, pause_s=0.005, signal_after=SIGNAL_AFTER)
    try:
        assert writer.stdout is not None
        started = time.monotonic()
        line = writer.stdout.readline()  # blocks until part-way (or the writer's end)
        assert line == "part-way\n", (line, writer.stderr.read() if writer.stderr else "")
        assert time.monotonic() - started < LIMIT_S
        writer.send_signal(sent)
        code = writer.wait(timeout=LIMIT_S)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert code == 128 + sent.value, writer.stderr.read() if writer.stderr else ""
    assert path.read_text("utf-8") == old  # not the lines written before the signal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]  # no temporary file left

    finished = _writer(path, pause_s=0.0, signal_after=-1)
    out, err = finished.communicate(timeout=LIMIT_S)
    assert finished.returncode == 0 and out.endswith("written\n"), err
    assert path.read_text("utf-8") == _new_report()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as a plain write makes it


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_no_report_writer_of_the_loadtest_tools_bypasses_the_atomic_writes() -> None:
    """Every file ``loadtests/`` writes goes through :mod:`loadtests.atomic_files`, but the kvlb
    configs the tools write for the processes they start (YAML, before those start), the kernel's
    ``/proc`` knobs and a child process's stderr log (the child writes it). Before 2026-12-01
    (h-smallfollow) 24 places wrote reports in place."""
    direct = re.compile(r"""\.write_text\(|\.write_bytes\(|\.savefig\(|open\([^)]*["'][wa]b?["']""")
    kept = ("yaml.safe_dump", "/proc/", "stderr_path.open(")
    found = []
    for path in sorted((REPO / "loadtests").rglob("*.py")):
        if path.name == "atomic_files.py":
            continue
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if direct.search(code) and not any(k in code for k in kept):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_a_report_path_that_is_a_link_is_written_through_it(tmp_path: Path) -> None:
    """``--output /dev/stdout`` (a link to the process's stdout, a regular file when redirected) or
    any link is written in place through it: a rename would have replaced the link itself."""
    target = tmp_path / "target.json"
    target.write_text("old\n", "utf-8")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    write_text_atomic(link, "new\n")
    assert link.is_symlink() and link.resolve() == target
    assert target.read_text("utf-8") == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "target.json"]
