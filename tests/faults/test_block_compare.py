"""The fault rig's comparison tells a stale index from a fresh one even when the block counts agree,
with real processes (``kvlb emulate``, ``kvlb serve``).

kvlb's index of an SGLang replica is frozen by cutting its event path (every live batch dropped, the
replay socket behind a paused proxy), while requests with new prompts make the engine, full at 64
blocks, evict whole prompts and cache new ones of the same size: its count stays where the index's
is, its blocks do not. The count comparison (the rig's criterion until 2026-11-30) then says
"equal"; the block comparison says "differ", and that the index claims blocks the engine evicted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loadtests.faults.procs import MODEL
from loadtests.faults.rig import FaultRig, fault_rig

PROMPT_TOKENS = 33
"""4k + 1 tokens and ``max_tokens`` 4: whole blocks only, each prompt 9 of the engine's 64."""
MAX_REQUESTS = 40


async def complete(f: FaultRig, number: int) -> None:
    prompt = [9, number, *range(1000 + 50 * number, 1000 + 50 * number + PROMPT_TOKENS - 2)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    async with f.session.post(f.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def test_blocks_differ_where_the_counts_agree(tmp_path: Path) -> None:
    sim_args = {"r0": ("--buffer-steps", "4")}
    async with fault_rig(tmp_path, ("sglang",), sim_args=sim_args, replay_proxies=("r0",)) as f:
        for number in range(10):  # fills the cache: 7 prompts fit
            await complete(f, number)
        deadline = time.monotonic() + 10.0
        while not (reading := await f.read()).blocks_equal:
            assert time.monotonic() < deadline, reading
            await asyncio.sleep(0.05)
        assert reading.counts_equal and reading.blocks_within and reading.text is None
        f.replay_proxies["r0"].pause()
        await f.fault("r0", drop_events=1.0)
        try:
            stale = None
            for number in range(10, 10 + MAX_REQUESTS):
                await complete(f, number)
                reading = await f.read()
                if reading.counts_equal and not reading.blocks_equal:
                    stale = reading
                    break
            assert stale is not None, f"no reading with equal counts in {MAX_REQUESTS} requests: {reading}"
            assert stale.counts_within and not stale.blocks_within  # it claims blocks the engine evicted
            assert stale.text is not None and "'r0': '-" in stale.text, stale.text
            print(f"\nafter {number - 9} request(s): {stale.text}")
            assert (await f.compare()) == (False, False)
        finally:
            await f.fault("r0", drop_events=0.0)
            f.replay_proxies["r0"].resume()
