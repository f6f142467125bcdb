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
   fleet's repeats are judged against that spread (:mod:`loadtests.capacity.band`). Each fleet run is
   also simulated at its own routing times over ``--confirm-retimed-hops-ms`` and, with a spread
   hop, ``--confirm-retimed-draws`` times per ``--confirm-retimed-hop-ranges-ms`` range, and judged
   against the draws and those (:mod:`loadtests.capacity.retimed`).
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
import signal
import sys
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from loadtests.atomic_files import save_figure_atomic, write_text_atomic
from loadtests.capacity.confirm import confirm_on_fleet, kvlb_workers
from loadtests.capacity.report import build_report, markdown, routed_points, svg_plot
from loadtests.capacity.retimed import (
    DEFAULT_HOP_RANGES_MS,
    DEFAULT_HOPS_MS,
    DEFAULT_SPREAD_DRAWS,
    MAX_HOPS,
    MAX_SPREAD_SIMULATIONS,
    parse_hop_ranges_ms,
    parse_hops_ms,
)
from loadtests.capacity.search import RatePoint, Search, Slo, search, searches_from_report
from loadtests.capacity.simulated import (
    Stream,
    diagnose,
    oracle_saved,
    sim_config,
    sim_measure,
    sim_router,
    simulated_as,
    slo_of,
)
from loadtests.capacity.target import (
    SearchInterrupted,
    TargetDown,
    add_target_arguments,
    check_target_args,
    gate,
    model_of,
    search_target,
    sigterm_as_sigint,
    stopped_by,
)
from loadtests.flag_checks import refuse_below_one, refuse_not_above
from loadtests.fleet.child_process import ChildFailed
from loadtests.kvlb_timers import WALL_TIMERS_HELP, fleet_sets_of
from loadtests.oracle import prefix_reuse_bound
from loadtests.peers import PEER_NAMES
from loadtests.simulate import SimRequest
from loadtests.simulate.oracle import DEFAULT_LOAD_BOUND_S
from loadtests.target import EXIT_INTERRUPTED, EXIT_SLO_MISSED
from loadtests.target_access import redact_argv, redact_url
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

CHAT_MEMO_MAX = 4096
"""Distinct chats whose token ids ``kvlb capacity`` remembers while it builds a stream of chat prompts."""
DEFAULT_MAX_HELD_TOKENS = 1 << 28
"""``--max-held-tokens``'s default: 268,435,456 token ids, 1 GiB at 4 bytes each."""
EXIT_FLEET_FAILED = 1
"""``--confirm``'s emulated fleet did not start (a child exited, stayed silent or could not be
started): one line naming it, its exit code and its stderr's last lines, the report of the
simulator's searches written (``meta.fleet_error``). The code of ``--target``'s run that measured
nothing and of ``kvlb loadtest``'s failed run. Before 2026-12-01 (h-capfollow2) a traceback."""
DEFAULT_ROUTERS = ("kvlb", "round_robin", "least_load", "sglang_cache_aware", "oracle")
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
    add("--max-held-tokens", type=int, default=DEFAULT_MAX_HELD_TOKENS,
        help="the stream's prompts are held once, 4 bytes a token id: refuse a stream whose prompts "
        f"pass this many token ids (default {DEFAULT_MAX_HELD_TOKENS:,}: 1 GiB)")  # fmt: skip
    add("--routers", default=",".join(DEFAULT_ROUTERS),
        help="comma-separated: kvlb, round_robin, least_load, power_of_two, kvlb:<policy>[+w=v], "
        "sglang_cache_aware (simulated as sglang_threshold); simulator only: oracle (its plan on MIN "
        "engines), oracle_lru (its plan on LRU engines), <kvlb router>@min (on MIN engines)")  # fmt: skip
    add("--replicas", type=int, default=None, help="replicas (8; --smoke: 2)")
    add("--profile", choices=sorted(PROFILES), default="h100-llama3-8b", help="replica profile")
    add("--kv-capacity-tokens", type=int, default=None, help="per-replica KV pool (default: the profile's)")
    add("--slo-ttft-p90", default=None, help="TTFT p90 bound, model time (2s; --smoke without --trace: 0.3s)")
    add("--slo-ttft-p99", default=None, help="also a TTFT p99 bound, e.g. 4s")
    add("--max-error-rate", type=float, default=0.001, help="error rate bound (0.001)")
    add("--start-rate", type=float, default=None, help="first rate tried (default: 2 per replica)")
    add("--growth", type=float, default=None, help="rate step while bracketing (1.5; --smoke: 3)")
    add("--rel-tol", type=float, default=None,
        help="bisect until the bracket is this narrow (0.05; --smoke: 0.25)")  # fmt: skip
    add("--max-points", type=int, default=None, help="simulations per router at most (14; --smoke: 8)")
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
    add("--confirm-retimed-hops-ms", default=",".join(f"{h:g}" for h in DEFAULT_HOPS_MS), metavar="H1,H2,...",
        help="after each fleet run, simulate its requests once per hop (model ms, the same for every "
        "request) with each arriving when the run routed it (the kvlb's decision times when "
        "--confirm-save-decisions saved them all, else the client's send times), and judge the run "
        f"against the draws and them (default 5,10,20; at most {MAX_HOPS}; none: off)")  # fmt: skip
    add("--confirm-retimed-hop-ranges-ms", metavar="LO-HI,...",
        default=",".join(f"{lo:g}-{hi:g}" for lo, hi in DEFAULT_HOP_RANGES_MS),
        help="also simulate each fleet run's requests at its own times with a spread hop: each "
        "request's hop its own uniform draw in [LO, HI] model ms, --confirm-retimed-draws times per "
        "range (seeded by --seed and the draw); the run is timing when the fixed hops or any range "
        "agree with it (default 5-15, the fleet's hop on idle replicas at --time-scale 0.25; "
        "none: off)")  # fmt: skip
    add("--confirm-retimed-draws", type=int, default=DEFAULT_SPREAD_DRAWS,
        help=f"simulations per --confirm-retimed-hop-ranges-ms range, each with its own hops "
        f"({DEFAULT_SPREAD_DRAWS}; ranges × draws at most {MAX_SPREAD_SIMULATIONS})")  # fmt: skip
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
    add("--smoke", action="store_true",
        help="tiny preset for CI (2 replicas, 120 short requests, at most 8 points, --rel-tol 0.25, "
        "--growth 3); a flag given explicitly wins over the preset")  # fmt: skip
    add("--json", action="store_true", help="print the JSON report on stdout")
    add_target_arguments(parser)
    parser.set_defaults(handler=run)


def build_stream(args: argparse.Namespace) -> tuple[Workload, Stream]:
    """The workload and its stream: one pass over the specs, each prompt kept as 4-byte token ids
    (``array('I')``) and their total bounded by ``--max-held-tokens`` (``ValueError`` naming the
    request past it); the specs themselves are not kept but regenerated for the fleet's and the
    target's runs (``Stream.specs_of``: deterministic in ``--seed``). Before 2026-12-01 the
    stream held every spec's prompt twice as Python ints (about 52 bytes a token: 1.03 GB of peak
    RSS for the repo's 3,993-row trace)."""
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

    def specs_of(count: int | None) -> list[RequestSpec]:
        return list(itertools.islice(_specs(workload, args.seed, args.requests), count))

    requests: list[SimRequest] = []
    held_tokens = 0
    tokens_of = _token_ids()
    for spec in _specs(workload, args.seed, args.requests):
        prompt = tokens_of(spec)
        held_tokens += len(prompt)
        if held_tokens > args.max_held_tokens:
            raise ValueError(
                f"the stream's prompts pass --max-held-tokens {args.max_held_tokens} token ids "
                f"({prompt.itemsize} bytes each) at request {len(requests) + 1}: pass a lower "
                "--requests, or raise --max-held-tokens"
            )
        requests.append(SimRequest(prompt, spec.max_tokens, spec.arrival_s or 0.0, spec.session_id))
    if not requests:
        raise ValueError("the workload produced no requests")
    span = max(r.arrival_s for r in requests)
    base_rate = len(requests) / span if span > 0 else 1.0
    return workload, Stream(requests, base_rate, specs_of)


def _specs(workload: Workload, seed: int, requests: int | None) -> Iterator[RequestSpec]:
    """The workload's first ``requests`` specs (all when ``None``), with Poisson arrivals (1/s, from
    ``seed + 1``) when they have none: the same specs on every call."""
    generated = itertools.islice(workload.generate(random.Random(seed)), requests)
    first = next(generated, None)
    if first is None:
        return
    specs: Iterator[RequestSpec] = itertools.chain((first,), generated)
    if first.arrival_s is None:
        specs = with_arrivals(specs, poisson_arrivals(1.0, random.Random(seed + 1)))
    yield from specs


def _token_ids() -> Callable[[RequestSpec], array[int]]:
    """Spec → the token ids the replicas will see, as ``array('I')`` (a chat through the fleet's
    default tokenizer, loaded at the first chat; the last :data:`CHAT_MEMO_MAX` distinct chats
    remembered, so a chat repeated by many requests is tokenized once and held once; the bound of
    ``--max-held-tokens`` counts it per request all the same)."""
    memo: dict[tuple[Any, ...], array[int]] = {}
    tokenizer: Any = None

    def tokens_of(spec: RequestSpec) -> array[int]:
        nonlocal tokenizer
        if spec.prompt_token_ids is not None:
            return array("I", spec.prompt_token_ids)
        key = tuple(spec.messages or ())
        found = memo.get(key)
        if found is None:
            if tokenizer is None:
                from balancer.tokenizer.default import default_tokenizer

                tokenizer = default_tokenizer()
            if len(memo) >= CHAT_MEMO_MAX:
                memo.clear()
            found = memo[key] = array("I", tokenizer.encode_chat([m.to_json() for m in spec.messages or ()]))
        return found

    return tokens_of


def _params(pairs: Sequence[str]) -> dict[str, Any]:
    from loadtests.command import _params as parse

    return parse(pairs)


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
                rates, ttfts = zip(*fleet, strict=True)
                axes.scatter(rates, ttfts, s=80, facecolors="none", edgecolors=line.get_color())
    axes.axhline(report["slo"]["ttft_p90_s"], linestyle="--", color="black", label="SLO")
    axes.set_yscale("log")
    axes.set_xlabel("offered rate, req/s")
    axes.set_ylabel("TTFT p90, s")
    axes.legend()
    save_figure_atomic(figure, path, dpi=110)
    plt.close(figure)
    return True


PRESETS: dict[str, tuple[Any, Any]] = {
    "replicas": (8, SMOKE["replicas"]),
    "max_points": (14, 8),
    "rel_tol": (0.05, 0.25),
    "growth": (1.5, 3.0),
}
"""Flag (its ``args`` name) → (its default, ``--smoke``'s value); a flag given explicitly keeps its value."""


def apply_presets(args: argparse.Namespace) -> None:
    """``--smoke``'s shape, and the default request count of a workload. A flag given explicitly
    wins over the preset (before 2026-12-01 ``--smoke`` replaced ``--replicas``, ``--max-points``,
    ``--rel-tol`` and ``--growth`` without a word, so ``--smoke --replicas 0`` ran). ``--smoke``
    tightens the default SLO to 0.3 s for its 120 short requests on 2 replicas, but not with
    ``--trace``: the trace's prompts (up to 8,000 tokens) missed 0.3 s at every rate down to
    0.002 req/s, so the README's ``kvlb capacity --trace ... --smoke`` found no capacity for any
    router (2026-11-30)."""
    for name, (default, smoke) in PRESETS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else default)
    if args.slo_ttft_p90 is None:
        args.slo_ttft_p90 = "0.3s" if args.smoke and args.trace is None else "2s"
    if args.smoke:
        args.requests = SMOKE["requests"] if args.requests is None else args.requests
    elif args.requests is None and args.trace is None:
        args.requests = 600


def capacity_line(capacity: float | None, first_fail: float | None) -> str:
    """A search's outcome in words: ``capacity 1.2 req/s (first failing 1.5)``, or that no rate tried
    met the SLO."""
    if capacity is None:
        lowest = "" if first_fail is None else f" (down to {first_fail:.3g} req/s)"
        return f"no rate tried met the SLO{lowest}"
    failing = "none" if first_fail is None else f"{first_fail:.3g}"
    return f"capacity {capacity:.3g} req/s (first failing {failing})"


def run(args: argparse.Namespace) -> int:
    """``kvlb capacity``; SIGINT outside ``--target``'s own handling is one line, exit 128 + 2 (no
    report; a ``--confirm`` fleet is stopped as ``asyncio.run`` cancels its campaign)."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("kvlb capacity: stopped by SIGINT (no report)", file=sys.stderr)
        return EXIT_INTERRUPTED + signal.SIGINT.value


def _run(args: argparse.Namespace) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr)

    apply_presets(args)
    try:
        slo = slo_of(args)
        names = [n.strip() for n in args.routers.split(",") if n.strip()]
        if args.target:
            names = ["target"]
            if args.confirm or args.searches_from is not None:
                raise ValueError("--target measures every point for real: no --confirm, --searches-from")
            check_target_args(args)
        for name in names:
            if name != "target":
                sim_router(name)
            if name == "vllm_kv_aware":
                raise ValueError("vllm_kv_aware has no simulator model; `kvlb loadtest` runs it")
        if not names:
            raise ValueError("--routers names no router")
        if args.confirm_interleave and args.confirm_rates is None:
            raise ValueError("--confirm-interleave needs --confirm-rates (the same rates for every router)")
        parse_hops_ms(args.confirm_retimed_hops_ms)
        parse_hop_ranges_ms(args.confirm_retimed_hop_ranges_ms, args.confirm_retimed_draws)
        if not math.isfinite(args.sim_forward_delay_ms) or args.sim_forward_delay_ms < 0:
            raise ValueError(f"--sim-forward-delay-ms must be >= 0, got {args.sim_forward_delay_ms}")
        jitter_ms = args.sim_forward_jitter_ms
        if not math.isfinite(jitter_ms) or jitter_ms < 0 or jitter_ms > args.sim_forward_delay_ms:
            raise ValueError(
                f"--sim-forward-jitter-ms must be in [0, --sim-forward-delay-ms], got {jitter_ms}"
            )
        check_numbers(args)
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        workload, stream = build_stream(args)
        label = "mooncake" if args.trace is not None else args.workload
        out = args.out or Path("capacity-results") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {out}: {exc.strerror or exc}") from None
        if not os.access(out, os.W_OK):
            raise ValueError(f"--out {out}: not writable")
    except (ValueError, KeyError, OSError) as exc:
        print(f"kvlb capacity: {exc}", file=sys.stderr)
        return 2
    return _search_and_report(args, names, slo, workload, stream, out, started, log)


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse, with one line naming the flag, numbers no search can use (``ValueError``)."""
    refuse_below_one(
        {
            "--replicas": args.replicas,
            "--requests": args.requests,
            "--max-input-tokens": args.max_input_tokens,
            "--max-tokens-cap": args.max_tokens_cap,
            "--kv-capacity-tokens": args.kv_capacity_tokens,
            "--confirm-requests": args.confirm_requests,
            "--confirm-repeats": args.confirm_repeats,
            "--processes": args.processes,
            "--max-held-tokens": args.max_held_tokens,
        }
    )
    if args.max_points < 2:  # the search needs a bracket: one pass and one fail
        raise ValueError(f"--max-points must be >= 2, got {args.max_points}")
    if args.trace_offset < 0:
        raise ValueError(f"--trace-offset must be >= 0, got {args.trace_offset}")
    if args.kvlb_workers < 0:
        raise ValueError(f"--kvlb-workers must be >= 0 (0: kvlb's own default), got {args.kvlb_workers}")
    if args.confirm_sim_draws < 0:
        raise ValueError(f"--confirm-sim-draws must be >= 0, got {args.confirm_sim_draws}")
    if not (math.isfinite(args.oracle_load_bound_s) and args.oracle_load_bound_s >= 0):
        raise ValueError(
            f"--oracle-load-bound-s must be a finite number >= 0, got {args.oracle_load_bound_s}"
        )
    refuse_not_above("--time-scale", args.time_scale, 0)
    refuse_not_above("--start-rate", args.start_rate, 0, "req/s")
    refuse_not_above("--growth", args.growth, 1)
    refuse_not_above("--rel-tol", args.rel_tol, 0)


def _search_and_report(
    args: argparse.Namespace,
    names: list[str],
    slo: Slo,
    workload: Workload,
    stream: Stream,
    out: Path,
    started: str,
    log: Callable[[str], None],
) -> int:
    start = args.start_rate or 2.0 * args.replicas
    log(f"{len(stream.requests)} requests; base rate {stream.base_rate:.3g}/s; searching from {start:.3g}/s")
    searches: dict[str, Search] = {}
    saved_searches = (
        searches_from_report(json.loads(args.searches_from.read_text("utf-8")))
        if args.searches_from is not None
        else {}
    )
    if args.target:
        with sigterm_as_sigint() as received:
            try:
                return _run_target(args, workload, stream, slo, out, start, started, log, received)
            except KeyboardInterrupt:  # SIGINT or SIGTERM before the search started
                print(f"kvlb capacity: stopped by {stopped_by(received).name}", file=sys.stderr)
                return EXIT_INTERRUPTED + stopped_by(received).value
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
        log(f"{name}: {capacity_line(searches[name].capacity, searches[name].first_fail)}")
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
    fleet_error = None
    if args.confirm:
        try:
            confirmed, invalid, processes, bands = asyncio.run(
                confirm_on_fleet(args, stream, searches, out, log)
            )
        except ChildFailed as failed:  # every child it started is stopped (start_emulator)
            fleet_error = f"the emulated fleet did not start: {failed.one_line()}"
            processes = [{"name": failed.name, "pid": failed.pid, "exit_code": failed.exit_code}]
    meta = {
        "command": _command_line(),
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
        "simulated_as": {n: simulated_as(n) for n in names},
        "confirmed_on_fleet": bool(args.confirm) and fleet_error is None,
        "fleet_error": fleet_error,
        "confirm_requests": min(args.confirm_requests, len(stream.requests)) if args.confirm else None,
        "confirm_sim_draws": args.confirm_sim_draws if args.confirm else None,
        "confirm_sim_jitter_ms": args.confirm_sim_jitter_ms if args.confirm else None,
        "confirm_retimed_hops_ms": (
            list(parse_hops_ms(args.confirm_retimed_hops_ms)) if args.confirm else None
        ),
        "confirm_retimed_hop_ranges_ms": (
            [
                list(r)
                for r in parse_hop_ranges_ms(args.confirm_retimed_hop_ranges_ms, args.confirm_retimed_draws)
            ]
            if args.confirm
            else None
        ),
        "confirm_retimed_draws": args.confirm_retimed_draws if args.confirm else None,
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
    _write_report(args, report, out, log)
    if fleet_error is not None:
        log(f"kvlb capacity: {fleet_error}: exit {EXIT_FLEET_FAILED} (the report is written, no fleet run)")
        return EXIT_FLEET_FAILED
    return no_capacity_exit(searches, log)


def no_capacity_exit(searches: dict[str, Search], log: Callable[[str], None]) -> int:
    """The exit code of a written report: :data:`EXIT_SLO_MISSED` (3, as ``--target --slo-gate``'s
    miss) when a router's search met the SLO at no rate tried (its capacity is missing from the
    report), with one line naming those routers; else 0. Before 2026-12-01 it was 0 either way."""
    missing = [name for name, found in searches.items() if found.capacity is None]
    if not missing:
        return 0
    log(
        f"kvlb capacity: no rate tried met the SLO for {', '.join(missing)}: "
        f"exit {EXIT_SLO_MISSED} (the report is written)"
    )
    return EXIT_SLO_MISSED


def _run_target(
    args: argparse.Namespace,
    workload: Workload,
    stream: Stream,
    slo: Slo,
    out: Path,
    start: float,
    started: str,
    log: Callable[[str], None],
    received: Sequence[signal.Signals],
) -> int:
    """``--target``: every point a real run at the URL (:mod:`loadtests.capacity.target`); after
    SIGINT or SIGTERM (``received`` names a SIGTERM) the report of the points measured so far, exit
    130 or 143. A target that names no model (``GET /v1/models``; without ``--model``) or answers no
    request of a point stops the search with exit 1 and one line (the first says to pass
    ``--model``), and the report is written all the same: the points measured before (none for the
    models), the reason in ``meta.error`` and the row's ``invalid`` (before 2026-12-01: no report)."""
    interrupted = error = model = None
    found = Search((), None, None)
    try:
        model = model_of(args)
        specs_at = functools.partial(_specs_at_wall, stream)
        found = search_target(args, model, specs_at, slo, start, log)
    except SearchInterrupted as stop:
        found, interrupted = (
            stop.search,
            f"stopped by {stopped_by(received).name} after {len(stop.search.points)} points",
        )
    except TargetDown as down:
        found, error = down.search, str(down)
    except (ValueError, OSError) as exc:  # GET /v1/models named no model, or could not be read
        error = str(exc)
    meta = {
        "command": _command_line(),
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": redact_url(args.target),
        "model": model,
        "workload": {"name": workload.name, **dataclasses.asdict(workload)},  # type: ignore[call-overload]
        "requests_per_point": min(args.target_requests, len(stream.requests)),
        "base_rate_per_s": stream.base_rate,
        "search": {"start_rate": start, "rel_tol": args.rel_tol, "max_points": args.max_points},
        "slo_gate_rate": args.slo_gate,
        "interrupted": interrupted,
        "error": error,
    }
    report = build_report(meta, slo, {"target": found}, [], invalid={"target": error} if error else None)
    _write_report(args, report, out, log)
    if error:
        print(f"kvlb capacity: {error}", file=sys.stderr)
        return 1
    if interrupted:
        log(f"kvlb capacity: {interrupted}: the report holds those (partial results)")
        return EXIT_INTERRUPTED + stopped_by(received).value
    return gate(found, args, log)


def _specs_at_wall(stream: Stream, rate: float, limit: int) -> list[RequestSpec]:
    """The first ``limit`` specs at ``rate``, arrivals in wall seconds (``--target``: no time scale)."""
    return stream.specs_at(rate, limit, 1.0)


def _command_line() -> str:
    """This run's command line as the report's ``meta.command``."""
    return (
        "kvlb capacity " + " ".join(redact_argv(sys.argv[sys.argv.index("capacity") + 1 :]))
        if "capacity" in sys.argv
        else "kvlb capacity"
    )


def _write_report(
    args: argparse.Namespace, report: dict[str, Any], out: Path, log: Callable[[str], None]
) -> None:
    """The report's files in ``out`` (``capacity.json``, ``capacity.md``, ``ttft_vs_rate.svg``, and
    ``ttft_vs_rate.png`` with matplotlib), and on stdout the JSON (``--json``) or the markdown's
    summary."""
    write_text_atomic(out / "capacity.json", json.dumps(report, indent=1) + "\n")
    write_text_atomic(out / "capacity.md", markdown(report))
    write_text_atomic(out / "ttft_vs_rate.svg", svg_plot(report))
    png = write_png(report, out / "ttft_vs_rate.png")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(markdown(report).split("## Every point")[0])
    log(f"report: {out}/capacity.md, capacity.json, ttft_vs_rate.svg" + (", ttft_vs_rate.png" if png else ""))
