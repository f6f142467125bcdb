"""``kvlb demo``: the command line of :mod:`loadtests.demo.run` and its progress bar (I/O).

The progress bar goes to stderr (redrawn in place on a terminal, a line per phase step otherwise),
and so does the console's URL and admin token, as soon as kvlb is up; the table goes to stdout,
followed by the JSON report on one line with ``--json``. With ``--linger S`` the table is printed
when the runs end and the fleet stays up S more seconds for the console (Ctrl-C ends it early).
Exit status: 0 when both runs finished (errors are reported in the table), 1 when the demo could not
run, 130 on Ctrl-C or SIGTERM before the figures were printed (every process started is stopped
first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, TextIO

from loadtests.demo.emulator import ENGINE_CHOICES
from loadtests.demo.report import format_header, format_table
from loadtests.demo.run import SMOKE, DemoShape, run_demo

BAR_WIDTH = 30
REDRAW_S = 0.1
"""Least time between two redraws of the bar on a terminal."""
LINE_STEPS = 4
"""Off a terminal, a phase prints a line at each quarter."""


class ProgressBar:
    """``[#####.....] 120/240  kvlb run  12.3 s`` on a terminal; plain lines otherwise."""

    def __init__(self, stream: TextIO, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._last_step: tuple[str, int] = ("", -1)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        finished = done >= total
        if self.tty:
            if not finished and now - self._last_draw < REDRAW_S:
                return
            self._last_draw = now
            self.stream.write("\r" + self._line(phase, done, total, now) + ("\n" if finished else ""))
        else:
            step = done * LINE_STEPS // max(total, 1)
            if (phase, step) == self._last_step:
                return
            self._last_step = (phase, step)
            self.stream.write(self._line(phase, done, total, now) + "\n")
        self.stream.flush()

    def _line(self, phase: str, done: int, total: int, now: float) -> str:
        filled = BAR_WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return f"[{bar}] {done:>4}/{total:<4} {phase:<28} {now - self.started:6.1f} s"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="emulated fleet: kvlb vs round robin on a shared-prefix chat workload",
        description="Start 4 emulated replicas (SGLang and TRT-LLM; --engines vllm: vLLM) and kvlb on "
        "127.0.0.1, send a "
        "shared-prefix chat workload through kvlb, then the same workload round robin, and print "
        "TTFT, prefix-cache hit rate and per-replica share for both. Takes about a minute.",
    )
    parser.add_argument("--json", action="store_true", help="also print the JSON report (last line)")
    parser.add_argument("--smoke", action="store_true", help="a few-seconds run (tests, CI)")
    parser.add_argument(
        "--engines",
        choices=ENGINE_CHOICES,
        default=None,
        help="the fleet: mixed (SGLang and TRT-LLM, the default), sglang, vllm or trtllm",
    )
    defaults = DemoShape()  # the help's defaults are the demo's own
    parser.add_argument("--requests", type=int, help=f"requests per run (default {defaults.requests})")
    parser.add_argument(
        "--rate", type=float, help=f"Poisson arrivals per second (default {defaults.rate_per_s:g})"
    )
    parser.add_argument(
        "--seed", type=int, help=f"seed of prompts and arrival times (default {defaults.seed})"
    )
    parser.add_argument(
        "--kvlb-workers",
        type=int,
        default=None,
        metavar="N",
        help="`kvlb serve --workers` of the demo's kvlb (default: kvlb's own, one per core)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--linger-on-terminal",
        action="store_true",
        help="linger only when stdin and stderr are a terminal (a person is watching; `make demo`)",
    )
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    parser.add_argument(
        "--linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after the runs, print the figures and keep the fleet and kvlb up this long with a trickle "
        "of traffic, for a look at the console (default 0; Ctrl-C ends it early)",
    )
    parser.set_defaults(handler=run)


def shape_from_args(args: argparse.Namespace) -> DemoShape:
    shape = SMOKE if args.smoke else DemoShape()
    changes: dict[str, Any] = {}
    if args.requests is not None:
        changes["requests"] = args.requests
    if args.rate is not None:
        changes["rate_per_s"] = args.rate
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.engines is not None:
        changes["engines"] = args.engines
    if args.kvlb_workers is not None:
        changes["kvlb_workers"] = args.kvlb_workers
    return replace(shape, **changes)


def _runner(use_uvloop: bool) -> Callable[[Coroutine[Any, Any, dict[str, Any]]], dict[str, Any]]:
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.run
    return asyncio.run


def announce_console(url: str, token: str, stream: TextIO = sys.stderr) -> None:
    """The console's address and login, printed once kvlb is up."""
    stream.write(
        f"\nkvlb console: {url}\n"
        f"  admin token: {token}\n"
        "  (open it in a browser on this machine and paste the token; it is valid for this demo only)\n\n"
    )
    stream.flush()


def print_report(report: dict[str, Any], with_json: bool) -> None:
    print(format_header(report))
    print()
    print(format_table(report))
    print(f"(wall time {report['wall_s']:.0f} s)")
    if with_json:
        print(json.dumps(report))
    sys.stdout.flush()


async def _until_done_or_terminated(
    shape: DemoShape, progress: ProgressBar, linger_s: float, on_report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Run the demo; SIGTERM cancels it like Ctrl-C does, so its processes are stopped too."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await run_demo(
            shape, progress, on_console=announce_console, on_report=on_report, linger_s=linger_s
        )
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    shape = shape_from_args(args)
    if shape.requests < 1 or shape.rate_per_s <= 0 or not 0 <= args.linger <= 86_400:
        print("kvlb demo: --requests must be >= 1, --rate > 0 and --linger in 0..86400", file=sys.stderr)
        return 2
    if shape.kvlb_workers is not None and shape.kvlb_workers < 1:
        print(f"kvlb demo: --kvlb-workers must be >= 1, got {shape.kvlb_workers}", file=sys.stderr)
        return 2
    if args.linger_on_terminal and args.linger > 0 and not (sys.stdin.isatty() and sys.stderr.isatty()):
        print(
            "kvlb demo: not on a terminal, so the fleet stops after the figures (no --linger)",
            file=sys.stderr,
        )
        args.linger = 0.0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    progress = ProgressBar(sys.stderr, enabled=not args.no_progress)
    printed = False

    def on_report(report: dict[str, Any]) -> None:
        nonlocal printed
        print_report(report, args.json)
        printed = True
        print(
            f"kvlb demo: the fleet and kvlb stay up for {args.linger:g} s more for the console "
            "(Ctrl-C to stop now)",
            file=sys.stderr,
            flush=True,
        )

    try:
        report = _runner(not args.no_uvloop)(
            _until_done_or_terminated(shape, progress, args.linger, on_report)
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\nkvlb demo: interrupted; every process it started was stopped", file=sys.stderr)
        return 0 if printed else 130
    except Exception as exc:  # a process did not start, a replica refused a flush...
        print(f"\nkvlb demo: failed: {exc}", file=sys.stderr)
        return 1
    if not printed:
        print_report(report, args.json)
    return 0
