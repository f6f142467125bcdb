"""File discovery: reloads on change, keeps the last good set, and feeds a real index through the hook."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from balancer.config import ReplicaConfig
from balancer.discovery import DiscoveryEvent, FileDiscovery, ReplicaAdded, ReplicaRemoved
from balancer.engines.registry import engine_spec
from balancer.events import Stored
from balancer.index.hashing import pack_tokens
from balancer.index.memory import MemoryIndex
from balancer.metrics import Metrics
from balancer.routing.router import PoolRouter
from balancer.sources.pipeline import EventIngest
from balancer.types import EngineHash, ReplicaId

TWO = """
pools:
  - model: m1
    replicas:
      - {id: a, url: "http://127.0.0.1:30000", engine: sglang, events: "tcp://127.0.0.1:5557"}
      - {id: b, url: "http://127.0.0.1:30001", engine: trtllm, block_size: 32}
"""


class Recorder:
    def __init__(self) -> None:
        self.events: list[DiscoveryEvent] = []

    async def __call__(self, event: DiscoveryEvent) -> None:
        self.events.append(event)


def write(path: Path, text: str) -> None:
    """Write ``text`` so that the signature surely changes, even on a coarse-mtime file system."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


async def test_reload_emits_adds_changes_and_removals(tmp_path: Path) -> None:
    path = tmp_path / "replicas.yaml"
    write(path, TWO)
    discovery = FileDiscovery(path, reload_interval_s=0.05)
    recorder = Recorder()
    assert await discovery.check(recorder)
    assert [(type(e).__name__, getattr(e, "pool_model", "")) for e in recorder.events] == [
        ("ReplicaAdded", "m1"),
        ("ReplicaAdded", "m1"),
    ]
    assert not await discovery.check(recorder)  # unchanged file: not even read
    write(path, TWO.replace("30001", "30011").replace("\n      - {id: a,", "\n      - {id: c,"))
    assert await discovery.check(recorder)
    assert recorder.events[2:] == [
        ReplicaRemoved("m1", ReplicaId("a"), "gone"),
        ReplicaRemoved("m1", ReplicaId("b"), "changed"),
        ReplicaAdded("m1", ReplicaConfig("b", "http://127.0.0.1:30011", "trtllm", block_size=32)),
        ReplicaAdded(
            "m1", ReplicaConfig("c", "http://127.0.0.1:30000", "sglang", events="tcp://127.0.0.1:5557")
        ),
    ]
    write(path, "pools: []\n")
    assert await discovery.check(recorder)
    assert {e.replica_id for e in recorder.events[6:] if isinstance(e, ReplicaRemoved)} == {"b", "c"}
    assert discovery.current() == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pools: [unclosed\n", "not valid YAML"),
        ("", "is empty"),  # truncated by a writer that has not written yet: not "no replicas"
        ("# replicas follow\n\n", "is empty"),
        ("replicas: []\n", "one key, pools"),
        ("pools: [{model: m1, replicas: [{id: a, url: 'ftp://x'}]}]\n", "url must be http"),
        ("pools: [{model: m1, replicas: [{id: a, url: 'http://x', dp_size: 0}]}]\n", "dp_size"),
        ("pools: [{model: m1, tokenizer: t, replicas: []}]\n", "model and replicas only"),
        ("pools: [{model: m1, replicas: [{id: a, url: 'http://x', api_key_env: K}]}]\n", "names no API key"),
    ],
)
async def test_a_bad_file_keeps_the_last_good_set(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "replicas.yaml"
    write(path, TWO)
    discovery = FileDiscovery(path)
    recorder = Recorder()
    await discovery.check(recorder)
    write(path, text)
    assert not await discovery.check(recorder)
    assert len(recorder.events) == 2 and sorted(discovery.current()) == ["a", "b"]
    assert message in str(discovery.status()["last_error"])
    path.unlink()
    assert not await discovery.check(recorder)
    assert "cannot stat" in str(discovery.status()["last_error"])
    write(path, TWO)
    assert await discovery.check(recorder)
    assert len(recorder.events) == 2  # same replicas as before the bad versions: nothing to emit
    assert discovery.status()["last_error"] is None


async def test_configmap_style_symlink_swap_is_seen(tmp_path: Path) -> None:
    """A ConfigMap volume swaps the ``..data`` symlink; size and mtime may even be equal."""
    first, second = tmp_path / "v1", tmp_path / "v2"
    first.mkdir()
    second.mkdir()
    (first / "replicas.yaml").write_text(TWO)
    (second / "replicas.yaml").write_text(TWO.replace("30001", "30009"))
    stat = (first / "replicas.yaml").stat()
    os.utime(second / "replicas.yaml", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    data = tmp_path / "..data"
    data.symlink_to(first)
    discovery = FileDiscovery(data / "replicas.yaml")
    recorder = Recorder()
    await discovery.check(recorder)
    swap = tmp_path / "..data_tmp"
    swap.symlink_to(second)
    swap.replace(data)
    assert await discovery.check(recorder)
    assert isinstance(recorder.events[-1], ReplicaAdded) and recorder.events[-1].replica.url.endswith(
        ":30009"
    )


async def test_run_polls_and_caps_the_replica_count(tmp_path: Path) -> None:
    path = tmp_path / "replicas.yaml"
    write(path, "pools: []\n")
    discovery = FileDiscovery(path, reload_interval_s=0.02, max_replicas=1)
    recorder = Recorder()
    task = asyncio.create_task(discovery.run(recorder))
    try:
        await asyncio.sleep(0.05)
        write(path, TWO)
        for _ in range(200):
            if recorder.events:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert [e.replica.id for e in recorder.events if isinstance(e, ReplicaAdded)] == ["a"]
        assert discovery.status()["skipped_over_cap"] == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_hook_drops_a_removed_replicas_blocks_from_the_index(tmp_path: Path) -> None:
    """The application's hook, reduced to routing and ingest: a removal empties the replica's blocks."""
    router = PoolRouter("m1")
    ingests: dict[int, EventIngest] = {}
    metrics = Metrics.create()

    async def hook(event: DiscoveryEvent) -> None:
        if isinstance(event, ReplicaAdded):
            replica = ReplicaId(event.replica.id)
            alignment = engine_spec(event.replica.engine).alignment()
            space = router.add_replica(replica, event.replica.block_size, alignment)
            ingest = ingests.setdefault(
                id(space), EventIngest(MemoryIndex.over(space.table), metrics=metrics)
            )
            ingest.add_replica(replica, event.replica.engine, sources=())
        else:
            space = router.space_of[event.replica_id]
            await ingests[id(space)].remove_replica(event.replica_id)  # drops its blocks
            router.remove_replica(event.replica_id)

    path = tmp_path / "replicas.yaml"
    write(path, TWO)
    discovery = FileDiscovery(path)
    await discovery.check(hook)
    table = router.space_of[ReplicaId("a")].table
    tokens = pack_tokens(range(64))
    stored = Stored(0, None, tuple(EngineHash(h) for h in (11, 12, 13, 14)), tokens, 16)
    table.apply(ReplicaId("a"), [stored], 0.0)
    assert table.stats().blocks_by_replica.get(ReplicaId("a")) == 4
    write(
        path,
        TWO.replace(
            '      - {id: a, url: "http://127.0.0.1:30000", engine: sglang, events: "tcp://127.0.0.1:5557"}\n',
            "",
        ),
    )
    assert await discovery.check(hook)
    assert table.stats().blocks_by_replica.get(ReplicaId("a"), 0) == 0
    assert ReplicaId("a") not in router.space_of
    for ingest in ingests.values():
        await ingest.aclose()
