"""``kvlb simulate``, ``kvlb tune`` and ``kvlb capacity`` given what a capacity planner mistypes: one
line naming the flag, exit 2, before any simulation runs; SIGINT is one line and exit 130."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from balancer.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "loadtests" / "traces" / "mooncake_synthetic_trace.jsonl"


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 100 * n, "input_length": 600, "output_length": 4, "hash_ids": [n % 3, 10 + n]}
        for n in range(20)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", "utf-8")
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("simulate", "--rate", "0"),
            "kvlb simulate: --rate must be a finite number > 0 (requests/s), got 0.0",
        ),
        (
            ("simulate", "--rate", "-1"),
            "kvlb simulate: --rate must be a finite number > 0 (requests/s), got -1.0",
        ),
        (("simulate", "--replicas", "0"), "kvlb simulate: --replicas must be >= 1, got 0"),
        (("simulate", "--requests", "0"), "kvlb simulate: --requests must be >= 1, got 0"),
        (("simulate", "--page-size", "-16"), "kvlb simulate: --page-size must be >= 1, got -16"),
        (("simulate", "--max-tokens-cap", "0"), "kvlb simulate: --max-tokens-cap must be >= 1, got 0"),
        (
            ("simulate", "--scrape-interval-s", "nan"),
            "kvlb simulate: --scrape-interval-s must be a finite number >= 0 (virtual s), got nan",
        ),
        (
            ("tune", "--no-plot", "--rate", "0"),
            "kvlb tune: --rate must be a finite number > 0 (requests/s), got 0.0",
        ),
        (
            ("capacity", "--start-rate", "0"),
            "kvlb capacity: --start-rate must be a finite number > 0 (req/s), got 0.0",
        ),
        (("capacity", "--slo-ttft-p90", "0"), "kvlb capacity: SLO TTFT bounds must be > 0"),
        (
            ("tune", "--no-plot", "--max-imbalance", "-1"),
            "kvlb tune: --max-imbalance must be a finite number >= 1 (max/mean replica requests), got -1.0",
        ),
        (
            ("tune", "--no-plot", "--min-hit-rate", "2"),
            "kvlb tune: --min-hit-rate must be in [0, 1], got 2.0",
        ),
        # before (2026-12-01, h-capfollow): --smoke put 2 in place of --replicas 0 and ran
        (("capacity", "--smoke", "--replicas", "0"), "kvlb capacity: --replicas must be >= 1, got 0"),
        # before: a ValueError traceback out of the search
        (("capacity", "--max-points", "1"), "kvlb capacity: --max-points must be >= 2, got 1"),
        (("capacity", "--processes", "0"), "kvlb capacity: --processes must be >= 1, got 0"),
        (
            ("capacity", "--time-scale", "0"),
            "kvlb capacity: --time-scale must be a finite number > 0, got 0.0",
        ),
        # before: the flag did not exist and every prompt was held as Python ints
        (
            ("capacity", "--max-held-tokens", "1000"),
            "kvlb capacity: the stream's prompts pass --max-held-tokens 1000 token ids (4 bytes each) "
            "at request 2: pass a lower --requests, or raise --max-held-tokens",
        ),
        # before: no replica started, then "min() arg is an empty sequence", exit 1
        (("loadtest", "--replicas", "0"), "kvlb loadtest: --replicas must be >= 1, got 0"),
        # before: ran and wrote a report of no completed request, exit 0
        (("loadtest", "--processes", "0"), "kvlb loadtest: --processes must be >= 1, got 0"),
        # before: the 36 default points swept, every one routing alike, and a recommendation
        (
            ("tune", "--no-plot", "--policy", "round_robin"),
            "kvlb tune: policy round_robin reads no weight: nothing to tune (weights move cost, "
            "sglang_threshold)",
        ),
        (
            ("tune", "--no-plot", "--policy", "sglang_threshold", "--grid", "overlap_credit=0,1"),
            "kvlb tune: --grid overlap_credit: policy sglang_threshold does not read it (it reads "
            "balance_abs_threshold, balance_rel_threshold, cache_threshold)",
        ),
    ],
)
def test_an_unusable_number_is_one_line(
    capsys: pytest.CaptureFixture[str], trace: Path, argv: tuple[str, ...], message: str
) -> None:
    # before: --rate 0 on a trace was a ZeroDivisionError traceback, -1 replayed every row at t=0,
    # --replicas 0 an IndexError, --requests 0 an empty report with exit 0, --page-size -16 a traceback,
    # --max-tokens-cap 0 requests of 0 tokens, nan scrapes silently off, --start-rate 0 and
    # --slo-ttft-p90 0 silently the defaults (2 per replica, 2 s); tune's unmeetable SLOs ran every
    # grid point and then said "no point meets" with exit 1
    code = main([*argv, "--trace", str(trace)])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [message]


def test_an_output_that_cannot_be_written_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    # before: the whole simulation ran, then an IsADirectoryError / FileNotFoundError traceback, no report
    for output, said in (
        (tmp_path, "is a directory"),
        (tmp_path / "no" / "x.json", "does not exist"),
    ):
        assert main(["simulate", "--trace", str(trace), "--output", str(output)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"kvlb simulate: --output {output}: ") and said in err[0]
    blocker = tmp_path / "file"
    blocker.write_text("", "utf-8")
    assert main(["capacity", "--trace", str(trace), "--out", str(blocker / "sub")]) == 2
    assert capsys.readouterr().err.startswith(f"kvlb capacity: --out {blocker / 'sub'}: ")


def test_a_bad_trace_line_is_one_line_from_every_tool(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # before: a timestamp of 1e400 was an OverflowError traceback out of kvlb simulate and kvlb capacity
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1e400, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n', "utf-8")
    for command in ("simulate", "tune", "capacity"):
        assert main([command, "--trace", str(bad), "--no-plot" if command == "tune" else "--json"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [
            f"kvlb {command}: {bad} line 1: timestamp must be a finite number, got inf: "
            f"'{bad.read_text('utf-8').strip()}'"
        ]


def _cpu_s(pid: int) -> float:
    """The process's user and system CPU seconds so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text("ascii").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("command", ["simulate", "tune"])
def test_sigint_mid_run_is_one_line_and_exit_130(command: str) -> None:
    # before: a KeyboardInterrupt traceback from wherever the simulation was
    argv = [sys.executable, "-m", "balancer", command, "--trace", str(TRACE), "--requests", "200000"]
    child = subprocess.Popen(
        [*argv, *(["--no-plot"] if command == "tune" else ["--json"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        # inside the trace reading or the run (both are covered): 1.5 s of the child's own CPU, not
        # of wall time, which a loaded machine spent on the interpreter's start (a SIGINT there is
        # the default action's, exit -2: seen at load 12)
        deadline = time.monotonic() + 60
        while child.poll() is None and _cpu_s(child.pid) < 1.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is None and time.monotonic() < deadline
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert child.returncode == 130, err
    assert "Traceback" not in err and out == ""
    expected = "stopped by SIGINT (no report)" if command == "simulate" else "stopped by SIGINT"
    assert err.splitlines()[-1].startswith(f"kvlb {command}: {expected}")


def test_tune_plot_path_is_checked_first_and_written_as_given(
    capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path
) -> None:
    # before: a --plot in a missing folder was a FileNotFoundError traceback after the whole sweep, and
    # a path without a suffix was written as <path>.png while the report said <path>
    missing = tmp_path / "no" / "f.png"
    assert main(["tune", "--trace", str(trace), "--grid", "overlap_credit=1", "--plot", str(missing)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvlb tune: --plot {missing}: the folder {missing.parent} does not exist"
    ]
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: no plot to write")
    plot = tmp_path / "frontier"
    grid = ("--grid", "overlap_credit=1", "--max-imbalance", "3")
    code = main(["tune", "--trace", str(trace), *grid, "--plot", str(plot), "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not plot.with_suffix(".png").exists()


def test_capacity_with_no_rate_meeting_the_slo_exits_3_with_the_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # before (2026-12-01, h-capfollow): "no rate tried met the SLO" and exit 0, so a CI job had to
    # read the report to tell
    out = tmp_path / "out"
    argv = ["capacity", "--smoke", "--routers", "round_robin", "--slo-ttft-p90", "0.0001", "--out", str(out)]
    assert main(argv) == 3
    err = capsys.readouterr().err.splitlines()
    assert (
        err[-1] == "kvlb capacity: no rate tried met the SLO for round_robin: exit 3 (the report is written)"
    )
    report = json.loads((out / "capacity.json").read_text("utf-8"))
    assert [r["capacity_rate"] for r in report["routers"]] == [None]
    assert (out / "capacity.md").exists() and (out / "ttft_vs_rate.svg").exists()


def test_loadtest_refuses_an_unsorted_trace_before_its_fleet_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # before (2026-12-01, h-capfollow): the fleet started (about 5 s), then the replay found row 2,
    # exit 1
    rows = [{"timestamp": t, "input_length": 600, "output_length": 4, "hash_ids": [t]} for t in (5, 1, 9)]
    unsorted = tmp_path / "unsorted.jsonl"
    unsorted.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    argv = ["loadtest", "--workload", "mooncake", "--trace", str(unsorted), "--routers", "round_robin",
            "--replicas", "1", "--processes", "1", "--requests", "3",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvlb loadtest: {unsorted}: trace row 2: timestamp 1 ms is earlier than the row before it (5 ms); "
        "a trace must be in arrival order (sort it by timestamp)"
    ]
    assert not (tmp_path / "out").exists()
