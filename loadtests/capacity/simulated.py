"""The simulated side of ``kvlb capacity``: routers in the simulator, the oracle, the band (pure).

No I/O and no clock (but for the ``log`` function it is given): the command's options become a
:class:`SimConfig` (:func:`sim_config`) and an SLO (:func:`slo_of`); a router name becomes what the
simulator runs for it (:func:`sim_router`: a kvlb policy, a peer's simulated policy, the oracle's plan
on MIN or LRU engines, ``<kvlb router>@min``). :func:`sim_measure` is the ``rate → RatePoint``
function the search (:func:`loadtests.capacity.search.search`) calls; :func:`diagnose` splits kvlb's
shortfall against the oracle into eviction and placement; :func:`sim_band` is a confirmed point's
spread over jittered draws (:mod:`loadtests.capacity.band`); :func:`sim_rows_of` and
:func:`sim_decision_rows` put a simulation's requests and decisions in the shape of the fleet's, for
the confirmation (:mod:`loadtests.capacity.confirm`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from balancer.policy.base import PolicyWeights
from loadtests.capacity.agreement import RequestRow
from loadtests.capacity.band import band_of, draw_rng, hop_rng, jitter_arrivals
from loadtests.capacity.report import ratio
from loadtests.capacity.retimed import arrivals_of, offsets_ms, retime, spread_config
from loadtests.capacity.search import RatePoint, Slo, parse_seconds, point_of
from loadtests.peers import RouterSpec, parse_router
from loadtests.simulate import SimConfig, SimRequest, SimResult, Simulation
from loadtests.simulate.oracle import (
    BeladySimulation,
    OracleLruSimulation,
    OraclePlan,
    plan_oracle,
    simulate_oracle,
)
from loadtests.workloads import RequestSpec

Assignment = dict[str, str | None]
"""Request id → the replica a simulation placed it on (``None``: refused there)."""
SIM_POLICY = {"sglang_cache_aware": "sglang_threshold"}
"""Fleet router name → the kvlb policy that simulates it."""
ORACLES = ("oracle", "oracle_lru")
"""Simulator-only oracle routers: the plan replayed on MIN engines, and on the engines' LRU caches."""
MIN_SUFFIX = "@min"
"""``<kvlb router>@min``: that router in the simulator on engines that evict with MIN (simulator only)."""


@dataclasses.dataclass(frozen=True)
class Stream:
    """The request stream at its base rate; :meth:`at` rescales arrivals to any offered rate."""

    specs: list[RequestSpec]
    requests: list[SimRequest]
    base_rate: float

    def at(self, rate: float, limit: int | None = None) -> list[SimRequest]:
        scale = self.base_rate / rate
        chosen = self.requests if limit is None else self.requests[:limit]
        return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in chosen]

    def specs_at(self, rate: float, limit: int, wall_per_model: float) -> list[RequestSpec]:
        scale = self.base_rate / rate * wall_per_model
        return [dataclasses.replace(s, arrival_s=(s.arrival_s or 0.0) * scale) for s in self.specs[:limit]]


def slo_of(args: argparse.Namespace) -> Slo:
    """The SLO of ``--slo-ttft-p90`` (default 2 s), ``--slo-ttft-p99`` and ``--max-error-rate``."""
    return Slo(
        ttft_p90_s=2.0 if (p90 := parse_seconds(args.slo_ttft_p90)) is None else p90,
        ttft_p99_s=parse_seconds(args.slo_ttft_p99),
        max_error_rate=args.max_error_rate,
    )


def sim_router(name: str) -> tuple[RouterSpec | None, bool]:
    """A router name → its spec (``None`` for an oracle) and whether its engines evict with MIN;
    ``ValueError`` for an unknown name or ``@min`` on a router that is not kvlb's."""
    if name in ORACLES:
        return None, name == "oracle"
    if name.endswith(MIN_SUFFIX):
        spec = parse_router(name[: -len(MIN_SUFFIX)])
        if spec.kind != "kvlb":
            raise ValueError(f"router {name!r}: {MIN_SUFFIX} applies to kvlb routers in the simulator only")
        return spec, True
    return parse_router(name), False


def sim_only(name: str) -> bool:
    """Whether router ``name`` exists in the simulator only (no fleet confirmation)."""
    return name in ORACLES or name.endswith(MIN_SUFFIX)


def sim_config(args: argparse.Namespace, spec: RouterSpec | None) -> SimConfig:
    policy = "cost" if spec is None else SIM_POLICY.get(spec.name, spec.policy)
    weights = (
        PolicyWeights().replace(**dict(spec.weights))
        if spec is not None and spec.weights
        else PolicyWeights()
    )
    return SimConfig(
        replicas=args.replicas,
        profile=args.profile,
        kv_capacity_tokens=args.kv_capacity_tokens,
        policy=policy,
        weights=weights,
        seed=args.seed,
        forward_delay_s=args.sim_forward_delay_ms / 1000.0,
        prune=not args.sim_no_prune,
        forward_jitter_s=args.sim_forward_jitter_ms / 1000.0,
    )


def sim_measure(
    args: argparse.Namespace,
    name: str,
    stream: Stream,
    log: Callable[[str], None],
    keep: list[SimResult] | None = None,
    keep_decisions: bool = False,
) -> Any:
    """``rate → RatePoint`` of router ``name`` in the simulator (:func:`sim_router`); ``keep``
    collects each run's :class:`SimResult` (not an oracle's), with its decisions when
    ``keep_decisions`` (LRU engines only)."""
    spec, min_engines = sim_router(name)
    config = sim_config(args, spec)

    def measure(rate: float, limit: int | None = None) -> RatePoint:
        requests = stream.at(rate, limit)
        if spec is None:
            plan, result = simulate_oracle(
                config, requests, args.oracle_load_bound_s, lru_engines=not min_engines
            )
            point = point_of(
                rate,
                result.summary,
                "sim",
                planned_hit_tokens=plan.hit_tokens,
                planned_hit_rate=plan.hit_rate,
            )
        else:
            if min_engines:
                result = BeladySimulation(config, requests).run()
            else:
                result = Simulation(config, requests, keep_decisions=keep_decisions).run()
            point = point_of(rate, result.summary, "sim")
            if keep is not None:
                keep.append(result)
        log(f"  {name} @ {rate:.3g}/s: TTFT p90 {point.ttft_p90_s or float('nan'):.3f} s, "
            f"errors {point.errors}, hit rate {point.hit_rate or 0:.3f}")  # fmt: skip
        return point

    return measure


def diagnose(args: argparse.Namespace, stream: Stream, rate: float) -> dict[str, Any]:
    """Where kvlb's saved prefill falls short of the oracle's at ``rate``: kvlb's placement on the
    engines' LRU caches, the same policy on MIN engines (:class:`BeladySimulation`), and the oracle's
    plan. LRU → MIN is what eviction blindness costs; MIN → oracle is what placement costs."""
    config = sim_config(args, parse_router("kvlb"))
    requests = stream.at(rate)
    lru = Simulation(config, requests).run().summary
    belady = BeladySimulation(config, requests).run().summary
    plan = oracle_plan(args, stream, rate)
    planned = plan.hit_tokens
    oracle_lru = OracleLruSimulation(sim_config(args, None), requests, plan.assignment).run().summary
    return {
        "rate": rate,
        "kvlb_lru_cached_tokens": lru.cached_tokens,
        "kvlb_min_engines_cached_tokens": belady.cached_tokens,
        "oracle_planned_hit_tokens": planned,
        "kvlb_lru_vs_oracle": ratio(lru.cached_tokens, planned),
        "kvlb_min_engines_vs_oracle": ratio(belady.cached_tokens, planned),
        "oracle_lru_engines_cached_tokens": oracle_lru.cached_tokens,
        "oracle_lru_engines_vs_oracle": ratio(oracle_lru.cached_tokens, planned),
        "oracle_lru_engines_ttft_p90_s": oracle_lru.ttft_p90_s,
        "kvlb_lru_ttft_p90_s": lru.ttft_p90_s,
        "kvlb_min_engines_ttft_p90_s": belady.ttft_p90_s,
    }


def oracle_saved(args: argparse.Namespace, stream: Stream, rate: float) -> int:
    """Tokens the oracle's plan serves from cache at ``rate``."""
    return oracle_plan(args, stream, rate).hit_tokens


def oracle_plan(args: argparse.Namespace, stream: Stream, rate: float) -> OraclePlan:
    """The oracle's plan of the stream at ``rate``."""
    config = sim_config(args, None)
    profile = config.resolved_profile()
    page = profile.page_size
    return plan_oracle(
        stream.at(rate),
        replicas=args.replicas,
        blocks_per_replica=max(1, profile.kv_capacity_tokens // page),
        block_size=page,
        prefill_s_per_token=profile.prefill_s_per_token,
        load_bound_s=args.oracle_load_bound_s,
    )


def sim_band(args: argparse.Namespace, name: str, stream: Stream, rate: float, limit: int) -> dict[str, Any]:
    """``--confirm-sim-draws`` simulations of router ``name`` on the first ``limit`` requests at
    ``rate``, each with the arrivals jittered by draw ``k``'s generator and (with
    ``--sim-forward-jitter-ms``) its own hops from draw ``k``'s hop generator, as :func:`band_of`."""
    config = sim_config(args, parse_router(name))
    requests = stream.at(rate, limit)
    jitter_s = args.confirm_sim_jitter_ms / 1000.0
    simulations = (
        Simulation(
            config, jitter_arrivals(requests, jitter_s, draw_rng(args.seed, draw)), hop_rng(args.seed, draw)
        )
        for draw in range(args.confirm_sim_draws)
    )
    return {
        "rate": rate,
        "jitter_ms": args.confirm_sim_jitter_ms,
        "hop_jitter_ms": args.sim_forward_jitter_ms,
        **_band_of_runs(rate, slo_of(args), simulations),
    }


def _band_of_runs(rate: float, slo: Slo, simulations: Iterable[Simulation]) -> dict[str, Any]:
    """:func:`band_of` of ``simulations`` at ``rate`` (each run in turn): TTFT p90s, SLO passes, hit rates."""
    points = [point_of(rate, simulation.run().summary, "sim") for simulation in simulations]
    return band_of(
        [p.ttft_p90_s for p in points], [p.meets(slo) for p in points], [p.hit_rate for p in points]
    )


def sim_retimed(
    args: argparse.Namespace,
    name: str,
    stream: Stream,
    rate: float,
    times: tuple[str, Sequence[float]],
    hops_ms: Sequence[float],
    ranges_ms: Sequence[tuple[float, float]] = (),
    draws: int = 0,
) -> dict[str, Any]:
    """Router ``name`` on the first ``len(times[1])`` requests at ``rate``, each arriving at its time
    in one fleet run (``times``: the source and the wall seconds by stream position, converted by
    ``--time-scale`` and anchored at the schedule's first arrival, :mod:`loadtests.capacity.retimed`),
    once per hop of ``hops_ms`` (model ms, each the same for every request), as :func:`band_of` of
    those simulations (``passes``: at least half of them meet the SLO), with the hops, the source of
    the times and the arrivals' offsets from the schedule; and ``draws`` times per hop range of
    ``ranges_ms`` (``spread``: each request's hop uniform in ``[lo, hi]`` model ms, draw ``k``'s hops
    from :func:`hop_rng` ``(--seed, k)``), one :func:`band_of` per range."""
    source, wall = times
    requests = stream.at(rate, len(wall))
    scheduled = [r.arrival_s for r in requests]
    arrivals = arrivals_of(wall, args.time_scale, min(scheduled, default=0.0))
    moved = retime(requests, arrivals)
    config = sim_config(args, parse_router(name))
    slo = slo_of(args)
    fixed = (spread_config(config, hop_ms, hop_ms) for hop_ms in hops_ms)
    figures = _band_of_runs(rate, slo, (Simulation(c, moved) for c in fixed))
    figures["simulations"] = figures.pop("draws")
    spread = []
    for lo_ms, hi_ms in ranges_ms:
        hopped = spread_config(config, lo_ms, hi_ms)
        runs = (Simulation(hopped, moved, hop_rng(args.seed, draw)) for draw in range(draws))
        spread.append({"hop_ms": [lo_ms, hi_ms], **_band_of_runs(rate, slo, runs)})
    offsets = offsets_ms(scheduled, arrivals)
    return {"times": source, "hops_ms": list(hops_ms), "offset_ms": offsets, **figures, "spread": spread}


def simulated_as(name: str) -> str:
    """What the simulator runs for router ``name`` (the report's ``simulated_as``)."""
    spec, min_engines = sim_router(name)
    if spec is None:
        return "oracle" if min_engines else "oracle's plan on LRU engines"
    policy = SIM_POLICY.get(spec.name, spec.policy)
    return f"{policy} on MIN engines" if min_engines else policy


def sim_rows_of(
    result: SimResult, specs: Sequence[RequestSpec], fleet_names: Sequence[str]
) -> list[RequestRow]:
    """The simulation's records as rows of the stream's positions (records are in arrival order, the
    stream is sorted by arrival), its replica ``i`` named as the fleet's ``i``-th replica."""
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s or 0.0)
    names = {name: fleet_names[i] for i, name in enumerate(result.records.replicas)}
    rows = []
    for position, record in zip(order, result.records, strict=True):
        replica = None if record.replica is None else names[record.replica]
        rows.append(RequestRow(position, replica, record.ttft_s, record.cached_tokens))
    return sorted(rows, key=lambda r: r.index)


def sim_decision_rows(
    result: SimResult, specs: Sequence[RequestSpec], fleet_names: Sequence[str]
) -> list[dict[str, Any]]:
    """The simulation's kept decisions (:attr:`SimResult.decisions`) in the shape of the fleet's saved
    ones (``decisions/<run>.jsonl``: ``request_id``, ``decision`` with ``replica``, ``reason`` and
    per-replica ``terms``), its replica ``i`` named as the fleet's ``i``-th and each record named by
    the stream's request id (records are in arrival order, as in :func:`sim_rows_of`), plus the
    decision's virtual time ``now_s`` (model seconds): one row per routed request, in routing order."""
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s or 0.0)
    names = {name: fleet_names[i] for i, name in enumerate(result.records.replicas)}
    rows = []
    for index, now, decision in result.decisions:
        terms = [{**dataclasses.asdict(t), "replica": names[t.replica]} for t in decision.terms]
        rows.append(
            {
                "request_id": specs[order[index]].request_id,
                "now_s": now,
                "decision": {
                    "replica": names[decision.replica],
                    "reason": decision.reason,
                    "policy": decision.policy,
                    "overlap_blocks": decision.overlap_blocks,
                    "request_blocks": decision.request_blocks,
                    "cached_tokens": decision.cached_tokens,
                    "terms": terms,
                },
            }
        )
    return rows
