"""What one convergence check of the fault rig costs under the fault load (I/O; a measurement).

``PYTHONPATH=$PWD python -m loadtests.faults.check_cost`` starts the rig's fleet (two SGLang and one
TRT-LLM emulator, one ``kvlb serve``) under the scenarios' load (20 requests/s), and after a warm-up
times, in turn, 100 block checks (:meth:`~loadtests.faults.rig.FaultRig.read`: for every replica at
once, its engine's page listing, kvlb's key listing of it, its engine again) and 100 count checks as
the rig made them until 2026-11-30 (``/admin/stats`` of each engine, ``/admin/replicas``, the
engines again), 0.05 s apart (the rig's poll). It prints the median and 90th percentile of each,
and how many readings were steady (the two engine readings agreed, every replica's for a block
check, so the check counted).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from loadtests.faults.load import Load
from loadtests.faults.rig import POLL_S, fault_rig

CHECKS = 100
WARM_UP_S = 3.0


async def measure() -> str:
    tmp = Path(tempfile.mkdtemp(prefix="kvlb-check-cost-"))
    async with fault_rig(tmp) as f:
        load = Load(f.url, rate=20.0, seed=1)
        load.start()
        try:
            await asyncio.sleep(WARM_UP_S)
            blocks_s: list[float] = []
            counts_s: list[float] = []
            steady_blocks = steady_counts = 0
            for _ in range(CHECKS):
                started = time.perf_counter()
                reading = await f.read()
                blocks_s.append(time.perf_counter() - started)
                steady_blocks += reading.text is not None or reading.blocks_equal
                started = time.perf_counter()
                before = await f.engine_blocks()
                await f.index_blocks()
                after = await f.engine_blocks()
                counts_s.append(time.perf_counter() - started)
                steady_counts += before is not None and before == after
                await asyncio.sleep(POLL_S)
        finally:
            await load.stop()
    return (
        f"block check: {_quantiles(blocks_s)}, steady {steady_blocks}/{CHECKS}; "
        f"count check: {_quantiles(counts_s)}, steady {steady_counts}/{CHECKS}"
    )


def _quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return f"median {statistics.median(ordered) * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms"


if __name__ == "__main__":
    print(asyncio.run(measure()))
