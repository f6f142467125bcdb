"""``kvlb bench flood`` at smoke size: real processes (fake upstream, ``kvlb serve``, a ZMQ PUB here),
every field of the report present and consistent. No timing assertions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadtests.bench.flood import SMOKE, format_report, measure


# Two runs (three until 2026-12-01: 1 worker, 2 workers, 1 worker on Redis): the bench's two options,
# ``workers`` and ``redis``, both taken by the second run; kvlb's own two-worker ingest without Redis is
# tests/e2e/test_serve_workers.py's.
@pytest.mark.parametrize(("workers", "redis"), [(1, False), pytest.param(2, True, marks=pytest.mark.redis)])
async def test_smoke_run_reports_every_field(workers: int, redis: bool) -> None:
    # phases of at least 0.75 s instead of the smoke's 1.5 (the flood's phase lasts until kvlb took
    # every batch whatever its floor): each phase still has its requests and probes, 1.5 s less a run
    report = await measure(replace(SMOKE, workers=workers, redis=redis, phase_s=0.75))
    base, flood = report["baseline"], report["flood"]
    assert base["errors"] == flood["errors"] == 0, (base["first_errors"], flood["first_errors"])
    for phase in (base, flood):
        for key in ("requests", "healthz"):
            assert phase[key]["count"] > 0 and phase[key]["p99_ms"] >= phase[key]["p50_ms"] > 0
        assert phase["rss_peak_mb"] >= phase["rss_start_mb"] > 0
    info = flood["flood"]
    assert info["batches"] == SMOKE.batches and info["events"] == SMOKE.batches * SMOKE.events_per_batch
    assert info["taken_s"] is not None  # kvlb emptied its queues within the bound
    # every published block reached the index of every worker (or was dropped and resynced)
    events = report["kvlb_events"]
    applied_or_dropped = events["stored_blocks_applied"] + events["queue_overflows"]
    assert applied_or_dropped >= SMOKE.events_per_batch * workers
    assert report["leases_lost"] == (0 if redis else None)  # embedded: no leases
    assert report["after_flood_batch_taken"] is True  # the engine's next batch, taken in order
    assert set(report["ratios"]) == {
        "requests_p99", "healthz_p99", "rss_settled_vs_baseline", "rss_settled_vs_idle"
    }  # fmt: skip
    warmup = report["warmup"]
    assert warmup["requests"] > 0 and warmup["errors"] == 0 and isinstance(warmup["ring_full"], bool)
    assert report["rss_idle_mb"] > 0 and report["decision_ring_entries"] > 0
    table = format_report(report)
    assert "request p99, ms" in table and "/healthz p99, ms" in table and "RSS MB" in table
