"""``kvlb serve`` imports only what its configuration uses: an embedded start (no ``redis.url``, no
``listen.grpc_port``, static discovery) imports neither the Redis client nor gRPC nor the Kubernetes
discovery (31–36 ms, 14–18 ms and about 15 ms of every start before 2026-12-01); a start with a gRPC
port still imports and serves it; a start with file discovery does not import the Kubernetes one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = """
import asyncio, json, sys
from balancer.app import Balancer
from balancer.config import Settings, from_mapping
from balancer.tokenizer.tokenizer import TokenIdTokenizer

HEAVY = (
    "redis", "grpc", "grpc_health", "grpc_reflection", "balancer.fleet.runtime",
    "balancer.discovery.kubernetes",
)


async def main() -> None:
    loaded = {"imported": sorted(m for m in HEAVY if m in sys.modules)}
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": "m", "replicas": [{"id": "r0", "url": "http://127.0.0.1:9", "engine": "vllm"}]}],
        "health_interval_s": 0.1,
        "scrape_interval_s": 0,
    }
    if sys.argv[1] == "grpc":
        tree["listen"]["grpc_port"] = 0
    if sys.argv[1] == "file":  # a discovery, not Kubernetes's
        tree["discovery"] = {"kind": "file", "file": sys.argv[2], "reload_interval_s": 0.2}
    balancer = Balancer(from_mapping(Settings, tree).validate(), tokenizers={"m": TokenIdTokenizer()})
    await balancer.start()
    try:
        loaded["started"] = sorted(m for m in HEAVY if m in sys.modules)
        loaded["grpc_port"] = balancer.grpc_port is not None
        if sys.argv[1] == "file":
            loaded["over_cap"] = dict(balancer.metrics.discovery_over_cap.source())
    finally:
        await balancer.stop()
    print(json.dumps(loaded))


asyncio.run(main())
"""


def _probe(mode: str, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_an_embedded_static_start_imports_neither_redis_nor_grpc_nor_kubernetes() -> None:
    assert _probe("embedded") == {"imported": [], "started": [], "grpc_port": False}


def test_a_configured_grpc_port_still_imports_and_serves_grpc() -> None:
    result = _probe("grpc")
    assert result["imported"] == []  # importing balancer.app loads neither
    assert result["started"] == ["grpc", "grpc_health", "grpc_reflection"] and result["grpc_port"] is True


def test_a_file_discovery_start_does_not_import_kubernetes(tmp_path: Path) -> None:
    """The app asks the discovery itself for its caps (``Discovery.over_cap``), not whether it is
    Kubernetes's: before h-zmqparts (2026-12-01) any configured discovery imported the Kubernetes module."""
    replica_file = tmp_path / "replicas.yaml"
    replica_file.write_text("pools: []\n", "utf-8")
    result = _probe("file", str(replica_file))
    assert result["imported"] == []
    assert result["started"] == []  # the Kubernetes discovery stays unimported
    assert result["over_cap"] == {}  # a file keeps no objects: the family has no samples, as before
