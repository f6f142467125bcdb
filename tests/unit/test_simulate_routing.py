"""The simulator's routing: the sharded tracker equals one LoadTracker, and pruned candidate sets
give the policy's choice over the full set (exactly, up to ties)."""

from __future__ import annotations

import random

import pytest

from balancer.errors import Overloaded
from balancer.events import Removed, Stored
from balancer.index.hashing import pack_tokens
from balancer.index.slots import TableLimits
from balancer.load.tracker import EngineStats, LoadConfig, LoadTracker
from balancer.policy.base import PolicyWeights
from balancer.policy.cost import loaded_credit
from balancer.routing.router import RoutePlan
from balancer.types import EngineHash, ReplicaId
from loadtests.simulate.load_order import LoadOrder
from loadtests.simulate.routing import ShardedTracker, SimRouter

BLOCK = 4
PREVIOUS_DEFAULT = {"overlap_credit_loaded": None, "root_weight": 0.0}
"""The default weights before 2026-11-29 (the held-roots charge off, the credit constant)."""


def test_sharded_tracker_matches_one_tracker() -> None:
    rng = random.Random(11)
    names = [ReplicaId(f"r{i}") for i in range(5)]
    config = LoadConfig(block_size_tokens=BLOCK, max_age_s=50.0)
    plain, sharded = LoadTracker(config), ShardedTracker(config)
    live: list[str] = []
    now = 0.0
    for n in range(400):
        now += rng.uniform(0.0, 0.5)
        op = rng.random()
        if op < 0.4 or not live:
            rid, replica = f"q{n}", rng.choice(names)
            args = (rid, replica, rng.randrange(0, 500), rng.randrange(1, 40), now)
            assert plain.reserve(*args) == sharded.reserve(*args)
            live.append(rid)
        elif op < 0.6:
            rid = rng.choice(live)
            assert plain.first_token(rid, now) == sharded.first_token(rid, now)
        elif op < 0.85:
            rid = live.pop(rng.randrange(len(live)))
            assert plain.release(rid, now) == sharded.release(rid, now)
        else:
            stats = EngineStats(rng.randrange(0, 9), rng.randrange(0, 9), rng.random())
            replica = rng.choice(names)
            assert plain.observe(replica, stats, now) == sharded.observe(replica, stats, now)
        assert plain.snapshot(now).replicas == sharded.snapshot(now).replicas
        for replica in names:  # the interference scan's shortcut reads the same count
            assert sharded.decoding(replica, now) == sharded.load_of(replica, now).active_decode_seqs
    sharded.focus = names[:2]
    assert set(sharded.snapshot(now).replicas) <= set(names[:2])
    assert plain.stats().released_total == sharded.stats().released_total


def test_load_order_returns_least_keys_and_skips_superseded() -> None:
    order = LoadOrder(random.Random(1))
    for n, key in enumerate([5.0, 1.0, 3.0, 2.0]):
        order.update(ReplicaId(f"r{n}"), key)
    order.update(ReplicaId("r1"), 9.0)  # supersedes its key 1.0
    assert order.least(2, lambda _: True)[0] == ["r3", "r2"]
    assert order.least(2, lambda r: r != "r3")[0] == ["r2", "r0"]
    assert order.least(10, lambda _: True)[0] == ["r3", "r2", "r0", "r1"]  # the heap was left intact
    order.discard(ReplicaId("r2"))
    assert order.least(10, lambda _: True)[0] == ["r3", "r0", "r1"]


def test_load_order_bound_scans_on_while_a_cheaper_replica_may_follow() -> None:
    order = LoadOrder(random.Random(1))
    for name, key in (("a", 1.0), ("b", 2.0), ("c", 4.0), ("d", 7.0)):
        order.update(ReplicaId(name), key)
    extra = {"a": 5.0, "b": 3.0, "c": 0.0, "d": 0.0}  # cost = key + extra
    chosen, best = order.least(1, lambda _: True, lambda key, r: key + extra[r])
    assert chosen == ["a", "b", "c"]  # d's key 7 is not below the best cost, 4 (c)
    assert best == 4.0
    chosen, best = order.least(1, lambda _: True, lambda key, r: key + extra[r], best=1.5)
    assert (chosen, best) == (["a"], 1.5)  # a bound from elsewhere stops the scan at once


def _fleet(
    seed: int, policy: str, weights: PolicyWeights, replicas: int = 12
) -> tuple[SimRouter, list[tuple[int, ...]]]:
    rng = random.Random(seed)
    names = [ReplicaId(f"r{i:02d}") for i in range(replicas)]
    router = SimRouter(
        names, model="m", block_size=BLOCK, policy=policy, weights=weights, rng=random.Random(seed),
        limits=TableLimits(), max_inflight_per_replica=5, prune_k=2,
    )  # fmt: skip
    prefixes = [tuple(rng.randrange(1000, 5000) for _ in range(40)) for _ in range(6)]
    for n, replica in enumerate(names):  # every replica caches a random depth of two prefixes
        for k, prefix in enumerate(rng.sample(prefixes, 2)):
            depth = rng.randrange(1, 10)
            hashes = tuple(EngineHash(1000 * n + 100 * k + i) for i in range(depth))
            stored = Stored(0, None, hashes, pack_tokens(prefix[: depth * BLOCK]), BLOCK)
            router.apply(replica, [stored], 0.0)
    for n in range(3 * replicas):  # real load: routed, some past their first token
        tokens = (
            *rng.choice(prefixes)[: rng.randrange(4, 40)],
            *(rng.randrange(5000, 9000) for _ in range(9)),
        )
        router.route(f"warm{n}", tokens, rng.randrange(1, 64), None, 0.5)
    for n in range(0, 3 * replicas, 2):
        replica = router.tracker._owner[f"warm{n}"]
        router.first_token(f"warm{n}", replica, 0.6)
    for replica in names:
        capacity = rng.choice([10, 14, 20, 40, None])  # blocks: full, pressured, half-full, empty, unknown
        usage = rng.choice([0.2, 0.5, 0.97])
        stats = EngineStats(1, rng.randrange(0, 4), usage, None if capacity is None else capacity * BLOCK)
        router.observe(replica, stats, 0.7)
    return router, [list(p) for p in prefixes]  # type: ignore[misc]


def _plan(
    router: SimRouter,
    tokens: list[int],
    candidates: list[ReplicaId],
    seed: int,
    weights: PolicyWeights | None = None,
    now: float = 1.0,
) -> RoutePlan:
    router.tracker.focus = candidates
    weights = router.weights if weights is None else weights
    try:
        return router.router.plan(tokens, candidates, router.policy, weights, random.Random(seed), now)
    finally:
        router.tracker.focus = None


def _best(plan: RoutePlan) -> tuple[float, list[ReplicaId]]:
    scored = [(t.cost, t.replica) for t in plan.decision.terms if t.excluded is None and t.cost is not None]
    low = min(cost for cost, _ in scored)
    return low, [r for cost, r in scored if cost <= low + 1e-9 * max(1.0, abs(low))]


@pytest.mark.parametrize(
    ("policy", "weights"),
    [
        ("cost", PolicyWeights()),  # the default: the ramp, the held-roots charge
        ("cost", PolicyWeights(**PREVIOUS_DEFAULT)),
        # the held-roots charge alone (key-order scan without the interference charge), and stronger
        ("cost", PolicyWeights(root_weight=2.0, root_cap_prompts=3.0, imbalance_threshold_blocks=8.0)),
        ("cost", PolicyWeights(kv_usage_ceiling=0.95, overlap_credit_loaded=None)),
        ("cost", PolicyWeights(root_weight=0.0)),  # the default's ramp (credit 4 when busy)
        # with the KV-usage ceiling the ramp needs every replica (no pruning), so the constant credit here
        (
            "cost",
            PolicyWeights(kv_usage_ceiling=0.95, imbalance_threshold_blocks=8.0, **PREVIOUS_DEFAULT),
        ),
        (
            "cost",
            PolicyWeights(
                overlap_credit=0.5,
                decode_weight=0.3,
                queue_weight=2.0,
                kv_usage_ceiling=0.9,
                **PREVIOUS_DEFAULT,
            ),
        ),
        ("cost", PolicyWeights(duplication_weight=1.0, **PREVIOUS_DEFAULT)),
        (
            "cost",
            PolicyWeights(
                duplication_weight=4.0, overlap_credit=0.5, imbalance_threshold_blocks=8.0, **PREVIOUS_DEFAULT
            ),
        ),
        ("cost", PolicyWeights(overlap_credit_loaded=3.0, root_weight=0.0)),
        # a cold replica's cost reads its decode batch
        ("cost", PolicyWeights(interference_weight=0.5, **PREVIOUS_DEFAULT)),
        ("cost", PolicyWeights(interference_weight=0.2, duplication_weight=0.0, **PREVIOUS_DEFAULT)),
        ("cost", PolicyWeights(overlap_credit_loaded=0.0, imbalance_threshold_blocks=8.0, root_weight=0.0)),
        ("least_load", PolicyWeights()),
    ],
)
def test_pruned_candidates_choose_as_the_full_set(policy: str, weights: PolicyWeights) -> None:
    for seed in range(3):
        router, prefixes = _fleet(seed, policy, weights)
        rng = random.Random(100 + seed)
        pruned_smaller = charged = 0
        for n in range(50):
            tokens = [
                *rng.choice(prefixes)[: rng.randrange(0, 41)],
                *(rng.randrange(5000, 9000) for _ in range(7)),
            ]
            pruned = router.candidates(tokens, 1.0)
            full = router._full()
            pruned_smaller += len(pruned) < len(full)
            # pruned: the credit counted over the fleet (plan_weights); full: the policy's own ramp
            by_pruned = _plan(router, tokens, pruned, n, router.plan_weights())
            by_full = _plan(router, tokens, full, n)
            full_cost, full_best = _best(by_full)
            chosen = by_pruned.decision.replica
            chosen_cost = next(t.cost for t in by_full.decision.terms if t.replica == chosen)
            assert chosen in full_best, (seed, n, chosen, full_best)
            assert chosen_cost == pytest.approx(full_cost)
            if len(full_best) == 1 or router._roots or policy == "least_load":  # ties drawn alike
                assert chosen == by_full.decision.replica
            charged += any(
                t.duplication_term > 0 or t.interference_term > 0 or t.root_term > 0
                for t in by_full.decision.terms
            )
        assert pruned_smaller > 25  # the pruning did prune
        assert (charged > 10) == (policy == "cost")  # a charge (duplication on by default) was in play


def test_temperature_and_baselines_get_every_open_replica() -> None:
    for policy, weights in (
        ("cost", PolicyWeights(temperature=0.5)),
        # the ramp over eligible ones
        ("cost", PolicyWeights(overlap_credit_loaded=2.0, kv_usage_ceiling=0.9)),
        # reads the scraped KV usage, not the load key
        ("cost", PolicyWeights(admission_weight=1.0)),
        ("round_robin", PolicyWeights()),
    ):
        router, _ = _fleet(0, policy, weights)
        full = router._full()
        assert router.candidates([1, 2, 3, 4, 5], 1.0) == full
        assert all(router.inflight[r] < router.cap for r in full)


def _pressured_fleet(seed: int, weights: PolicyWeights) -> tuple[SimRouter, list[tuple[int, ...]]]:
    """60 replicas whose private holdings put them in every pressure band (pool 40 blocks), some
    holding a shared prefix, under random load: where the duplication charge decides the choice."""
    rng = random.Random(seed)
    names = [ReplicaId(f"r{i:02d}") for i in range(60)]
    router = SimRouter(
        names, model="m", block_size=BLOCK, policy="cost", weights=weights, rng=random.Random(seed),
        limits=TableLimits(), max_inflight_per_replica=50, prune_k=1,
    )  # fmt: skip
    shared = [tuple(rng.randrange(1000, 5000) for _ in range(60)) for _ in range(6)]
    for n, replica in enumerate(names):
        fill = rng.randrange(0, 44)
        private = tuple(rng.randrange(5000, 9000) for _ in range(fill * BLOCK))
        if fill:
            hashes = tuple(EngineHash(10_000 * n + i) for i in range(fill))
            router.apply(replica, [Stored(0, None, hashes, pack_tokens(private), BLOCK)], 0.0)
        if rng.random() < 0.15:
            prefix, depth = rng.choice(shared), rng.randrange(1, 15)
            hashes = tuple(EngineHash(10_000 * n + 5_000 + i) for i in range(depth))
            router.apply(replica, [Stored(0, None, hashes, pack_tokens(prefix[: depth * BLOCK]), BLOCK)], 0.0)
        router.observe(replica, EngineStats(1, rng.randrange(0, 3), 0.5, 40 * BLOCK), 0.1)
    for n in range(120):
        tokens = (*rng.choice(shared)[: rng.randrange(0, 60)], *(rng.randrange(9000, 9999) for _ in range(9)))
        router.route(f"load{n}", tokens, rng.randrange(1, 30), None, 0.2)
        if rng.random() < 0.5:
            router.first_token(f"load{n}", router.tracker._owner[f"load{n}"], 0.3)
    return router, shared  # type: ignore[return-value]


@pytest.mark.parametrize(
    "weights",
    [
        PolicyWeights(**PREVIOUS_DEFAULT),
        PolicyWeights(root_weight=0.0),
        PolicyWeights(duplication_weight=4.0, overlap_credit=0.5, **PREVIOUS_DEFAULT),
        PolicyWeights(imbalance_threshold_blocks=8.0, kv_usage_ceiling=0.9, **PREVIOUS_DEFAULT),
    ],
)
def test_pruning_stays_exact_when_the_duplication_charge_decides(weights: PolicyWeights) -> None:
    charged = 0
    for seed in range(8):
        router, shared = _pressured_fleet(seed, weights)
        rng = random.Random(1000 + seed)
        for n in range(40):
            tokens = [
                *rng.choice(shared)[: rng.randrange(0, 60)],
                *(rng.randrange(9000, 9999) for _ in range(5)),
            ]
            by_full = _plan(router, tokens, router._full(), n)
            by_pruned = _plan(router, tokens, router.candidates(tokens, 1.0), n, router.plan_weights())
            assert by_pruned.decision.replica in _best(by_full)[1], (seed, n)
            charged += any(t.duplication_term > 0 for t in by_full.decision.terms)
    assert charged > 50  # the charge was in play


def test_plan_weights_carry_the_fleet_wide_ramp() -> None:
    """The credit the pruned policy gets is the one the full policy computes for itself."""
    weights = PolicyWeights(overlap_credit_loaded=3.0, root_weight=0.0)  # pruned: no held-roots charge
    ramped = 0
    for seed in range(6):
        router, _ = _fleet(seed, "cost", weights)
        full = router._full()
        loads = [router.tracker.load_of(r, 1.0) for r in full]
        share = sum(1 for x in loads if x.pending_prefill_seqs > 0) / len(full)
        given = router.plan_weights()
        assert given.overlap_credit_loaded is None
        assert given.overlap_credit == pytest.approx(loaded_credit(1.0, 3.0, share))
        plan = _plan(router, [1, 2, 3], full, 0)
        assert {t.overlap_credit for t in plan.decision.terms if t.overlap_credit} <= {given.overlap_credit}
        ramped += given.overlap_credit > 1.0
    constant = PolicyWeights(**PREVIOUS_DEFAULT)
    assert _fleet(0, "cost", constant)[0].plan_weights() is constant
    assert ramped  # some fleet was on the ramp


@pytest.mark.parametrize(("pending_ttl_s", "held_before_first_token"), [(60.0, True), (None, False)])
def test_speculative_entries_are_held_until_the_first_token_as_the_service_does(
    pending_ttl_s: float | None, held_before_first_token: bool
) -> None:
    """The service commits with ``pending_ttl_s`` (its first-byte timeout): a queued request's
    entries outlive ``speculative_ttl_s`` until its first token, then get ``speculative_ttl_s``."""
    names = [ReplicaId("a"), ReplicaId("b")]
    router = SimRouter(
        names, model="m", block_size=BLOCK, policy="cost", weights=PolicyWeights(), rng=random.Random(0),
        limits=TableLimits(), max_inflight_per_replica=5, speculative_ttl_s=2.0, pending_ttl_s=pending_ttl_s,
    )  # fmt: skip
    tokens = list(range(100, 140))
    replica = router.route("r1", tokens, 8, None, 0.0).decision.replica
    table = router.space.table
    assert table.prefix_holders(tokens, 1.0) == (replica,)
    assert table.prefix_holders(tokens, 5.0) == ((replica,) if held_before_first_token else ())
    router.first_token("r1", replica, 5.0)
    assert table.prefix_holders(tokens, 6.9) == ((replica,) if held_before_first_token else ())
    assert table.prefix_holders(tokens, 7.1) == ()


def _tenant_fleet(seed: int, weights: PolicyWeights) -> tuple[SimRouter, list[list[int]]]:
    """30 replicas homing 0–12 contexts each (stored roots), under random load, and 90 contexts
    of which a third are homed nowhere: where the held-roots charge decides new contexts' homes."""
    rng = random.Random(seed)
    names = [ReplicaId(f"r{i:02d}") for i in range(30)]
    router = SimRouter(
        names, model="m", block_size=BLOCK, policy="cost", weights=weights, rng=random.Random(seed),
        limits=TableLimits(), max_inflight_per_replica=8, prune_k=1, speculative_ttl_s=1.0,
    )  # fmt: skip
    contexts = [[rng.randrange(1000, 60_000) for _ in range(rng.randrange(8, 48))] for _ in range(90)]
    for n, replica in enumerate(names):
        for k, context in enumerate(rng.sample(contexts[:60], rng.randrange(0, 13))):
            depth = rng.randrange(1, len(context) // BLOCK + 1)
            hashes = tuple(EngineHash(100_000 * n + 1000 * k + i) for i in range(depth))
            router.apply(
                replica, [Stored(0, None, hashes, pack_tokens(context[: depth * BLOCK]), BLOCK)], 0.0
            )
        capacity = rng.choice([40, 80, None])
        router.observe(
            replica, EngineStats(1, rng.randrange(0, 3), rng.random(), capacity and capacity * BLOCK), 0.0
        )
    return router, contexts


@pytest.mark.parametrize(
    "weights",
    [
        PolicyWeights(),  # the default: ramp, duplication, interference and held-roots charges
        PolicyWeights(duplication_weight=3.0, interference_weight=0.5),
        PolicyWeights(root_cap_prompts=4.0, root_weight=2.0, overlap_credit_loaded=None),
        PolicyWeights(interference_weight=0.0, duplication_weight=0.0, overlap_credit_loaded=None),
        PolicyWeights(kv_usage_ceiling=0.8, imbalance_threshold_blocks=16.0, overlap_credit_loaded=None),
    ],
)
def test_pruning_stays_exact_when_the_held_roots_charge_decides(weights: PolicyWeights) -> None:
    """Decision by decision over a routed run: requests are committed (speculative roots, expiring
    1 s later), reach their first token and finish, replicas store and evict contexts; every
    decision over the pruned set is a least-cost replica of the full set."""
    decided = requests = ties = 0
    sizes: list[tuple[int, int]] = []
    for seed in range(4):
        router, contexts = _tenant_fleet(seed, weights)
        rng = random.Random(500 + seed)
        live: list[tuple[str, ReplicaId, float]] = []
        now = 0.1
        for n in range(150):
            now += rng.uniform(0.0, 0.08)
            for rid, replica, started in [x for x in live if x[2] + 0.3 < now]:
                live.remove((rid, replica, started))
                router.first_token(rid, replica, now)
                if rng.random() < 0.7:
                    router.release(rid, replica, now)
            tokens = [
                *rng.choice(contexts),
                *(rng.randrange(60_000, 90_000) for _ in range(rng.randrange(1, 9))),
            ]
            pruned = router.candidates(tokens, now)
            by_full = _plan(router, tokens, router._full(), n, now=now)
            by_pruned = _plan(router, tokens, pruned, n, router.plan_weights(), now=now)
            chosen = by_pruned.decision.replica
            # with the held-roots charge every tie is in the pruned set, in the full list's order: the
            # same draw picks the same replica
            assert chosen == by_full.decision.replica, (seed, n, chosen, _best(by_full)[1])
            ties += len(_best(by_full)[1]) > 1
            sizes.append((len(pruned), len(router._full())))
            terms = {
                t.replica: t for t in by_full.decision.terms if t.excluded is None and t.cost is not None
            }
            without_roots = min(t.cost - t.root_term for t in terms.values())  # type: ignore[operator]
            decided += terms[chosen].cost - terms[chosen].root_term > without_roots + 1e-9  # type: ignore[operator]
            try:
                plan = router.route(f"q{n}", tokens, rng.randrange(1, 32), None, now)
            except Overloaded:  # every replica at its cap: the service answers 429
                continue
            requests += 1
            replica = plan.decision.replica
            live.append((f"q{n}", replica, now))
            if rng.random() < 0.5:  # the engine stores the prompt (a new root where nobody held it)
                blocks = len(tokens) // BLOCK
                hashes = tuple(EngineHash(10_000_000 + 1000 * n + i) for i in range(blocks))
                router.apply(
                    replica, [Stored(0, None, hashes, pack_tokens(tokens[: blocks * BLOCK]), BLOCK)], now
                )
            if rng.random() < 0.2:  # some replica evicts one of its stored contexts
                victim = rng.randrange(30)
                router.apply(
                    ReplicaId(f"r{victim:02d}"),
                    [
                        Removed(
                            0,
                            tuple(
                                EngineHash(100_000 * victim + 1000 * rng.randrange(13) + i) for i in range(12)
                            ),
                        )
                    ],
                    now,
                )
        # every candidate set, the test's and route()'s, was pruned (the test's _full() counts as full)
        assert router.counters.pruned == 2 * 150
    assert requests > 400
    assert decided > 20  # the held-roots charge moved the choice off the cheapest replica without it
    assert sum(pruned < full for pruned, full in sizes) > len(sizes) // 2  # and smaller than the full set
    assert ties > 20  # ties in the full set, drawn alike over the pruned one


@pytest.mark.parametrize(
    ("policy", "weights"),
    [
        ("cost", PolicyWeights(queue_weight=1.0)),
        ("cost", PolicyWeights(queue_weight=1.0, **PREVIOUS_DEFAULT)),
        ("least_load", PolicyWeights()),
    ],
)
def test_pruning_follows_a_scraped_queue_that_goes_stale(policy: str, weights: PolicyWeights) -> None:
    # The load key of cost with queue_weight > 0 (and of least_load) reads the scraped waiting
    # queue, which the policy reads as unknown (0) once the scrape is older than stale_after_s.
    # Before (h-capfollow2) the key kept the stale queue until the replica's next touch, so a
    # replica whose last scrape said "long queue" stayed out of the pruned set while the full
    # list, as the service's router gives it, chose it (a --scrape-interval-s above 5 s).
    names = [ReplicaId(f"r{i}") for i in range(6)]
    router = SimRouter(
        names, model="m", block_size=BLOCK, policy=policy, weights=weights, rng=random.Random(0),
        limits=TableLimits(), max_inflight_per_replica=50, prune_k=2,
    )  # fmt: skip
    stale_s = router.tracker.config.stale_after_s
    queued = names[-1]  # not the first: with the held-roots charge the first holding the fewest joins the set
    for n, replica in enumerate(names):  # each holds one root of its own (the held-roots charge counts them)
        router.apply(replica, [Stored(0, None, (EngineHash(n),), pack_tokens([n] * BLOCK), BLOCK)], 0.0)
        router.observe(replica, EngineStats(0, 100 if replica == queued else 0, 0.1), 0.0)
    for n, replica in enumerate(names[:-1], start=1):  # every other replica has work in flight, unequal
        for k in range(n):
            router.tracker.reserve(f"busy{n}-{k}", replica, 8 * BLOCK, 9, 0.5)
            router.inflight[replica] += 1
        router._touch(replica, 0.5)
    rng = random.Random(1)
    for now, fresh in ((1.0, True), (stale_s + 0.5, False)):
        tokens = [rng.randrange(10_000, 20_000) for _ in range(4 * BLOCK)]
        pruned = router.candidates(tokens, now)
        by_full = _plan(router, tokens, router._full(), 0, now=now)
        by_pruned = _plan(router, tokens, pruned, 0, router.plan_weights(), now=now)
        assert by_full.decision.replica == by_pruned.decision.replica, (now, pruned)
        assert (by_full.decision.replica == queued) is not fresh  # the stale queue no longer counts
