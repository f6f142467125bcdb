"""In-process micro-benchmark of one pool router: route + first token + release of 8k-token prompts.

Not part of ``kvlb bench``: a probe of the request path's own routing work, without HTTP. Four
replicas (block size 16), the serve defaults for the table (``TableLimits(gap_hold_s=0.5,
gap_keep_s=2.0)``), ``speculative_ttl_s`` 2 s and ``pending_ttl_s`` 30 s, the cost policy. 32 prompts
(random ids, or with ``--shared`` a 7,990-token shared prefix and 190 distinct ids each) are routed
in turn (with ``--fresh``, one prompt per request, warm-up included, each a new 64-token tail on
one 8,128-token prefix: ``chat_shared``'s shape, where every request lists 4 new blocks), one
simulated millisecond apart.
With ``in flight`` N, a request's first token comes N/2 routes after its lease and its release N/2
after that; with 0, both come right after the lease.
Prints the p50 and mean wall time per request (route, first token and release) of 3,000 requests
after 300 of warm-up, and the process's CPU time per request over those 3,000 (on a machine shared
with other work, preemption inflates the wall times, not the CPU time). With ``--decisions`` every
committed decision is also kept in a console decision ring of 10,000 as ``kvlb serve`` keeps it
(:class:`~balancer.service.decisions.DecisionLog`), so the garbage collector sees what a serving
process holds; ``--requests`` times more requests (past 10,000 the ring is full and evicting).

    PYTHONPATH=$PWD python loadtests/bench/route_micro.py [--shared | --fresh] [--decisions] [--requests N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array

from balancer.index.slots import TableLimits
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import Lease, PoolRequest, PoolRouter, RouteLimits
from balancer.service.decisions import DecisionLog

DECISION_RING = 10_000
"""Decisions kept with ``--decisions`` (``console.decision_ring_size``'s default)."""


def prompts(shared: bool, seed: int = 1, fresh: int = 0) -> list[array[int]]:
    rng = random.Random(seed)
    if fresh:  # chat_shared's shape: one 8,128-token shared prefix, a new 64-token tail each
        head = array("I", [rng.randrange(1, 100_000) for _ in range(8128)])
        return [head + array("I", [rng.randrange(1, 100_000) for _ in range(64)]) for _ in range(fresh)]
    if not shared:
        return [array("I", [rng.randrange(1, 100_000) for _ in range(8192)]) for _ in range(32)]
    prefix = [rng.randrange(1, 100_000) for _ in range(7990)]
    return [array("I", prefix + [rng.randrange(1, 100_000) for _ in range(190)]) for _ in range(32)]


def run(
    bodies: list[array[int]],
    in_flight: int,
    requests: int = 3000,
    warmup: int = 300,
    decisions: DecisionLog | None = None,
) -> tuple[list[float], float]:
    """The wall time of each timed request, and the CPU time per timed request (seconds)."""
    router = PoolRouter(
        "m",
        TableLimits(gap_hold_s=0.5, gap_keep_s=2.0),
        route_limits=RouteLimits(speculative_ttl_s=2.0, pending_ttl_s=30.0),
    )
    for i in range(4):
        router.add_replica(f"r{i}", 16, "plain")
    policy, weights = make_policy("cost"), PolicyWeights()
    prefilling: list[Lease] = []
    decoding: list[Lease] = []
    times: list[float] = []
    now = 1000.0
    cpu_started = 0.0
    for i in range(warmup + requests):
        if i == warmup:
            cpu_started = time.process_time()
        now += 0.001
        started = time.perf_counter()
        lease = router.route(PoolRequest(bodies[i % len(bodies)], policy, weights, f"q{i}"), now)
        prefilling.append(lease)
        plan = lease.plan
        if decisions is not None and plan.inputs is not None:  # as the service's record_commit
            decisions.record(
                "m", plan.inputs, plan.decision, weights, plan.prompt_tokens, plan.cached_tokens, None, now
            )
        if len(prefilling) > in_flight // 2:
            lease = prefilling.pop(0)
            lease.first_token(now)
            decoding.append(lease)
        if len(decoding) > in_flight // 2:
            decoding.pop(0).release(now)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times, (time.process_time() - cpu_started) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", action="store_true", help="prompts sharing a 7,990-token prefix")
    parser.add_argument(
        "--fresh", action="store_true", help="a new 64-token tail a request on a shared 8,128-token prefix"
    )
    parser.add_argument("--decisions", action="store_true", help="keep decisions as kvlb serve does")
    parser.add_argument("--requests", type=int, default=3000, help="requests timed (default 3000)")
    args = parser.parse_args()
    bodies = prompts(args.shared, fresh=300 + args.requests if args.fresh else 0)
    for in_flight in (0, 32):
        log = DecisionLog(DECISION_RING, 128 * 1024 * 1024) if args.decisions else None
        times, cpu = run(bodies, in_flight, args.requests, decisions=log)
        p50, mean = statistics.median(times) * 1e6, statistics.mean(times) * 1e6
        cpu_us = cpu * 1e6
        print(f"in flight {in_flight}: p50 {p50:.1f} us, mean {mean:.1f} us, cpu {cpu_us:.1f} us per request")


if __name__ == "__main__":
    main()
