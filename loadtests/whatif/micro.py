"""What recording a decision and replaying the ring cost, in process (``python -m loadtests.whatif.micro``).

Routes ``--decisions`` requests through a real :class:`~balancer.routing.router.PoolRouter` (4
replicas, 4 shared prefixes of 8 blocks, random suffixes, a third of the leases released), keeps
every decision in a :class:`~balancer.service.decisions.DecisionLog` with the app's metric
callbacks and the spans of the released ones' load (:meth:`DecisionLog.on_phase`, as the service
keeps them), then times: ``PoolRouter.route`` (select and commit, for scale), ``DecisionLog.record``
(the cost added at commitment), keeping the two spans (``spans_us_mean``, per released request), and
:func:`~balancer.service.whatif.replay` of the whole ring with the weights in force and with
``overlap_credit`` 0.5, without pauses (the worker thread's pure CPU time); and the event loop's lag
(how late a 0.5 ms ``asyncio.sleep`` wakes) while nothing else runs, while replays run back to back
in a worker thread without pauses, and paced as kvlb paces them (:class:`ReplayPacer`). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from balancer.api.console import ReplayPacer
from balancer.app import Balancer
from balancer.config import Settings
from balancer.events import Stored
from balancer.health.book import HealthBook
from balancer.index.hashing import pack_tokens
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRequest, PoolRouter, RouteLimits
from balancer.service.whatif import replay
from balancer.types import EngineHash, ReplicaId

REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]


def _prefix(i: int) -> list[int]:
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + 128))


def _router() -> PoolRouter:
    health = HealthBook()
    for replica in REPLICAS:
        health.add(replica, probe_ok=True)
    router = PoolRouter("m", health=health, route_limits=RouteLimits(max_inflight_per_replica=1_000_000))
    for i, replica in enumerate(REPLICAS):
        router.add_replica(replica, 16, "plain")
        hashes = tuple(EngineHash(100 * i + 1 + k) for k in range(8))
        stored = Stored(
            dp_rank=0, parent=None, engine_hashes=hashes, tokens=pack_tokens(_prefix(i)), block_size=16
        )
        router.space_of[replica].table.apply(replica, [stored], now=0.0)
    return router


def measure(decisions: int, seed: int) -> dict[str, Any]:
    router = _router()
    log = Balancer(Settings())._decision_log()
    policy, weights = make_policy("cost"), PolicyWeights()
    rng = random.Random(seed)
    leases = []
    recording = routing = spans = 0.0
    spanned = 0
    for k in range(decisions):
        now = 1.0 + k * 0.01
        tokens = _prefix(rng.randrange(4))[: rng.choice([64, 128])] + [
            rng.randrange(50_000) for _ in range(64)
        ]
        started = time.perf_counter()
        lease = router.route(PoolRequest(tokens, policy, weights, f"q{k}"), now)
        routing += time.perf_counter() - started
        plan = lease.plan
        assert plan.inputs is not None
        started = time.perf_counter()
        record = log.record(
            "m", plan.inputs, plan.decision, weights, plan.prompt_tokens, plan.cached_tokens, None, now
        )
        lease.on_phase = partial(log.on_phase, "m", record.id, plan.inputs.load.now)
        recording += time.perf_counter() - started
        leases.append(lease)
        if k % 3 == 0:
            done = leases.pop(0)
            hook, done.on_phase = done.on_phase, None
            assert hook is not None
            started = time.perf_counter()  # what keeping the two spans adds to a request
            hook(now, False)
            hook(now, True)
            spans += time.perf_counter() - started
            spanned += 1
            done.first_token(now)
            done.release(now)
    records = log.ring("m").snapshot()
    replays: dict[str, Any] = {}
    for label, proposed in (
        ("unchanged", weights),
        ("overlap_credit=0.5", weights.replace(overlap_credit=0.5)),
    ):
        started = time.perf_counter()
        result = replay("m", records, make_policy("cost"), proposed)
        replays[label] = {"seconds": round(time.perf_counter() - started, 3), "changed": result.changed}
    lags = {
        "idle": asyncio.run(_loop_lag(None)),
        "replay, no pauses": asyncio.run(
            _loop_lag(lambda: replay("m", records, make_policy("cost"), weights))
        ),
        "replay, paced as kvlb does": asyncio.run(
            _loop_lag(
                lambda: replay(
                    "m",
                    records,
                    make_policy("cost"),
                    weights,
                    pause=ReplayPacer(threading.Event()),
                    pause_every=1,
                )
            )
        ),
    }
    return {
        "loop_lag_ms": lags,
        "decisions": len(records),
        "replicas": len(REPLICAS),
        "route_us_mean": round(1e6 * routing / decisions, 2),
        "record_us_mean": round(1e6 * recording / decisions, 2),
        "spans_us_mean": round(1e6 * spans / max(1, spanned), 2),
        "ring_bytes_estimate": log.ring("m").stats.bytes,
        "replay": replays,
    }


async def _loop_lag(background: Callable[[], object] | None, ticks: int = 1000) -> dict[str, float]:
    """How late ``asyncio.sleep(0.5 ms)`` wakes (event-loop lag) while ``background`` runs in a
    worker thread (again and again until the ticks are done): the GIL wait a replay adds to every
    step of routing."""
    done = threading.Event()

    def loop_background() -> None:
        while background is not None and not done.is_set():
            background()

    worker = asyncio.get_running_loop().run_in_executor(None, loop_background)
    lags = []
    try:
        for _ in range(ticks):
            started = time.perf_counter()
            await asyncio.sleep(0.0005)
            lags.append(time.perf_counter() - started - 0.0005)
    finally:
        done.set()
        await worker
    lags.sort()
    return {
        q: round(1e3 * lags[int(f * (len(lags) - 1))], 3)
        for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decisions", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.decisions, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
