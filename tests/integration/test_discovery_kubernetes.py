"""Kubernetes discovery against a fake API server on 127.0.0.1 (real HTTP, EndpointSlice JSON, watches)."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from fake_kube_api import NAMESPACE, PODS, SLICES, TOKEN, FakeKubeApi, fixture, serving
from prometheus_client import generate_latest

from balancer.config import DiscoveryConfig
from balancer.discovery import DiscoveryEvent, KubernetesDiscovery, ReplicaAdded, ReplicaRemoved
from balancer.metrics import Metrics
from balancer.types import ReplicaId

SLICE = "sglang-engines-x7k2p"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def make_pod(name: str, uid: str, ip: str, **annotations: str) -> dict[str, Any]:
    pod = fixture("pod-sglang-0.json")
    pod["metadata"].update(name=name, uid=uid)
    pod["metadata"]["annotations"].update(
        {f"kvlb.io/{k.replace('_', '-')}": v for k, v in annotations.items()}
    )
    if annotations.get("engine") == "trtllm":
        del pod["metadata"]["annotations"]["kvlb.io/block-size"]  # TRT-LLM's default applies: 32
    pod["status"]["podIP"] = ip
    pod["status"]["podIPs"] = [{"ip": ip}]
    return pod


def make_slice(*endpoints: tuple[str, str, str], terminating: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fixture slice with endpoints ``(pod, uid, ip)``; pods in ``terminating`` are terminating."""
    slice_obj = fixture("endpointslice-sglang.json")
    template = slice_obj["endpoints"][0]
    slice_obj["endpoints"] = []
    for pod, uid, ip in endpoints:
        endpoint = copy.deepcopy(template)
        endpoint["addresses"] = [ip]
        endpoint["hostname"] = pod
        endpoint["targetRef"].update(name=pod, uid=uid)
        if pod in terminating:
            endpoint["conditions"] = {"ready": False, "serving": True, "terminating": True}
        slice_obj["endpoints"].append(endpoint)
    return slice_obj


class Recorder:
    """The application's hook, as a test sees it: every event, in order."""

    def __init__(self) -> None:
        self.events: list[DiscoveryEvent] = []
        self._changed = asyncio.Event()

    async def __call__(self, event: DiscoveryEvent) -> None:
        self.events.append(event)
        self._changed.set()

    async def wait(self, what: str, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
        async def loop() -> None:
            while not done():
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(loop(), timeout_s)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; events: {self.events}") from None

    async def count(self, n: int) -> list[DiscoveryEvent]:
        await self.wait(f"{n} events", lambda: len(self.events) >= n)
        return self.events[:n]


async def until(what: str, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubeApi]:
    async with serving(FakeKubeApi()) as api:
        yield api


def write_token(path: Path, token: str) -> None:
    path.write_text(token + "\n")


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    write_token(path, TOKEN)
    return path


def start(
    kube: FakeKubeApi, token_file: Path, recorder: Recorder, **overrides: Any
) -> tuple[KubernetesDiscovery, asyncio.Task[None]]:
    settings: dict[str, Any] = {
        "kind": "kubernetes",
        "namespace": NAMESPACE,
        "api_url": kube.url,
        "backoff_max_s": 0.2,
        "watch_timeout_s": 30.0,
        **overrides,
    }
    config = DiscoveryConfig(**settings)
    discovery = KubernetesDiscovery(
        config, namespace=NAMESPACE, token_file=token_file, rng=random.Random(7), retry_s=0.1
    )
    return discovery, asyncio.create_task(discovery.run(recorder))


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def seed_two_engines(kube: FakeKubeApi) -> None:
    kube.put(PODS, make_pod("sglang-0", "uid-0", "10.244.1.17"))
    kube.put(PODS, make_pod("sglang-1", "uid-1", "10.244.2.23", dp_size="2"))
    kube.put(SLICES, make_slice(("sglang-0", "uid-0", "10.244.1.17"), ("sglang-1", "uid-1", "10.244.2.23")))


async def test_initial_list_adds_annotated_engines(kube: FakeKubeApi, token_file: Path) -> None:
    seed_two_engines(kube)
    kube.put(PODS, make_pod("stray-0", "uid-9", "10.244.3.3", engine="tgi"))
    slice_obj = make_slice(("stray-0", "uid-9", "10.244.3.3"))
    slice_obj["metadata"]["name"] = "sglang-engines-zzzzz"
    kube.put(SLICES, slice_obj)
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder)
    try:
        events = await recorder.count(2)
        assert all(isinstance(e, ReplicaAdded) for e in events)
        added = {e.replica.id: e for e in events if isinstance(e, ReplicaAdded)}
        assert sorted(added) == ["sglang-0", "sglang-1"]
        first = added["sglang-0"]
        assert first.pool_model == MODEL
        assert first.replica.url == "http://10.244.1.17:30000"
        assert first.replica.events == "tcp://10.244.1.17:5557"
        assert first.replica.replay == "tcp://10.244.1.17:5558"
        assert (first.replica.engine, first.replica.block_size, first.replica.dp_size) == ("sglang", 16, 1)
        assert added["sglang-1"].replica.dp_size == 2
        # A not-ready endpoint stays: readiness is kvlb's own health probe's business.
        await until("the stray pod's skip reason", lambda: "stray-0" in discovery.status()["skipped"])  # type: ignore[operator]
        assert "engine" in discovery.status()["skipped"]["stray-0"]  # type: ignore[index]
        list_params = next(q for p, q in kube.requests if p.endswith(SLICES) and not q.get("watch"))
        assert list_params["labelSelector"] == "kvlb.io/role=engine"
    finally:
        await stop(task)


async def test_watch_adds_removes_and_replaces_replicas(kube: FakeKubeApi, token_file: Path) -> None:
    seed_two_engines(kube)
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder)
    try:
        await recorder.count(2)
        # scale up: a third pod joins the slice
        kube.put(PODS, make_pod("sglang-2", "uid-2", "10.244.4.4"))
        kube.put(
            SLICES,
            make_slice(
                ("sglang-0", "uid-0", "10.244.1.17"),
                ("sglang-1", "uid-1", "10.244.2.23"),
                ("sglang-2", "uid-2", "10.244.4.4"),
            ),
        )
        events = await recorder.count(3)
        assert isinstance(events[2], ReplicaAdded) and events[2].replica.id == "sglang-2"
        # scale down: sglang-2 terminates, then leaves
        kube.put(
            SLICES,
            make_slice(
                ("sglang-0", "uid-0", "10.244.1.17"),
                ("sglang-1", "uid-1", "10.244.2.23"),
                ("sglang-2", "uid-2", "10.244.4.4"),
                terminating=("sglang-2",),
            ),
        )
        events = await recorder.count(4)
        assert events[3] == ReplicaRemoved(MODEL, "sglang-2", "gone")  # type: ignore[arg-type]
        # sglang-1 is recreated: new UID and IP → removed ("changed") then added at its new address
        kube.delete(PODS, "sglang-1")
        kube.put(PODS, make_pod("sglang-1", "uid-1b", "10.244.5.5"))
        kube.put(
            SLICES, make_slice(("sglang-0", "uid-0", "10.244.1.17"), ("sglang-1", "uid-1b", "10.244.5.5"))
        )
        events = await recorder.count(6)
        assert events[4] == ReplicaRemoved(MODEL, "sglang-1", "changed")  # type: ignore[arg-type]
        assert isinstance(events[5], ReplicaAdded) and events[5].replica.url == "http://10.244.5.5:30000"
        # the Service goes away: its slice is deleted and every replica with it
        kube.delete(SLICES, SLICE)
        events = await recorder.count(8)
        assert {e.replica_id for e in events[6:] if isinstance(e, ReplicaRemoved)} == {"sglang-0", "sglang-1"}
        assert discovery.current() == {}
    finally:
        await stop(task)


async def test_bookmarks_and_watch_ends_resume_from_the_last_version(
    kube: FakeKubeApi, token_file: Path
) -> None:
    seed_two_engines(kube)
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder)
    try:
        await recorder.count(2)
        await until("a watch", lambda: bool(kube.watches))
        assert kube.watches[0].bookmarks
        version = kube.bookmark()
        await until("the bookmark", lambda: discovery.status()["resource_version"] == str(version))
        kube.end_watches()  # as at timeoutSeconds
        await until("a second watch", lambda: len(kube.watch_versions()) >= 2)
        assert kube.watch_versions()[1] == str(version)
        kube.fail_next("/apis/", 500, times=2)  # the next watches fail: back off, same version
        kube.end_watches()
        await until(
            "a watch after the failures", lambda: len(kube.watch_versions()) >= 5 and bool(kube.watches)
        )
        assert kube.watch_versions()[-1] == str(version)
        assert discovery.status()["errors"] == 2
        assert discovery.status()["lists"] == 1  # no relist was needed
        assert len(recorder.events) == 2  # and nothing was emitted twice
    finally:
        await stop(task)


async def test_expired_version_relists_and_removes_what_vanished(kube: FakeKubeApi, token_file: Path) -> None:
    seed_two_engines(kube)
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder)
    try:
        await recorder.count(2)
        await until("a watch", lambda: bool(kube.watches))
        kube.fail_next("/apis/", 503, times=1000)  # the API server is unreachable for a while ...
        kube.end_watches()
        await until("failed watches", lambda: discovery.status()["errors"] >= 2)  # type: ignore[operator]
        kube.put(SLICES, make_slice(("sglang-0", "uid-0", "10.244.1.17")))  # ... sglang-1 leaves ...
        kube.compact()  # ... and the history is compacted away
        kube.failures.clear()
        events = await recorder.count(3)
        assert events[2] == ReplicaRemoved(MODEL, "sglang-1", "gone")  # type: ignore[arg-type]
        status = discovery.status()
        assert status["expired"] == 1 and status["lists"] == 2
        # a 410 ERROR event on an open watch relists as well
        await until("a watch", lambda: bool(kube.watches))
        kube.expire_watches()
        await until("a third list", lambda: discovery.status()["lists"] == 3)
        assert len(recorder.events) == 3
    finally:
        await stop(task)


async def test_failed_pod_lookup_is_retried(kube: FakeKubeApi, token_file: Path) -> None:
    kube.put(PODS, make_pod("sglang-0", "uid-0", "10.244.1.17"))
    kube.put(SLICES, make_slice(("sglang-0", "uid-0", "10.244.1.17")))
    kube.fail_next(f"/api/v1/namespaces/{NAMESPACE}/pods/sglang-0", 500, times=2)
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder)
    try:
        events = await recorder.count(1)
        assert isinstance(events[0], ReplicaAdded) and events[0].replica.id == "sglang-0"
        pod_gets = [p for p, _ in kube.requests if p.endswith("/pods/sglang-0")]
        assert len(pod_gets) == 3
        assert discovery.status()["errors"] == 2
    finally:
        await stop(task)


async def test_pods_mode_follows_phase_and_deletion(kube: FakeKubeApi, token_file: Path) -> None:
    kube.put(PODS, make_pod("trt-0", "uid-t0", "10.244.6.6", engine="trtllm", port="8000"))
    pending = make_pod("trt-1", "uid-t1", "10.244.7.7", engine="trtllm")
    pending["status"]["phase"] = "Pending"
    kube.put(PODS, pending)
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder, resource="pods")
    try:
        events = await recorder.count(1)
        assert isinstance(events[0], ReplicaAdded)
        assert (events[0].replica.id, events[0].replica.url) == ("trt-0", "http://10.244.6.6:8000")
        assert (events[0].replica.engine, events[0].replica.block_size) == ("trtllm", 32)
        running = make_pod("trt-1", "uid-t1", "10.244.7.7", engine="trtllm")
        kube.put(PODS, running)  # Running now: added with the container's http port
        events = await recorder.count(2)
        assert isinstance(events[1], ReplicaAdded) and events[1].replica.url == "http://10.244.7.7:30000"
        terminating = copy.deepcopy(kube.objects[PODS]["trt-0"])
        terminating["metadata"]["deletionTimestamp"] = "2026-10-01T13:00:00Z"
        kube.put(PODS, terminating)
        events = await recorder.count(3)
        assert events[2] == ReplicaRemoved(MODEL, "trt-0", "gone")  # type: ignore[arg-type]
        assert sorted(discovery.current()) == ["trt-1"]
    finally:
        await stop(task)


async def test_rotated_token_is_read_again(kube: FakeKubeApi, token_file: Path) -> None:
    seed_two_engines(kube)
    write_token(token_file, "stale-token")
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder)
    try:
        await until("a refused list", lambda: discovery.status()["errors"] >= 1)  # type: ignore[operator]
        assert "401" in str(discovery.status()["last_error"])
        write_token(token_file, TOKEN)  # the kubelet rotates the projected token
        await recorder.count(2)
    finally:
        await stop(task)


async def test_wrong_namespace_is_an_error_not_an_empty_set(kube: FakeKubeApi, token_file: Path) -> None:
    seed_two_engines(kube)
    recorder = Recorder()
    config = DiscoveryConfig(kind="kubernetes", api_url=kube.url, backoff_max_s=0.05)
    discovery = KubernetesDiscovery(config, namespace="other", token_file=token_file, rng=random.Random(1))
    task = asyncio.create_task(discovery.run(recorder))
    try:
        await until("errors", lambda: discovery.status()["errors"] >= 2)  # type: ignore[operator]
        assert "403" in str(discovery.status()["last_error"])
        assert recorder.events == []
    finally:
        await stop(task)


def _padded(pod: dict[str, Any], pad_bytes: int) -> dict[str, Any]:
    """``pod`` with what a real pod carries and kvlb does not read: managed fields, environment,
    other annotations, container statuses (``pad_bytes`` of strings in all)."""
    pod = copy.deepcopy(pod)
    each = pad_bytes // 4
    pod["metadata"]["managedFields"] = [{"manager": "kubelet", "fieldsV1": {"f:status": "x" * each}}]
    pod["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "y" * each
    pod["spec"]["containers"][0]["env"] = [
        {"name": f"VAR_{n}", "value": "z" * (each // 64)} for n in range(64)
    ]
    pod["status"]["containerStatuses"] = [{"name": "sglang", "message": "w" * each}]
    return pod


async def test_discovery_keeps_only_what_it_reads_of_each_object(kube: FakeKubeApi, token_file: Path) -> None:
    """The objects discovery keeps (up to 4 × ``max_replicas``) were whole: a pod's managed fields,
    environment, statuses and other annotations, several times their JSON once parsed. Now only the
    fields it reads are kept (2026-12-01, branch h-membytes), with the same replicas found."""
    pad = 256 * 1024
    for number in range(4):
        pod = make_pod(f"sglang-{number}", f"uid-{number}", f"10.244.1.{number + 1}")
        kube.put(PODS, _padded(pod, pad))
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder, resource="pods")
    try:
        await recorder.count(4)
        assert sorted(discovery.current()) == [f"sglang-{n}" for n in range(4)]
        added = {e.replica.id: e.replica for e in recorder.events if isinstance(e, ReplicaAdded)}
        assert added["sglang-2"].url == "http://10.244.1.3:30000" and added["sglang-2"].replay is not None
        kept = discovery._objects["sglang-1"]
        assert len(json.dumps(kept)) < 2048, kept  # of a pod of over 256 KiB
        assert set(kept["metadata"]["annotations"]) == {
            k for k in make_pod("x", "u", "10.0.0.1")["metadata"]["annotations"] if k.startswith("kvlb.io/")
        }
        padded = make_pod("sglang-1", "uid-1b", "10.244.9.9")
        kube.put(PODS, _padded(padded, pad))  # a watch event: kept small too
        await recorder.wait(
            "sglang-1 replaced", lambda: discovery.current()[ReplicaId("sglang-1")].instance == "uid-1b"
        )
        assert len(json.dumps(discovery._objects["sglang-1"])) < 2048
    finally:
        await stop(task)


def _annotated(name: str, uid: str, ip: str, annotation_bytes: int) -> dict[str, Any]:
    """A pod whose ``kvlb.io/`` annotations (which discovery keeps) hold ``annotation_bytes``."""
    pod = make_pod(name, uid, ip)
    pod["metadata"]["annotations"].update(
        {f"kvlb.io/extra-{n}": "x" * 1000 for n in range(annotation_bytes // 1000)}
    )
    return pod


async def test_kept_objects_are_bounded_in_bytes_and_both_caps_are_exported(
    kube: FakeKubeApi, token_file: Path
) -> None:
    """``discovery.max_object_bytes`` bounds what discovery keeps (by ``kept_bytes``): an object
    that does not fit is not kept and its replica not added, or removed when a watch event makes it
    too big; ``kvlb_discovery_objects_over_cap_total{bound}`` counts those refused for bytes and for
    the count cap (4 × ``max_replicas``), which was only in the discovery's status."""
    for number in range(3):
        kube.put(PODS, make_pod(f"sglang-{number}", f"uid-{number}", f"10.244.1.{number + 1}"))
    kube.put(PODS, _annotated("sglang-big", "uid-big", "10.244.1.9", 80_000))
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder, resource="pods", max_object_bytes=64 * 1024)
    metrics = Metrics.create()
    metrics.discovery_over_cap.source = discovery.over_cap
    sample = metrics.registry.get_sample_value
    try:
        await recorder.count(3)
        assert sorted(discovery.current()) == [f"sglang-{n}" for n in range(3)]
        assert sample("kvlb_discovery_objects_over_cap_total", {"bound": "bytes"}) == 1
        assert sample("kvlb_discovery_objects_over_cap_total", {"bound": "count"}) == 0
        held = discovery.status()["object_bytes"]
        assert isinstance(held, int) and 3 * 2_000 < held <= 64 * 1024
        kube.put(PODS, _annotated("sglang-1", "uid-1", "10.244.1.2", 62_000))  # grows past the cap
        events = await recorder.count(4)
        assert events[3] == ReplicaRemoved(MODEL, "sglang-1", "gone")  # type: ignore[arg-type]
        assert sample("kvlb_discovery_objects_over_cap_total", {"bound": "bytes"}) == 2
        kube.put(PODS, make_pod("sglang-1", "uid-1", "10.244.1.2"))  # small again: kept
        await recorder.wait("sglang-1 back", lambda: ReplicaId("sglang-1") in discovery.current())
        assert discovery.status()["object_bytes"] == held
    finally:
        await stop(task)
    kube.objects[PODS].clear()
    for number in range(6):
        kube.put(PODS, make_pod(f"p-{number}", f"uid-p{number}", f"10.244.2.{number + 1}"))
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder, resource="pods", max_replicas=1)
    metrics = Metrics.create()
    metrics.discovery_over_cap.source = discovery.over_cap
    try:
        await recorder.count(1)
        await until("a list", lambda: discovery.status()["lists"] == 1)
        scraped = generate_latest(metrics.registry).decode()
        assert 'kvlb_discovery_objects_over_cap_total{bound="count"} 2.0' in scraped  # 6 for 4 kept
    finally:
        await stop(task)


async def test_pod_annotations_read_for_slices_count_in_the_byte_cap(
    kube: FakeKubeApi, token_file: Path
) -> None:
    """With EndpointSlices, discovery reads each endpoint's pod once and keeps its ``kvlb.io/``
    annotations: those count in ``discovery.max_object_bytes`` too. A pod whose annotations do not
    fit is not added (counted under ``bound="bytes"``); the same pod, recreated small, is."""
    kube.put(PODS, make_pod("sglang-0", "uid-0", "10.244.1.17"))
    kube.put(PODS, _annotated("sglang-1", "uid-1", "10.244.2.23", 80_000))
    kube.put(SLICES, make_slice(("sglang-0", "uid-0", "10.244.1.17"), ("sglang-1", "uid-1", "10.244.2.23")))
    recorder = Recorder()
    discovery, task = start(kube, token_file, recorder, max_object_bytes=64 * 1024)
    try:
        await recorder.count(1)
        await until("the big pod refused", lambda: discovery.over_cap()["bytes"] >= 1)
        assert sorted(discovery.current()) == ["sglang-0"]
        held = discovery.status()["object_bytes"]
        assert isinstance(held, int) and held < 16 * 1024  # the slice and one pod's annotations
        kube.put(PODS, make_pod("sglang-1", "uid-1b", "10.244.2.23"))  # recreated small
        kube.put(
            SLICES, make_slice(("sglang-0", "uid-0", "10.244.1.17"), ("sglang-1", "uid-1b", "10.244.2.23"))
        )
        await recorder.wait("sglang-1 added", lambda: ReplicaId("sglang-1") in discovery.current())
        assert discovery.over_cap()["count"] == 0
    finally:
        await stop(task)
