"""``kvlb simulate`` (fleet-scale simulation) and ``kvlb tune`` (policy-weight sweeps) (I/O shell).

Both build a :class:`~loadtests.simulate.SimConfig` and a request stream from the same flags; the work
is in :mod:`loadtests.simulate` and :mod:`loadtests.tune`. ``--smoke`` runs a tiny preset (4
replicas, 200 short requests; tune: 4 grid points) for CI. Progress goes to stderr; ``--json`` prints
only the JSON report on stdout. See ``docs/simulate.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import yaml

from balancer.errors import ConfigError
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import POLICY_NAMES
from loadtests import tune
from loadtests.atomic_files import write_text_atomic
from loadtests.flag_checks import refuse_below_one, refuse_not_above
from loadtests.simulate import SimConfig, SimRequest, Simulation, trace_requests, workload_requests
from loadtests.simulate.bound import pooled_ttfts
from loadtests.simulate.oracle import BeladySimulation
from loadtests.simulate.report import compare, compare_table, summary_of, summary_table
from loadtests.stats import percentile
from loadtests.workloads import WORKLOADS
from replicas.sim.profiles import PROFILES

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

SMOKE_PARAMS: dict[str, Any] = {
    "prompt_format": "tokens",
    "tenants": 4,
    "users_per_tenant": 2,
    "context_tokens": 1024,
    "question_tokens": 128,
    "max_tokens": 32,
}
EXIT_SIGINT = 128 + 2
"""Exit code of a run stopped by SIGINT (as ``kvlb loadtest``'s)."""
DEFAULT_RATE_PER_REPLICA = 2.0
"""Default arrival rate of workloads without a schedule, requests/s per replica."""


def register(subparsers: SubParsers) -> None:
    simulate = subparsers.add_parser(
        "simulate",
        help="simulate a fleet behind the real routing code, on virtual time",
        description="Discrete-event simulation of N replicas behind kvlb's routing; "
        "prints the loadtest summary.",
    )
    _fleet_arguments(simulate)
    simulate.add_argument(
        "--compare-with", type=Path, metavar="REPORT.json", help="a loadtest JSON report to check against"
    )
    simulate.add_argument(
        "--compare-router",
        metavar="NAME",
        help="router entry of a loadtest report (default: kvlb, same policy)",
    )
    simulate.add_argument(
        "--tolerance", type=float, default=0.10, help="relative tolerance of --compare-with (0.10)"
    )
    simulate.add_argument("--output", type=Path, help="also write the JSON report here")
    simulate.add_argument(
        "--engines",
        choices=("lru", "min"),
        default="lru",
        help="the replicas' eviction: lru (as engines do) or min (Belady's, sees the future; fast model)",
    )
    simulate.add_argument(
        "--pooled-bound",
        action="store_true",
        help="print the routing-independent pooled list schedule's TTFT instead (one unbounded "
        "cache, one FCFS queue; loadtests/simulate/bound.py)",
    )
    simulate.set_defaults(handler=run_simulate)
    tuner = subparsers.add_parser(
        "tune",
        help="sweep policy weights in the simulator and recommend some for an SLO",
        description="Sweep policy weights over one workload in the simulator; print the frontier and a "
        "`kvlb admin policy set` line for the SLO.",
    )
    _fleet_arguments(tuner)
    tuner.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="a swept weight (repeat); null = off",
    )
    tuner.add_argument(
        "--max-imbalance", type=float, default=1.5, help="SLO: max/mean replica requests (1.5)"
    )
    tuner.add_argument("--min-hit-rate", type=float, default=0.0, help="SLO: minimum hit rate (0)")
    tuner.add_argument(
        "--objective", choices=sorted(tune.OBJECTIVES), default="ttft_p90", help="minimised figure"
    )
    tuner.add_argument(
        "--plot", type=Path, default=Path("kvlb-tune-frontier.png"), help="PNG path (needs matplotlib)"
    )
    tuner.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    tuner.set_defaults(handler=run_tune)


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="workload name (default tenants)")
    source.add_argument("--trace", type=Path, help="Mooncake trace (JSON lines), tiled to --requests")
    add(
        "--param",
        action="append",
        default=[],
        metavar="K=V",
        help="workload field (repeat), e.g. prompt_format=tokens",
    )
    add("--replicas", type=int, default=None, help="replicas (default 8; smoke 4)")
    add(
        "--profile",
        choices=sorted(PROFILES),
        default="h100-llama3-8b",
        help="replica timing/capacity profile",
    )
    add("--page-size", type=int, default=None, help="KV page = router block size, tokens (default: profile)")
    add("--kv-capacity-tokens", type=int, default=None, help="override the profile's KV pool per replica")
    add("--policy", choices=POLICY_NAMES, default="cost", help="routing policy (default cost)")
    add("--weights", nargs="*", default=[], metavar="K=V", help="policy weights, as `kvlb admin policy set`")
    add(
        "--requests", type=int, default=None, help="requests to simulate (default: the workload's; smoke 200)"
    )
    add(
        "--rate",
        type=float,
        default=None,
        help=f"arrivals/s (default {DEFAULT_RATE_PER_REPLICA:g} per replica; trace: its own)",
    )
    add("--seed", type=int, default=0, help="seed of the workload and of routing tie-breaks")
    add(
        "--replica-model",
        choices=("fast", "step"),
        default="fast",
        help="fast (event-level) or step (exact, slow)",
    )
    add("--no-prune", action="store_true", help="give the policy every replica (slow on big fleets)")
    add(
        "--max-input-tokens",
        type=int,
        default=None,
        help="trace: cut prompts (default: context − max-tokens cap)",
    )
    add("--max-tokens-cap", type=int, default=1024, help="trace: cap on output tokens (1024)")
    add("--scrape-interval-s", type=float, default=1.0, help="engine-gauge scrape period, virtual s (0: off)")
    add("--event-delay-s", type=float, default=0.0, help="KV event delay to the index, virtual s")
    add("--json", action="store_true", help="print the JSON report only")
    add("--smoke", action="store_true", help="tiny preset for CI")


@dataclass(frozen=True, slots=True)
class Inputs:
    config: SimConfig
    source: dict[str, Any]
    requests: list[SimRequest] | None
    stream: Iterator[SimRequest] | None


def name_values(items: list[str], what: str) -> dict[str, Any]:
    """``NAME=VALUE`` flags as a dict, each value read as YAML (``null``, numbers, strings; empty:
    ``None``)."""
    values: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{what}: expected NAME=VALUE, got {item!r}")
        values[name.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return values


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse, with one line naming the flag, the numeric flags no run can use (``ValueError``)."""
    refuse_below_one(
        {
            "--replicas": args.replicas,
            "--requests": args.requests,
            "--page-size": args.page_size,
            "--kv-capacity-tokens": args.kv_capacity_tokens,
            "--max-input-tokens": args.max_input_tokens,
            "--max-tokens-cap": args.max_tokens_cap,
        }
    )
    refuse_not_above("--rate", args.rate, 0, "requests/s")
    for flag, seconds in (
        ("--scrape-interval-s", args.scrape_interval_s),
        ("--event-delay-s", args.event_delay_s),
    ):
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"{flag} must be a finite number >= 0 (virtual s), got {seconds}")
    tolerance = getattr(args, "tolerance", 0.0)
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"--tolerance must be a finite number >= 0, got {tolerance}")


def check_writable(path: Path | None, flag: str) -> None:
    """Refuse an output ``path`` that cannot be written before any work is done (``ValueError``)."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory (give a file name)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")


def finite_or_none(value: float) -> float | None:
    """``value``, or ``None`` when it is not finite (JSON has no infinity)."""
    return value if math.isfinite(value) else None


def build_inputs(args: argparse.Namespace, materialise: bool) -> Inputs:
    """The config and requests the flags describe (``materialise``: a list, for repeated runs)."""
    check_numbers(args)
    weights = PolicyWeights.from_dict(name_values(args.weights, "--weights"))
    replicas = args.replicas if args.replicas is not None else (4 if args.smoke else 8)
    config = SimConfig(
        replicas=replicas,
        profile=args.profile,
        page_size=args.page_size,
        kv_capacity_tokens=args.kv_capacity_tokens,
        policy=args.policy,
        weights=weights,
        replica_model=args.replica_model,
        seed=args.seed,
        prune=not args.no_prune,
        scrape_interval_s=args.scrape_interval_s,
        event_delay_s=args.event_delay_s,
    )
    requests = args.requests if args.requests is not None else (200 if args.smoke else None)
    stream: Iterator[SimRequest]
    if args.trace is not None:
        profile = config.resolved_profile()
        cut = args.max_input_tokens or max(1, profile.max_context_tokens - args.max_tokens_cap)
        shape, stream = trace_requests(
            args.trace,
            requests=requests,
            rate_per_s=args.rate,
            seed=args.seed,
            max_input_tokens=cut,
            max_tokens_cap=args.max_tokens_cap,
        )
        source: dict[str, Any] = {
            "trace": str(args.trace),
            "rows": shape.rows,
            "trace_rate_per_s": finite_or_none(shape.rate_per_s),
        }
        source |= {"requests": requests or shape.rows, "rate_per_s": args.rate, "max_input_tokens": cut}
    else:
        name = args.workload or "tenants"
        params = (dict(SMOKE_PARAMS) if args.smoke and name == "tenants" else {}) | name_values(
            args.param, "--param"
        )
        rate = args.rate if args.rate is not None else DEFAULT_RATE_PER_REPLICA * replicas
        stream = workload_requests(name, params, requests=requests, rate_per_s=rate, seed=args.seed)
        # the workload is built when its first request is drawn: a bad --param fails here, as a
        # one-line error of the command, not as a traceback out of the running simulation
        first = next(stream, None)
        stream = itertools.chain(() if first is None else (first,), stream)
        source = {"workload": name, "params": params, "requests": requests, "rate_per_s": rate}
    listed = list(stream) if materialise else None
    return Inputs(config, source, listed, None if materialise else stream)


def _progress(started: float) -> Any:
    def show(done: int, virtual_s: float) -> None:
        wall = time.perf_counter() - started
        print(
            f"  {done:,} requests, {virtual_s:,.0f} virtual s, {wall:,.0f} s, {done / wall:,.0f} req/s",
            file=sys.stderr,
        )

    return show


def run_simulate(args: argparse.Namespace) -> int:
    """``kvlb simulate``; SIGINT at any point is one line and exit :data:`EXIT_SIGINT` (no report)."""
    try:
        return _simulate(args)
    except KeyboardInterrupt:
        print("kvlb simulate: stopped by SIGINT (no report)", file=sys.stderr)
        return EXIT_SIGINT


def _simulate(args: argparse.Namespace) -> int:
    try:
        check_writable(args.output, "--output")
        inputs = build_inputs(args, materialise=args.engines == "min" or args.pooled_bound)
        measured = None
        if args.compare_with is not None:
            measured = _measured(args.compare_with, args.compare_router, inputs.config.policy)
    except (ConfigError, ValueError, KeyError, OSError) as exc:
        print(f"kvlb simulate: {exc}", file=sys.stderr)
        return 2
    if args.pooled_bound:
        return _print_pooled_bound(inputs, args.json)
    started, cpu_started = time.perf_counter(), time.process_time()
    if args.engines == "min":
        assert inputs.requests is not None
        simulation: Simulation = BeladySimulation(inputs.config, inputs.requests)
    else:
        assert inputs.stream is not None
        simulation = Simulation(inputs.config, inputs.stream)
    result = simulation.run(progress=_progress(started))
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    report: dict[str, Any] = {
        "kind": "kvlb-simulate",
        "config": inputs.config.to_dict(),
        "engines": args.engines,
        "source": inputs.source,
        "summary": result.summary.to_dict(),
        "sim": {
            "virtual_s": result.virtual_s,
            "events": result.events,
            "wall_s": wall_s,
            "cpu_s": cpu_s,
            "requests_per_wall_s": len(result.records) / wall_s if wall_s > 0 else None,
            **result.stats,
        },
    }
    code = 0
    checks = compare(result.summary, measured, args.tolerance) if measured is not None else None
    if checks is not None:
        report["comparison"] = {
            "tolerance": args.tolerance,
            "ok": all(c.ok for c in checks),
            "fields": [
                {
                    "name": c.name,
                    "simulated": c.simulated,
                    "measured": c.measured,
                    "relative_error": c.relative_error,
                    "ok": c.ok,
                }
                for c in checks
            ],
        }
        code = 0 if report["comparison"]["ok"] else 1
    text = json.dumps(report, indent=2)
    if args.output is not None:
        try:
            write_text_atomic(args.output, text + "\n")
        except OSError as exc:
            print(f"kvlb simulate: --output {args.output}: {exc.strerror or exc}", file=sys.stderr)
            code = 2
    if args.json:
        print(text)
        return code
    sim = report["sim"]
    print(
        f"kvlb simulate: {len(result.records):,} requests on {inputs.config.replicas} replicas "
        f"({inputs.config.replica_model} model), {result.virtual_s:,.1f} virtual s in {wall_s:,.1f} s "
        f"({sim['requests_per_wall_s']:,.0f} requests/s)"
    )
    print(summary_table(result.summary))
    if checks is not None:
        print()
        print(compare_table(checks, args.tolerance))
    return code


def _measured(path: Path, router: str | None, policy: str) -> Any:
    """The summary of ``--compare-with``'s report; errors name the file."""
    try:
        loaded = json.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise ValueError(f"--compare-with {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--compare-with {path}: not a JSON report ({exc})") from None
    try:
        return summary_of(loaded, router, policy)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--compare-with {path}: no loadtest summary in it ({exc})") from None


def _print_pooled_bound(inputs: Inputs, as_json: bool) -> int:
    """``--pooled-bound``: the TTFT percentiles of :func:`pooled_ttfts` for the stream."""
    assert inputs.requests is not None
    config = inputs.config
    profile = config.resolved_profile()
    ttfts = pooled_ttfts(inputs.requests, config.replicas, profile, config.page_size or profile.page_size)
    report = {
        "kind": "kvlb-simulate-pooled-bound",
        "replicas": config.replicas,
        "profile": profile.name,
        "source": inputs.source,
        "requests": len(ttfts),
        **{f"ttft_p{p}_s": percentile(ttfts, p) for p in (50, 90, 99)},
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"kvlb simulate --pooled-bound: {len(ttfts):,} requests on {config.replicas} replicas")
    for name in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"):
        value = report[name]
        print(f"{name:<18} {value:.4g}" if isinstance(value, float) else f"{name:<18} -")
    return 0


def run_tune(args: argparse.Namespace) -> int:
    """``kvlb tune``; SIGINT at any point is one line and exit :data:`EXIT_SIGINT` (no recommendation)."""
    try:
        return _tune(args)
    except KeyboardInterrupt:
        print("kvlb tune: stopped by SIGINT (no recommendation)", file=sys.stderr)
        return EXIT_SIGINT


def _tune(args: argparse.Namespace) -> int:
    try:
        grid = (
            tune.grid_for_policy(  # before the stream is built: a grid the policy ignores is refused at once
                args.policy,
                tune.parse_grid(args.grid) if args.grid else None,
                dict(tune.SMOKE_GRID if args.smoke else tune.DEFAULT_GRID),
            )
        )
        inputs = build_inputs(args, materialise=True)
        if not (math.isfinite(args.max_imbalance) and args.max_imbalance >= 1):
            raise ValueError(
                "--max-imbalance must be a finite number >= 1 (max/mean replica requests), "
                f"got {args.max_imbalance}"
            )
        if not 0 <= args.min_hit_rate <= 1:
            raise ValueError(f"--min-hit-rate must be in [0, 1], got {args.min_hit_rate}")
        if not args.no_plot:
            check_writable(args.plot, "--plot")
        slo = tune.Slo(args.max_imbalance, args.min_hit_rate, args.objective)
        for values in tune.grid_points(grid):  # validate every point before running any
            inputs.config.weights.replace(**values)
    except (ConfigError, ValueError, KeyError, OSError) as exc:
        print(f"kvlb tune: {exc}", file=sys.stderr)
        return 2
    assert inputs.requests is not None

    def progress(n: int, total: int, values: dict[str, float | None]) -> None:
        print(f"  point {n + 1}/{total}: {values}", file=sys.stderr)

    points = tune.mark(tune.sweep(inputs.config, inputs.requests, grid, progress), slo)
    best = tune.recommend(points, slo)
    report = tune.report(points, best, slo, inputs.config.policy)
    report["source"] = inputs.source
    plotted = False
    if not args.no_plot:
        plotted = tune.write_plot(points, best, args.plot)
        report["plot"] = str(args.plot) if plotted else None
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(tune.table(points, list(grid)))
        print(f"\nplot: {args.plot}" if plotted else "\n(no plot: matplotlib missing or --no-plot)")
        if best is None:
            print(
                f"no point meets imbalance <= {slo.max_imbalance:g}, "
                f"hit rate >= {slo.min_hit_rate:g}, no errors"
            )
        else:
            print(f"recommended (min {slo.objective}, imbalance <= {slo.max_imbalance:g}):")
            print(tune.admin_command(inputs.config.policy, best.weights))
    return 0 if best is not None else 1
