"""Soak mode of ``kvlb loadtest`` (I/O): ``kvlb loadtest --duration 30m --fault-every 30s``.

One ``kvlb serve`` in front of three emulated replicas (two SGLang, one TRT-LLM: ``kvlb emulate``
processes) under a steady load of ``--rate`` requests/s (:mod:`loadtests.faults.load`: half of them
streaming) for ``--duration``. Every ``--fault-every`` the next replica fault of :data:`ROTATION` is
injected (``0``: none; one fault at a time, a late one starts when the previous one is done), and the
time until kvlb's index is within, then equal to, the engines' caches is measured. Every
``--sample-every`` a :class:`Sampler` records kvlb's RSS, open file descriptors, asyncio tasks
(``kvlb_process_asyncio_tasks``), index size, and the requests completed and failed in the interval.
:mod:`loadtests.faults.soak_report` writes the report and judges the flat lines; the exit status is
1 if a request was lost, a fault could not be injected, or a growth is over its limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from balancer.load.scrape import ScrapeError, parse_prometheus
from loadtests.faults.load import Load, percentile
from loadtests.faults.rig import FaultRig, fault_rig
from loadtests.faults.scenarios import FAULT_TIMEOUTS, REPLICA_SCENARIOS
from loadtests.faults.soak_report import GrowthLimits, judge, write_report

ROTATION = (
    "restart_flushed",
    "hwm_loss_replay",
    "trtllm_overflow",
    "slow_replica",
    "gap_beyond_replay",
    "hung_replica",
    "crash_mid_stream",
)
"""The replica faults, in the order they take turns."""
HOLD_S = 1.5
"""How long each fault stays on (slow and hung replicas: twice this)."""
CONVERGE_WAIT_S = 6.0
"""How long convergence is waited for after each fault (``null`` in the report beyond it)."""
DEFAULT_RATE = 20.0
"""Requests per second when ``--rate`` is not given (the fault suite's steady load)."""
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"3m"``, ``"1.5h"`` (an ``argparse`` type: raises on junk)."""
    raw = text.strip().lower()
    scale = _UNITS.get(raw[-1:], 0.0)
    try:
        value = float(raw[:-1] if scale else raw) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90, 90s, 3m, 1h)") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}")
    return value


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--duration", type=parse_duration, default=None,
        help="soak mode: one kvlb and 3 emulated replicas under --rate req/s (default 20) for this "
        "long, e.g. 3m, 30m, 1h; the other options of the router comparison are ignored")  # fmt: skip
    add("--fault-every", type=parse_duration, default=30.0,
        help="soak: inject the next replica fault this often (default 30s; 0: no faults)")  # fmt: skip
    add("--sample-every", type=parse_duration, default=5.0, help="soak: sampling period (default 5s)")
    add("--max-rss-growth-mb", type=float, default=GrowthLimits.rss_mb,
        help="soak: allowed RSS growth, first to last quarter (default %(default)s)")  # fmt: skip
    add("--max-fd-growth", type=float, default=GrowthLimits.fds,
        help="soak: allowed growth of open file descriptors (default %(default)s)")  # fmt: skip
    add("--max-task-growth", type=float, default=GrowthLimits.tasks,
        help="soak: allowed growth of asyncio tasks (default %(default)s)")  # fmt: skip


@dataclass(frozen=True)
class SoakOptions:
    duration_s: float
    """Load this long; the run ends when the fault in progress, if any, is done."""
    fault_every_s: float
    """A fault at every multiple of this (seconds since the start) before ``duration_s``; 0: none."""
    rate: float
    """Requests per second (open loop, at most 64 in flight)."""
    sample_every_s: float
    """Seconds between samples."""
    seed: int
    """Seed of the load's prompts."""
    limits: GrowthLimits
    """Allowed growth from the first to the last quarter of the run."""


@dataclass
class Sampler:
    """Samples kvlb and the load every ``every_s`` on its own task (started and stopped by the soak)."""

    fleet: FaultRig
    load: Load
    every_s: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    fault: str = ""
    """The fault on now (written into each sample)."""
    _started: float = 0.0
    _seen: Counter[str] = field(default_factory=Counter)
    _task: asyncio.Task[None] | None = None

    def start(self, started: float) -> None:
        self._started = started
        self._task = asyncio.create_task(self._run(), name="soak-sampler")

    async def stop(self) -> None:
        """Cancel the sampling task, then take a last sample (``drained``: the load has stopped)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.sample(drained=True)

    async def _run(self) -> None:
        next_at = self._started
        while True:
            await self.sample()
            next_at += self.every_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def sample(self, drained: bool = False) -> None:
        t_s = time.monotonic() - self._started
        figures = kvlb_figures(await self._scrape())
        engines = await self.fleet.engine_blocks()
        kvlb = self.fleet.kvlb
        finished = Counter(r.outcome for r in self.load.records if r.outcome != "pending")
        interval, self._seen = finished - self._seen, finished
        completed = sum(interval.values())
        errors = completed - interval["ok"]
        self.samples.append(
            {
                "t_s": round(t_s, 1),
                "rss_mb": round(kvlb.rss_bytes() / 2**20, 1),
                "fds": kvlb.fd_count(),
                "tasks": figures["tasks"],
                "index_held_blocks": figures["index_held_blocks"],
                "index_unique_blocks": figures["index_unique_blocks"],
                "engine_blocks": None if engines is None else sum(engines.values()),
                "inflight": figures["inflight"],
                "completed": completed,
                "errors": errors,
                "lost": interval["lost"],
                "error_rate": round(errors / completed, 4) if completed else 0.0,
                "fault": self.fault,
                "drained": drained,
            }
        )

    async def _scrape(self) -> str:
        """kvlb's ``/metrics`` text (empty when kvlb does not answer)."""
        try:
            timeout = aiohttp.ClientTimeout(total=2.0)
            async with self.fleet.session.get(self.fleet.url + "/metrics", timeout=timeout) as response:
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return ""
        return text


KVLB_SERIES = ("kvlb_process_asyncio_tasks", "kvlb_index_blocks", "kvlb_http_inflight_requests")
"""The series of kvlb's ``/metrics`` a sample records."""


def kvlb_figures(text: str) -> dict[str, int | None]:
    """The sampled figures in kvlb's ``/metrics`` text (``None`` where a series is missing; all of
    them when the text does not parse)."""
    try:
        samples = parse_prometheus(text, KVLB_SERIES)
    except ScrapeError:
        samples = {}

    def value(name: str, **labels: str) -> int | None:
        found = [v for have, v in samples.get(name, []) if all(have.get(k) == w for k, w in labels.items())]
        return int(found[0]) if found else None

    return {
        "tasks": value("kvlb_process_asyncio_tasks"),
        "index_held_blocks": value("kvlb_index_blocks", kind="held"),
        "index_unique_blocks": value("kvlb_index_blocks", kind="unique"),
        "inflight": value("kvlb_http_inflight_requests"),
    }


async def _inject_in_turn(
    f: FaultRig, load: Load, options: SoakOptions, sampler: Sampler, started: float
) -> list[dict[str, Any]]:
    faults: list[dict[str, Any]] = []
    every = options.fault_every_s
    turn = 0
    while every > 0 and (turn + 1) * every < options.duration_s:
        await asyncio.sleep(max(0.0, started + (turn + 1) * every - time.monotonic()))
        name = ROTATION[turn % len(ROTATION)]
        turn += 1
        sampler.fault = name
        entry: dict[str, Any] = {"fault": name, "at_s": round(time.monotonic() - started, 1)}
        try:
            entry["note"] = await REPLICA_SCENARIOS[name].inject(f, HOLD_S, load)
            recovered = time.monotonic()
            times = await f.time_to_converge(recovered, CONVERGE_WAIT_S)
            entry["within_s"], entry["equal_s"] = times.within_s, times.equal_s
            entry["equal_count_s"] = times.equal_count_s
        except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
            entry["error"] = f"{exc.__class__.__name__}: {exc}"[:300]
        finally:
            sampler.fault = ""
        faults.append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)
    await asyncio.sleep(max(0.0, started + options.duration_s - time.monotonic()))
    return faults


async def soak(options: SoakOptions, logs: Path) -> dict[str, Any]:
    """Run the soak with its processes' configs and stderr in ``logs``; returns the report's figures."""
    top: dict[str, Any] = {"timeouts": dict(FAULT_TIMEOUTS)}
    async with fault_rig(logs, sim_args={"r0": ("--buffer-steps", "4")}, **top) as f:
        load = Load(f.url, rate=options.rate, seed=options.seed)
        sampler = Sampler(f, load, options.sample_every_s)
        started = time.monotonic()
        load.start()
        sampler.start(started)
        try:
            faults = await _inject_in_turn(f, load, options, sampler, started)
        finally:
            await load.stop()
            await sampler.stop()
        elapsed_s = time.monotonic() - started
        counts = load.counts()
        requests = {
            "sent": len(load.records),
            "outcomes": dict(counts),
            "error_rate": round(1 - counts["ok"] / len(load.records), 4) if load.records else 0.0,
            "p50_ok_s": round(percentile(load.latencies_s(), 0.5), 3),
            "p99_ok_s": round(percentile(load.latencies_s(), 0.99), 3),
            "lost_details": [r.detail for r in load.records if r.outcome == "lost"][:10],
        }
        kvlb = {"pid": f.kvlb.pid, "engines": [s.engine for s in f.sims]}
    return {
        "elapsed_s": round(elapsed_s, 1),
        "kvlb": kvlb,
        "requests": requests,
        "faults": faults,
        "samples": sampler.samples,
    }


def soak_campaign(args: argparse.Namespace, command: list[str]) -> Coroutine[Any, Any, int]:
    """Validate ``args`` (ValueError) and return the soak to run; ``command`` is for the report."""
    options = SoakOptions(
        duration_s=args.duration,
        fault_every_s=args.fault_every,
        rate=DEFAULT_RATE if args.rate is None else args.rate,
        sample_every_s=args.sample_every,
        seed=args.seed,
        limits=GrowthLimits(args.max_rss_growth_mb, args.max_fd_growth, args.max_task_growth),
    )
    if options.duration_s <= 0 or options.rate <= 0 or options.sample_every_s <= 0:
        raise ValueError("soak: need --duration > 0, --rate > 0 and --sample-every > 0")
    out = args.out or Path("loadtest-results") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    return _campaign(options, out, command, args.no_plots)


async def _campaign(options: SoakOptions, out: Path, command: list[str], no_plots: bool) -> int:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "kvlb loadtest " + " ".join(shlex.quote(a) for a in command if a != "--in-netns"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "options": asdict(options),
    }
    print(
        f"soak for {options.duration_s:g} s, a fault every {options.fault_every_s:g} s ...", file=sys.stderr
    )
    figures = await soak(options, logs)
    report = {"meta": meta, **figures, "verdict": judge(figures, options.limits)}
    write_report(report, out, plots=not no_plots)
    print(json.dumps(report, indent=1))
    print(f"report: {out / 'report.md'} and {out / 'report.json'}", file=sys.stderr)
    return 0 if report["verdict"]["passed"] else 1
