"""Kubernetes discovery: engine pods found by a label selector in one namespace (does I/O: HTTP).

Two tasks share the state of the watched objects:

* the **watch loop** lists the EndpointSlices (or pods) once, then watches from the list's
  ``resourceVersion`` with bookmarks. A watch that ends (``watch_timeout_s``) resumes from the last
  version seen; an error retries after an exponential backoff (0.5 s up to ``backoff_max_s``, with
  jitter); "410 Gone" (the version left the server's window) lists again, which also removes every
  replica that vanished meanwhile;
* the **reconcile loop** wakes when the state changed, turns it into replicas
  (:mod:`balancer.discovery.k8s_objects`) and emits the difference. With EndpointSlices it first
  reads the annotations of pods it has not seen (one GET per pod incarnation, 8 at a time). A pod
  whose GET fails keeps its previous replica and is retried after ``retry_s``.

Bursts of watch events coalesce into one reconcile. Objects held are capped at 4 × ``max_replicas``
and at ``max_object_bytes`` of what is kept of them and of the pods' annotations read for a slice's
endpoints (:func:`kept_bytes`); an object over either cap is not kept, nor a pod's annotations over
the bytes (its replica is not added) (``over_cap``, ``over_cap_bytes``:
``kvlb_discovery_objects_over_cap_total{bound}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from balancer.config import DiscoveryConfig
from balancer.discovery.base import Backoff, Discovered, Emit
from balancer.discovery.k8s_objects import (
    Endpoint,
    build_replicas,
    endpoint_from_pod,
    endpoints_from_slices,
    kept_bytes,
    kept_pod,
    kept_slice,
    pod_annotations,
)
from balancer.discovery.kube_api import ApiError, KubeApi, ResourceExpired, ssl_context
from balancer.discovery.publisher import ReplicaPublisher
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

_LOOKUP_CONCURRENCY = 8
_NETWORK_ERRORS = (ApiError, aiohttp.ClientError, TimeoutError, ValueError)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


class KubernetesDiscovery:
    """Watches one namespace's engine EndpointSlices (or pods) and emits replica changes."""

    def __init__(
        self,
        config: DiscoveryConfig,
        *,
        namespace: str,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        rng: random.Random | None = None,
        retry_s: float = 2.0,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self._token_file = token_file
        self._ca_file = ca_file
        self._retry_s = retry_s
        self._backoff = Backoff(0.5, config.backoff_max_s, rng or random.Random())
        self._publisher = ReplicaPublisher("kubernetes", config.max_replicas)
        self._max_objects = 4 * config.max_replicas
        self._objects: dict[str, dict[str, Any]] = {}
        self._sizes: dict[tuple[str, str], int] = {}
        """``("object", name)`` → :func:`kept_bytes` of its kept object, ``("pod", name)`` → of the
        pod's annotations read for a slice's endpoint; they add up to ``_held_bytes``."""
        self._held_bytes = 0
        self._bytes_warned = False
        self._resource_version: str | None = None
        self._dirty = asyncio.Event()
        self._needs_retry = False
        self._annotations: dict[str, tuple[str, dict[str, str]]] = {}
        """Pod name → (pod UID asked for, its annotations): one GET per pod incarnation."""
        self._skipped: dict[str, str] = {}
        self.counters = {
            "lists": 0,
            "watches": 0,
            "expired": 0,
            "errors": 0,
            "events": 0,
            "over_cap": 0,
            "over_cap_bytes": 0,
        }
        self.last_error: str | None = None

    @property
    def collection_path(self) -> str:
        if self.config.resource == "pods":
            return f"/api/v1/namespaces/{self.namespace}/pods"
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def current(self) -> Mapping[ReplicaId, Discovered]:
        return dict(self._publisher.replicas)

    def status(self) -> dict[str, object]:
        status = self._publisher.status()
        status.update(
            namespace=self.namespace,
            resource=self.config.resource,
            label_selector=self.config.label_selector,
            resource_version=self._resource_version,
            skipped=dict(self._skipped),
            last_error=self.last_error,
            object_bytes=self._held_bytes,
            **self.counters,
        )
        return status

    def over_cap(self) -> dict[str, int]:
        """Objects not kept, by the cap that refused them (``kvlb_discovery_objects_over_cap_total``)."""
        return {"count": self.counters["over_cap"], "bytes": self.counters["over_cap_bytes"]}

    async def run(self, emit: Emit) -> None:
        """List, watch and reconcile until cancelled."""
        use_tls = self.config.api_url.startswith("https://")
        connector = aiohttp.TCPConnector(ssl=ssl_context(self._ca_file) if use_tls else False, limit=16)
        async with aiohttp.ClientSession(connector=connector) as session:
            api = KubeApi(
                self.config.api_url,
                session,
                token_file=self._token_file,
                request_timeout_s=self.config.request_timeout_s,
            )
            async with asyncio.TaskGroup() as group:
                group.create_task(self._watch_loop(api), name="kvlb-discovery-watch")
                group.create_task(self._reconcile_loop(api, emit), name="kvlb-discovery-reconcile")

    # ------------------------------------------------------------------------------- watching

    async def _watch_loop(self, api: KubeApi) -> None:
        expired_in_a_row = 0
        while True:
            try:
                if self._resource_version is None:
                    await self._relist(api)
                delivered = await self._watch_once(api)
                expired_in_a_row = 0
            except ResourceExpired as exc:
                self.counters["expired"] += 1
                log.info("kubernetes discovery: %s; listing again", exc)
                self._resource_version = None
                expired_in_a_row += 1
                if expired_in_a_row > 1:
                    await asyncio.sleep(self._backoff.next_delay_s())
                continue
            except _NETWORK_ERRORS as exc:
                self._fail(exc)
                await asyncio.sleep(self._backoff.next_delay_s())
                continue
            if not delivered:  # an empty watch that ends at once must not spin
                await asyncio.sleep(self._backoff.next_delay_s())

    async def _relist(self, api: KubeApi) -> None:
        result = await api.list(self.collection_path, self.config.label_selector)
        items = sorted(result.items, key=_name)
        if len(items) > self._max_objects:
            self.counters["over_cap"] += len(items) - self._max_objects
            log.warning("kubernetes discovery: %d objects match; keeping %d", len(items), self._max_objects)
        for name in self._objects:
            self._held_bytes -= self._sizes.pop(("object", name), 0)
        self._objects = {}
        self._bytes_warned = False  # one line a list, and one a watch (below), while over the cap
        for obj in items[: self._max_objects]:
            self._keep(_name(obj), self._kept(obj))
        self._resource_version = result.resource_version
        self.counters["lists"] += 1
        self._dirty.set()

    async def _watch_once(self, api: KubeApi) -> bool:
        """One watch request; ``True`` if it delivered at least one event."""
        assert self._resource_version is not None
        self.counters["watches"] += 1
        self._bytes_warned = False
        delivered = False
        path, selector = self.collection_path, self.config.label_selector
        async for event in api.watch(path, selector, self._resource_version, self.config.watch_timeout_s):
            delivered = True
            self._backoff.reset()
            self.counters["events"] += 1
            self._apply(event)
        return delivered

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event["object"]
        version = str((obj.get("metadata") or {}).get("resourceVersion", ""))
        if version:
            self._resource_version = version
        name = _name(obj)
        if kind in ("ADDED", "MODIFIED"):
            if name not in self._objects and len(self._objects) >= self._max_objects:
                self.counters["over_cap"] += 1
                return
            self._keep(name, self._kept(obj))
        elif kind == "DELETED":
            self._drop(name)
        else:  # BOOKMARK (only moves the version) or a type we do not know
            return
        self._dirty.set()

    def _keep(self, name: str, kept: dict[str, Any]) -> None:
        """Keep ``kept`` under ``name`` (replacing its previous version) if it fits in
        ``max_object_bytes``; one that does not is not kept, and its previous version goes too (its
        replica is removed rather than left as it was)."""
        if self._fits(("object", name), kept):
            self._objects[name] = kept
        else:
            self._drop(name)

    def _drop(self, name: str) -> None:
        self._objects.pop(name, None)
        self._held_bytes -= self._sizes.pop(("object", name), 0)

    def _fits(self, key: tuple[str, str], kept: object) -> bool:
        """Count ``kept`` under ``key`` (in place of what was counted there) if it fits in
        ``max_object_bytes`` with the rest held; else count it over the cap (``False``)."""
        size = kept_bytes(kept)
        held = self._held_bytes - self._sizes.pop(key, 0)
        if held + size <= self.config.max_object_bytes:
            self._sizes[key] = size
            self._held_bytes = held + size
            return True
        self._held_bytes = held
        self.counters["over_cap_bytes"] += 1
        if not self._bytes_warned:
            self._bytes_warned = True
            log.warning(
                "kubernetes discovery: %s %s (%d B kept) does not fit in discovery.max_object_bytes "
                "(%d B, %d held): not kept (kvlb_discovery_objects_over_cap_total counts the rest)",
                *key,
                size,
                self.config.max_object_bytes,
                held,
            )
        return False

    def _kept(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """What reconciling reads of ``obj`` (:func:`kept_pod`, :func:`kept_slice`): the objects
        kept are small whatever the API server sends."""
        if self.config.resource == "pods":
            return kept_pod(obj, self.config.annotation_prefix)
        return kept_slice(obj)

    def _fail(self, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("kubernetes discovery: %s; retrying", self.last_error)

    # ---------------------------------------------------------------------------- reconciling

    async def _reconcile_loop(self, api: KubeApi, emit: Emit) -> None:
        while True:
            if self._needs_retry:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), self._retry_s)
            else:
                await self._dirty.wait()
            self._dirty.clear()
            await self.reconcile(api, emit)

    async def reconcile(self, api: KubeApi, emit: Emit) -> None:
        """Turn the watched objects into replicas and emit what changed."""
        failed: set[str] = set()
        if self.config.resource == "pods":
            endpoints = [e for e in map(endpoint_from_pod, self._objects.values()) if e is not None]
            prefix = self.config.annotation_prefix
            annotations = {_name(pod): pod_annotations(pod, prefix) for pod in self._objects.values()}
        else:
            endpoints = endpoints_from_slices(self._objects.values())
            annotations, failed = await self._pod_annotations(api, endpoints)
        found, skipped = build_replicas(
            endpoints,
            annotations,
            prefix=self.config.annotation_prefix,
            default_model=self.config.default_model,
        )
        for pod in failed:  # keep what we had until the pod can be read again
            previous = self._publisher.replicas.get(ReplicaId(pod))
            if previous is not None:
                found[ReplicaId(pod)] = previous
        self._needs_retry = bool(failed)
        if skipped != self._skipped:
            for pod, reason in sorted(skipped.items()):
                if self._skipped.get(pod) != reason:
                    log.warning("kubernetes discovery: pod %s skipped: %s", pod, reason)
            self._skipped = skipped
        await self._publisher.publish(found, emit)

    async def _pod_annotations(
        self, api: KubeApi, endpoints: list[Endpoint]
    ) -> tuple[dict[str, dict[str, str]], set[str]]:
        """Annotations of every endpoint's pod (cached per UID) and the pods whose GET failed."""
        wanted = {e.pod: e.pod_uid for e in endpoints}
        for name in [n for n in self._annotations if n not in wanted]:
            del self._annotations[name]
            self._held_bytes -= self._sizes.pop(("pod", name), 0)
        missing = [
            n for n, uid in wanted.items() if n not in self._annotations or self._annotations[n][0] != uid
        ]
        gate = asyncio.Semaphore(_LOOKUP_CONCURRENCY)

        async def fetch(name: str) -> dict[str, Any] | None:
            async with gate:
                return await api.get(f"/api/v1/namespaces/{self.namespace}/pods/{name}")

        results = await asyncio.gather(*(fetch(n) for n in missing), return_exceptions=True)
        failed: set[str] = set()
        for name, result in zip(missing, results, strict=True):
            if isinstance(result, _NETWORK_ERRORS):
                failed.add(name)
                self._fail(result)
            elif isinstance(result, BaseException):
                raise result
            elif result is not None:  # None: the pod is gone and the slice will follow
                kept = pod_annotations(result, self.config.annotation_prefix)
                if self._fits(("pod", name), kept):
                    self._annotations[name] = (wanted[name], kept)
                else:  # not added (its annotations unknown), asked again at the next change
                    self._annotations.pop(name, None)
        known = {name: entry[1] for name, entry in self._annotations.items() if name in wanted}
        return known, failed
