"""Processes of a load test: the emulated fleet, ``kvlb serve`` and the peers (I/O).

Everything is a child process (:mod:`loadtests.fleet.child_process`) started here and stopped here,
by its own pid: SIGTERM, a bounded wait, then SIGKILL. Each child prints one JSON line when it is
ready (the fleet its replica listing, kvlb ``{"kvlb": "serving"}``); peers print nothing useful, so
readiness is polled over HTTP.

The fleet runs in ``processes`` children (``python -m loadtests.fleet.emulator_child``: ``kvlb emulate``
plus the profile overrides and event flavour ``kvlb emulate`` lacks). Or :func:`attach_emulator` uses a
running fleet from its listing (``kvlb emulate … > fleet.jsonl``); it must be SGLang replicas (flush,
events, ``/admin/stats``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.fleet.child_process import Child, ChildFailed, spawn, stop_all
from loadtests.kvlb_timers import model_time_weights
from loadtests.peers import PEER_ENV, RouterSpec, peer_command
from replicas.sim.ports import free_port_run

START_TIMEOUT_S = 90.0
"""How long a child may take to print its ready line (the tokenizer loads in it)."""
READY_TIMEOUT_S = 60.0
"""How long a router may take to see every replica (healthy, registered)."""
IDLE_TIMEOUT_S = 120.0
"""How long the fleet may take to finish leftover requests before a flush."""
HTTP_TIMEOUT_S = 10.0
READY_POLL_S = 0.05
"""How often a starting router is asked whether it sees every replica (0.3 s until 2026-11-30: a
kvlb whose first answer came too early waited 0.3 s more in every run of a capacity confirmation)."""


# ------------------------------------------------------------------------------------------ fleet


@dataclass(frozen=True, slots=True)
class EmulatorOptions:
    """The fleet a load test starts."""

    replicas: int = 8
    profile: str = "h100-llama3-8b"
    kv_capacity_tokens: int | None = None
    """Per-replica KV pool in tokens; ``None``: the profile's."""
    max_context_tokens: int | None = None
    """Per-request context limit; ``None``: the profile's."""
    time_scale: float = 1.0
    processes: int = 2
    engine: str = "sglang"
    """The engine the replicas emulate: ``sglang`` (0.5.23) or ``vllm`` (0.32: its events, block size
    128, block eviction, ``/reset_prefix_cache`` and ``vllm:`` metrics)."""
    event_flavor: str = "sglang"
    """SGLang replicas only: the KV-event field set, ``sglang`` or ``vllm`` (a stopgap that adds
    ``lora_name`` etc. to SGLang replicas' events, for vllm-router's ``kv_aware``, which rejects events
    without ``lora_name``)."""


def emulator_options(
    args: argparse.Namespace, *, engine: str = "sglang", event_flavor: str = "sglang"
) -> EmulatorOptions:
    """The fleet of a command's parsed ``--replicas``, ``--profile``, ``--kv-capacity-tokens``,
    ``--max-context-tokens`` (the profile's where the command has no such option), ``--time-scale``
    and ``--processes``, of ``engine`` with ``event_flavor`` events."""
    return EmulatorOptions(
        replicas=args.replicas,
        profile=args.profile,
        kv_capacity_tokens=args.kv_capacity_tokens,
        max_context_tokens=getattr(args, "max_context_tokens", None),
        time_scale=args.time_scale,
        processes=args.processes,
        engine=engine,
        event_flavor=event_flavor,
    )


@dataclass
class EmulatorHandle:
    """A running fleet: the listing of its replicas and the children (none when attached)."""

    replicas: list[dict[str, Any]]
    children: list[Child] = field(default_factory=list)
    capacity_tokens: int = 0
    """One replica's KV pool, in tokens (read from the replicas)."""

    @property
    def names(self) -> list[str]:
        return [str(r["name"]) for r in self.replicas]

    @property
    def model(self) -> str:
        return str(self.replicas[0]["model"])

    @property
    def block_size(self) -> int:
        return int(self.replicas[0]["block_size"])

    async def stop(self) -> None:
        await stop_all(self.children)
        self.children.clear()


async def start_emulator(options: EmulatorOptions, logs: Path) -> EmulatorHandle:
    """Start ``options.replicas`` replicas of ``options.engine`` over ``options.processes`` children.
    A child that exits, stays silent or cannot be started raises :class:`ChildFailed` (its
    :meth:`~ChildFailed.one_line` names it, its exit code and its stderr's last lines), after every
    child started is stopped."""
    processes = max(1, min(options.processes, options.replicas))
    per_child, extra = divmod(options.replicas, processes)
    handle = EmulatorHandle([])
    offset = 0
    try:
        for index in range(processes):
            count = per_child + (1 if index < extra else 0)
            argv = [
                sys.executable,
                "-m",
                "loadtests.fleet.emulator_child",
                *_child_args(options, offset, count),
            ]
            name = f"fleet-{index}"
            try:
                child = await spawn(
                    name,
                    argv,
                    logs / f"{name}.log",
                    ready_key="replicas",
                    timeout_s=START_TIMEOUT_S,
                    env=os.environ,
                )
            except OSError as exc:  # no process at all (fork or exec refused)
                log = logs / f"{name}.log"
                raise ChildFailed(name, None, exc.strerror or str(exc), stderr_path=log) from None
            handle.children.append(child)
            handle.replicas.extend(child.info["replicas"])
            offset += count
    except BaseException:
        await handle.stop()
        raise
    return handle


def _child_args(options: EmulatorOptions, offset: int, count: int) -> list[str]:
    args = [
        "--replicas", str(count), "--index-offset", str(offset), "--profile", options.profile,
        "--time-scale", str(options.time_scale), "--event-flavor", options.event_flavor,
        "--engine", options.engine,
    ]  # fmt: skip
    if options.kv_capacity_tokens is not None:
        args += ["--kv-capacity-tokens", str(options.kv_capacity_tokens)]
    if options.max_context_tokens is not None:
        args += ["--max-context-tokens", str(options.max_context_tokens)]
    return args


def attach_emulator(listing: Path) -> EmulatorHandle:
    """A running fleet from the JSON listing ``kvlb emulate`` prints (the last ``{"replicas": …}`` line)."""
    replicas: list[dict[str, Any]] | None = None
    for line in listing.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("{") and '"replicas"' in line:
            replicas = json.loads(line)["replicas"]
    if not replicas:
        raise ValueError(f"{listing}: no {{'replicas': [...]}} line found")
    if any("replay" not in r or "flush" not in r for r in replicas):
        raise ValueError("attach needs SGLang or vLLM replicas (a cache flush and ZMQ events)")
    return EmulatorHandle(replicas)


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as response:
        response.raise_for_status()
        return await response.json(content_type=None)


async def replica_stats(session: aiohttp.ClientSession, fleet: EmulatorHandle) -> dict[str, dict[str, Any]]:
    """``GET /admin/stats`` of every replica, ranks summed: name → figures."""
    answers = await asyncio.gather(*(_get_json(session, r["url"] + "/admin/stats") for r in fleet.replicas))
    result: dict[str, dict[str, Any]] = {}
    for replica, answer in zip(fleet.replicas, answers, strict=True):
        summed: dict[str, float] = {}
        for rank in answer["ranks"]:
            for key, value in rank.items():
                if isinstance(value, (int, float)) and key != "dp_rank":
                    summed[key] = summed.get(key, 0) + value
        result[str(replica["name"])] = summed
    return result


async def read_capacity(session: aiohttp.ClientSession, fleet: EmulatorHandle) -> int:
    """One replica's KV pool in tokens (the smallest of the fleet's, per DP rank summed)."""
    stats = await replica_stats(session, fleet)
    fleet.capacity_tokens = int(min(s["max_total_num_tokens"] for s in stats.values()))
    return fleet.capacity_tokens


async def wait_idle(session: aiohttp.ClientSession, fleet: EmulatorHandle) -> None:
    """Until no replica runs or queues a request (bounded by :data:`IDLE_TIMEOUT_S`)."""
    async with asyncio.timeout(IDLE_TIMEOUT_S):
        while True:
            stats = await replica_stats(session, fleet)
            if all(s["num_running_reqs"] + s["num_waiting_reqs"] == 0 for s in stats.values()):
                return
            await asyncio.sleep(0.2)


async def flush(session: aiohttp.ClientSession, fleet: EmulatorHandle) -> None:
    """Empty every replica's prefix cache (its listed ``flush``: SGLang ``POST /flush_cache``, vLLM
    ``POST /reset_prefix_cache``; refused while busy: wait idle first)."""
    await wait_idle(session, fleet)
    for replica in fleet.replicas:
        method, _, path = str(replica.get("flush", "POST /flush_cache")).partition(" ")
        async with session.request(
            method, replica["url"] + path, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"flush of {replica['name']} failed: HTTP {response.status}")
        await _get_json(session, replica["url"] + "/admin/requests?clear=1")


CAUGHT_UP_POLLS = 3
"""Consecutive answers :func:`wait_caught_up` needs, each on a new connection (with ``--workers`` a
different worker may answer each, and every worker keeps its own index)."""


async def published_seqs(session: aiohttp.ClientSession, fleet: EmulatorHandle) -> dict[str, list[int]]:
    """Per replica with ZMQ events (SGLang, vLLM), the seq of the last batch each rank published
    (-1: none yet), from its ``GET /admin/stats``; replicas without ZMQ publishers are left out."""
    answers = await asyncio.gather(*(_get_json(session, r["url"] + "/admin/stats") for r in fleet.replicas))
    return {
        str(replica["name"]): [int(seq) - 1 for seq in answer["seq"]]
        for replica, answer in zip(fleet.replicas, answers, strict=True)
        if isinstance(answer.get("seq"), list)
    }


def caught_up(views: Sequence[Mapping[str, Any]], published: Mapping[str, Sequence[int]]) -> bool:
    """Whether kvlb's ``/admin/replicas`` ``views`` show an index that has taken every event the
    fleet published (``published``: :func:`published_seqs`) and holds no block: every rank's
    source is at or past its replica's last batch, no batch waits in a replica's queue, and every
    replica's index is empty (the fleet was flushed, so its events end in a clear)."""
    for view in views:
        if view["index"]["blocks"]:
            return False
        events = view.get("events")
        if events is None or not events["sources"]:  # a kvlb routing without KV events
            continue
        if events["queued_batches"]:
            return False
        taken = {source["dp_rank"]: source["last_seq"] for source in events["sources"]}
        for rank, last in enumerate(published.get(str(view["id"]), ())):
            seen = taken.get(rank)
            if last >= 0 and (seen is None or seen < last):
                return False
    return True


async def wait_caught_up(session: aiohttp.ClientSession, url: str, fleet: EmulatorHandle) -> None:
    """After :func:`flush`: until the kvlb at ``url`` has applied the fleet's event streams to their
    end (:func:`caught_up` on :data:`CAUGHT_UP_POLLS` answers in a row; bounded by
    :data:`READY_TIMEOUT_S`). A kvlb started on a fleet that served an earlier run first replays
    that run's history from each engine's replay buffer; a drive that starts meanwhile has old
    stores confirm its new speculative entries, which the replayed flush then clears
    (docs/loadtest-history.md, "Where the fleet and the simulator part", 2026-11-29)."""
    published = await published_seqs(session, fleet)
    in_a_row = 0
    async with asyncio.timeout(READY_TIMEOUT_S):
        while True:
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as fresh:
                views = (await _get_json(fresh, url + "/admin/replicas"))["replicas"]
            in_a_row = in_a_row + 1 if caught_up(views, published) else 0
            if in_a_row >= CAUGHT_UP_POLLS:
                return
            await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------------------ routers


def kvlb_config(
    fleet: EmulatorHandle,
    policy: str,
    seed: int,
    weights: Mapping[str, float | None] | None = None,
    *,
    kv_events: bool = True,
) -> dict[str, Any]:
    """The ``kvlb serve`` settings for one pool over the fleet with ``policy`` (and weight overrides);
    ``kv_events=False``: the pool reads no KV events (``pools[].kv_events: false``)."""
    replicas = [
        {
            "id": r["name"],
            "url": r["url"],
            "engine": r["engine"],
            "block_size": r["block_size"],
            "dp_size": r.get("dp_size", 1),
            "events": r["events"][0],
            "replay": r["replay"][0],
        }
        for r in fleet.replicas
    ]
    pool: dict[str, Any] = {"model": fleet.model, "replicas": replicas}
    if not kv_events:
        pool["kv_events"] = False
        for replica in replicas:
            del replica["events"], replica["replay"]
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [pool],
        "policy": {"name": policy, "seed": seed, "weights": dict(weights or {})},
        "log_level": "WARNING",
    }


async def start_router(
    spec: RouterSpec,
    fleet: EmulatorHandle,
    logs: Path,
    *,
    seed: int,
    kvlb_sets: Sequence[str] = (),
    kvlb_workers: int | None = None,
    weight_time_scale: float = 1.0,
) -> tuple[Child, str]:
    """Start the router of ``spec`` in front of ``fleet``; returns it and its base URL once ready.

    ``kvlb_sets`` are ``kvlb serve --set NAME=VALUE`` overrides for kvlb routers (ignored by peers);
    ``kvlb_workers`` their ``--workers`` (``None``: kvlb's default); ``weight_time_scale`` puts a
    kvlb router's weights in seconds on the fleet's model time
    (:func:`loadtests.kvlb_timers.model_time_weights`; 1: as given)."""
    if spec.kind == "kvlb":
        config = logs / f"{_file_name(spec.name)}.yaml"
        weights = model_time_weights(dict(spec.weights), weight_time_scale)
        settings = kvlb_config(fleet, spec.policy, seed, weights, kv_events=spec.kv_events)
        config.write_text(yaml.safe_dump(settings))
        argv = [sys.executable, "-m", "balancer", "serve", "--config", str(config)]
        argv += [arg for item in kvlb_sets for arg in ("--set", item)]
        if kvlb_workers is not None:
            argv += ["--workers", str(kvlb_workers)]
        name = _file_name(spec.name)
        child = await spawn(
            name, argv, logs / f"{name}.log", ready_key="serving", timeout_s=START_TIMEOUT_S, env=os.environ
        )
        url = str(child.info["url"])
    else:
        port, metrics_port = free_port_run("127.0.0.1", 1), free_port_run("127.0.0.1", 1)
        argv = peer_command(
            spec, port=port, metrics_port=metrics_port, replicas=fleet.replicas, model=fleet.model
        )
        env = {**os.environ, **PEER_ENV}
        child = await spawn(spec.name, argv, logs / f"{spec.name}.log", ready_key=None, env=env)
        url = f"http://127.0.0.1:{port}"
    try:
        await _wait_router_ready(spec, url, fleet, child)
    except BaseException:
        await child.stop()
        raise
    return child, url


def _file_name(router: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in router)


async def _wait_router_ready(spec: RouterSpec, url: str, fleet: EmulatorHandle, child: Child) -> None:
    async with aiohttp.ClientSession() as session:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                while not await router_ready(session, spec, url, len(fleet.replicas)):
                    if child.process.returncode is not None:
                        raise RuntimeError(f"{spec.name} exited with {child.process.returncode}")
                    await asyncio.sleep(READY_POLL_S)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{spec.name} not ready at {url}: {exc}\n{child.log_tail()}") from None
    if spec.kind == "vllm":
        await asyncio.sleep(1.0)  # ZMQ slow joiner: let the SUB sockets connect before the first event


async def router_ready(session: aiohttp.ClientSession, spec: RouterSpec, url: str, replicas: int) -> bool:
    """Whether the router at ``url`` is up and lists ``replicas`` workers (one poll, never raises)."""
    try:
        if spec.kind == "kvlb":
            views = (await _get_json(session, url + "/admin/replicas"))["replicas"]
            return len(views) == replicas and all(v["routable"] for v in views)
        if spec.kind == "sglang":
            workers = await _get_json(session, url + "/workers")
            listed = workers.get("workers", workers) if isinstance(workers, dict) else workers
            return isinstance(listed, list) and len(listed) >= replicas
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return False
