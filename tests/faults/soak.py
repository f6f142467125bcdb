"""Soak: one fleet under steady load for ``--duration`` seconds, a fault every ``--every`` seconds.

    python tests/faults/soak.py --duration 180            # the 3-minute version
    python tests/faults/soak.py --duration 1800 --every 30

The faults of :mod:`scenarios` (all but the Redis ones) take turns on the same fleet. After each, the
time until the index is within and then equal to the engines' caches is measured. At the end one JSON
document reports requests by outcome (``lost`` must be 0), each fault's figures, and kvlb's RSS over
time; the exit status is 1 when a request was lost or the RSS grew by more than ``--rss-growth-mb``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from fleet import fleet  # noqa: E402
from load import Load, percentile  # noqa: E402
from scenarios import FAULT_TIMEOUTS, SCENARIOS  # noqa: E402

ROTATION = (
    "restart_flushed",
    "hwm_loss_replay",
    "trtllm_overflow",
    "slow_replica",
    "gap_beyond_replay",
    "hung_replica",
    "crash_mid_stream",
)


async def soak(duration_s: float, every_s: float, rate: float, tmp: Path) -> dict[str, object]:
    top = {"timeouts": dict(FAULT_TIMEOUTS)}
    async with fleet(tmp, sim_args={"r0": ("--buffer-steps", "4")}, **top) as f:
        load = Load(f.url, rate=rate, seed=42)
        load.start()
        started = time.monotonic()
        faults: list[dict[str, object]] = []
        rss: list[tuple[float, float]] = [(0.0, f.kvlb.rss_bytes() / 2**20)]
        turn = 0
        try:
            while time.monotonic() - started < duration_s:
                await asyncio.sleep(max(0.0, every_s - 8.0))
                name = ROTATION[turn % len(ROTATION)]
                turn += 1
                note = await SCENARIOS[name].inject(f, 1.5, load)
                recovered = time.monotonic()
                within_s, equal_s = await f.time_to_converge(recovered, 6.0)
                faults.append({"fault": name, "note": note, "within_s": within_s, "equal_s": equal_s})
                rss.append((round(time.monotonic() - started, 1), round(f.kvlb.rss_bytes() / 2**20, 1)))
                print(json.dumps(faults[-1]), flush=True)
        finally:
            await load.stop()
        counts = load.counts()
        return {
            "duration_s": round(time.monotonic() - started, 1),
            "sent": len(load.records),
            "outcomes": dict(counts),
            "p99_ok_s": round(percentile(load.latencies_s(), 0.99), 3),
            "faults": faults,
            "rss_mb": rss,
            "lost_details": [r.detail for r in load.records if r.outcome == "lost"][:10],
        }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=180.0, help="seconds (default 180)")
    parser.add_argument("--every", type=float, default=20.0, help="seconds between faults (default 20)")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    parser.add_argument("--rss-growth-mb", type=float, default=50.0, help="allowed RSS growth (default 50)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvlb-soak-") as tmp:
        report = asyncio.run(soak(args.duration, args.every, args.rate, Path(tmp)))
    print(json.dumps(report, indent=1))
    rss = [mb for _, mb in report["rss_mb"]]  # type: ignore[attr-defined]
    growth = max(rss) - rss[0]
    outcomes: dict[str, int] = report["outcomes"]  # type: ignore[assignment]
    return 1 if outcomes.get("lost", 0) or growth > args.rss_growth_mb else 0


if __name__ == "__main__":
    raise SystemExit(main())
