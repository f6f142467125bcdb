"""The race of ``limits.tenant_rate_per_s`` between workers, contrived (``python -m
loadtests.tenant_race``).

A fake replica answering at once (:mod:`loadtests.tenant_flood`'s, a child process) stands behind a
real ``kvlb serve --workers N`` (another child process), on 127.0.0.1, with ``tenant_rate_per_s:
0.01`` and ``tenant_burst: 1`` (one request a tenant in 100 s) and a newcomers' rate that never binds.
Each trial is a tenant of its own: ``--connections`` sockets are opened (the kernel hands them to
the workers), then one request of that tenant is written on each in one go, without awaiting
between the writes, so that the workers check the tenant's bucket at nearly the same instant. One
request is allowed; every other one let in passed a worker that had not yet seen another worker's
bucket time (the shared load table has no lock between workers). Printed (JSON): the trials, the
requests let in, those over the one allowed in all and at most in one trial, and the UTC time and
load. Bounded: ``--trials`` ≤ 1,000, ``--connections`` ≤ 256, each answer 10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from loadtests.fleet.child_process import python_module, spawn
from loadtests.tenant_flood import MODEL, start_replica

HEADER = "x-kvlb-tenant"
ANSWER_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0


def kvlb_config(replica_url: str) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [
            {
                "model": MODEL,
                "kv_events": False,
                "replicas": [{"id": "fast", "url": replica_url, "engine": "sglang", "block_size": 4}],
            }
        ],
        "limits": {
            "max_inflight": 1024,
            "max_queued": 1024,
            "tenant_rate_per_s": 0.01,
            "tenant_burst": 1,
            "tenant_rate_new_per_s": 100_000.0,
        },
        "scrape_interval_s": 0,
        "health_interval_s": 0.5,
        "log_level": "WARNING",
    }


def request_bytes(host: str, tenant: str) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{HEADER}: {tenant}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def status_of(reader: asyncio.StreamReader) -> int:
    line = await asyncio.wait_for(reader.readline(), ANSWER_TIMEOUT_S)
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0


async def trial(host: str, port: int, tenant: str, connections: int) -> list[int]:
    """One request of ``tenant`` on each of ``connections`` fresh sockets, written together; the
    statuses."""
    opened = [await asyncio.open_connection(host, port) for _ in range(connections)]
    payload = request_bytes(f"{host}:{port}", tenant)
    try:
        for _, writer in opened:  # no await in between: the requests leave together
            writer.write(payload)
        return list(await asyncio.gather(*(status_of(reader) for reader, _ in opened)))
    finally:
        for _, writer in opened:
            writer.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        replica = await start_replica(0.0, tmp)
        try:
            path = tmp / "kvlb.yaml"
            path.write_text(yaml.safe_dump(kvlb_config(str(replica.info["url"]))))
            argv = python_module("balancer", "serve", "--config", str(path), "--workers", str(args.workers))
            serve = await spawn(
                "kvlb", argv, tmp / "kvlb.log", ready_key="serving", timeout_s=START_TIMEOUT_S
            )
            try:
                parts = urlsplit(str(serve.info["url"]))
                assert parts.hostname is not None and parts.port is not None
                await asyncio.sleep(1.0)  # every worker up (the supervisor announces the first)
                result: dict[str, Any] = {
                    "utc": time.strftime("%H:%M:%S", time.gmtime()),
                    "load": round(os.getloadavg()[0], 2),
                    "workers": args.workers,
                    "connections": args.connections,
                    "trials": args.trials,
                }
                let_in: list[int] = []
                other: dict[str, int] = {}
                for index in range(args.trials):
                    statuses = await trial(
                        parts.hostname, parts.port, f"race-{args.seed}-{index}", args.connections
                    )
                    let_in.append(statuses.count(200))
                    for status in statuses:
                        if status not in (200, 429):
                            other[str(status)] = other.get(str(status), 0) + 1
            finally:
                await serve.stop()
        finally:
            await replica.stop()
    result["let_in"] = sum(let_in)
    result["over"] = sum(max(0, n - 1) for n in let_in)
    result["trials_over"] = sum(1 for n in let_in if n > 1)
    result["most_in_one_trial"] = max(let_in, default=0)
    result["none_let_in"] = sum(1 for n in let_in if n == 0)
    result["other_statuses"] = other
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="names the trials' tenants")
    args = parser.parse_args(argv)
    if not 1 <= args.trials <= 1000 or not 1 <= args.connections <= 256 or not 1 <= args.workers <= 16:
        parser.error("--trials in 1..1000, --connections in 1..256, --workers in 1..16")
    return args


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse())), indent=1))
