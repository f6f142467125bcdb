"""``kvlb capacity``: each router's highest arrival rate within a TTFT SLO (I/O shell).

1. Builds the request stream once (a workload, or the Mooncake trace with ``--trace``).
2. For each router, searches the capacity in the simulator (:func:`loadtests.capacity.search.search`: the
   stream's arrival times rescaled to each offered rate, the real policy code routing it). ``oracle``
   is the simulator's oracle router (:mod:`loadtests.simulate.oracle`); ``oracle_lru`` its plan
   replayed on engines that evict LRU; ``<kvlb router>@min`` that router on engines that evict with
   Belady's MIN (the three simulator only: they separate placement from eviction);
   ``sglang_cache_aware`` is simulated by kvlb's ``sglang_threshold`` policy (its switch rule on
   kvlb's index).
3. With ``--confirm``, runs the bracketing rates of each router (its capacity and the first failing
   rate) on the emulated fleet with ``kvlb loadtest``'s machinery (the real peers for peer names),
   on the first ``--confirm-requests`` requests, next to a simulation of those same requests. The
   report says which rates were measured on the fleet. A fleet run with more than 1% errors marks
   the router invalid, with the reason. With ``--confirm-sim-draws N`` each confirmed point is
   also simulated ``N`` times with every arrival moved by up to ``±--confirm-sim-jitter-ms``, and the
   fleet's repeats are judged against that spread (:mod:`loadtests.capacity.band`).
4. Writes ``capacity.json``, ``capacity.md``, ``ttft_vs_rate.svg`` (and ``.png`` with matplotlib).

Rates and TTFTs are in model time (``--time-scale`` converts for the fleet). See ``docs/loadtest.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from balancer.policy.base import PolicyWeights
from loadtests.capacity.agreement import RequestRow, compare, followers, rows_of
from loadtests.capacity.band import band_of, draw_rng, hop_rng, jitter_arrivals, verdict
from loadtests.capacity.report import build_report, markdown, ratio, routed_points, svg_plot
from loadtests.capacity.search import RatePoint, Search, Slo, point_of, search, searches_from_report
from loadtests.capacity.target import TargetDown, add_target_arguments, gate, search_target
from loadtests.kvlb_timers import WALL_TIMERS_HELP, fleet_sets_of
from loadtests.oracle import prefix_reuse_bound
from loadtests.peers import PEER_NAMES, RouterSpec, parse_router, replay_router
from loadtests.simulate import SimConfig, SimRequest, SimResult, Simulation
from loadtests.simulate.oracle import (
    DEFAULT_LOAD_BOUND_S,
    BeladySimulation,
    OracleLruSimulation,
    OraclePlan,
    plan_oracle,
    simulate_oracle,
)
from loadtests.stats import send_lag
from loadtests.workloads import (
    MooncakeWorkload,
    RequestSpec,
    TenantsWorkload,
    Workload,
    make_workload,
    poisson_arrivals,
    with_arrivals,
)
from replicas.sim.profiles import PROFILES

DEFAULT_ROUTERS = ("kvlb", "round_robin", "least_load", "sglang_cache_aware", "oracle")
Assignment = dict[str, str | None]
"""Request id → the replica a simulation placed it on (``None``: refused there)."""
SIM_POLICY = {"sglang_cache_aware": "sglang_threshold"}
"""Fleet router name → the kvlb policy that simulates it."""
ORACLES = ("oracle", "oracle_lru")
"""Simulator-only oracle routers: the plan replayed on MIN engines, and on the engines' LRU caches."""
MIN_SUFFIX = "@min"
"""``<kvlb router>@min``: that router in the simulator on engines that evict with MIN (simulator only)."""
SMOKE: dict[str, Any] = {
    "workload": "tenants",
    "params": {
        "prompt_format": "tokens",
        "tenants": 4,
        "users_per_tenant": 2,
        "context_tokens": 1024,
        "question_tokens": 128,
        "max_tokens": 16,
    },
    "requests": 120,
    "replicas": 2,
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "capacity",
        help="each router's highest arrival rate within a TTFT SLO (simulator search, fleet confirmation)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--workload", default="tenants", help="tenants, unique, chat, rag, agent (default tenants)")
    add("--param", action="append", default=[], metavar="NAME=VALUE", help="a workload field (repeatable)")
    add("--trace", type=Path, help="a Mooncake trace: replay it (all rows, or --requests)")
    add("--trace-offset", type=int, default=0, help="trace rows skipped")
    add("--prompt-format", choices=("tokens", "text"), default="tokens",
        help="trace prompts: token ids, or text of the same prefix structure (text-only peers)")  # fmt: skip
    add("--max-input-tokens", type=int, default=8000, help="trace: prompts cut to this (8000)")
    add("--max-tokens-cap", type=int, default=32, help="trace: cap on completion tokens (32)")
    add("--requests", type=int, default=None, help="requests (default: the trace's rows; workloads 600)")
    add("--routers", default=",".join(DEFAULT_ROUTERS),
        help="comma-separated: kvlb, round_robin, least_load, power_of_two, kvlb:<policy>[+w=v], "
        "sglang_cache_aware (simulated as sglang_threshold); simulator only: oracle (its plan on MIN "
        "engines), oracle_lru (its plan on LRU engines), <kvlb router>@min (on MIN engines)")  # fmt: skip
    add("--replicas", type=int, default=8, help="replicas (8)")
    add("--profile", choices=sorted(PROFILES), default="h100-llama3-8b", help="replica profile")
    add("--kv-capacity-tokens", type=int, default=None, help="per-replica KV pool (default: the profile's)")
    add("--slo-ttft-p90", default="2s", help="TTFT p90 bound, model time (2s; smoke 0.3s)")
    add("--slo-ttft-p99", default=None, help="also a TTFT p99 bound, e.g. 4s")
    add("--max-error-rate", type=float, default=0.001, help="error rate bound (0.001)")
    add("--start-rate", type=float, default=None, help="first rate tried (default: 2 per replica)")
    add("--growth", type=float, default=1.5, help="rate step while bracketing (1.5)")
    add("--rel-tol", type=float, default=0.05, help="bisect until the bracket is this narrow (0.05)")
    add("--max-points", type=int, default=14, help="simulations per router at most (14)")
    add("--oracle-load-bound-s", type=float, default=DEFAULT_LOAD_BOUND_S,
        help=f"the oracle's prefill-backlog bound, s ({DEFAULT_LOAD_BOUND_S})")  # fmt: skip
    add("--seed", type=int, default=0, help="seed of the workload, arrivals and routing")
    add("--sim-forward-delay-ms", type=float, default=0.0,
        help="simulator: each request reaches its replica this long after it is routed, model ms "
        "(0; the emulated fleet at --time-scale 0.25 adds about 20 to 7,000-token chat prompts)")  # fmt: skip
    add("--sim-no-prune", action="store_true",
        help="simulator: give the cost policy every open replica, as with admission_weight > 0, instead "
        "of the pruned candidate set (the same choice up to tie-breaking, exact with root_weight > 0: "
        "separates a charge's effect from the tie-breaks of the full list)")  # fmt: skip
    add("--sim-forward-jitter-ms", type=float, default=0.0,
        help="simulator: each request's hop is its own uniform draw within this of --sim-forward-delay-ms, "
        "model ms (0: the same hop for every request; at most the delay); each --confirm-sim-draws draw "
        "has its own hop draws")  # fmt: skip
    add("--confirm", action="store_true", help="run the bracketing rates on the emulated fleet")
    add("--searches-from", type=Path, metavar="CAPACITY.json",
        help="reuse the simulator searches of a saved report (same stream flags) instead of searching; "
        "with --confirm, only confirms them")  # fmt: skip
    add("--confirm-requests", type=int, default=400, help="requests per fleet run (400)")
    add("--confirm-repeats", type=int, default=1, help="fleet runs of each confirmed point (1)")
    add("--confirm-replay", action="store_true",
        help="also run each kvlb router's simulated assignment on the fleet: each request straight "
        "to the replica the simulation chose (no router): routing apart from replica timing")  # fmt: skip
    add("--confirm-sim-draws", type=int, default=4,
        help="simulations of each confirmed point with jittered arrivals, the band the fleet's repeats "
        "are judged against (4; 0: none)")  # fmt: skip
    add("--confirm-sim-jitter-ms", type=float, default=1.0,
        help="each draw moves every arrival by a uniform draw within ± this, model ms (1)")  # fmt: skip
    add("--confirm-rates", default=None, metavar="R1,R2,...",
        help="confirm these rates (model req/s) instead of each search's bracketing rates")  # fmt: skip
    add("--confirm-interleave", action="store_true",
        help="with --confirm-rates: at each rate, the routers' runs alternate A B B A A B ... instead "
        "of one router's repeats after another's: machine drift hits every router alike")  # fmt: skip
    add("--confirm-save-decisions", action="store_true",
        help="fleet: save every decision of each kvlb run, with its per-replica cost terms and inputs "
        "(GET /admin/decisions/{id}, read before the router stops), to decisions/<run>.jsonl, and the "
        "simulation's decisions of the same requests to decisions/<router>-<rate>-sim.jsonl")  # fmt: skip
    # testing: flush before the router starts and drive at once (the order before fd35bf6), so that
    # a kvlb replays the fleet's history while it routes (DriveOptions.catch_up)
    add("--confirm-no-catch-up", action="store_true", help=argparse.SUPPRESS)
    add("--time-scale", type=float, default=1.0, help="fleet: emulator model seconds per wall second")
    add("--processes", type=int, default=2, help="fleet: child processes")
    add("--kvlb-set", action="append", default=[], metavar="NAME=VALUE",
        help="fleet: `kvlb serve --set` override for every kvlb router, e.g. limits.speculative_ttl_s=4 "
        "(in wall seconds: at --time-scale s, 4 wall s are 4·s model s); it wins over the model-time "
        "timers below")  # fmt: skip
    add("--kvlb-wall-timers", action="store_true", help=WALL_TIMERS_HELP)
    add("--kvlb-workers", type=int, default=1,
        help="fleet: `kvlb serve --workers` of every kvlb router (default 1: the simulator models one "
        "router process; 0: kvlb's own default, the cores)")  # fmt: skip
    add("--out", type=Path, default=None, help="output folder (default capacity-results/<workload>-<time>)")
    add("--smoke", action="store_true", help="tiny preset for CI (2 replicas, 120 short requests)")
    add("--json", action="store_true", help="print the JSON report on stdout")
    add_target_arguments(parser)
    parser.set_defaults(handler=run)


def parse_seconds(text: str | None) -> float | None:
    """``2s``, ``500ms``, ``2`` → seconds."""
    if text is None:
        return None
    raw = text.strip().lower()
    if raw.endswith("ms"):
        return float(raw[:-2]) / 1000.0
    return float(raw.removesuffix("s"))


# ------------------------------------------------------------------------------------------- stream


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


def build_stream(args: argparse.Namespace) -> tuple[Workload, Stream]:
    from loadtests.command import spec_token_ids

    params = dict(SMOKE["params"]) if args.smoke else {}
    params |= _params(args.param)
    workload: Workload
    if args.trace is not None:
        workload = MooncakeWorkload(
            path=str(args.trace),
            offset=args.trace_offset,
            limit=args.requests,
            max_tokens_cap=args.max_tokens_cap,
            max_input_tokens=args.max_input_tokens,
            prompt_format=args.prompt_format,
        )
    else:
        workload = make_workload(args.workload, **params)
        fields = {f.name for f in dataclasses.fields(workload)}  # type: ignore[arg-type]
        if "num_requests" in fields and "num_requests" not in params:
            workload = dataclasses.replace(workload, num_requests=args.requests)  # type: ignore[type-var]
        if isinstance(workload, TenantsWorkload) and "tenants" not in params:
            profile = PROFILES[args.profile]
            kv = args.kv_capacity_tokens or profile.kv_capacity_tokens
            workload = workload.for_capacity(kv, replicas=args.replicas)
    specs = list(itertools.islice(workload.generate(random.Random(args.seed)), args.requests))
    if not specs:
        raise ValueError("the workload produced no requests")
    if specs[0].arrival_s is None:
        specs = list(with_arrivals(specs, poisson_arrivals(1.0, random.Random(args.seed + 1))))
    span = max(s.arrival_s or 0.0 for s in specs)
    base_rate = len(specs) / span if span > 0 else 1.0
    prompts = spec_token_ids(specs)
    requests = [
        SimRequest(p, s.max_tokens, s.arrival_s or 0.0, s.session_id)
        for p, s in zip(prompts, specs, strict=True)
    ]
    return workload, Stream(specs, requests, base_rate)


def _params(pairs: Sequence[str]) -> dict[str, Any]:
    from loadtests.command import _params as parse

    return parse(pairs)


# --------------------------------------------------------------------------------------- simulator


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
    slo = _slo(args)
    requests = stream.at(rate, limit)
    p90s: list[float | None] = []
    passes: list[bool] = []
    hits: list[float | None] = []
    for draw in range(args.confirm_sim_draws):
        moved = jitter_arrivals(requests, args.confirm_sim_jitter_ms / 1000.0, draw_rng(args.seed, draw))
        simulation = Simulation(config, moved, hop_rng(args.seed, draw))
        point = point_of(rate, simulation.run().summary, "sim")
        p90s.append(point.ttft_p90_s)
        passes.append(point.meets(slo))
        hits.append(point.hit_rate)
    return {
        "rate": rate,
        "jitter_ms": args.confirm_sim_jitter_ms,
        "hop_jitter_ms": args.sim_forward_jitter_ms,
        **band_of(p90s, passes, hits),
    }


# ------------------------------------------------------------------------------------------- fleet


def kvlb_workers(args: argparse.Namespace) -> int | None:
    """The fleet's kvlb ``--workers``: ``--kvlb-workers``, 0 meaning kvlb's own default (``None``)."""
    return args.kvlb_workers if args.kvlb_workers else None


def confirm_order(
    names: Sequence[str], rates_of: dict[str, list[float]], repeats: int, *, interleave: bool
) -> list[tuple[str, float, int]]:
    """The fleet runs of a confirmation as ``(router, rate, repeat)`` in the order they run. By
    default one router's points after another's, each point's repeats in a row. With ``interleave``
    (every router confirming the same rates), rate by rate, each repeat runs the routers in turn,
    forwards on even repeats and backwards on odd ones: two routers, three repeats give A B B A A B,
    so a drift in the machine's load falls on every router alike."""
    if not interleave:
        return [(name, rate, k) for name in names for rate in rates_of[name] for k in range(repeats)]
    rates = rates_of[names[0]] if names else []
    if any(rates_of[name] != rates for name in names):
        raise ValueError("--confirm-interleave needs the same rates for every router (--confirm-rates)")
    order: list[tuple[str, float, int]] = []
    for rate in rates:
        for k in range(repeats):
            turn = names if k % 2 == 0 else list(reversed(names))
            order += [(name, rate, k) for name in turn]
    return order


async def confirm_on_fleet(
    args: argparse.Namespace,
    stream: Stream,
    searches: dict[str, Search],
    out: Path,
    log: Callable[[str], None],
) -> tuple[dict[str, list[RatePoint]], dict[str, str], list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Each router's bracketing rates (or ``--confirm-rates``) on the emulated fleet, each next to a
    simulation of the same requests, ``--confirm-repeats`` times; with ``--confirm-replay``, each kvlb
    router's simulated assignment also runs on the fleet without a router. Returns the points (a
    replay's under its router, ``fleet_router`` ``replay:<name>``), the invalid routers with their
    reasons, the processes, and per router each rate's band (:func:`sim_band` with the :func:`verdict`
    of the router's own runs; none with ``--confirm-sim-draws 0``). Per-request rows of every run go to
    ``out/requests/``."""
    from loadtests.processes import EmulatorOptions, start_emulator
    from loadtests.runs import DriveOptions

    fixed_rates = None if args.confirm_rates is None else [float(r) for r in args.confirm_rates.split(",")]
    names = [name for name in searches if not sim_only(name)]
    rates_of = {
        name: fixed_rates
        or [r for r in (searches[name].capacity, searches[name].first_fail) if r is not None]
        for name in names
    }
    # before the fleet starts: an order that cannot interleave stops here, with nothing to clean up
    order = confirm_order(names, rates_of, args.confirm_repeats, interleave=args.confirm_interleave)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (out / "requests").mkdir(parents=True, exist_ok=True)
    options = EmulatorOptions(
        replicas=args.replicas,
        profile=args.profile,
        kv_capacity_tokens=args.kv_capacity_tokens,
        time_scale=args.time_scale,
        processes=args.processes,
    )
    log(f"starting {args.replicas} emulated replicas ({args.profile}) ...")
    fleet = await start_emulator(options, logs)
    confirmed: dict[str, list[RatePoint]] = {}
    invalid: dict[str, str] = {}
    processes: list[dict[str, Any]] = []
    bands: dict[str, list[dict[str, Any]]] = {}
    drive = DriveOptions(
        seed=args.seed,
        max_duration_s=900.0,
        kvlb_sets=fleet_sets_of(args).all,
        kvlb_workers=kvlb_workers(args),
        catch_up=not args.confirm_no_catch_up,
    )
    limit = min(args.confirm_requests, len(stream.specs))
    prepared: dict[tuple[str, float], dict[str, Any]] = {}
    given_up: set[tuple[str, float]] = set()
    try:
        for name, rate, repeat in order:
            if name in invalid or (name, rate) in given_up:
                continue
            spec = parse_router(name)
            point_of = prepared.get((name, rate))
            if point_of is None:
                kept: list[SimResult] = []
                save_sim = args.confirm_save_decisions and spec.kind == "kvlb"
                sim = sim_measure(args, name, stream, lambda _: None, keep=kept, keep_decisions=save_sim)(
                    rate, limit
                )
                specs = stream.specs_at(rate, limit, 1.0 / args.time_scale)
                sim_rows = _sim_rows(kept[0], specs, fleet.names)
                _write_rows(out / "requests" / f"{_slug(name)}-{rate:g}-sim.jsonl", sim_rows)
                if save_sim:
                    (out / "decisions").mkdir(exist_ok=True)
                    rows = sim_decision_rows(kept[0], specs, fleet.names)
                    text = "".join(json.dumps(d, sort_keys=True) + "\n" for d in rows)
                    (out / "decisions" / f"{_slug(name)}-{rate:g}-sim.jsonl").write_text(text, "utf-8")
                band = None
                if args.confirm_sim_draws > 0:
                    band = sim_band(args, name, stream, rate, limit)
                    log(f"  {band['draws']} draws (±{band['jitter_ms']:g} ms, "
                        f"hop ±{band['hop_jitter_ms']:g} ms): TTFT p90 median "
                        f"{_num(band['ttft_p90_median_s'])} s, {_num(band['ttft_p90_min_s'])}-"
                        f"{_num(band['ttft_p90_max_s'])} s, pass share {band['pass_share']:.2f}")  # fmt: skip
                replay = None
                if args.confirm_replay and spec.kind == "kvlb":
                    assignment = {s.request_id: r.replica for s, r in zip(specs, sim_rows, strict=True)}
                    replay = (replay_router(name), assignment)
                point_of = {"sim": sim, "specs": specs, "sim_rows": sim_rows, "band": band, "replay": replay}
                prepared[(name, rate)] = point_of
            sim, specs, sim_rows = point_of["sim"], point_of["specs"], point_of["sim_rows"]
            # the router's run and the replay alternate, so a change in the machine's load hits both
            runs: list[tuple[RouterSpec, Assignment | None]] = [(spec, None)]
            if point_of["replay"] is not None:
                runs.append(point_of["replay"])
            for router, assigned in runs:
                point, reason, process = await _fleet_point(
                    args, router, rate, specs, sim, sim_rows, fleet, drive, logs, assigned, log
                )
                if process is not None:
                    processes.append({"name": router.name, "pid": process[0], "exit_code": process[1]})
                if reason is not None:
                    invalid[name] = reason
                if point is None:
                    given_up.add((name, rate))
                    break
                extra = {**point.extra, "repeat": repeat}
                slug = f"{_slug(router.name)}-{rate:g}-fleet-{repeat}.jsonl"
                _write_rows(out / "requests" / slug, extra.pop("rows"))
                decision_rows = extra.pop("decision_rows", None)
                if decision_rows is not None:
                    (out / "decisions").mkdir(exist_ok=True)
                    text = "".join(json.dumps(d, sort_keys=True) + "\n" for d in decision_rows)
                    (out / "decisions" / slug).write_text(text, "utf-8")
                point = dataclasses.replace(point, extra=extra)
                confirmed.setdefault(name, []).append(point)
        for (name, rate), point_of in prepared.items():
            band = point_of["band"]
            if band is not None:
                runs_here = [p for p in confirmed.get(name, ()) if p.rate == rate]
                own = [p for p in runs_here if p.extra["fleet_router"] == name]
                judged = verdict(band, [p.ttft_p90_s for p in own], [p.meets(_slo(args)) for p in own])
                bands.setdefault(name, []).append(
                    {**band, "sim_single_ttft_p90_s": point_of["sim"].ttft_p90_s, **judged}
                )
    finally:
        children = list(fleet.children)
        await fleet.stop()
        processes += [{"name": c.name, "pid": c.pid, "exit_code": c.process.returncode} for c in children]
    return confirmed, invalid, processes, bands


async def _fleet_point(
    args: argparse.Namespace,
    router: RouterSpec,
    rate: float,
    specs: list[RequestSpec],
    sim: RatePoint,
    sim_rows: list[RequestRow],
    fleet: Any,
    drive: Any,
    logs: Path,
    assignment: Assignment | None,
    log: Callable[[str], None],
) -> tuple[RatePoint | None, str | None, tuple[int, int] | None]:
    """One fleet run of ``specs`` at ``rate`` through ``router`` (a replay with ``assignment``), as a
    point next to the simulation ``sim`` of the same requests; ``(None, reason, …)`` when it failed."""
    from loadtests.report import invalid_reason
    from loadtests.runs import run_router

    log(f"fleet: {router.name} @ {rate:.3g}/s (model time), {len(specs)} requests ...")
    load_before = _loadavg()
    started = time.strftime("%H:%M:%S", time.gmtime())
    pinned = None if assignment is None else {k: v for k, v in assignment.items() if v is not None}
    save = args.confirm_save_decisions and router.kind == "kvlb"
    run = await run_router(
        router, fleet, specs, drive, logs, assignment=pinned, after_drive=_read_decisions if save else None
    )
    finished = time.strftime("%H:%M:%S", time.gmtime())
    if run.status != "ok" or run.summary is None or run.result is None:
        return None, f"{run.status}: {run.note}", run.process
    reason = invalid_reason(run)
    ts = args.time_scale
    s = run.summary
    lag = send_lag(run.result.records)
    index_of = {spec.request_id: i for i, spec in enumerate(specs)}
    rows = rows_of(run.result.records, index_of, ts)
    block = PROFILES[args.profile].page_size
    agreement = compare(sim_rows, rows, block_tokens=block)
    groups = [q.tag("tenant") if q.tag("tenant") is not None else q.session_id for q in specs]
    arrivals = [(q.arrival_s or 0.0) * ts for q in specs]
    p90 = None if s.ttft_p90_s is None else s.ttft_p90_s * ts
    point = RatePoint(
        rate=rate,
        source="fleet",
        requests=s.requests,
        errors=s.requests - s.ok,
        ttft_p50_s=None if s.ttft_p50_s is None else s.ttft_p50_s * ts,
        ttft_p90_s=p90,
        ttft_p99_s=None if s.ttft_p99_s is None else s.ttft_p99_s * ts,
        hit_rate=s.hit_rate,
        prompt_tokens=s.prompt_tokens,
        cached_tokens=s.cached_tokens,
        extra={
            "fleet_router": router.name,
            "sim_same_requests_ttft_p90_s": sim.ttft_p90_s,
            "sim_same_requests_meets_slo": sim.meets(_slo(args)),
            "sim_same_requests_hit_rate": sim.hit_rate,
            "fleet_vs_sim_ttft_p90": ratio(p90, sim.ttft_p90_s),
            "vs_sim": agreement,
            "followers": followers(rows, groups, arrivals, block_tokens=block),
            "kvlb_receipts": run.prediction,
            "sim_followers": followers(sim_rows, groups, arrivals, block_tokens=block),
            # the emulators' loops behind their model over the run, summed over replicas (model s)
            "emulator_timing": {
                key: sum(d.get(key, 0) for d in run.replica_delta.values())
                for key in (
                    "steps_total",
                    "step_late_model_s_total",
                    "step_slips_total",
                    "step_slip_model_s_total",
                )
            },
            "wall_s": run.wall_s,
            "utc": f"{started}-{finished}",
            "load_1m": [load_before, _loadavg()],
            # the client's lag in model time, and the rate it really sent (model req/s)
            "client_lag_p90_s": None if lag is None else lag.p90_s * ts,
            "client_lag_max_s": None if lag is None else lag.max_s * ts,
            "sent_rate": None if lag is None else lag.sent_rate_per_s / ts,
            "client_behind": None if lag is None else lag.behind,
            "rows": rows,
            **_saved_decisions(run.after_drive if save else None),
        },
    )
    same_replica, same_cached = agreement["same_replica_share"] or 0, agreement["same_cached_share"] or 0
    log(f"  p90 {p90 or float('nan'):.3f} s (sim {sim.ttft_p90_s or float('nan'):.3f}), hit rate "
        f"{s.hit_rate or 0:.3f} (sim {sim.hit_rate or 0:.3f}), same replica {same_replica:.3f}, "
        f"same cached {same_cached:.3f}")  # fmt: skip
    return point, reason, run.process


def _saved_decisions(saved: dict[str, Any] | None) -> dict[str, Any]:
    """A point's ``decisions`` figures and its ``decision_rows`` (written to ``decisions/``, then
    dropped from the point) from :func:`_read_decisions`'s answer; nothing without one."""
    if saved is None:
        return {}
    counts = {"saved": len(saved["decisions"]), "missing": saved["missing"], "error": saved.get("error")}
    return {"decisions": counts, "decision_rows": saved["decisions"]}


async def _read_decisions(session: Any, url: str) -> dict[str, Any]:
    """The ``after_drive`` of ``--confirm-save-decisions``: the router's decision ring."""
    from loadtests.runs import kvlb_decisions

    return await kvlb_decisions(session, url)


def _sim_rows(
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
    the stream's request id (records are in arrival order, as in :func:`_sim_rows`), plus the
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


def _write_rows(path: Path, rows: Sequence[RequestRow]) -> None:
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows), "utf-8")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- run


def _slo(args: argparse.Namespace) -> Slo:
    return Slo(
        ttft_p90_s=parse_seconds(args.slo_ttft_p90) or 2.0,
        ttft_p99_s=parse_seconds(args.slo_ttft_p99),
        max_error_rate=args.max_error_rate,
    )


def write_png(report: dict[str, Any], path: Path) -> bool:
    """The SVG's plot as a PNG when matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    figure, axes = plt.subplots(figsize=(8, 5))
    for r in report["routers"]:
        sim = [(p["rate"], p["ttft_p90_s"]) for p in r.get("points", ()) if p.get("ttft_p90_s")]
        if sim:
            (line,) = axes.plot(*zip(*sim, strict=True), marker="o", label=r["name"])
            fleet = [(p["rate"], p["ttft_p90_s"]) for p in routed_points(r) if p.get("ttft_p90_s")]
            if fleet:
                axes.scatter(*zip(*fleet, strict=True), s=80, facecolors="none", edgecolors=line.get_color())
    axes.axhline(report["slo"]["ttft_p90_s"], linestyle="--", color="black", label="SLO")
    axes.set_yscale("log")
    axes.set_xlabel("offered rate, req/s")
    axes.set_ylabel("TTFT p90, s")
    axes.legend()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def run(args: argparse.Namespace) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr)

    if args.smoke:
        args.requests = args.requests or SMOKE["requests"]
        args.replicas = SMOKE["replicas"]
        args.max_points = min(args.max_points, 8)
        args.rel_tol = max(args.rel_tol, 0.25)
        args.growth = max(args.growth, 3.0)
        if args.slo_ttft_p90 == "2s":  # 120 short requests on 2 replicas: a tighter SLO to bracket
            args.slo_ttft_p90 = "0.3s"
    elif args.requests is None and args.trace is None:
        args.requests = 600
    try:
        slo = _slo(args)
        names = [n.strip() for n in args.routers.split(",") if n.strip()]
        if args.target:
            names = ["target"]
            if args.confirm or args.searches_from is not None:
                raise ValueError("--target measures every point for real: no --confirm, --searches-from")
        for name in names:
            if name != "target":
                sim_router(name)
            if name == "vllm_kv_aware":
                raise ValueError("vllm_kv_aware has no simulator model; `kvlb loadtest` runs it")
        if not names:
            raise ValueError("--routers names no router")
        if args.confirm_interleave and args.confirm_rates is None:
            raise ValueError("--confirm-interleave needs --confirm-rates (the same rates for every router)")
        if not math.isfinite(args.sim_forward_delay_ms) or args.sim_forward_delay_ms < 0:
            raise ValueError(f"--sim-forward-delay-ms must be >= 0, got {args.sim_forward_delay_ms}")
        jitter_ms = args.sim_forward_jitter_ms
        if not math.isfinite(jitter_ms) or jitter_ms < 0 or jitter_ms > args.sim_forward_delay_ms:
            raise ValueError(
                f"--sim-forward-jitter-ms must be in [0, --sim-forward-delay-ms], got {jitter_ms}"
            )
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        workload, stream = build_stream(args)
    except (ValueError, KeyError, OSError) as exc:
        print(f"kvlb capacity: {exc}", file=sys.stderr)
        return 2
    label = "mooncake" if args.trace is not None else args.workload
    out = args.out or Path("capacity-results") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    start = args.start_rate or 2.0 * args.replicas
    log(f"{len(stream.requests)} requests; base rate {stream.base_rate:.3g}/s; searching from {start:.3g}/s")
    searches: dict[str, Search] = {}
    saved_searches = (
        searches_from_report(json.loads(args.searches_from.read_text("utf-8")))
        if args.searches_from is not None
        else {}
    )
    if args.target:
        return _run_target(args, workload, stream, slo, out, start, started, log)
    for name in names:
        if name in saved_searches:
            searches[name] = saved_searches[name]
            log(f"{name}: search from {args.searches_from}: capacity {searches[name].capacity} req/s")
            continue
        measure = sim_measure(args, name, stream, log)
        searches[name] = search(
            functools.partial(measure, limit=None),
            slo,
            start,
            growth=args.growth,
            rel_tol=args.rel_tol,
            max_points=args.max_points,
        )
        log(f"{name}: capacity {searches[name].capacity} req/s (first failing {searches[name].first_fail})")
    saved = {
        name: oracle_saved(args, stream, found.capacity)
        for name, found in searches.items()
        if found.capacity is not None
    }
    config = sim_config(args, None)
    profile = config.resolved_profile()
    pooled = prefix_reuse_bound(
        [r.token_ids for r in stream.requests],
        block_size=profile.page_size,
        replicas=args.replicas,
        blocks_per_replica=profile.kv_capacity_tokens // profile.page_size,
    ).to_dict()
    kvlb_search = searches.get("kvlb")
    diagnosis = None
    if kvlb_search is not None and kvlb_search.capacity is not None and not args.smoke:
        log("diagnosis at kvlb's capacity: kvlb on MIN engines ...")
        diagnosis = diagnose(args, stream, kvlb_search.capacity)
    confirmed: dict[str, list[RatePoint]] = {}
    invalid: dict[str, str] = {}
    processes: list[dict[str, Any]] = []
    bands: dict[str, list[dict[str, Any]]] = {}
    if args.confirm:
        confirmed, invalid, processes, bands = asyncio.run(confirm_on_fleet(args, stream, searches, out, log))
    meta = {
        "command": "kvlb capacity " + " ".join(sys.argv[sys.argv.index("capacity") + 1 :])
        if "capacity" in sys.argv
        else "kvlb capacity",
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": workload.name, **dataclasses.asdict(workload)},  # type: ignore[call-overload]
        "requests": len(stream.requests),
        "base_rate_per_s": stream.base_rate,
        "fleet": {
            "replicas": args.replicas,
            "profile": args.profile,
            "kv_capacity_tokens": profile.kv_capacity_tokens,
        },
        "simulated_as": {n: _simulated_as(n) for n in names},
        "confirmed_on_fleet": bool(args.confirm),
        "confirm_requests": min(args.confirm_requests, len(stream.requests)) if args.confirm else None,
        "confirm_sim_draws": args.confirm_sim_draws if args.confirm else None,
        "confirm_sim_jitter_ms": args.confirm_sim_jitter_ms if args.confirm else None,
        "sim_forward_delay_ms": args.sim_forward_delay_ms,
        "sim_prune": not args.sim_no_prune,
        "sim_forward_jitter_ms": args.sim_forward_jitter_ms,
        "time_scale": args.time_scale,
        "processes": processes,
        "kvlb_sets": list(args.kvlb_set),
        "kvlb_model_time_sets": list(fleet_sets_of(args).model_time) if args.confirm else [],
        "kvlb_workers": kvlb_workers(args) if args.confirm else None,
        "search": {"start_rate": start, "rel_tol": args.rel_tol, "max_points": args.max_points},
        "oracle_load_bound_s": args.oracle_load_bound_s,
        "searches_from": str(args.searches_from) if args.searches_from is not None else None,
    }
    peers = [n for n in names if n in PEER_NAMES]
    report = build_report(
        meta,
        slo,
        searches,
        peers,
        confirmed=confirmed,
        oracle_bound=pooled,
        oracle_saved=saved,
        invalid=invalid,
        bands=bands,
    )
    report["diagnosis"] = diagnosis
    (out / "capacity.json").write_text(json.dumps(report, indent=1) + "\n", "utf-8")
    (out / "capacity.md").write_text(markdown(report), "utf-8")
    (out / "ttft_vs_rate.svg").write_text(svg_plot(report), "utf-8")
    png = write_png(report, out / "ttft_vs_rate.png")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(markdown(report).split("## Every point")[0])
    log(f"report: {out}/capacity.md, capacity.json, ttft_vs_rate.svg" + (", ttft_vs_rate.png" if png else ""))
    return 0


def _simulated_as(name: str) -> str:
    """What the simulator runs for router ``name`` (the report's ``simulated_as``)."""
    spec, min_engines = sim_router(name)
    if spec is None:
        return "oracle" if min_engines else "oracle's plan on LRU engines"
    policy = SIM_POLICY.get(spec.name, spec.policy)
    return f"{policy} on MIN engines" if min_engines else policy


def _run_target(
    args: argparse.Namespace,
    workload: Workload,
    stream: Stream,
    slo: Slo,
    out: Path,
    start: float,
    started: str,
    log: Callable[[str], None],
) -> int:
    """``--target``: every point a real run at the URL (:mod:`loadtests.capacity.target`)."""
    try:
        found = search_target(args, lambda rate, limit: stream.specs_at(rate, limit, 1.0), slo, start, log)
    except (TargetDown, ValueError, OSError) as exc:
        print(f"kvlb capacity: {exc}", file=sys.stderr)
        return 1
    meta = {
        "command": "kvlb capacity " + " ".join(sys.argv[sys.argv.index("capacity") + 1 :])
        if "capacity" in sys.argv
        else "kvlb capacity",
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": args.target,
        "workload": {"name": workload.name, **dataclasses.asdict(workload)},  # type: ignore[call-overload]
        "requests_per_point": min(args.target_requests, len(stream.specs)),
        "base_rate_per_s": stream.base_rate,
        "search": {"start_rate": start, "rel_tol": args.rel_tol, "max_points": args.max_points},
        "slo_gate_rate": args.slo_gate,
    }
    report = build_report(meta, slo, {"target": found}, [])
    (out / "capacity.json").write_text(json.dumps(report, indent=1) + "\n", "utf-8")
    (out / "capacity.md").write_text(markdown(report), "utf-8")
    (out / "ttft_vs_rate.svg").write_text(svg_plot(report), "utf-8")
    png = write_png(report, out / "ttft_vs_rate.png")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(markdown(report).split("## Every point")[0])
    log(f"report: {out}/capacity.md, capacity.json, ttft_vs_rate.svg" + (", ttft_vs_rate.png" if png else ""))
    return gate(found, args, log)
