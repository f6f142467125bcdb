"""``kvlb demo``: an emulated mixed fleet, kvlb in front, the same chat workload routed twice (I/O).

1. Start ``replicas`` emulated replicas (SGLang and TRT-LLM alternating, in ``fleet_processes``
   child processes, see :mod:`loadtests.demo.emulator`) and ``kvlb serve`` in front of them, all on
   127.0.0.1.
2. Send a shared-prefix chat workload (the ``tenants`` workload, sized so that its prefix demand is
   ``overflow`` × one replica's KV pool) through kvlb with its default ``cost`` policy, open loop.
3. Empty every replica's cache (SGLang ``/flush_cache``; TRT-LLM restart through the emulator's
   ``/admin/faults``) and wait until kvlb's index has dropped their blocks.
4. Switch kvlb to ``round_robin`` (``PUT /admin/policy``) and send the same request stream again.
5. Report both runs' TTFT, hit rate (the replicas' own ``cached_tokens``) and per-replica share.
6. With ``linger_s``: switch back to ``cost`` and keep the fleet and kvlb up that long with a
   trickle of the same workload, so that the console (``/ui/``, its URL and admin token announced
   when kvlb is up) can be looked at after the figures are printed.

kvlb runs with a fresh random admin token (``auth.admin_token``); each request carries its
tenant-and-user id in ``x-kvlb-tenant`` (the console filters decisions by it). Every process started
here is stopped on the way out, also on errors and Ctrl-C.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.demo.emulator import demo_profile, start_emulator
from loadtests.demo.report import verdict
from loadtests.driver import run_open_loop
from loadtests.fleet.child_process import Child, python_module, spawn, stop_all
from loadtests.stats import RequestRecord
from loadtests.workloads import RequestSpec, TenantsWorkload, poisson_arrivals, with_arrivals

ProgressFn = Callable[[str, int, int], None]
"""``(phase, done, total)``: called as the demo advances (requests done out of the phase's total)."""

READY_TIMEOUT_S = 30.0
FLUSH_TIMEOUT_S = 15.0
DRAIN_GRACE_S = 30.0
"""A run may take this much longer than its schedule (queued requests finish) before it is cut."""
REQUEST_TIMEOUT_S = 60.0
TENANT_HEADER = "x-kvlb-tenant"
"""Carries each request's tenant-and-user id (kvlb's default ``tenant_header``)."""
LINGER_RATE_PER_S = 2.0
"""Arrival rate of the trickle that keeps the console's views moving while the demo lingers."""


@dataclass(frozen=True, slots=True)
class DemoShape:
    """Sizes of one demo run (the defaults take about a minute on 2 cores)."""

    replicas: int = 4
    """Emulated replicas; with ``engines`` ``mixed``, SGLang (even index) and TRT-LLM (odd) alternate."""
    engines: str = "mixed"
    """The fleet: ``mixed`` (SGLang and TRT-LLM), or every replica ``sglang``, ``vllm`` or ``trtllm``."""
    fleet_processes: int = 2
    """Child processes the replicas are split over."""
    profile: str = "cpu-small-llama"
    """Emulator profile (batch cap, step timing); see docs/emulator.md."""
    kv_capacity_tokens: int | None = 16_384
    """Each replica's KV pool in tokens (``None``: the profile's); small, so that a short workload
    already overflows one replica's cache."""
    time_scale: float = 0.25
    """Model seconds per wall second of the emulator (< 1: a slower GPU, so that the modelled times
    dominate the CPU costs of this shared machine)."""
    context_tokens: int = 1200
    """Each tenant's shared system prompt, in tokens."""
    users_per_tenant: int = 4
    """Distinct questions per tenant."""
    question_tokens: int = 100
    """Each question, in tokens."""
    overflow: float = 2.5
    """Prefix demand as a multiple of one replica's KV pool (sets the tenant count)."""
    requests: int = 300
    """Requests per run."""
    rate_per_s: float = 10.0
    """Poisson arrival rate of the open-loop runs."""
    max_tokens: int = 4
    """Output tokens per request (short answers: the workload is about prefill; with long answers
    the default ``decode_weight`` makes decode load outweigh cache affinity, see docs/policies.md)."""
    concurrency_cap: int = 64
    """Most requests in flight at once (the open-loop driver's cap)."""
    seed: int = 1
    """Seed of the prompts and the arrival times (both runs get the same stream)."""
    kvlb_workers: int | None = None
    """``kvlb serve --workers`` (``None``: kvlb's own default, one per core)."""


SMOKE = DemoShape(
    context_tokens=200, users_per_tenant=2, question_tokens=30, overflow=0.05, requests=24, rate_per_s=20.0
)
"""A few-seconds run for tests: every phase runs, the figures mean little."""


def tenants_for(shape: DemoShape) -> int:
    """Tenants whose prefix demand is ``overflow`` × one replica's KV (at least ``replicas``)."""
    capacity = demo_profile(shape.profile, shape.kv_capacity_tokens).kv_capacity_tokens
    per_tenant = shape.context_tokens + shape.users_per_tenant * shape.question_tokens
    return max(shape.replicas, math.floor(shape.overflow * capacity / per_tenant))


def workload_for(shape: DemoShape) -> TenantsWorkload:
    return TenantsWorkload(
        tenants=tenants_for(shape),
        users_per_tenant=shape.users_per_tenant,
        context_tokens=shape.context_tokens,
        question_tokens=shape.question_tokens,
        num_requests=shape.requests,
        max_tokens=shape.max_tokens,
    )


def request_stream(shape: DemoShape) -> Iterator[RequestSpec]:
    """The run's requests with Poisson arrival times; the same every call."""
    specs = workload_for(shape).generate(random.Random(shape.seed))
    return with_arrivals(specs, poisson_arrivals(shape.rate_per_s, random.Random(shape.seed + 1)))


def kvlb_settings(model: str, replicas: list[dict[str, Any]], admin_token: str) -> dict[str, Any]:
    """``kvlb serve`` settings for one pool over the fleet's listing, the admin API behind
    ``admin_token``."""
    entries = []
    for info in replicas:
        entry = {
            "id": info["name"],
            "url": info["url"],
            "engine": info["engine"],
            "block_size": info["block_size"],
        }
        if "replay" in info:  # a ZMQ publisher (SGLang, vLLM)
            entry["events"], entry["replay"] = info["events"][0], info["replay"][0]
        entries.append(entry)
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": model, "replicas": entries}],
        "policy": {"seed": 7},
        "auth": {"admin_token": admin_token},
        "scrape_interval_s": 0.5,
        "health_interval_s": 1.0,
        "log_level": "WARNING",
    }


class Demo:
    """One demo: owns its fleet, its kvlb process and one HTTP session (see :func:`run_demo`)."""

    def __init__(self, shape: DemoShape, progress: ProgressFn, log_dir: Path) -> None:
        self.shape = shape
        self.progress = progress
        self.log_dir = log_dir
        self.model = demo_profile(shape.profile, None).model
        self.fleet: list[dict[str, Any]] = []
        self.children: list[Child] = []
        self.kvlb_url = ""
        self.admin_token = secrets.token_urlsafe(18)
        """kvlb's admin token (the console's login), fresh for each demo."""
        self.session: aiohttp.ClientSession | None = None

    @property
    def console_url(self) -> str:
        return self.kvlb_url + "/ui/"

    async def start(self) -> None:
        shape = self.shape
        self.progress("starting the fleet and kvlb", 0, 1)
        self.fleet = await start_emulator(
            replicas=shape.replicas,
            processes=shape.fleet_processes,
            profile=shape.profile,
            kv_capacity_tokens=shape.kv_capacity_tokens,
            time_scale=shape.time_scale,
            engines=shape.engines,
            log_dir=self.log_dir,
            children=self.children,
        )
        config = self.log_dir / "kvlb.yaml"
        config.write_text(yaml.safe_dump(kvlb_settings(self.model, self.fleet, self.admin_token)))
        config.chmod(0o600)  # it holds the admin token
        argv = python_module("balancer", "serve", "--config", str(config))
        if shape.kvlb_workers is not None:
            argv += ["--workers", str(shape.kvlb_workers)]
        kvlb = await spawn("kvlb", argv, self.log_dir / "kvlb.stderr", ready_key="kvlb")
        self.children.append(kvlb)
        self.kvlb_url = str(kvlb.info["url"])
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0))
        await self._until("kvlb ready", self._ready, READY_TIMEOUT_S)
        self.progress("starting the fleet and kvlb", 1, 1)

    async def stop(self) -> None:
        """Close the session, then stop kvlb and the fleet (in reverse start order)."""
        try:
            if self.session is not None:
                await self.session.close()
        finally:
            await stop_all(self.children)

    @property
    def replica_ids(self) -> list[str]:
        return [str(info["name"]) for info in self.fleet]

    async def set_policy(self, policy: str, reason: str) -> None:
        await self._admin("PUT", "/admin/policy", {"name": policy, "reason": reason})

    async def run(self, key: str, policy: str) -> dict[str, Any]:
        """Set ``policy`` and send the workload; the run's summary (a dict) with the policy name."""
        await self.set_policy(policy, f"kvlb demo: the {key} run")
        shape = self.shape
        done = 0
        phase = f"{key} run"
        self.progress(phase, 0, shape.requests)

        def on_record(record: RequestRecord) -> None:
            nonlocal done
            done += 1
            self.progress(phase, done, shape.requests)

        result = await run_open_loop(
            request_stream(shape),
            self.kvlb_url,
            model=self.model,
            max_requests=shape.requests,
            max_duration_s=shape.requests / shape.rate_per_s + DRAIN_GRACE_S,
            concurrency_cap=shape.concurrency_cap,
            timeout_s=REQUEST_TIMEOUT_S,
            on_progress=on_record,
            session_header=TENANT_HEADER,
        )
        summary = result.summary(self.replica_ids).to_dict()
        return {"policy": policy, **summary}

    async def linger(self, seconds: float) -> None:
        """Keep everything up for ``seconds`` with a trickle of the same workload (a request every
        ``1 / LINGER_RATE_PER_S`` s on average), for a look at the console."""
        shape = self.shape
        specs = workload_for(shape).generate(random.Random(shape.seed + 2))
        stream = with_arrivals(specs, poisson_arrivals(LINGER_RATE_PER_S, random.Random(shape.seed + 3)))
        self.progress("lingering: the console is up", 0, 1)
        started = time.monotonic()
        while (left := seconds - (time.monotonic() - started)) > 0:
            await run_open_loop(
                stream,
                self.kvlb_url,
                model=self.model,
                max_requests=shape.requests,
                max_duration_s=left,
                concurrency_cap=shape.concurrency_cap,
                timeout_s=REQUEST_TIMEOUT_S,
                session_header=TENANT_HEADER,
            )
            specs = workload_for(shape).generate(random.Random(shape.seed + 2))
            stream = with_arrivals(specs, poisson_arrivals(LINGER_RATE_PER_S, random.Random(shape.seed + 3)))
        self.progress("lingering: the console is up", 1, 1)

    async def flush(self) -> None:
        """Empty every replica's KV cache and wait until kvlb's index holds none of their blocks."""
        self.progress("flushing replica caches", 0, 1)
        for info in self.fleet:
            if "flush" in info:  # SGLang POST /flush_cache, vLLM POST /reset_prefix_cache
                flushed = self._post_ok(info["url"] + str(info["flush"]).partition(" ")[2], None)
            else:
                flushed = self._post_ok(info["url"] + "/admin/faults", {"restart": True})
            await self._until(f"{info['name']} flushed", flushed, FLUSH_TIMEOUT_S)
        await self._until("kvlb's index empty", self._index_empty, FLUSH_TIMEOUT_S)
        self.progress("flushing replica caches", 1, 1)

    def _post_ok(self, url: str, body: Any) -> Callable[[], Awaitable[bool]]:
        """A check that POSTs and is true on 200 (SGLang refuses a flush while requests run)."""
        assert self.session is not None
        session = self.session

        async def post() -> bool:
            async with session.post(url, json=body) as response:
                return response.status == 200

        return post

    async def _index_empty(self) -> bool:
        views = (await self._admin("GET", "/admin/replicas"))["replicas"]
        return all(int(view["index"]["blocks"]) == 0 for view in views)

    async def _ready(self) -> bool:
        assert self.session is not None
        async with self.session.get(self.kvlb_url + "/readyz") as response:
            return response.status == 200

    async def _admin(self, method: str, path: str, body: Any = None) -> Any:
        assert self.session is not None
        headers = {"Authorization": f"Bearer {self.admin_token}", "x-kvlb-actor": "kvlb demo"}
        async with self.session.request(method, self.kvlb_url + path, json=body, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(
                    f"kvlb {method} {path} answered {response.status}: {await response.text()}"
                )
            return await response.json()

    async def _until(self, what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not await check():  # noqa: ASYNC110 - polls another process
                    await asyncio.sleep(0.1)
        except TimeoutError:
            tail = "\n".join(child.log_tail() for child in self.children)
            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}\n{tail}") from None

    def describe(self) -> dict[str, Any]:
        """The fleet and workload part of the report."""
        shape = self.shape
        workload = workload_for(shape)
        kv_tokens = demo_profile(shape.profile, shape.kv_capacity_tokens).kv_capacity_tokens
        fleet = [
            {
                "id": info["name"],
                "engine": info["engine"],
                "block_size": info["block_size"],
                "url": info["url"],
            }
            for info in self.fleet
        ]
        return {
            "fleet": fleet,
            "workload": {
                "name": workload.name,
                "profile": shape.profile,
                "time_scale": shape.time_scale,
                "replica_kv_tokens": kv_tokens,
                "tenants": workload.tenants,
                "context_tokens": workload.context_tokens,
                "users_per_tenant": workload.users_per_tenant,
                "question_tokens": workload.question_tokens,
                "prefix_demand_tokens": workload.prefix_demand_tokens,
                "demand_over_replica_kv": workload.prefix_demand_tokens / kv_tokens,
                "requests": shape.requests,
                "rate_per_s": shape.rate_per_s,
                "max_tokens": shape.max_tokens,
            },
        }


ConsoleFn = Callable[[str, str], None]
"""``(console_url, admin_token)``: called once kvlb is up."""
ReportFn = Callable[[dict[str, Any]], None]
"""Called with the report before the demo lingers (so that it is printed while the console is up)."""


async def run_demo(
    shape: DemoShape,
    progress: ProgressFn,
    *,
    on_console: ConsoleFn | None = None,
    on_report: ReportFn | None = None,
    linger_s: float = 0.0,
) -> dict[str, Any]:
    """Run the whole demo and return its JSON-ready report; always stops what it started. With
    ``linger_s`` > 0, ``on_report`` gets the report first, then everything stays up that long."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvlb-demo-") as folder:
        demo = Demo(shape, progress, Path(folder))
        try:
            await demo.start()
            if on_console is not None:
                on_console(demo.console_url, demo.admin_token)
            kvlb_run = await demo.run("kvlb", "cost")
            await demo.flush()
            round_robin_run = await demo.run("round robin", "round_robin")
            report = demo.describe()
            report["runs"] = {"kvlb": kvlb_run, "round_robin": round_robin_run}
            report["verdict"] = verdict(kvlb_run, round_robin_run)
            report["shape"] = asdict(shape)
            report["wall_s"] = round(time.monotonic() - started, 1)
            if linger_s > 0:
                await demo.set_policy("cost", "kvlb demo: back to kvlb's default policy for the console")
                if on_report is not None:
                    on_report(report)
                await demo.linger(linger_s)
        finally:
            await demo.stop()
    return report
