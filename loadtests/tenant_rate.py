"""A quiet tenant's latency while another floods or sends the tenant isolation walk's other
scenarios, with and without the tenant limits (``python -m loadtests.tenant_rate``).

Two emulated SGLang replicas (``kvlb emulate --profile h100-llama3-8b``, time scale 1, token ids
only: one child process; with the default tokenizer when a scenario sends text) stand behind a real
``kvlb serve --workers N`` (a fresh child process for each run), all on 127.0.0.1, with the tenant
isolation walk's limits (``max_inflight: 64``, ``max_inflight_per_tenant: 16``, ``max_queued: 128``,
``max_queued_per_tenant: 32``, ``queue_timeout_s: 2``, ``max_prompt_tokens: 7000``; 262,144 for
``huge``, as the walk ran it). The quiet tenant (``x-kvlb-tenant: quiet``) is ``--quiet-clients``
loops in this process, each sending one small completion after another (10 token ids,
``max_tokens: 8``, 20 ms pause). The noisy tenant is ``--loops`` loops (unset: the walk's for the
scenario) in a separate process (so the quiet client's own loop is not the one delayed), sending one
of the walk's scenarios (``--noise``, several with commas, each with every mode of ``--runs``;
:mod:`loadtests.tenant_noise`): ``flood``, ``default`` (no tenant header), ``made-up`` (a new tenant
a request), ``values`` (10,000 tenant values of 128 characters), ``token-ids`` (6,000 random ids a
prompt), ``hot-prefix`` (one shared 1,000-word prefix), ``huge`` (560,000-character chats),
``over-chars`` (6 MB chats), ``bursts`` (100 at once, cut after 50 ms), ``streams`` (streams of 2,000
tokens read slowly or never). ``--noisy-nice 19`` runs it under ``nice``, so that the flooding
client's own CPU (a core of the 2 this was measured on) yields to the others and what is left of the
quiet tenant's rise is the part kvlb's refusals and serving cost. Each run is one mode:

* ``caps``: the per-tenant caps only (what the walk measured);
* ``rate``: the caps and ``limits.tenant_rate_per_s: --rate-per-s`` (``tenant_burst``: the same;
  the default tenant held too, ``tenant_rate_default_tenant``);
* ``tokenizing``: the caps and ``limits.max_tokenizing_per_tenant: --tokenizing-per-tenant``;
* ``prompt-tokens``: the caps and ``limits.max_inflight_prompt_tokens_per_tenant:
  --prompt-tokens-per-tenant``.

Each run measures a window of ``--seconds`` without the noisy tenant, then one with it (started,
then 0.5 s of noise before the window opens). Printed: a JSON document on stdout and a table on
stderr; for each run the UTC time and load, the quiet tenant's p50/p99 (nearest rank) and answers in
each window, the noisy tenant's answers by status, and the CPU seconds ``kvlb serve`` (all its
processes) used in each window, whence the CPU per noisy request beyond the quiet window's
(``cpu_us_per_noisy_request``). Runs go in the order of ``--runs`` (default
``caps,rate,rate,caps``), so both modes share the machine's conditions.
With ``--refusals`` each run measures instead what a refusal costs: the noisy tenant alone for
``--seconds``, every request of it refused, in ``caps`` mode by its queue cap
(``max_inflight_per_tenant: 1``, ``max_queued_per_tenant: 0``, its one slot held by a long
generation), in ``rate`` mode by its bucket; printed: ``kvlb serve``'s CPU seconds over the flood,
less what it used idle (measured over ``--seconds`` before the flood, pro rata), divided by the
refusals (``cpu_us_per_refusal``: everything kvlb does for one, aiohttp included).
Bounded: each window at most 60 s, each loop at most 100,000 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from balancer.service.series import percentile
from loadtests.fleet.child_process import Child, python_module, spawn, tree_cpu_seconds
from loadtests.tenant_noise import MODEL, NOISES, TEXT_NOISES, WALK_LIMITS, WALK_LOOPS, noisy, small_body

HEADER = "x-kvlb-tenant"
MAX_REQUESTS_PER_LOOP = 100_000
START_TIMEOUT_S = 60.0
NOISE_LEAD_S = 0.5
QUIET_PAUSE_S = 0.02


MODES = ("caps", "rate", "tokenizing", "prompt-tokens")


def kvlb_config(
    replicas: list[dict[str, Any]], mode: str, args: argparse.Namespace, noise: str = "flood"
) -> dict[str, Any]:
    limits: dict[str, Any] = {
        "max_inflight": 64,
        "max_inflight_per_tenant": 16,
        "max_queued": 128,
        "max_queued_per_tenant": 32,
        "queue_timeout_s": 2,
        "max_prompt_tokens": 7000,
        **WALK_LIMITS.get(noise, {}),
    }
    if mode == "tokenizing":
        limits["max_tokenizing_per_tenant"] = args.tokenizing_per_tenant
    elif mode == "prompt-tokens":
        limits["max_inflight_prompt_tokens_per_tenant"] = args.prompt_tokens_per_tenant
    elif mode == "rate":
        limits["tenant_rate_per_s"] = args.rate_per_s
        limits["tenant_burst"] = max(1, round(args.rate_per_s))
        limits["tenant_rate_default_tenant"] = True  # the default tenant's flood is held too
    entries = []
    for info in replicas:
        entry = {"id": info["name"], "url": info["url"], "engine": "sglang", "block_size": info["block_size"]}
        entry["events"], entry["replay"] = info["events"][0], info["replay"][0]
        entries.append(entry)
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": entries}],
        "limits": limits,
        "scrape_interval_s": 0.5,
        "health_interval_s": 1.0,
        "log_level": "WARNING",
    }


async def quiet_window(session: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> dict[str, Any]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    deadline = time.monotonic() + args.seconds

    async def loop(index: int) -> None:
        for sent in range(MAX_REQUESTS_PER_LOOP):
            if time.monotonic() >= deadline:
                return
            started = time.perf_counter()
            headers = {HEADER: "quiet", "content-type": "application/json"}
            async with session.post(
                url + "/v1/completions", data=small_body(10_000 + 1000 * index + sent), headers=headers
            ) as response:
                await response.read()
                statuses[response.status] += 1
                if response.status == 200:
                    latencies.append(time.perf_counter() - started)
            await asyncio.sleep(QUIET_PAUSE_S)

    await asyncio.gather(*(loop(i) for i in range(args.quiet_clients)))
    latencies.sort()
    return {
        "p50_ms": _ms(percentile(latencies, 0.50)),
        "p99_ms": _ms(percentile(latencies, 0.99)),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


async def one_run(
    mode: str, replicas: list[dict[str, Any]], args: argparse.Namespace, tmp: Path, noise: str = "flood"
) -> dict[str, Any]:
    path = tmp / f"kvlb-{noise}-{mode}.yaml"
    path.write_text(yaml.safe_dump(kvlb_config(replicas, mode, args, noise)))
    loops = args.loops or WALK_LOOPS[noise]
    run: dict[str, Any] = {
        "noise": noise,
        "loops": loops,
        "mode": mode,
        "utc": time.strftime("%H:%M:%S", time.gmtime()),
        "load": round(os.getloadavg()[0], 2),
    }
    argv = python_module("balancer", "serve", "--config", str(path), "--workers", str(args.workers))
    serve = await spawn(
        "kvlb", argv, tmp / f"kvlb-{noise}-{mode}.log", ready_key="serving", timeout_s=START_TIMEOUT_S
    )
    url = str(serve.info["url"])
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=30)
        ) as session:
            async with asyncio.timeout(START_TIMEOUT_S):
                while True:
                    async with session.get(url + "/readyz") as response:
                        if response.status == 200:
                            break
                    await asyncio.sleep(0.05)
            await quiet_window(session, url, argparse.Namespace(**{**vars(args), "seconds": 1.0}))  # warm
            cpu = tree_cpu_seconds(serve.pid)
            run["without"] = await quiet_window(session, url, args)
            run["without"]["kvlb_cpu_s"] = round(tree_cpu_seconds(serve.pid) - cpu, 3)
            seconds = args.seconds + NOISE_LEAD_S + 1.0
            noise_argv = python_module(
                "loadtests.tenant_rate", "--noisy", url, "--loops", str(loops),
                "--seconds", str(seconds), "--noise", noise,
            )  # fmt: skip
            if args.noisy_nice:  # the flooding client's own CPU out of the others' way
                noise_argv = ["nice", "-n", str(args.noisy_nice), *noise_argv]
            noisy_child = await spawn(
                "noisy", noise_argv, tmp / f"noisy-{noise}-{mode}.log", ready_key="noisy"
            )
            try:
                await asyncio.sleep(NOISE_LEAD_S)
                cpu = tree_cpu_seconds(serve.pid)
                run["with"] = await quiet_window(session, url, args)
                run["with"]["kvlb_cpu_s"] = round(tree_cpu_seconds(serve.pid) - cpu, 3)
                assert noisy_child.process.stdout is not None
                line = await asyncio.wait_for(noisy_child.process.stdout.readline(), seconds + 30)
                run["noisy_statuses"] = json.loads(line)["statuses"]
            finally:
                await noisy_child.stop()
    finally:
        await serve.stop()
    noisy_total = sum(run["noisy_statuses"].values())
    noisy_in_window = noisy_total * args.seconds / seconds  # the window's share, at a steady rate
    extra_cpu = run["with"]["kvlb_cpu_s"] - run["without"]["kvlb_cpu_s"]
    run["cpu_us_per_noisy_request"] = round(1e6 * extra_cpu / noisy_in_window, 1) if noisy_in_window else None
    return run


async def refusal_run(
    mode: str, replicas: list[dict[str, Any]], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """CPU of ``kvlb serve`` per refused request: the noisy tenant alone, every request of it refused,
    in ``caps`` mode by its queue cap (``max_inflight_per_tenant: 1``, ``max_queued_per_tenant: 0``,
    its one slot held by a long generation) and in ``rate`` mode by its bucket (0.001 a second,
    burst 1: its first request is the one let in)."""
    config = kvlb_config(replicas, "caps", args)
    if mode == "caps":
        config["limits"].update(max_inflight_per_tenant=1, max_queued_per_tenant=0)
    else:
        config["limits"].update(tenant_rate_per_s=0.001, tenant_burst=1)
    path = tmp / f"kvlb-refusals-{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    run: dict[str, Any] = {"mode": mode, "utc": time.strftime("%H:%M:%S", time.gmtime())}
    run["load"] = round(os.getloadavg()[0], 2)
    argv = python_module("balancer", "serve", "--config", str(path), "--workers", str(args.workers))
    serve = await spawn("kvlb", argv, tmp / f"kvlb-refusals-{mode}.log", ready_key="serving")
    url = str(serve.info["url"])
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async with asyncio.timeout(START_TIMEOUT_S):
                while True:
                    async with session.get(url + "/readyz") as response:
                        if response.status == 200:
                            break
                    await asyncio.sleep(0.05)
            long = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4000})
            headers = {HEADER: "noisy", "content-type": "application/json"}

            async def hold() -> None:
                async with session.post(url + "/v1/completions", data=long, headers=headers) as response:
                    await response.read()

            held = asyncio.create_task(hold())
            await asyncio.sleep(0.5)  # in flight (caps) or its bucket's one token taken (rate)
            cpu = tree_cpu_seconds(serve.pid)
            await asyncio.sleep(args.seconds)  # what kvlb uses idle (probes, scrapes, events)
            idle_s_per_s = (tree_cpu_seconds(serve.pid) - cpu) / args.seconds
            cpu, flood_started = tree_cpu_seconds(serve.pid), time.monotonic()
            noise_argv = python_module(
                "loadtests.tenant_rate", "--noisy", url, "--loops", str(args.loops or 200),
                "--seconds", str(args.seconds), "--noise", "flood",
            )  # fmt: skip
            noise = await spawn("noisy", noise_argv, tmp / f"noisy-refusals-{mode}.log", ready_key="noisy")
            try:
                assert noise.process.stdout is not None
                line = await asyncio.wait_for(noise.process.stdout.readline(), args.seconds + 30)
            finally:
                await noise.stop()
            run["kvlb_cpu_s"] = round(tree_cpu_seconds(serve.pid) - cpu, 3)
            run["kvlb_idle_cpu_s"] = round(idle_s_per_s * (time.monotonic() - flood_started), 3)
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await held
    finally:
        await serve.stop()
    run["noisy_statuses"] = statuses = json.loads(line)["statuses"]
    refused = statuses.get("429", 0)
    flood_cpu_s = run["kvlb_cpu_s"] - run["kvlb_idle_cpu_s"]
    run["cpu_us_per_refusal"] = round(1e6 * flood_cpu_s / refused, 1) if refused else None
    return run


async def main(args: argparse.Namespace) -> None:
    runs: list[dict[str, Any]] = []
    noises = args.noise.split(",")
    text = any(noise in TEXT_NOISES for noise in noises)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        argv = python_module(
            "balancer", "emulate", "--replicas", "2", "--engine", "sglang", "--profile", "h100-llama3-8b",
            "--base-port", "0", "--event-port-base", "0", "--tokenizer", "default" if text else "none",
            "--log-level", "WARNING",
        )  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLB_")}
        fleet: Child = await spawn("fleet", argv, tmp / "fleet.log", ready_key="replicas", env=env)
        try:
            for noise in noises:
                for mode in args.runs.split(","):
                    if args.refusals:
                        runs.append(await refusal_run(mode, fleet.info["replicas"], args, tmp))
                    else:
                        runs.append(await one_run(mode, fleet.info["replicas"], args, tmp, noise))
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        finally:
            await fleet.stop()
    print(json.dumps({"settings": vars(args), "runs": runs}, indent=1))
    print(table(runs), file=sys.stderr)


def table(runs: list[dict[str, Any]]) -> str:
    """The runs as a Markdown table (the quiet tenant's p50 / p99 without and with the noise)."""
    lines = [
        "| noise (loops) | mode | UTC, load | quiet p50 / p99 without | with | noisy answers |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        if "without" not in run:  # a refusals run
            lines.append(
                f"| flood | {run['mode']} | {run['utc']}, {run['load']} | | | "
                f"{_statuses(run['noisy_statuses'])}; {run['cpu_us_per_refusal']} µs a refusal |"
            )
            continue
        without, with_ = run["without"], run["with"]
        lines.append(
            f"| {run['noise']} ({run['loops']}) | {run['mode']} | {run['utc']}, {run['load']} | "
            f"{without['p50_ms']} / {without['p99_ms']} ms | {with_['p50_ms']} / {with_['p99_ms']} ms | "
            f"{_statuses(run['noisy_statuses'])} |"
        )
    return "\n".join(lines)


def _statuses(statuses: dict[str, int]) -> str:
    return ", ".join(f"{status} ×{count:,}" for status, count in statuses.items())


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", default="caps,rate,rate,caps", help=f"modes in turn: {', '.join(MODES)}")
    parser.add_argument("--seconds", type=float, default=3.0, help="each window (≤ 60)")
    parser.add_argument(
        "--loops", type=int, default=None, help="the noisy tenant's loops (unset: the walk's for the noise)"
    )
    parser.add_argument(
        "--noise", default="flood", help=f"a scenario, or several with commas: {', '.join(NOISES)}"
    )
    parser.add_argument("--quiet-clients", type=int, default=2)
    parser.add_argument("--rate-per-s", type=float, default=50.0, help="limits.tenant_rate_per_s (rate runs)")
    parser.add_argument(
        "--tokenizing-per-tenant",
        type=int,
        default=1,
        help="limits.max_tokenizing_per_tenant (tokenizing runs)",
    )
    parser.add_argument(
        "--prompt-tokens-per-tenant",
        type=int,
        default=16_000,
        help="limits.max_inflight_prompt_tokens_per_tenant (prompt-tokens runs)",
    )
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--noisy-nice",
        type=int,
        default=0,
        help="run the noisy client under nice -n N (0..19): what is left is kvlb's share",
    )
    parser.add_argument(
        "--refusals", action="store_true", help="measure kvlb's CPU per refused request instead"
    )
    parser.add_argument("--noisy", metavar="URL", help="(internal) be the noisy tenant against URL")
    args = parser.parse_args(argv)
    loops_ok = args.loops is None or 1 <= args.loops <= 1000
    if not 0 < args.seconds <= 60 or not loops_ok or not 1 <= args.quiet_clients <= 64:
        parser.error("--seconds in (0, 60], --loops in 1..1000, --quiet-clients in 1..64")
    if not 0 <= args.noisy_nice <= 19:
        parser.error("--noisy-nice in 0..19")
    if any(noise not in NOISES for noise in args.noise.split(",")):
        parser.error(f"--noise: one or more of {', '.join(NOISES)} (commas), got {args.noise!r}")
    if any(mode not in MODES for mode in args.runs.split(",")):
        parser.error(f"--runs: modes among {', '.join(MODES)}, got {args.runs!r}")
    if args.refusals and any(mode not in ("caps", "rate") for mode in args.runs.split(",")):
        parser.error("--refusals: --runs of caps and rate only")
    return args


if __name__ == "__main__":
    options = parse()
    if options.noisy:
        asyncio.run(
            noisy(options.noisy, options.loops or WALK_LOOPS[options.noise], options.seconds, options.noise)
        )
    else:
        asyncio.run(main(options))
