"""In-process micro-benchmark of one pool router: route + first token + release of 8k-token prompts.

Not part of ``kvlb bench``: a probe of the request path's own routing work, without HTTP. Four
replicas (block size 16), the serve defaults for the table (``TableLimits(gap_hold_s=0.5,
gap_keep_s=2.0)``), ``speculative_ttl_s`` 2 s and ``pending_ttl_s`` 30 s, the cost policy. 32 prompts
(random ids, or with ``--shared`` a 7,990-token shared prefix and 190 distinct ids each) are routed
in turn (with ``--fresh``, one prompt per request, warm-up included, each a new 64-token tail on
one 8,128-token prefix, or with ``--heads N`` on N such prefixes in turn: ``chat_shared``'s shape,
where every request lists 4 new blocks, the bench's 32 system prompts with ``--heads 32``), one
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

``--weight NAME=VALUE`` (repeatable) sets a field of the policy's ``PolicyWeights`` (default: all
defaults), e.g. ``--weight root_weight=1 --weight overlap_credit_loaded=4`` for the held-roots charge.

Instructions (repeatable on a busy machine, unlike times): ``--callgrind PART`` runs one ``in
flight`` (``--in-flight``, default 0) and, from the first timed request on, calls ``PART`` through
``operator.call``, whose inclusive cost under ``valgrind --tool=callgrind`` is then the instructions
of that part over the timed requests (no start-up, no warm-up, no prompt generation). ``request``
wraps each whole timed request (route, first token, release and, with ``--decisions``, the record);
the other parts are the methods in :data:`PARTS`. One part a run (nested parts would be counted
twice). ``PYTHONHASHSEED=0`` fixes the order of string sets, so a count repeats to the instruction.
Divide by ``--requests``::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=cg.out \
        python loadtests/bench/route_micro.py --fresh --decisions --warmup 300 --requests 300 \
        --callgrind request
    callgrind_annotate --threshold=100 --inclusive=yes cg.out | grep _operator_call

(``--threshold=100``: the default listing leaves out functions under 1% of the program, a small
part among them.) The whole run's ``PROGRAM TOTALS`` less a ``--requests 0`` run's (no
``--callgrind``, ``--prompts`` equal in both so the same prompts are made) cross-checks it: within
1% (docs/benchmark-history.md, "round 13").
"""

from __future__ import annotations

import argparse
import operator
import random
import statistics
import time
from array import array

from balancer.index.hashing import BlockHasher
from balancer.index.locked import LockedPrefixTable
from balancer.index.slots import TableLimits
from balancer.load.tracker import LoadTracker
from balancer.policy.base import PolicyWeights
from balancer.policy.cost import CostPolicy
from balancer.policy.registry import make_policy
from balancer.routing.router import Lease, PoolRequest, PoolRouter, RouteLimits
from balancer.service.decisions import DecisionLog
from balancer.types import ReplicaId
from loadtests.simulate.command import name_values

DECISION_RING = 10_000
"""Decisions kept with ``--decisions`` (``console.decision_ring_size``'s default)."""

PARTS: dict[str, tuple[type, str]] = {
    "route": (PoolRouter, "route"),
    "plan": (PoolRouter, "plan"),
    "candidates": (PoolRouter, "candidates"),
    "lease": (PoolRouter, "lease"),
    "first_token": (PoolRouter, "first_token"),
    "release": (PoolRouter, "release"),
    "request_keys": (BlockHasher, "request_keys"),
    "match_confirmed": (LockedPrefixTable, "match_confirmed"),
    "add_speculative": (LockedPrefixTable, "add_speculative"),
    "load_snapshot": (PoolRouter, "load_snapshot"),
    "policy": (CostPolicy, "__call__"),
    "reserve": (LoadTracker, "reserve"),
    "record": (DecisionLog, "record"),
}
"""``--callgrind`` parts: the method called through ``operator.call`` (one C function to annotate)."""


def wrap(part: str) -> None:
    """Route every later call of ``part``'s method through ``operator.call`` (for callgrind)."""
    cls, name = PARTS[part]
    inner = getattr(cls, name)

    def through_call(*args: object, **kwargs: object) -> object:
        return operator.call(inner, *args, **kwargs)

    setattr(cls, name, through_call)


def prompts(shared: bool, seed: int = 1, fresh: int = 0, heads: int = 1) -> list[array[int]]:
    rng = random.Random(seed)
    if fresh:  # chat_shared's shape: 8,128-token shared prefixes in turn, a new 64-token tail each
        prefixes = [array("I", [rng.randrange(1, 100_000) for _ in range(8128)]) for _ in range(heads)]
        return [
            prefixes[i % heads] + array("I", [rng.randrange(1, 100_000) for _ in range(64)])
            for i in range(fresh)
        ]
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
    callgrind: str | None = None,
    weights: PolicyWeights | None = None,
) -> tuple[list[float], float]:
    """The wall time of each timed request, and the CPU time per timed request (seconds); from the
    first timed request on, ``callgrind`` (a :data:`PARTS` name, or ``request``) is called through
    ``operator.call``."""
    router = PoolRouter(
        "m",
        TableLimits(gap_hold_s=0.5, gap_keep_s=2.0),
        route_limits=RouteLimits(speculative_ttl_s=2.0, pending_ttl_s=30.0),
    )
    for i in range(4):
        router.add_replica(ReplicaId(f"r{i}"), 16, "plain")
    policy = make_policy("cost")
    weights = weights or PolicyWeights()
    prefilling: list[Lease] = []
    decoding: list[Lease] = []
    times: list[float] = []
    now = 1000.0
    cpu_started = 0.0

    def step(i: int, now: float) -> None:
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

    for i in range(warmup + requests):
        if i == warmup:
            cpu_started = time.process_time()
            if callgrind is not None and callgrind != "request":
                wrap(callgrind)
        now += 0.001
        started = time.perf_counter()
        if callgrind == "request" and i >= warmup:
            operator.call(step, i, now)
        else:
            step(i, now)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times, (time.process_time() - cpu_started) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", action="store_true", help="prompts sharing a 7,990-token prefix")
    parser.add_argument(
        "--fresh", action="store_true", help="a new 64-token tail a request on a shared 8,128-token prefix"
    )
    parser.add_argument(
        "--heads",
        type=int,
        default=1,
        help="--fresh: shared prefixes taken in turn (default 1; 32 as the bench)",
    )
    parser.add_argument("--decisions", action="store_true", help="keep decisions as kvlb serve does")
    parser.add_argument("--requests", type=int, default=3000, help="requests timed (default 3000)")
    parser.add_argument("--warmup", type=int, default=300, help="requests before the timed (default 300)")
    parser.add_argument("--in-flight", type=int, help="only this in flight (default: 0, then 32)")
    parser.add_argument("--prompts", type=int, help="--fresh prompts made (default warm-up + requests)")
    parser.add_argument("--callgrind", choices=["request", *PARTS], help="call it through operator.call")
    parser.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a PolicyWeights field (repeatable; null unsets an optional one)",
    )
    args = parser.parse_args()
    weights = PolicyWeights.from_dict(name_values(args.weight, "--weight"))
    fresh = max(args.prompts or 0, args.warmup + args.requests) if args.fresh else 0
    if args.heads < 1:
        parser.error("--heads must be at least 1")
    bodies = prompts(args.shared, fresh=fresh, heads=args.heads)
    in_flights = (0, 32) if args.in_flight is None and args.callgrind is None else (args.in_flight or 0,)
    for in_flight in in_flights:
        log = DecisionLog(DECISION_RING, 128 * 1024 * 1024) if args.decisions else None
        times, cpu = run(bodies, in_flight, args.requests, args.warmup, log, args.callgrind, weights)
        if not times:
            continue
        p50, mean = statistics.median(times) * 1e6, statistics.mean(times) * 1e6
        cpu_us = cpu * 1e6
        print(f"in flight {in_flight}: p50 {p50:.1f} us, mean {mean:.1f} us, cpu {cpu_us:.1f} us per request")


if __name__ == "__main__":
    main()
