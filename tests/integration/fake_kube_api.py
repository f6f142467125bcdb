"""A fake Kubernetes API server on 127.0.0.1 for discovery tests (aiohttp, real HTTP and JSON).

It serves what kvlb's discovery uses, with the API server's observable behaviour:

* ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`` and ``/api/v1/namespaces/{ns}/pods``:
  lists (``limit``/``continue`` pages, equality label selectors) and, with ``watch=1``, streams of
  newline-delimited watch events from ``resourceVersion`` (history replayed first), ``BOOKMARK`` events
  when asked, and the real "410 Expired" ``ERROR`` event for a version older than the compacted window;
* ``GET /api/v1/namespaces/{ns}/pods/{name}``, with a ``Status`` 404 for a missing pod;
* a bearer token check (401) and another namespace answered with 403, as RBAC would.

Tests drive it: :meth:`put` / :meth:`delete` change objects (bumping the resourceVersion and
notifying open watches), :meth:`compact` forgets history, :meth:`end_watches` closes the streams,
:meth:`fail_next` makes the next requests to a path prefix answer an error.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "k8s"
NAMESPACE = "inference"
TOKEN = "fake-token-1"
SLICES = "endpointslices"
PODS = "pods"


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a`` (exists), comma-joined."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class _Watch:
    resource: str
    selector: str
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=lambda: asyncio.Queue(1000))


class FakeKubeApi:
    """State and handlers of the fake API server."""

    def __init__(self, namespace: str = NAMESPACE, token: str | None = TOKEN) -> None:
        self.namespace = namespace
        self.token = token
        self.version = 1000
        self.min_version = 0
        self.objects: dict[str, dict[str, dict[str, Any]]] = {SLICES: {}, PODS: {}}
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []
        self.watches: list[_Watch] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.failures: list[tuple[str, int]] = []
        self.url = ""

    # ------------------------------------------------------------------------- test controls

    def put(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace ``obj`` (ADDED/MODIFIED); returns the stored copy with its new version."""
        stored = copy.deepcopy(obj)
        name = stored["metadata"]["name"]
        kind = "MODIFIED" if name in self.objects[resource] else "ADDED"
        self._bump(stored)
        self.objects[resource][name] = stored
        self._notify(resource, kind, stored)
        return stored

    def delete(self, resource: str, name: str) -> None:
        obj = self.objects[resource].pop(name)
        self._bump(obj)
        self._notify(resource, "DELETED", obj)

    def bookmark(self) -> int:
        """Send a BOOKMARK at a new version to every watch that asked for bookmarks."""
        self.version += 1
        for watch in self.watches:
            if watch.bookmarks:
                kind = "EndpointSlice" if watch.resource == SLICES else "Pod"
                obj = {"kind": kind, "metadata": {"resourceVersion": str(self.version)}}
                watch.queue.put_nowait({"type": "BOOKMARK", "object": obj})
        return self.version

    def compact(self) -> None:
        """Forget history: a watch from an older version now gets "410 Expired"."""
        self.min_version = self.version
        self.history.clear()

    def expire_watches(self) -> None:
        """Send the 410 ERROR event to open watches (as after an etcd compaction) and close them."""
        for watch in self.watches:
            error = status(410, "Expired", "The resourceVersion for the provided watch is too old.")
            watch.queue.put_nowait({"type": "ERROR", "object": error})
            watch.queue.put_nowait(None)

    def end_watches(self) -> None:
        for watch in self.watches:
            watch.queue.put_nowait(None)

    def fail_next(self, path_prefix: str, code: int, times: int = 1) -> None:
        self.failures.extend([(path_prefix, code)] * times)

    def watch_versions(self) -> list[str]:
        return [params.get("resourceVersion", "") for path, params in self.requests if params.get("watch")]

    # ------------------------------------------------------------------------------ internals

    def _bump(self, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)

    def _notify(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self.history.append((self.version, resource, kind, copy.deepcopy(obj)))
        for watch in self.watches:
            if watch.resource == resource and matches(obj["metadata"].get("labels", {}), watch.selector):
                watch.queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})

    def _check(self, request: web.Request) -> web.Response | None:
        self.requests.append((request.path, dict(request.query)))
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        if request.match_info["ns"] != self.namespace:
            message = f'cannot list resource in the namespace "{request.match_info["ns"]}"'
            return web.json_response(status(403, "Forbidden", message), status=403)
        for position, (prefix, code) in enumerate(self.failures):
            if request.path.startswith(prefix):
                del self.failures[position]
                return web.json_response(status(code, "InternalError", "injected failure"), status=code)
        return None

    async def collection(self, request: web.Request) -> web.StreamResponse:
        refused = self._check(request)
        if refused is not None:
            return refused
        resource = SLICES if request.path.endswith(SLICES) else PODS
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") in ("1", "true"):
            return await self._watch(request, resource, selector)
        items = [
            obj
            for name, obj in sorted(self.objects[resource].items())
            if matches(obj["metadata"].get("labels", {}), selector)
        ]
        start = int(request.query.get("continue", "0") or 0)
        limit = int(request.query.get("limit", "0") or 0) or len(items) or 1
        page = items[start : start + limit]
        meta: dict[str, Any] = {"resourceVersion": str(self.version)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        kind, api_version = (
            ("EndpointSliceList", "discovery.k8s.io/v1") if resource == SLICES else ("PodList", "v1")
        )
        return web.json_response({"kind": kind, "apiVersion": api_version, "metadata": meta, "items": page})

    async def _watch(self, request: web.Request, resource: str, selector: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion", "0") or 0)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if since < self.min_version:
            error = status(410, "Expired", f"too old resource version: {since} ({self.min_version})")
            await response.write(json.dumps({"type": "ERROR", "object": error}).encode() + b"\n")
            return response
        watch = _Watch(resource, selector, request.query.get("allowWatchBookmarks") == "true")
        for version, kind_of, kind, obj in self.history:
            if (
                version > since
                and kind_of == resource
                and matches(obj["metadata"].get("labels", {}), selector)
            ):
                watch.queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})
        self.watches.append(watch)
        timeout_s = float(request.query.get("timeoutSeconds", "60"))
        try:
            while True:
                try:
                    event = await asyncio.wait_for(watch.queue.get(), timeout_s)
                except TimeoutError:
                    break
                if event is None:
                    break
                await response.write(json.dumps(event).encode() + b"\n")
        finally:
            self.watches.remove(watch)
        return response

    async def pod(self, request: web.Request) -> web.Response:
        refused = self._check(request)
        if refused is not None:
            return refused
        obj = self.objects[PODS].get(request.match_info["name"])
        if obj is None:
            message = f'pods "{request.match_info["name"]}" not found'
            return web.json_response(status(404, "NotFound", message), status=404)
        return web.json_response(obj)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self.collection)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.collection)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self.pod)
        return app


@asynccontextmanager
async def serving(api: FakeKubeApi) -> AsyncIterator[FakeKubeApi]:
    """Serve ``api`` on a free port of 127.0.0.1 until the block ends."""
    runner = web.AppRunner(api.app(), shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    api.url = f"http://{host}:{port}"
    try:
        yield api
    finally:
        api.end_watches()
        await runner.cleanup()
