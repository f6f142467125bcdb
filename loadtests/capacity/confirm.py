"""``kvlb capacity --confirm``: the bracketing rates on the emulated fleet, each next to a simulation (I/O).

:func:`confirm_order` (pure) orders the fleet runs. :func:`confirm_on_fleet` starts the emulated fleet
(:mod:`loadtests.fleet.processes`), runs each router at each rate with ``kvlb loadtest``'s machinery
(:mod:`loadtests.runs`) on the same requests as a simulation of them
(:mod:`loadtests.capacity.simulated`), compares the two request by request
(:mod:`loadtests.capacity.agreement`) and judges the router's repeats against the simulator's band
(:mod:`loadtests.capacity.band`). Each run's client is judged against its schedule by
:func:`confirm_client`, the rule of ``kvlb loadtest`` and ``--target`` (:mod:`loadtests.client_lag`)
in model time: a point whose client fell behind is ``invalid`` and never meets the SLO. It writes
each run's per-request rows to ``requests/`` and, with ``--confirm-save-decisions``, the decisions to
``decisions/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtests.atomic_files import write_lines_atomic, write_text_atomic
from loadtests.capacity.agreement import RequestRow, compare, followers, rows_of
from loadtests.capacity.band import passing, verdict
from loadtests.capacity.report import ratio
from loadtests.capacity.retimed import (
    decision_times,
    parse_hop_ranges_ms,
    parse_hops_ms,
    routing_lag_ms,
    run_times,
    verdict_of,
)
from loadtests.capacity.search import RatePoint, Search, Slo
from loadtests.capacity.simulated import (
    Assignment,
    Stream,
    sim_band,
    sim_decision_rows,
    sim_measure,
    sim_only,
    sim_retimed,
    sim_rows_of,
    slo_of,
)
from loadtests.client_lag import lag_bound_s, no_schedule
from loadtests.kvlb_timers import fleet_sets_of
from loadtests.peers import RouterSpec, parse_router, replay_router
from loadtests.simulate import SimResult
from loadtests.workloads import RequestSpec
from replicas.sim.profiles import PROFILES

if TYPE_CHECKING:
    from loadtests.driver import RunResult

CONFIRM_ADVICE = (
    "the point counts as failing; run on a quieter machine, or at a lower --time-scale (the fleet "
    "slower on the wall clock: the client's sends further apart)"
)
"""What a ``kvlb capacity --confirm`` user can do about a point whose client fell behind (its
in-flight cap already holds every request of the point: :func:`open_loop_cap`)."""


def kvlb_workers(args: argparse.Namespace) -> int | None:
    """The fleet's kvlb ``--workers``: ``--kvlb-workers``, 0 meaning kvlb's own default (``None``)."""
    return args.kvlb_workers if args.kvlb_workers else None


def open_loop_cap(base_cap: int, requests: int) -> int:
    """The client's in-flight cap for a confirmation of ``requests`` requests: at least ``requests``,
    so it never holds a launch back. The simulation beside each run has no client cap; a cap below
    the schedule's in-flight peak (its rate × the requests' e2e, which does not change with
    ``--time-scale``) makes launches wait for requests to end, and the fleet is offered less than the
    simulation (docs/loadtest.md, "The client's send lag"). Bounded by ``--confirm-requests``."""
    return max(base_cap, requests)


def confirm_client(result: RunResult, slo: Slo, time_scale: float) -> tuple[dict[str, Any], str | None]:
    """One fleet run's client against its schedule, by :mod:`loadtests.client_lag`'s rule (the one
    of ``kvlb loadtest`` and ``kvlb capacity --target``) in model time: the records' wall times ×
    ``time_scale``, the lag bounded by a tenth of the tightest TTFT bound of ``slo`` (model time).
    Returns the figures (keys :data:`loadtests.client_lag.FIELDS`, seconds and requests per model
    second; all ``None`` without a schedule) and the point's ``invalid`` note (``None`` when the
    client kept its schedule)."""
    client = result.client_check(lag_bound_s(slo.latency_bounds_s()), time_scale=time_scale)
    if client is None:
        return no_schedule(), None
    return client.to_dict(), client.note(CONFIRM_ADVICE)


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
    from loadtests.fleet.processes import emulator_options, start_emulator
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
    options = emulator_options(args)
    log(f"starting {args.replicas} emulated replicas ({args.profile}) ...")
    fleet = await start_emulator(options, logs)
    confirmed: dict[str, list[RatePoint]] = {}
    invalid: dict[str, str] = {}
    processes: list[dict[str, Any]] = []
    bands: dict[str, list[dict[str, Any]]] = {}
    limit = min(args.confirm_requests, len(stream.requests))
    drive = DriveOptions(
        concurrency=open_loop_cap(DriveOptions().concurrency, limit),
        seed=args.seed,
        max_duration_s=900.0,
        kvlb_sets=fleet_sets_of(args).all,
        kvlb_weight_time_scale=fleet_sets_of(args).weight_time_scale,
        kvlb_workers=kvlb_workers(args),
        catch_up=not args.confirm_no_catch_up,
    )
    hops_ms = parse_hops_ms(args.confirm_retimed_hops_ms)
    ranges_ms = parse_hop_ranges_ms(args.confirm_retimed_hop_ranges_ms, args.confirm_retimed_draws)
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
                sim_rows = sim_rows_of(kept[0], specs, fleet.names)
                _write_rows(out / "requests" / f"{_slug(name)}-{rate:g}-sim.jsonl", sim_rows)
                if save_sim:
                    (out / "decisions").mkdir(exist_ok=True)
                    rows = sim_decision_rows(kept[0], specs, fleet.names)
                    text = "".join(json.dumps(d, sort_keys=True) + "\n" for d in rows)
                    write_text_atomic(out / "decisions" / f"{_slug(name)}-{rate:g}-sim.jsonl", text)
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
                send_times = extra.pop("send_times")
                if assigned is None and (hops_ms or ranges_ms):
                    band = point_of["band"]
                    times_of = (send_times, decision_rows)
                    extra["retimed"] = _retimed(
                        args, name, stream, point, specs, times_of, band, (hops_ms, ranges_ms), log
                    )
                if decision_rows is not None:
                    (out / "decisions").mkdir(exist_ok=True)
                    text = "".join(json.dumps(d, sort_keys=True) + "\n" for d in decision_rows)
                    write_text_atomic(out / "decisions" / slug, text)
                point = dataclasses.replace(point, extra=extra)
                confirmed.setdefault(name, []).append(point)
        for (name, rate), point_of in prepared.items():
            band = point_of["band"]
            if band is not None:
                runs_here = [p for p in confirmed.get(name, ()) if p.rate == rate]
                own = [p for p in runs_here if p.extra["fleet_router"] == name]
                judged = verdict(band, [p.ttft_p90_s for p in own], [p.meets(slo_of(args)) for p in own])
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
    client, note = confirm_client(run.result, slo_of(args), ts)
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
            "sim_same_requests_meets_slo": sim.meets(slo_of(args)),
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
            # the client against its schedule, in model time (s, req/s): confirm_client
            **client,
            "rows": rows,
            "send_times": {r.request_id: r.start_s for r in run.result.records},
            **_saved_decisions(run.after_drive if save else None),
        },
        invalid=note,
    )
    same_replica, same_cached = agreement["same_replica_share"] or 0, agreement["same_cached_share"] or 0
    log(f"  p90 {p90 or float('nan'):.3f} s (sim {sim.ttft_p90_s or float('nan'):.3f}), hit rate "
        f"{s.hit_rate or 0:.3f} (sim {sim.hit_rate or 0:.3f}), same replica {same_replica:.3f}, "
        f"same cached {same_cached:.3f}" + (f"; INVALID: {note}" if note else ""))  # fmt: skip
    return point, reason, run.process


def _retimed(
    args: argparse.Namespace,
    name: str,
    stream: Stream,
    point: RatePoint,
    specs: Sequence[RequestSpec],
    times_of: tuple[dict[str, float], Sequence[dict[str, Any]] | None],
    band: dict[str, Any] | None,
    hops: tuple[Sequence[float], Sequence[tuple[float, float]]],
    log: Callable[[str], None],
) -> dict[str, Any] | None:
    """One fleet run's retimed simulations (:func:`sim_retimed`: its requests at the times the run
    routed them, per fixed hop and ``--confirm-retimed-draws`` times per hop range, ``hops``;
    ``times_of``: the client's send times by request id and the saved decisions, if any) and its
    verdict against the draws' ``band`` and them
    (:func:`loadtests.capacity.retimed.verdict_of`); ``None`` when the run has no time for some
    request (a request the client never sent)."""
    send_times, decision_rows = times_of
    decided = decision_times(decision_rows) if decision_rows is not None else None
    ids = [s.request_id for s in specs]
    times = run_times(ids, send_times, decided)
    if times is None:
        log("  retimed: the run has no time for every request; not simulated")
        return None
    hops_ms, ranges_ms = hops
    retimed = sim_retimed(
        args, name, stream, point.rate, times, hops_ms, ranges_ms, args.confirm_retimed_draws
    )
    fleet_passes = point.meets(slo_of(args))
    draws_pass = None if band is None else bool(band["passes"])
    fixed_pass = retimed["passes"] if hops_ms else None
    spread_passes = [bool(s["passes"]) for s in retimed["spread"]]
    invalid = point.invalid is not None
    judged = verdict_of(fleet_passes, draws_pass, fixed_pass, invalid=invalid, spread_passes=spread_passes)
    p90s = ", ".join(f"{h:g} ms {_num(p)}" for h, p in zip(hops_ms, retimed["ttft_p90_s"], strict=True))
    spread = "".join(
        f"; hop {lo:g}-{hi:g} ms: {passing(s)} of {s['draws']} pass, "
        f"p90 median {_num(s['ttft_p90_median_s'])} s"
        for (lo, hi), s in zip(ranges_ms, retimed["spread"], strict=True)
    )
    log(f"  retimed at the run's {times[0]} times: TTFT p90 {p90s} s{spread}; {judged}")
    lag = None if decided is None else routing_lag_ms(ids, send_times, decided, args.time_scale)
    return {
        **retimed,
        "routing_lag_ms": lag,
        "fleet_passes": fleet_passes,
        "draws_pass": draws_pass,
        "verdict": judged,
    }


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


def _write_rows(path: Path, rows: Sequence[RequestRow]) -> None:
    write_lines_atomic(path, (json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
