"""Diagnostic: one long run of ``kvlb_killed`` with a trace of the convergence check (I/O).

Run from the root of a checkout (``PYTHONPATH=$PWD python tests/faults/trace_takeover.py OUT.json``;
for an A/B, run this file from the root of a ``git archive`` of the other revision: it imports that
tree's scenarios). For 10 s from the moment the scenario starts measuring (the kill before
2026-11-30, the takeover since), every 0.05 s it records the engines' block counts, the first kvlb's
index counts and the leases it holds, and the first exact match as the suite's check counts it. It
prints one JSON line: the result's figures, when the first kvlb held the dead one's leases
(``takeover_s``), the first exact match after that (``equal_after_takeover_s``), and the most blocks
each taken-over replica's index lacked within 1.5 s of the takeover (``max_lack_after_takeover``).
The trace goes to ``OUT.json``.

The suite's convergence check (:meth:`FaultRig.time_to_converge`) is replaced here by the tracing
loop, which measures the same way and keeps going: a diagnostic of the rig, not of kvlb.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = ["tests/faults", "tests/integration", "tests"]

import scenarios  # noqa: E402 (the tree's suite, from the working directory)

from loadtests.faults import rig  # noqa: E402

TRACE_S = 10.0
TRACE: list[dict[str, Any]] = []


async def _traced(self: rig.FaultRig, since: float, limit_s: float) -> rig.Convergence:
    within_s = converge_s = None
    while time.monotonic() < since + TRACE_S:
        before = await self.engine_blocks()
        index = await self.index_blocks(self.url)
        after = await self.engine_blocks()
        async with self.session.get(self.url + "/admin/fleet") as response:
            leases = ((await response.json())["fleet"] or {}).get("leases", [])
        t = time.monotonic() - since
        TRACE.append(
            {"t": round(t, 3), "engines": before, "engines_again": after, "index": index, "leases": leases}
        )
        if before is not None and before == after:
            if within_s is None and all(index.get(n, 0) <= c for n, c in before.items()):
                within_s = t
            if converge_s is None and index == before:
                converge_s = t
        await asyncio.sleep(rig.POLL_S)
    return rig.Convergence(None, None, within_s, converge_s)  # counts only (the trace's criterion)


def _analyse(held: list[str]) -> dict[str, Any]:
    steady = [e for e in TRACE if e["engines"] is not None and e["engines"] == e["engines_again"]]
    takeover = next((e["t"] for e in TRACE if set(held) <= set(e["leases"])), None)
    if takeover is None:
        return {"takeover_s": None}
    after = [e for e in steady if e["t"] >= takeover]
    window = [e for e in after if e["t"] <= takeover + 1.5]
    lack = {r: max((e["engines"][r] - e["index"].get(r, 0) for e in window), default=None) for r in held}
    return {
        "takeover_s": takeover,
        "equal_after_takeover_s": next((e["t"] for e in after if e["index"] == e["engines"]), None),
        "max_lack_after_takeover": lack,
    }


async def main() -> dict[str, Any]:
    """Run the scenario once; its summary, result, trace and run directory."""
    rig.FaultRig.time_to_converge = _traced  # type: ignore[method-assign]
    tmp = Path(tempfile.mkdtemp(prefix="kvlb-trace-"))
    result = (await scenarios.run(scenarios.SCENARIOS["kvlb_killed"], tmp, scale=4.0)).to_json()
    held = result["note"].split(": ", 1)[1].split(";")[0].split(", ")
    summary = {
        "converge_s": result["converge_count_s"],
        "within_s": result["within_count_s"],
        "resyncs": result["counters"]["kvlb_events_resyncs_total"],
        "note": result["note"],
        **_analyse(held),
    }
    return {"summary": summary, "result": result, "trace": TRACE, "tmp": str(tmp)}


if __name__ == "__main__":
    data = asyncio.run(main())
    Path(sys.argv[1]).write_text(json.dumps(data))
    print(json.dumps(data["summary"]))
