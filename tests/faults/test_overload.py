"""Overload: five times the capacity offered to kvlb, with real processes.

kvlb admits ``limits.max_inflight`` requests and queues at most ``limits.max_queued`` for at most
``limits.queue_timeout_s``; the rest are refused at once (429) or after the wait (503), always with
``Retry-After``. Measured: capacity (``max_inflight`` / mean service time at a light load), then 5×
that rate for a while. Asserted: every answer is a success or a refusal with Retry-After (none lost),
kvlb's RSS grows by less than ``RSS_GROWTH_LIMIT_MB``, and the admitted requests' p99 latency stays
within the SLO: their p99 at light load plus the queue timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from report import save_result

from loadtests.faults.load import Load, percentile
from loadtests.faults.rig import fault_rig

MAX_INFLIGHT = 4
MAX_QUEUED = 8
QUEUE_TIMEOUT_S = 1.0
RSS_GROWTH_LIMIT_MB = 40.0
LIMITS = {"max_inflight": MAX_INFLIGHT, "max_queued": MAX_QUEUED, "queue_timeout_s": QUEUE_TIMEOUT_S}


async def measure(tmp: Path, phase_s: float, engines: tuple[str, ...]) -> dict[str, float]:
    async with fault_rig(tmp, engines, time_scale=0.1, limits=LIMITS) as f:
        light = Load(f.url, rate=3.0, seed=5)
        light.start()
        await asyncio.sleep(phase_s)
        await light.stop()
        served = light.latencies_s()
        assert served and light.counts()["lost"] == 0, light.counts()
        mean_s = sum(served) / len(served)
        capacity = MAX_INFLIGHT / mean_s
        slo_s = percentile(served, 0.99) + QUEUE_TIMEOUT_S
        rss_before = f.kvlb.rss_bytes()
        heavy = Load(f.url, rate=5 * capacity, seed=6, max_outstanding=4096)
        started = time.monotonic()
        heavy.start()
        rss_peak = rss_before
        while time.monotonic() - started < phase_s:
            await asyncio.sleep(0.2)
            rss_peak = max(rss_peak, f.kvlb.rss_bytes())
        await heavy.stop()
        metrics = await f.metrics()
        counts = heavy.counts()
        return {
            "capacity_rps": round(capacity, 1),
            "offered_rps": round(len(heavy.records) / phase_s, 1),
            "sent": len(heavy.records),
            "admitted_ok": counts["ok"],
            "refused": counts["refused"],
            "refused_429": sum(1 for r in heavy.records if r.outcome == "refused" and r.status == 429),
            "refused_503": sum(1 for r in heavy.records if r.outcome == "refused" and r.status == 503),
            "lost": counts["lost"],
            "light_p99_s": round(percentile(served, 0.99), 3),
            "slo_p99_s": round(slo_s, 3),
            "admitted_p50_s": round(percentile(heavy.latencies_s(), 0.5), 3),
            "admitted_p99_s": round(percentile(heavy.latencies_s(), 0.99), 3),
            "rss_before_mb": round(rss_before / 2**20, 1),
            "rss_peak_mb": round(rss_peak / 2**20, 1),
            "shed_total": metrics.get("kvlb_admission_shed_total", 0.0),
        }


def check(figures: dict[str, float]) -> None:
    summary = json.dumps(figures)
    assert figures["lost"] == 0, summary
    assert figures["refused"] > 0 and figures["admitted_ok"] > 0, summary
    assert figures["admitted_ok"] + figures["refused"] == figures["sent"], summary
    assert figures["rss_peak_mb"] - figures["rss_before_mb"] < RSS_GROWTH_LIMIT_MB, summary
    assert figures["admitted_p99_s"] <= figures["slo_p99_s"], summary


async def test_five_times_capacity_short(tmp_path: Path) -> None:
    figures = await measure(tmp_path, phase_s=2.0, engines=("sglang", "trtllm"))
    print(f"\noverload: {json.dumps(figures)}")
    check(figures)


@pytest.mark.faults_long
async def test_five_times_capacity_long(tmp_path: Path) -> None:
    figures = await measure(tmp_path, phase_s=20.0, engines=("sglang", "sglang", "trtllm"))
    save_result("overload", figures)
    print(f"\noverload: {json.dumps(figures)}")
    check(figures)
