"""Clients that declare large bodies and send almost nothing, against the pace a body must keep
(``timeouts.body_min_rate_bytes_per_s``) (I/O).

``python -m loadtests.faults.stalled_bodies`` from the repository root starts, for each run, one
emulated SGLang replica and a fresh ``kvlb serve`` with the default byte budget
(``limits.max_inflight_body_bytes``, 1 GiB) and ``limits.max_body_bytes`` (8 MiB). ``--stalled``
raw connections (default 128) each declare an 8 MiB body, send its first 10 bytes and then nothing;
together they hold the whole budget (the run waits until kvlb holds their bytes). Then one client
sends ``--requests`` small completion requests one after another and times each. Runs alternate
with the pace ``off`` (0: only ``timeouts.body_read_s``, 10 s) and ``on`` (the default, 256 KiB/s
after 1 s), ``off, on, on, off`` ``--pairs`` times. Printed: a JSON line per run (the small
requests' statuses and latencies, how many stalled connections got 408 and when), then a table.
Bounded: each run waits at most 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from balancer.service.series import percentile
from loadtests.faults.body_budget import MAX_BODY_BYTES, padded_body
from loadtests.faults.rig import FaultRig, fault_rig

RUN_TIMEOUT_S = 60.0
DEFAULT_RATE = 262_144


async def stalled_sender(url: str, declared: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection that declares ``declared`` bytes of body and sends 10 of them."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    writer.write(head.encode() + b'{"model": ')
    await writer.drain()
    return reader, writer


async def one_run(pace: str, stalled: int, requests: int) -> dict[str, Any]:
    rate = DEFAULT_RATE if pace == "on" else 0
    started_utc = time.strftime("%H:%M:%S", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="kvlb-stalled-") as tmp:
        async with fault_rig(
            Path(tmp), ("sglang",), time_scale=1.0, timeouts={"body_min_rate_bytes_per_s": rate}
        ) as f:
            clock = time.monotonic()
            senders = [await stalled_sender(f.url, MAX_BODY_BYTES) for _ in range(stalled)]
            cut_s: list[float] = []

            async def watch(reader: asyncio.StreamReader) -> None:
                line = await reader.readline()
                if line and int(line.split()[1]) == 408:
                    cut_s.append(time.monotonic() - clock)

            watchers = [asyncio.create_task(watch(reader)) for reader, _ in senders]
            held_bytes = await wait_held(f, stalled * MAX_BODY_BYTES)
            latencies_s: list[float] = []
            statuses: dict[str, int] = {}
            try:
                async with asyncio.timeout(RUN_TIMEOUT_S):
                    for index in range(requests):
                        sent = time.monotonic()
                        async with f.session.post(
                            f.url + "/v1/completions", data=padded_body(index, 2_000)
                        ) as r:
                            await r.read()
                            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
                        latencies_s.append(time.monotonic() - sent)
            finally:
                for _, writer in senders:
                    writer.close()
                for watcher in watchers:
                    watcher.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
    ordered = sorted(latencies_s)
    return {
        "pace": pace,
        "started_utc": started_utc,
        "load_1m_after": round(os.getloadavg()[0], 2),
        "statuses": statuses,
        "first_request_s": round(latencies_s[0], 3) if latencies_s else None,
        "p50_s": _round(percentile(ordered, 0.5)),
        "max_s": _round(ordered[-1] if ordered else None),
        "held_bytes_at_start": held_bytes,
        "stalled_cut_408": len(cut_s),
        "stalled_cut_after_s": _round(min(cut_s) if cut_s else None),
    }


async def wait_held(f: FaultRig, want: int, timeout_s: float = 10.0) -> int:
    """Wait until ``kvlb_admission_body_bytes`` reaches ``want`` (the stalled bodies all admitted),
    at most ``timeout_s``; returns the last figure read."""
    held = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = int((await f.metrics()).get("kvlb_admission_body_bytes", 0.0))
        if held >= want:
            break
        await asyncio.sleep(0.02)
    return held


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def main_async(args: argparse.Namespace) -> None:
    runs = []
    for _ in range(args.pairs):
        for pace in ("off", "on", "on", "off"):
            runs.append(await one_run(pace, args.stalled, args.requests))
            print(json.dumps(runs[-1]), flush=True)
    print()
    print(
        "| run | pace | UTC start | load 1m | statuses | first request (s) | p50 (s) | max (s) "
        "| stalled cut (408) | cut after (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for number, r in enumerate(runs, 1):
        print(
            f"| {number} | {r['pace']} | {r['started_utc']} | {r['load_1m_after']} | {r['statuses']} | "
            f"{r['first_request_s']} | {r['p50_s']} | {r['max_s']} | {r['stalled_cut_408']} | "
            f"{r['stalled_cut_after_s']} |"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.faults.stalled_bodies", description=__doc__)
    parser.add_argument("--stalled", type=int, default=128, help="stalled connections (default 128)")
    parser.add_argument("--requests", type=int, default=20, help="small requests timed (default 20)")
    parser.add_argument("--pairs", type=int, default=1, help="off/on/on/off rounds (default 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.stalled <= 1024 or not 1 <= args.requests <= 1000 or not 1 <= args.pairs <= 10:
        parser.error("--stalled in 1..1024, --requests in 1..1000, --pairs in 1..10")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
