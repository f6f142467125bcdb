"""``kvlb loadtest``: one workload through kvlb's policies and the peers, with a report (I/O).

Starts (or attaches to) an emulated SGLang fleet, builds the request stream once, computes the
oracle bound, runs every router in turn (flushing the caches between runs), and writes
``report.json``, ``report.md`` and PNG plots to ``--out``. See ``docs/loadtest.md``.

With ``--target URL`` it starts nothing and drives the workload at that OpenAI-compatible endpoint (a
deployed kvlb, a peer router, a bare engine), with ``--slo`` gating the exit code
(:mod:`loadtests.target`). With ``--duration`` it is a soak instead (:mod:`loadtests.faults.soak`):
one kvlb under steady load with replica faults every ``--fault-every``, and kvlb's resources over time
(``docs/reliability.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.faults.soak import add_soak_arguments, soak_campaign
from loadtests.flag_checks import refuse_below_one, refuse_not_above
from loadtests.fleet.child_process import ChildFailed
from loadtests.fleet.processes import (
    EmulatorHandle,
    attach_emulator,
    emulator_options,
    read_capacity,
    start_emulator,
)
from loadtests.kvlb_timers import WALL_TIMERS_HELP, fleet_sets_of
from loadtests.oracle import prefix_reuse_bound
from loadtests.peers import DEFAULT_ROUTERS, RouterSpec, parse_router
from loadtests.report import build_report, write_json, write_markdown, write_records
from loadtests.report_plots import write_plots
from loadtests.runs import DriveOptions, run_all
from loadtests.target import (
    EXIT_CLIENT_BEHIND,
    EXIT_INTERRUPTED,
    add_target_arguments,
    check_target_args,
    target_campaign,
)
from loadtests.whatif.check import add_whatif_arguments, whatif_campaign
from loadtests.workloads import (
    MooncakeWorkload,
    RequestSpec,
    TenantsWorkload,
    Workload,
    make_workload,
    poisson_arrivals,
    with_arrivals,
)
from loadtests.workloads.mooncake import check_order
from replicas.sim.profiles import PROFILES


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "loadtest",
        help="compare kvlb's policies and the peers on one workload",
        description=__doc__,
        epilog="Peers: `pip install -e '.[peers]'` installs both peer routers (sglang-router for "
        "sglang_cache_aware, vllm-router for vllm_kv_aware); a peer that is not installed is skipped. "
        "sglang-router takes text only: give the Mooncake trace --param prompt_format=text. A router "
        "with more than 1% failed requests is reported invalid, with the reason, instead of a row.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)
    from loadtests.capacity import command as capacity_command

    capacity_command.register(subparsers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--workload", default="tenants", help="tenants, unique, mooncake, chat, rag, agent (default tenants)")
    add("--param", action="append", default=[], metavar="NAME=VALUE",
        help="a workload field, e.g. --param context_tokens=2000 (repeatable)")  # fmt: skip
    add("--requests", type=int, default=400, help="requests per router (--target: in all; default 400)")
    add("--rate", type=float, default=None,
        help="open loop: Poisson arrivals per second (default 10; soak: steady, default 20)")  # fmt: skip
    add("--mode", choices=("open", "closed"), default="open", help="open (arrival rate) or closed (users)")
    add("--concurrency", type=int, default=512,
        help="open: cap on requests in flight; a cap below the schedule's own in-flight peak (rate × "
        "e2e) holds launches back, and the report flags the run as client behind its schedule "
        f"(not a valid measurement at the rate; --target with met --slo exits {EXIT_CLIENT_BEHIND}); "
        "closed: users (default 512)")  # fmt: skip
    add("--routers", default=",".join(DEFAULT_ROUTERS),
        help="comma-separated: kvlb, round_robin, least_load, power_of_two, kvlb:<policy>, "
        "sglang_cache_aware, vllm_kv_aware (default: all; peers not installed are skipped)")  # fmt: skip
    add("--kvlb-set", action="append", default=[], metavar="NAME=VALUE",
        help="`kvlb serve --set` override for all kvlb routers, e.g. limits.speculative_ttl_s=5 (wall "
        "seconds; wins over the model-time timers below)")  # fmt: skip
    add("--kvlb-wall-timers", action="store_true", help=WALL_TIMERS_HELP)
    add("--kvlb-workers", type=int, default=None,
        help="`kvlb serve --workers` of every kvlb router (default: kvlb's own, the cores)")  # fmt: skip
    add("--trace", help="mooncake: the trace file (JSON lines)")
    add("--trace-offset", type=int, default=0, help="mooncake: rows skipped")
    add("--trace-time-scale", type=float, default=1.0, help="mooncake: multiplies the arrival gaps")
    add("--max-input-tokens", type=int, default=None, help="mooncake: prompts cut to this many tokens")
    add("--max-tokens-cap", type=int, default=None, help="mooncake: cap on completion tokens")
    add("--replicas", type=int, default=8, help="replicas to start (default 8)")
    add("--profile", choices=sorted(PROFILES), default="h100-llama3-8b", help="emulator profile")
    add("--kv-capacity-tokens", type=int, default=None, help="per-replica KV pool (default: the profile's)")
    add("--max-context-tokens", type=int, default=None, help="per-request context (default: the profile's)")
    add("--time-scale", type=float, default=1.0, help="emulator model seconds per wall second (1)")
    add("--processes", type=int, default=2, help="child processes the fleet is split over (2)")
    add("--engine", choices=("sglang", "vllm"), default="sglang",
        help="engine the replicas emulate: SGLang 0.5.23 (block 16) or vLLM 0.32 (block 128, its "
        "events, /reset_prefix_cache and vllm: metrics)")  # fmt: skip
    add("--event-flavor", choices=("auto", "sglang", "vllm"), default="auto",
        help="SGLang replicas: KV-event fields they publish; auto: vllm when vllm_kv_aware runs (it needs "
        "lora_name), else sglang")  # fmt: skip
    add("--attach", type=Path, help="use a running fleet: a file with the JSON listing `kvlb emulate` prints")
    add("--out", type=Path, default=None,
        help="output folder (default loadtest-results/<workload>-<time>; --target: "
        "loadtest-results/target-<workload>-<time>)")  # fmt: skip
    add("--seed", type=int, default=0, help="seed of the workload, arrivals and routing")
    add(
        "--max-duration-s",
        type=float,
        default=600.0,
        help="per router (--target: the whole run): cancel what is left after this many wall seconds (600)",
    )
    add("--timeout-s", type=float, default=300.0, help="per request, wall seconds (300)")
    add(
        "--sample-interval-s", type=float, default=0.5, help="per-replica load sampling period, seconds (0.5)"
    )
    add("--no-oracle", action="store_true", help="skip the oracle bound (it tokenizes every prompt)")
    add("--no-plots", action="store_true", help="write no PNG plots")
    add("--netns", action="store_true",
        help="run everything in a new network namespace with only loopback (unshare -n)")  # fmt: skip
    add("--in-netns", action="store_true", help=argparse.SUPPRESS)
    add_soak_arguments(parser)
    add_target_arguments(parser)
    add_whatif_arguments(parser)


def _params(pairs: Sequence[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--param expects NAME=VALUE, got {pair!r}")
        params[name.strip()] = yaml.safe_load(raw)
    return params


def build_workload(args: argparse.Namespace, capacity_tokens: int | None, replicas: int) -> Workload:
    """The workload named by ``args``; ``tenants`` without a ``tenants`` count is sized to the fleet
    (when its capacity is known: ``--target`` without ``--kv-capacity-tokens`` keeps the default)."""
    params = _params(args.param)
    if args.workload == "mooncake":
        if not args.trace:
            raise ValueError("--workload mooncake needs --trace")
        return MooncakeWorkload(
            path=str(args.trace),
            offset=args.trace_offset,
            limit=args.requests,
            time_scale=args.trace_time_scale,
            max_tokens_cap=args.max_tokens_cap,
            max_input_tokens=args.max_input_tokens,
            prompt_format=str(params.get("prompt_format", "tokens")),
        )
    workload = make_workload(args.workload, **params)
    fields = {f.name for f in dataclasses.fields(workload)}  # type: ignore[arg-type]
    if "num_requests" in fields and "num_requests" not in params:
        workload = dataclasses.replace(workload, num_requests=args.requests)  # type: ignore[type-var]
    if isinstance(workload, TenantsWorkload) and "tenants" not in params and capacity_tokens is not None:
        workload = workload.for_capacity(capacity_tokens, replicas=replicas)
    return workload


def check_workload(args: argparse.Namespace) -> None:
    """Build the workload and draw its first request before any replica starts, so that an unknown
    workload, a bad ``--param`` or a missing ``--trace`` is a ``ValueError`` at once (it was found
    after the fleet of ``--replicas`` had started, about 5 s later, exit 1). A trace's rows to be
    replayed are read once (:func:`~loadtests.workloads.mooncake.check_order`: a bad row or one out
    of timestamp order is refused here; before 2026-12-01 it was found after the fleet started)."""
    workload = build_workload(args, None, args.replicas)
    try:
        if isinstance(workload, MooncakeWorkload):
            check_order(workload.path, offset=workload.offset, limit=workload.limit)
        next(iter(workload.generate(random.Random(args.seed))), None)
    except OSError as exc:
        raise ValueError(f"--trace {args.trace}: {exc.strerror or exc}") from None
    except TypeError as exc:  # a --param of the wrong type
        raise ValueError(f"workload {args.workload!r}: {exc}") from None


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse, with one line naming the flag, counts and scales no run can use (``ValueError``, exit 2
    before anything starts): before 2026-12-01 ``--replicas 0`` started no replica and failed with
    ``min() arg is an empty sequence`` (exit 1), and ``--processes 0`` ran and wrote a report of no
    completed request (exit 0)."""
    refuse_below_one(
        {
            "--replicas": args.replicas,
            "--processes": args.processes,
            "--requests": args.requests,
            "--kv-capacity-tokens": args.kv_capacity_tokens,
            "--max-context-tokens": args.max_context_tokens,
            "--max-input-tokens": args.max_input_tokens,
            "--max-tokens-cap": args.max_tokens_cap,
        }
    )
    if args.trace_offset < 0:
        raise ValueError(f"--trace-offset must be >= 0, got {args.trace_offset}")
    refuse_not_above("--time-scale", args.time_scale, 0)
    refuse_not_above("--trace-time-scale", args.trace_time_scale, 0)


def build_specs(workload: Workload, args: argparse.Namespace) -> list[RequestSpec]:
    """The stream every router gets: ``--requests`` specs, with Poisson arrivals when they have none."""
    specs = list(itertools.islice(workload.generate(random.Random(args.seed)), args.requests))
    if args.mode == "open" and specs and specs[0].arrival_s is None:
        arrivals = poisson_arrivals(args.rate, random.Random(args.seed + 1))
        specs = list(with_arrivals(specs, arrivals))
    return specs


def spec_token_ids(specs: Sequence[RequestSpec]) -> list[list[int]]:
    """The token ids the replicas will see (chat prompts via the fleet's default tokenizer)."""
    from balancer.tokenizer.default import default_tokenizer

    tokenizer = None
    memo: dict[tuple[Any, ...], list[int]] = {}
    prompts = []
    for spec in specs:
        if spec.prompt_token_ids is not None:
            prompts.append(list(spec.prompt_token_ids))
            continue
        key = tuple(spec.messages or ())
        if key not in memo:
            tokenizer = tokenizer or default_tokenizer()
            memo[key] = tokenizer.encode_chat([m.to_json() for m in spec.messages or ()])
        prompts.append(memo[key])
    return prompts


def _oracle(specs: Sequence[RequestSpec], fleet: EmulatorHandle) -> dict[str, Any]:
    prompts = spec_token_ids(specs)
    result = prefix_reuse_bound(
        prompts,
        block_size=fleet.block_size,
        replicas=len(fleet.replicas),
        blocks_per_replica=fleet.capacity_tokens // fleet.block_size,
    )
    return result.to_dict()


def drive_options(
    args: argparse.Namespace,
    *,
    kvlb_sets: Sequence[str],
    kvlb_workers: int | None,
    kvlb_weight_time_scale: float = 1.0,
) -> DriveOptions:
    """How each router of a fleet campaign is driven: the parsed ``--mode``, ``--concurrency``,
    ``--max-duration-s``, ``--timeout-s``, ``--sample-interval-s`` and ``--seed``, with these kvlb
    ``--set`` overrides, ``--workers`` and time scale of the weights in seconds."""
    return DriveOptions(
        mode=args.mode,
        concurrency=args.concurrency,
        max_duration_s=args.max_duration_s,
        timeout_s=args.timeout_s,
        sample_interval_s=args.sample_interval_s,
        seed=args.seed,
        kvlb_sets=tuple(kvlb_sets),
        kvlb_weight_time_scale=kvlb_weight_time_scale,
        kvlb_workers=kvlb_workers,
    )


def _event_flavor(choice: str, routers: Sequence[RouterSpec]) -> str:
    if choice != "auto":
        return choice
    return "vllm" if any(r.kind == "vllm" for r in routers) else "sglang"


def _workload_meta(workload: Workload) -> dict[str, Any]:
    data = dataclasses.asdict(workload)  # type: ignore[call-overload]
    return {"name": workload.name, **data}


async def _campaign(args: argparse.Namespace, routers: list[RouterSpec], out: Path) -> int:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    load_average = [round(x, 2) for x in os.getloadavg()]
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    kvlb_sets = fleet_sets_of(args)
    if args.attach:
        fleet = attach_emulator(args.attach)
    else:
        options = emulator_options(
            args, engine=args.engine, event_flavor=_event_flavor(args.event_flavor, routers)
        )
        print(f"starting {args.replicas} {args.engine} replicas ({args.profile}) ...", file=sys.stderr)
        fleet = await start_emulator(options, logs)
    try:
        async with aiohttp.ClientSession() as session:
            capacity = await read_capacity(session, fleet)
        workload = build_workload(args, capacity, len(fleet.replicas))
        specs = build_specs(workload, args)
        oracle = None
        if not args.no_oracle:
            print(f"oracle over {len(specs)} prompts ...", file=sys.stderr)
            oracle = await asyncio.to_thread(_oracle, specs, fleet)
        drive = drive_options(
            args,
            kvlb_sets=kvlb_sets.all,
            kvlb_workers=args.kvlb_workers,
            kvlb_weight_time_scale=kvlb_sets.weight_time_scale,
        )
        runs = await run_all(routers, fleet, specs, drive, logs)
    finally:
        started = list(fleet.children)
        await fleet.stop()
    processes = [{"name": c.name, "pid": c.pid, "exit_code": c.process.returncode} for c in started]
    processes += [
        {"name": r.spec.name, "pid": r.process[0], "exit_code": r.process[1]} for r in runs if r.process
    ]
    meta = {
        "command": "kvlb loadtest " + " ".join(shlex.quote(a) for a in _own_argv() if a != "--in-netns"),
        "started": started_at,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": load_average,
        "netns": bool(args.in_netns),
        "processes": processes,
        "fleet": {
            "replicas": len(fleet.replicas),
            "attached": bool(args.attach),
            "profile": args.profile if not args.attach else fleet.replicas[0].get("profile"),
            "model": fleet.model,
            "block_size": fleet.block_size,
            "kv_capacity_tokens_per_replica": fleet.capacity_tokens,
            "time_scale": args.time_scale,
            "engine": str(fleet.replicas[0].get("engine")),
            "event_flavor": None if args.attach else _event_flavor(args.event_flavor, routers),
        },
        "workload": _workload_meta(workload),
        "drive": {
            **dataclasses.asdict(drive),
            "requests": len(specs),
            "rate_per_s": args.rate,
            "kvlb_model_time_sets": list(kvlb_sets.model_time),
        },
    }
    report = build_report(meta, oracle, runs)
    plots, note = ([], "Plots skipped (--no-plots).") if args.no_plots else write_plots(report, out)
    write_json(report, out / "report.json")
    write_records(runs, out)
    write_markdown(report, out / "report.md", plots, note)
    print(f"report: {out / 'report.md'} and {out / 'report.json'}", file=sys.stderr)
    if note:
        print(note, file=sys.stderr)
    for entry in report["routers"]:
        if entry["client_behind"]:
            print(f"kvlb loadtest: {entry['name']}: {entry['note']}", file=sys.stderr)
    return 1 if any(r.status == "failed" for r in runs) else 0


def _own_argv() -> list[str]:
    """The arguments after ``loadtest`` on this process's command line."""
    argv = sys.argv[1:]
    return argv[argv.index("loadtest") + 1 :] if "loadtest" in argv else argv


def _reexec_in_netns() -> int:
    """Run this same command inside ``unshare -n`` with loopback up (no other interface exists)."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None:
        print("kvlb loadtest: --netns needs unshare and ip (util-linux, iproute2)", file=sys.stderr)
        return 2
    flags = ["-n"] if os.geteuid() == 0 else ["-r", "-n"]
    inner = [a for a in _own_argv() if a != "--netns"]
    argv = [unshare, *flags, "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh"]
    argv += [sys.executable, "-m", "balancer", "loadtest", *inner, "--in-netns"]
    with subprocess.Popen(argv) as child:

        def forward(signum: int, _frame: object) -> None:
            child.send_signal(signum)  # the inner run stops what it started, then exits

        previous = signal.signal(signal.SIGTERM, forward)
        try:
            return child.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)


async def _cancel_on_sigterm(campaign: Coroutine[Any, Any, int]) -> int:
    """Run ``campaign``; SIGTERM cancels it, so every process it started is still stopped."""
    task = asyncio.ensure_future(campaign)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        print("kvlb loadtest: stopped by SIGTERM", file=sys.stderr)
        return 143
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def run(args: argparse.Namespace) -> int:
    if args.target and (args.netns or args.attach or args.whatif):
        # --netns would cut the run off from the target (only a fresh loopback inside), and --attach
        # and --whatif drive an emulated fleet the target run never touches
        given = ", ".join(o for o, v in (("--netns", args.netns), ("--attach", args.attach),
                                          ("--whatif", args.whatif)) if v)  # fmt: skip
        print(f"kvlb loadtest: --target does not go with {given}", file=sys.stderr)
        return 2
    if args.netns and not args.in_netns:
        return _reexec_in_netns()
    try:
        check_numbers(args)
        if args.target and args.duration is not None:
            raise ValueError("--target and --duration (soak) do not go together")
        if args.target:
            args.rate = 10.0 if args.rate is None else args.rate
            check_target_args(args)
            check_workload(args)
            out = (
                args.out
                or Path("loadtest-results") / f"target-{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
            )
            campaign = target_campaign(args, _own_argv(), out)
        elif args.duration is not None:
            campaign = soak_campaign(args, _own_argv())
        elif args.whatif:
            args.rate = 10.0 if args.rate is None else args.rate
            out = args.out or Path("loadtest-results") / f"whatif-{time.strftime('%Y%m%d-%H%M%S')}"
            campaign = whatif_campaign(args, out)
        else:
            args.rate = 10.0 if args.rate is None else args.rate
            routers = [parse_router(name) for name in args.routers.split(",") if name.strip()]
            if not routers or args.requests <= 0 or args.rate <= 0:
                raise ValueError("need at least one router, --requests > 0 and --rate > 0")
            check_workload(args)
            out = args.out or Path("loadtest-results") / f"{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
            campaign = _campaign(args, routers, out)
    except ValueError as exc:
        print(f"kvlb loadtest: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_cancel_on_sigterm(campaign))
    except ChildFailed as failed:  # the fleet did not start; start_emulator stopped what it started
        print(f"kvlb loadtest: the emulated fleet did not start: {failed.one_line()}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvlb loadtest: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGINT outside a run that handles it (asyncio.run cancelled the campaign)
        print("kvlb loadtest: stopped by SIGINT", file=sys.stderr)
        return EXIT_INTERRUPTED + signal.SIGINT.value
