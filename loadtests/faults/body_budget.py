"""Peak RSS of ``kvlb serve`` under a burst of large bodies, with the byte budget of the bodies held
at once (``limits.max_inflight_body_bytes``) small and at its largest (in effect off) (I/O).

``python -m loadtests.faults.body_budget`` from the repository root starts, for each run, one
emulated SGLang replica and a fresh ``kvlb serve`` (so that ``VmHWM`` is that run's peak), sends
``--bodies`` completion requests of ``--body-mib`` MiB at once (a short token-id prompt padded by an
unknown field: parsed, dropped, forwarded as is; each request succeeds), and reads ``VmHWM`` from
``/proc/<pid>/status`` before and after. Runs alternate off, on, on, off (``--pairs`` times two), so
that the two settings meet the same machine; the figures are printed as JSON, then as a table with
the ratio of the medians.

The budget bounds what kvlb holds for the requests it admitted; the parse of each body (2× its
size for one long string, one at a time on the event loop) and aiohttp's read buffers come on top.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.faults.procs import MODEL
from loadtests.faults.rig import fault_rig

MIB = 1024 * 1024
MAX_BODY_BYTES = 8 * MIB
OFF_BYTES = 2**40
"""``max_inflight_body_bytes`` at its largest: in effect, no budget."""
TIMEOUT_S = 120.0
"""Bound on one burst (every request succeeds well within it: the queue waits up to 60 s)."""


def proc_status_mb(pid: int, field: str) -> float:
    """A ``/proc/<pid>/status`` figure in MB (``VmHWM``: the peak RSS, ``VmRSS``: now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def padded_body(index: int, size: int) -> bytes:
    """A completion request of ``size`` bytes: a 4-token prompt and an unknown ``pad`` field."""
    head = json.dumps({"model": MODEL, "prompt": [index + 1, 2, 3, 4], "max_tokens": 8}).encode()
    pad = size - len(head) - len(b', "pad": ""')
    return head[:-1] + b', "pad": "' + b"x" * pad + b'"}'


async def one_run(budget_bytes: int, bodies: int, body_bytes: int) -> dict[str, Any]:
    limits = {
        "max_body_bytes": MAX_BODY_BYTES,
        "max_inflight_body_bytes": budget_bytes,
        "max_queued": bodies,
        "queue_timeout_s": 60.0,
    }
    started_utc = time.strftime("%H:%M:%S", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="kvlb-body-budget-") as tmp:
        async with fault_rig(Path(tmp), ("sglang",), time_scale=1.0, limits=limits) as f:
            pid = f.kvlb.pid
            before = proc_status_mb(pid, "VmHWM")
            payloads = [padded_body(i, body_bytes) for i in range(bodies)]
            peak_held = 0.0
            done = asyncio.Event()

            async def held() -> float:
                async with f.session.get(f.url + "/metrics") as response:
                    for line in (await response.text()).splitlines():
                        if line.startswith("kvlb_admission_body_bytes "):
                            return float(line.split()[1])
                return 0.0

            async def sample() -> None:
                nonlocal peak_held
                while not done.is_set():
                    peak_held = max(peak_held, await held())
                    await asyncio.sleep(0.02)

            async def post(session: aiohttp.ClientSession, body: bytes) -> int:
                async with session.post(f.url + "/v1/completions", data=body) as response:
                    await response.read()
                    return response.status

            sampler = asyncio.create_task(sample())
            clock = time.monotonic()
            async with aiohttp.ClientSession() as session, asyncio.timeout(TIMEOUT_S):
                statuses = await asyncio.gather(*(post(session, body) for body in payloads))
            burst_s = time.monotonic() - clock
            done.set()
            await sampler
            after = proc_status_mb(pid, "VmHWM")
            held_after = await held()
    counts: dict[str, int] = {}
    for status in statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return {
        "budget": "off" if budget_bytes >= OFF_BYTES else f"{budget_bytes / MIB:g} MiB",
        "started_utc": started_utc,
        "load_1m_after": round(os.getloadavg()[0], 2),
        "peak_rss_before_mb": round(before, 1),
        "peak_rss_after_mb": round(after, 1),
        "peak_rise_mb": round(after - before, 1),
        "peak_held_bytes_sampled": int(peak_held),
        "held_bytes_after": int(held_after),
        "burst_s": round(burst_s, 2),
        "statuses": counts,
    }


async def main_async(args: argparse.Namespace) -> None:
    body_bytes = int(args.body_mib * MIB)
    budget_bytes = int(args.budget_mib * MIB)
    runs = []
    for _ in range(args.pairs):
        for budget in (OFF_BYTES, budget_bytes, budget_bytes, OFF_BYTES):
            runs.append(await one_run(budget, args.bodies, body_bytes))
            print(json.dumps(runs[-1]), flush=True)
    off = [r["peak_rise_mb"] for r in runs if r["budget"] == "off"]
    on = [r["peak_rise_mb"] for r in runs if r["budget"] != "off"]
    summary = {
        "bodies": args.bodies,
        "body_mib": args.body_mib,
        "budget_mib": args.budget_mib,
        "median_peak_rise_mb_off": round(statistics.median(off), 1),
        "median_peak_rise_mb_on": round(statistics.median(on), 1),
        "ratio_on_over_off": round(statistics.median(on) / statistics.median(off), 3),
        "runs": runs,
    }
    print(json.dumps(summary))
    print()
    print(
        "| run | budget | UTC start | load 1m | peak RSS before → after (MB) | rise (MB) "
        "| held peak (MiB) | burst (s) | statuses |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for number, r in enumerate(runs, 1):
        print(
            f"| {number} | {r['budget']} | {r['started_utc']} | {r['load_1m_after']} | "
            f"{r['peak_rss_before_mb']} → {r['peak_rss_after_mb']} | {r['peak_rise_mb']} | "
            f"{r['peak_held_bytes_sampled'] / MIB:.1f} | {r['burst_s']} | {r['statuses']} |"
        )
    print(
        f"\nmedian rise: off {summary['median_peak_rise_mb_off']} MB, "
        f"on {summary['median_peak_rise_mb_on']} MB (on/off {summary['ratio_on_over_off']})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.faults.body_budget", description=__doc__)
    parser.add_argument("--bodies", type=int, default=32, help="requests sent at once (default 32)")
    parser.add_argument("--body-mib", type=float, default=4.0, help="size of each body (MiB, default 4)")
    parser.add_argument("--budget-mib", type=float, default=16.0, help="the small budget (MiB, default 16)")
    parser.add_argument("--pairs", type=int, default=1, help="off/on/on/off rounds (default 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.bodies <= 256 or not 0 < args.body_mib <= 7.9 or args.budget_mib < 8:
        parser.error("--bodies in 1..256, --body-mib in (0, 7.9], --budget-mib >= 8 (max_body_bytes)")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
