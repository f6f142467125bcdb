"""Replica fault scenarios and their runner (I/O): steady load → fault → recovery → convergence.

Each scenario starts a fleet (three emulated replicas: two SGLang, one TRT-LLM, unless it says
otherwise) and one ``kvlb serve``, runs the load of :mod:`loadtests.faults.load` for a warm-up,
injects its fault, undoes it (or lets kvlb route around it), and measures from that moment how long
the index takes to match the engines' caches again while the load goes on. ``scale`` stretches every
phase (1 in ``make test``, 4 in ``make faults``). The faults here touch replicas only; the soak of
``kvlb loadtest --duration`` injects them in turn. ``tests/faults/scenarios.py`` adds the Redis ones.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtests.faults.load import Load, percentile
from loadtests.faults.rig import FaultRig, fault_rig

CONVERGE_LIMIT_S = 2.0
"""The target: the index matches the engines within this long after the fault."""
MEASURE_LIMIT_S = 15.0
"""How long convergence is waited for (the figure is reported even when over the target)."""
FAULT_TIMEOUTS = {"connect_s": 0.5, "first_byte_s": 1.5, "idle_s": 1.5}
"""kvlb's upstream timeouts in fault runs: a hung replica costs 1.5 s, not the default minute."""

Inject = Callable[[FaultRig, float, Load], Awaitable[str]]
"""Injects the fault, waits ``hold_s``, recovers; returns a note for the report."""
Verify = Callable[[FaultRig], Awaitable[str]]
"""Checks the fleet once the index converged (raises ``AssertionError``); returns a note."""
Excuse = Callable[[FaultRig], Awaitable[str | None]]
"""After the measurement: why this run's index cannot match the engines exactly (a loss the run
shows, e.g. a resync it counted), or ``None``."""


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    inject: Inject
    engines: tuple[str, ...] = ("sglang", "sglang", "trtllm")
    sim_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    hold_s: float = 1.5
    rate: float = 20.0
    redis: bool = False
    """FaultRig mode: a private ``redis-server`` (append-only file), reached through a delay proxy."""
    kvlbs: int = 1
    """kvlb instances (more than one only with ``redis``); the load and the checks use the first."""
    cluster: bool = False
    """With ``redis``: a 3-master, 3-replica Redis Cluster instead of one server (no delay proxy)."""
    converge_limit_s: float = CONVERGE_LIMIT_S
    """The convergence target of this scenario (seconds after the recovery)."""
    replay_proxies: tuple[str, ...] = ()
    """Replicas whose replay socket kvlb reaches through a proxy the fault can pause
    (:attr:`FaultRig.replay_proxies`)."""
    verify: Verify | None = None
    """Run after the convergence measurement, with the load still on; its note is appended."""
    exact: bool = True
    """Whether the index must match the engines exactly within the target. ``False`` after a resync:
    the engine still holds blocks stored before the gap that no event will name again, so the index
    only catches up as they are evicted; it must then at least hold nothing the engine lacks."""
    inexact: Excuse | None = None
    """For a fault that loses events only in some runs: asked after the measurement, a reason found
    in this run (a resync it counted) holds it to the ``exact=False`` check and goes into the note."""
    criterion: str = "blocks"
    """What the checks assert on: ``"blocks"`` (the index holds the engines' very blocks, by key) or
    ``"counts"`` (as many blocks; for a scenario whose blocks' match was measured over its target:
    ``docs/reliability.md``, "Open points"). Both are measured and reported either way."""


@dataclass
class Result:
    scenario: str
    title: str
    sent: int
    ok: int
    retried: int
    stream_errors: int
    upstream_errors: int
    refused: int
    lost: int
    converge_s: float | None
    """Until the index matches the engines' caches block for block (the same block keys)."""
    within_s: float | None
    """Until the index holds no block the engines lack (block keys)."""
    rss_mb: float
    p99_s: float
    """Of the successful requests, over the whole run."""
    p99_fault_s: float
    """Of the successful requests started while the fault was on."""
    counters: dict[str, float]
    note: str
    lost_details: list[str]
    exact: bool = True
    """Whether the exact match was required: the scenario's ``exact``, unless its ``inexact`` found
    a reason in this run."""
    converge_count_s: float | None = None
    """Until the index holds as many blocks as each engine (the criterion until 2026-11-30)."""
    within_count_s: float | None = None
    """Until the index holds no more blocks than each engine."""
    criterion: str = "blocks"
    """What the checks assert on (the scenario's :attr:`Scenario.criterion`)."""

    @property
    def asserted(self) -> tuple[float | None, float | None]:
        """``(within_s, converge_s)`` of the criterion the checks assert on."""
        if self.criterion == "counts":
            return self.within_count_s, self.converge_count_s
        return self.within_s, self.converge_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


INTERESTING = (
    "kvlb_upstream_retries_total",
    "kvlb_events_seq_gaps_total",
    "kvlb_events_replays_total",
    "kvlb_events_replay_polls_total",
    "kvlb_events_resyncs_total",
    "kvlb_events_queue_overflow_total",
    "kvlb_route_receipts_total",
    "kvlb_index_receipt_confirmed_blocks_total",
    "kvlb_index_receipt_taught_blocks_total",
    "kvlb_index_receipt_drops_blocks_total",
)
"""kvlb's counters whose change over a scenario goes into its result."""


async def run_in_fleet(
    scenario: Scenario, tmp: Path, scale: float, top: dict[str, Any], context: dict[str, Any]
) -> Result:
    """Run ``scenario`` on a fresh fleet; ``top`` is added to kvlb's config, ``context`` to the fleet's."""
    engines, args, kvlbs = scenario.engines, scenario.sim_args, scenario.kvlbs
    proxies = scenario.replay_proxies
    async with fault_rig(tmp, engines, sim_args=args, kvlbs=kvlbs, replay_proxies=proxies, **top) as f:
        f.context = context
        before = await f.metrics()
        load = Load(f.url, rate=scenario.rate, seed=hash(scenario.name) & 0xFFFF)
        load.start()
        try:
            await asyncio.sleep(1.5 * scale)
            injected = time.monotonic()
            note = await scenario.inject(f, scenario.hold_s * scale, load)
            recovered = time.monotonic()
            times = await f.time_to_converge(recovered, MEASURE_LIMIT_S)
            converge_s = times.equal_count_s if scenario.criterion == "counts" else times.equal_s
            if times.equal_s is None:
                note += f"; blocks not matched after {MEASURE_LIMIT_S}s: {await f.divergence()}"
            exact = scenario.exact
            excuse = None if scenario.inexact is None else await scenario.inexact(f)
            if exact and excuse is not None:
                exact, note = False, f"{note}; {excuse}"
            if converge_s is None or converge_s > scenario.converge_limit_s:
                note += f"; {times.steady} of {times.checks} checks steady"
                note += "; differing readings: " + (" | ".join(f.trail) or "none")
            if scenario.verify is not None:
                note += "; " + await scenario.verify(f)
            await asyncio.sleep(max(0.0, 1.0 * scale - (time.monotonic() - recovered)))
            rss_mb = f.kvlb.rss_bytes() / 2**20
        finally:
            await load.stop()
        after = await f.metrics()
        counts = load.counts()
        delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in INTERESTING}
        return Result(
            scenario=scenario.name,
            title=scenario.title,
            sent=len(load.records),
            ok=counts["ok"],
            retried=int(delta["kvlb_upstream_retries_total"]),
            stream_errors=counts["stream_error"],
            upstream_errors=counts["upstream_error"],
            refused=counts["refused"],
            lost=counts["lost"],
            converge_s=times.equal_s,
            within_s=times.within_s,
            rss_mb=round(rss_mb, 1),
            p99_s=round(percentile(load.latencies_s(), 0.99), 3),
            p99_fault_s=round(percentile(load.latencies_s(injected, recovered), 0.99), 3),
            counters=delta,
            note=note,
            lost_details=[r.detail for r in load.records if r.outcome == "lost"][:5],
            exact=exact,
            converge_count_s=times.equal_count_s,
            within_count_s=times.within_count_s,
            criterion=scenario.criterion,
        )


# ------------------------------------------------------------------------------------------ faults


async def crash_mid_stream(f: FaultRig, hold_s: float, load: Load) -> str:
    """SIGKILL a replica with streams in flight; an orchestrator starts it again ``hold_s`` later."""
    streams, records = await load.long_streams(6)
    await f.replica("r0").kill()
    await asyncio.sleep(hold_s)
    await f.restart_replica("r0")
    await asyncio.gather(*streams)
    cut = [r.outcome for r in records if r.replica == "r0"]
    return f"r0 SIGKILLed with {len(cut)} long stream(s) on it ({', '.join(cut) or '-'}), restarted"


async def restart_flushed(f: FaultRig, hold_s: float, load: Load) -> str:
    """The engine restarts in place: in-flight requests cut, cache emptied, events from seq 0."""
    await f.fault("r0", restart=True)
    await f.fault("r2", restart=True)
    return "r0 (SGLang) and r2 (TRT-LLM) restarted"


async def _drop_events(f: FaultRig, replica: str, fraction: float, hold_s: float) -> int:
    """Drop ``fraction`` of ``replica``'s event batches (after their seq was taken) for ``hold_s``;
    returns how many were dropped."""
    await f.fault(replica, drop_events=fraction)
    await asyncio.sleep(hold_s)
    stats = await f.fault(replica, drop_events=0.0)
    return int(stats["dropped_batches"])


async def hwm_loss(f: FaultRig, hold_s: float, load: Load) -> str:
    """Half of r0's event batches lost after their seq was taken (a PUB high-water mark)."""
    return f"r0 lost {await _drop_events(f, 'r0', 0.5, hold_s)} batches"


async def gap_beyond_buffer(f: FaultRig, hold_s: float, load: Load) -> str:
    """Every batch lost for ``hold_s`` while the replay buffer keeps only 4: replay cannot fill it."""
    return f"r0 lost {await _drop_events(f, 'r0', 1.0, hold_s)} batches, replay buffer 4"


async def gap_partitioned(f: FaultRig, hold_s: float, load: Load) -> str:
    """r0's event path partitioned for ``hold_s`` while the engine goes on: every live batch lost (its
    PUB drops them) and its replay socket unreachable (kvlb's requests wait until the partition heals),
    so the 4-batch buffer rotates past the lost batches whatever kvlb polls: a true gap beyond it."""
    proxy = f.replay_proxies["r0"]
    proxy.pause()
    try:
        dropped = await _drop_events(f, "r0", 1.0, hold_s)
    finally:
        proxy.resume()
    return f"r0 lost {dropped} batches, replay buffer 4 unreachable meanwhile"


async def trtllm_overflow(f: FaultRig, hold_s: float, load: Load) -> str:
    """TRT-LLM's event buffer overflows: events dropped after their ``event_id`` was taken."""
    return f"r2 lost {await _drop_events(f, 'r2', 0.5, hold_s)} event batches (event_id gaps)"


async def slow_replica(f: FaultRig, hold_s: float, load: Load) -> str:
    await f.fault("r1", slowdown=10.0)
    await asyncio.sleep(hold_s * 2)
    await f.fault("r1", slowdown=1.0)
    return "r1 at 10x step time"


async def hung_replica(f: FaultRig, hold_s: float, load: Load) -> str:
    """SIGSTOP: the kernel still accepts r1's connections, nothing ever answers them."""
    f.replica("r1").signal(signal.SIGSTOP)
    await asyncio.sleep(hold_s * 2)
    f.replica("r1").signal(signal.SIGCONT)
    await f.wait_routable("r1")
    return "r1 SIGSTOPped (accepts, never answers), then SIGCONT"


REPLICA_SCENARIOS = {
    s.name: s
    for s in (
        Scenario("crash_mid_stream", "replica crash mid-stream (SIGKILL, restart)", crash_mid_stream),
        Scenario("restart_flushed", "replica restart with flushed cache", restart_flushed),
        Scenario("hwm_loss_replay", "PUB HWM event loss (seq gap) → replay", hwm_loss),
        Scenario(
            "gap_beyond_replay",
            "live stream lost, replay buffer of 4 batches → polled replay (resync if a poll is late)",
            gap_beyond_buffer,
            sim_args={"r0": ("--buffer-steps", "4")},
            exact=False,
        ),
        Scenario(
            "gap_partitioned",
            "live stream lost, replay buffer of 4 unreachable (partition) → true gap, resync",
            gap_partitioned,
            sim_args={"r0": ("--buffer-steps", "4")},
            replay_proxies=("r0",),
            exact=False,
        ),
        Scenario(
            "trtllm_overflow", "TRT-LLM buffer overflow (event_id gap) → resync", trtllm_overflow, exact=False
        ),
        Scenario("slow_replica", "slow replica (10× step time)", slow_replica),
        Scenario("hung_replica", "replica accepts connections, never answers", hung_replica),
    )
}
"""The faults that need nothing but the replicas (no Redis), by name."""
