"""Balancer CPU per request: the figure docs/operations.md sizes the HPA with (I/O: processes, HTTP).

Starts ``kvlb emulate`` (SGLang replicas with events) and ``kvlb serve`` in front of them on 127.0.0.1,
sends ``--requests`` chat requests (``--concurrency`` at a time; prompts share a few long system
prompts, so cache routing and the index are exercised) and reads the CPU time the balancer process
spent (user + system, from /proc). Prints one JSON report; with ``--explain`` also one
``/admin/explain`` answer. Every child is stopped by its own pid.

    .venv/bin/python deploy/capacity/measure_cpu.py --requests 2000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the emulator's h100-llama3-8b profile
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ready_line(process: subprocess.Popen[str], key: str, timeout_s: float = 120.0) -> dict[str, Any]:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited before printing {key}")
        if line.startswith("{") and key in line:
            data: dict[str, Any] = json.loads(line)
            return data
    raise RuntimeError(f"no {key} line within {timeout_s} s")


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def prompts(count: int, prompt_words: int, systems: int, rng: random.Random) -> list[list[dict[str, str]]]:
    system_texts = [" ".join(rng.choice(WORDS) for _ in range(prompt_words)) for _ in range(systems)]
    return [
        [
            {"role": "system", "content": rng.choice(system_texts)},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(32))},
        ]
        for _ in range(count)
    ]


async def drive(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[int, int]:
    """Send every body; returns (answered 200, failed)."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    counts = [0, 0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    await response.read()
                    counts[0 if response.status == 200 else 1] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts[0], counts[1]


async def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(url + "/readyz") as response:
                if response.status == 200:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError("kvlb did not become ready")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=600, help="words per system prompt")
    parser.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--time-scale", type=float, default=50.0, help="emulator speed-up")
    parser.add_argument("--explain", action="store_true", help="also print one /admin/explain answer")
    return parser.parse_args()


def spawn(argv: list[str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "balancer", *argv]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def write_config(sim: subprocess.Popen[str], folder: Path) -> Path:
    """A kvlb config routing to the fleet ``sim`` printed (SGLang replicas with their events)."""
    fleet = ready_line(sim, '"replicas"')["replicas"]
    replicas = [
        {"id": r["name"], "url": r["url"], "engine": "sglang", "block_size": 16, "events": r["events"][0]}
        for r in fleet
    ]
    config = {
        "listen": {"port": 0},
        "pools": [{"model": MODEL, "replicas": replicas}],
        "log_level": "WARNING",
    }
    path = folder / "kvlb.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """Drive the requests and report the balancer's CPU time per request."""
    chats = prompts(args.requests, args.prompt_words, args.systems, random.Random(0))
    bodies = [{"model": MODEL, "messages": m, "max_tokens": 8} for m in chats]
    asyncio.run(drive(url, bodies[: args.concurrency], args.concurrency))  # warm-up: not counted
    cpu_before, wall_before = cpu_seconds(pid), time.perf_counter()
    ok, failed = asyncio.run(drive(url, bodies, args.concurrency))
    cpu_s, wall_s = cpu_seconds(pid) - cpu_before, time.perf_counter() - wall_before
    report = {
        "requests_ok": ok,
        "requests_failed": failed,
        "concurrency": args.concurrency,
        "replicas": args.replicas,
        "prompt_words": args.prompt_words,
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(ok / wall_s, 1),
        "balancer_cpu_s": round(cpu_s, 2),
        "balancer_cpu_ms_per_request": round(1000 * cpu_s / max(ok, 1), 3),
        "cores_per_100_requests_per_s": round(100 * cpu_s / max(ok, 1), 3),
    }
    if args.explain:
        report["explain"] = asyncio.run(explain(url, bodies[0]))
    return report


def main() -> int:
    args = parse_args()
    sim = spawn(["emulate", "--replicas", str(args.replicas), "--time-scale", str(args.time_scale)])
    serve: subprocess.Popen[str] | None = None
    try:
        with tempfile.TemporaryDirectory() as folder:
            serve = spawn(["serve", "--config", str(write_config(sim, Path(folder)))])
            url = ready_line(serve, '"serving"')["url"]
            asyncio.run(wait_ready(url))
            report = measure(url, serve.pid, args)
        explained = report.pop("explain", None)
        print(json.dumps(report))
        if explained is not None:
            print(json.dumps(explained, indent=2))
        return 0
    finally:
        if serve is not None:
            stop(serve)
        stop(sim)


async def explain(url: str, body: dict[str, Any]) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/admin/explain", json=body) as response,
    ):
        return await response.json()


if __name__ == "__main__":
    raise SystemExit(main())
