"""A minimal Kubernetes API client: list, watch and get, in one namespace (does I/O: HTTP, files).

Only what discovery needs, over one ``aiohttp`` session:

* ``list`` follows ``continue`` tokens (pages of ``page_size``) and returns the items and the list's
  ``resourceVersion``;
* ``watch`` streams newline-delimited watch events from a ``resourceVersion`` with bookmarks on. An
  HTTP 410 or an ``ERROR`` event with code 410 ("Expired", "Gone") raises :class:`ResourceExpired`:
  the caller lists again. A line over ``max_event_bytes`` ends the watch with an :class:`ApiError`;
* ``get`` returns one object, or ``None`` on 404.

The bearer token is read from ``token_file`` on every request because projected service-account
tokens rotate (hourly by default). A missing token file sends no ``Authorization`` header (e.g.
through ``kubectl proxy``).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's token, CA bundle and namespace."""


class ApiError(Exception):
    """The API server answered with an error, or a response could not be understood."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ResourceExpired(ApiError):
    """The requested resourceVersion is too old (HTTP 410): list again."""


@dataclass(frozen=True, slots=True)
class ListResult:
    items: list[dict[str, Any]]
    resource_version: str


def ssl_context(ca_file: Path | None) -> ssl.SSLContext:
    """A client TLS context trusting ``ca_file`` (the cluster CA) when it exists, else the system's."""
    if ca_file is not None and ca_file.exists():
        return ssl.create_default_context(cafile=str(ca_file))
    return ssl.create_default_context()


class KubeApi:
    """List, watch and get one kind of object under ``base_url``."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        token_file: Path | None = SERVICE_ACCOUNT_DIR / "token",
        request_timeout_s: float = 10.0,
        page_size: int = 500,
        max_event_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._token_file = token_file
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._request_timeout_s = request_timeout_s
        self._page_size = page_size
        self._max_event_bytes = max_event_bytes

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_file is not None:
            try:
                token = self._token_file.read_text("utf-8").strip()
            except OSError:
                token = ""
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    async def list(self, path: str, label_selector: str) -> ListResult:
        """Every object at ``path`` matching ``label_selector``, across pages."""
        items: list[dict[str, Any]] = []
        params = {"labelSelector": label_selector, "limit": str(self._page_size)}
        while True:
            body = await self._get_json(path, params)
            page = body.get("items") or []
            items.extend(item for item in page if isinstance(item, dict))
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return ListResult(items, str(meta.get("resourceVersion", "")))
            params = {**params, "continue": str(token)}

    async def get(self, path: str) -> dict[str, Any] | None:
        """One object, or ``None`` if it does not exist."""
        try:
            return await self._get_json(path, {})
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def _get_json(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        url = self.base_url + path
        async with self._session.get(
            url, params=params, headers=self._headers(), timeout=self._timeout
        ) as resp:
            if resp.status != 200:
                raise _error(resp.status, await resp.text())
            body = await resp.json(content_type=None)
        if not isinstance(body, dict):
            raise ApiError(f"GET {path}: expected a JSON object")
        return body

    async def watch(
        self, path: str, label_selector: str, resource_version: str, timeout_s: float
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events after ``resource_version`` until the server ends the watch (``timeout_s``)."""
        params = {
            "watch": "1",
            "labelSelector": label_selector,
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        # The server closes the stream after timeoutSeconds; a silent socket beyond that is dead.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._request_timeout_s, sock_read=timeout_s + self._request_timeout_s
        )
        url = self.base_url + path
        async with self._session.get(url, params=params, headers=self._headers(), timeout=timeout) as resp:
            if resp.status != 200:
                raise _error(resp.status, await resp.text())
            buffer = bytearray()
            async for chunk in resp.content.iter_any():
                buffer.extend(chunk)
                while (end := buffer.find(b"\n")) >= 0:
                    line = bytes(buffer[:end])
                    del buffer[: end + 1]
                    if line.strip():
                        yield _watch_event(line)
                if len(buffer) > self._max_event_bytes:
                    raise ApiError(f"watch event over {self._max_event_bytes} bytes")
            if buffer.strip():
                yield _watch_event(bytes(buffer))


def _watch_event(line: bytes) -> dict[str, Any]:
    """One decoded watch event; ``ERROR`` events become exceptions."""
    try:
        event = json.loads(line)
    except ValueError:
        raise ApiError("watch stream: a line is not JSON") from None
    if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
        raise ApiError("watch stream: an event has no object")
    if event.get("type") == "ERROR":
        status = event["object"]
        code = status.get("code")
        raise _error(code if isinstance(code, int) else 500, str(status.get("message", "")))
    return event


def _error(status: int, text: str) -> ApiError:
    message = text[:300]
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict) and parsed.get("message"):
            message = str(parsed["message"])
    except ValueError:
        pass
    if status == 410:
        return ResourceExpired(f"resourceVersion expired: {message}", status)
    return ApiError(f"HTTP {status}: {message}", status)
