"""A request body sent in one-byte HTTP chunks against a real ``kvlb serve``, and what it does to
everyone else: ``/healthz``'s latency, asked every 5 ms from another thread meanwhile (I/O; a
measuring tool, not a test).

aiohttp parses each chunk with a Python call on kvlb's event loop before kvlb reads the body, so one
such body held the loop for seconds (the adversarial run of 2026-11-30); ``limits.max_body_chunks``
refuses it once kvlb has read that many chunks, and closes the connection. Run it from each tree of
an A/B::

    PYTHONPATH=$PWD python -m loadtests.chunk_flood [--body-kib 1024] [--runs 2] [--set NAME=VALUE ...]

It starts ``python -m balancer serve`` on a free 127.0.0.1 port (no pool: the body is read whole
before its model is looked up) and prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def exchange(port: int, data: bytes, timeout_s: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def one_run(port: int, body_bytes: int) -> dict[str, Any]:
    body = json.dumps({"model": "none", "prompt": "x" * body_bytes}).encode()
    chunked = b"".join(b"1\r\n" + body[i : i + 1] + b"\r\n" for i in range(len(body))) + b"0\r\n\r\n"
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.monotonic()
            exchange(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", 10)
            latencies.append(time.monotonic() - started)
            time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    started = time.monotonic()
    try:
        answer = exchange(port, HEAD + chunked)
    except OSError as exc:  # the connection closed while the body was still being sent
        answer = f"<{type(exc).__name__}>".encode()
    answered_s = time.monotonic() - started
    time.sleep(0.2)
    stop.set()
    prober.join()
    latencies.sort()
    return {
        "chunks": len(body),
        "status": answer.split(b"\r\n", 1)[0].decode(errors="replace"),
        "answered_s": round(answered_s, 3),
        "healthz_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "healthz_max_ms": round(latencies[-1] * 1000, 1),
        "healthz_probes": len(latencies),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.chunk_flood", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--body-kib", type=int, default=1024, help="body size, KiB (default 1024)")
    parser.add_argument("--runs", type=int, default=2, help="bodies sent one after another (default 2)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a kvlb setting")
    args = parser.parse_args(argv)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "balancer", "serve", "--workers", "1", "--set", f"listen.port={port}",
         "--set", "limits.max_body_bytes=8388608", "--log-level", "warning",
         *(arg for item in args.set for arg in ("--set", item))],
        env={**os.environ}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        runs = [one_run(port, args.body_kib * 1024) for _ in range(max(1, args.runs))]
    finally:
        server.terminate()
        server.wait(10)
    print(json.dumps({"runs": runs}, indent=2))
    print("| run | chunks | status | answered s | /healthz p50 ms | /healthz max ms |")
    print("|---|---|---|---|---|---|")
    for i, run in enumerate(runs, 1):
        print(
            f"| {i} | {run['chunks']} | {run['status']} | {run['answered_s']} | {run['healthz_p50_ms']} "
            f"| {run['healthz_max_ms']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
