"""What one worker of ``kvlb serve --workers N`` tells the others (I/O: HTTP on 127.0.0.1, files).

A request on the shared port reaches one worker. Two things must still read as one service:

* **Admin changes** (``PUT /admin/policy``, ``POST /admin/replicas/{id}/drain|undrain``): after the
  receiving worker applied one (status < 300), :func:`sibling_middleware` sends it, with the
  caller's ``Authorization`` header, to every other worker's private address, marked
  ``x-kvlb-sibling: 1`` so it is applied there and not sent on again: a drain with its note (who,
  when, why: the receiving worker's, so every worker shows the same one), a policy
  change as the whole policy the receiving worker now runs (its answer's name and weights) with the
  change's reason and ``x-kvlb-actor``, so every worker's audit log has it.
  Embedded mode only: with Redis the policy already travels through the fleet. A sibling that
  cannot be reached in :data:`SIBLING_TIMEOUT_S` is logged. A worker the supervisor restarts asks a
  sibling for the policy in force, the drained replicas and the drains it keeps for removed
  replicas (:func:`catch_up`) before it serves. A change made through gRPC (``Admin.SetPolicy``,
  ``Admin.DrainReplica``) is sent the same way (:func:`grpc_fan_out`, ``ServiceState.admin_fan_out``).
* **The console's reads** (``/admin/decisions``, ``/admin/series``, ``/admin/whatif``): answered
  for every worker by :mod:`balancer.api.gathered`.
* **``GET /metrics``**: the receiving worker answers with every worker's series, each sample labelled
  ``worker="<index>"`` (a sum over workers is a PromQL ``sum without (worker)``). A worker that does
  not answer in time is left out of that scrape (logged), but for its ``kvlb_process_restarts_total``,
  taken from the supervisor's record (:mod:`balancer.worker_record`): a worker that dies before it
  serves is counted too. The texts are merged in steps (:func:`balancer.exposition.merge_rendered_steps`),
  the loop serving other requests between two.

Each worker also serves the app on a private port (127.0.0.1, ephemeral) and writes its URL to
``<run dir>/worker-<index>.url``; the siblings read those files at each fan-out, so a restarted
worker is found at its new port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from balancer import strict_json
from balancer.api.admin import ACTOR_HEADER, POLICY_REASON, SIBLING_HEADER
from balancer.api.gathered import gather, gathered_view
from balancer.exposition import merge_rendered, merge_rendered_steps
from balancer.health.book import DrainNote
from balancer.metrics import PROCESS_RESTARTS_HELP
from balancer.policy import PolicyWeights
from balancer.service.policy_control import PolicyView
from balancer.service.state import ServiceState
from balancer.tasks import stepwise
from balancer.types import ReplicaId
from balancer.worker_record import read_record

log = logging.getLogger(__name__)

SIBLING_TIMEOUT_S = 2.0
"""Budget (seconds) of one call to a sibling worker."""
SIBLING_ANSWER_MAX_BYTES = 64 * 1024 * 1024
"""Most bytes of one sibling's answer read (a declared or read length over it is an error: that
sibling is left out, as one that does not answer). What siblings answer is bounded by what they
make (at most 1,000 decision summaries, a what-if of at most 100 sampled decisions, their own
``/metrics``), far under it; this keeps a gathered read's memory bounded whatever a sibling sends:
at most ``(workers - 1)`` × this, for one read."""


class SiblingAnswerTooLarge(Exception):
    """A sibling's answer declared or sent more than :attr:`Siblings.max_answer_bytes`."""


_FANNED_OUT = re.compile(r"^/admin/(policy|replicas/[^/]+/(drain|undrain))$")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Siblings:
    """This worker's index, and where the other workers of its supervisor listen privately."""

    def __init__(
        self,
        run_dir: str,
        index: int,
        count: int,
        *,
        max_answer_bytes: int = SIBLING_ANSWER_MAX_BYTES,
        on_oversize: Callable[[], None] | None = None,
    ) -> None:
        """``on_oversize`` is told of each answer refused for :attr:`max_answer_bytes` (metric)."""
        self.run_dir = Path(run_dir)
        self.index = index
        self.count = count
        self.max_answer_bytes = max_answer_bytes
        self._on_oversize = on_oversize
        self.session: aiohttp.ClientSession | None = None
        self.session_timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)

    def register(self, url: str) -> None:
        """Publish this worker's private URL (atomically: write, then rename)."""
        path = self.run_dir / f"worker-{self.index}.url"
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(url)
        temporary.replace(path)

    def others(self) -> dict[int, str]:
        """The other workers' private URLs, by index (a worker not started yet is missing)."""
        found: dict[int, str] = {}
        for index in range(self.count):
            if index == self.index:
                continue
            try:
                found[index] = (self.run_dir / f"worker-{index}.url").read_text().strip()
            except OSError:
                continue
        return found

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(
            timeout=self.session_timeout,
            connector=aiohttp.TCPConnector(ssl=False),  # loopback to our own sibling
        )

    async def aclose(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await session.close()

    async def call(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        only: int | None = None,
    ) -> dict[int, tuple[int, bytes] | BaseException]:
        """The same request to every sibling at once (or to sibling ``only``): index → (status,
        body) or the error. ``timeout_s``: the budget when not :data:`SIBLING_TIMEOUT_S`."""
        session = self.session
        if session is None:
            return {}
        sent = {**(headers or {}), SIBLING_HEADER: "1"}
        timeout = self.session_timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)

        async def one(url: str) -> tuple[int, bytes]:
            async with session.request(
                method, url + path, data=body, headers=sent, timeout=timeout
            ) as response:
                return response.status, await self._read(response)

        others = self.others()
        if only is not None:
            others = {index: url for index, url in others.items() if index == only}
        results = await asyncio.gather(*(one(url) for url in others.values()), return_exceptions=True)
        return dict(zip(others, results, strict=True))

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        """The answer's body, at most :attr:`max_answer_bytes` of it (else
        :class:`SiblingAnswerTooLarge`, counted, with nothing more read)."""
        limit = self.max_answer_bytes
        declared = response.content_length
        if declared is None or declared <= limit:
            parts: list[bytes] = []
            read = 0
            async for chunk in response.content.iter_chunked(256 * 1024):
                read += len(chunk)
                if read > limit:
                    break
                parts.append(chunk)
            else:
                return b"".join(parts)
        if self._on_oversize is not None:
            self._on_oversize()
        raise SiblingAnswerTooLarge(f"a sibling's answer is over {limit} bytes (Content-Length {declared})")


async def catch_up(siblings: Siblings, state: ServiceState) -> bool:
    """Adopt the policy and the drained replicas of the first sibling that answers (a restarted
    worker joining the others); ``False`` when none did (the first start: none is up yet)."""
    token = state.settings.auth.admin_token
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    policies = await siblings.call("GET", "/admin/policy", headers=headers)
    replicas = await siblings.call("GET", "/admin/replicas", headers=headers)
    for index, answer in policies.items():
        listed = replicas.get(index)
        if isinstance(answer, BaseException) or answer[0] != 200:
            continue
        if listed is None or isinstance(listed, BaseException) or listed[0] != 200:
            continue
        view = strict_json.loads(answer[1])
        state.policy.adopt(
            PolicyView(
                str(view["name"]),
                PolicyWeights.from_dict(view["weights"]),
                int(view["version"]),
                str(view["updated_by"]),
                float(view["updated_at"]),
            )
        )
        answer_replicas = strict_json.loads(listed[1])
        for replica in answer_replicas["replicas"]:
            health = replica.get("health") or {}
            if health.get("draining"):
                note = DrainNote.from_json(health.get("drain"))
                if not state.health.set_draining(ReplicaId(replica["id"]), True, note):  # not found yet
                    state.health.keep_drain(ReplicaId(replica["id"]), True, note, state.monotonic())
        adopted = adopt_kept_drains(state, answer_replicas.get("kept_drains") or [])
        log.info(
            "worker %d: policy version %s, drains and %d kept drains taken from worker %d",
            siblings.index,
            view["version"],
            adopted,
            index,
        )
        return True
    return False


def adopt_kept_drains(state: ServiceState, kept_drains: list[dict[str, Any]]) -> int:
    """Keep a sibling's kept drains of its own (``source: memory``; the fleet's are in Redis) for
    the replicas discovery removed before this worker restarted, oldest removal first; how many.
    Until 2026-12-01 (h-fleetfollow2) a restarted worker had none: a replica added again after its
    restart came back undrained there and drained on its siblings."""
    now, wall, adopted = state.monotonic(), state.wall_clock(), 0
    for kept in sorted(kept_drains, key=lambda kept: float(kept["removed_at_wall_ts"])):
        if kept.get("source") != "memory":
            continue
        drain = kept.get("drain")
        note = None if drain is None else DrainNote.from_json(drain)
        replica, removed = ReplicaId(str(kept["id"])), float(kept["removed_at_wall_ts"])
        adopted += state.health.adopt_kept(replica, note, removed, now, wall)
    return adopted


def sibling_middleware(
    siblings: Siblings, *, fan_out_admin: bool
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The middleware that fans admin changes out and gathers ``/metrics`` (see the module doc)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.headers.get(SIBLING_HEADER):
            return await handler(request)
        if request.method == "GET" and request.path == "/metrics":
            return await _gathered_metrics(request, handler, siblings)
        if gathered_view(request):
            return await gather(request, handler, siblings)
        if fan_out_admin and request.method in ("PUT", "POST") and _FANNED_OUT.match(request.path):
            response = await handler(request)
            if response.status < 300:
                await _fan_out(request, _replayed_body(request, response), siblings)
            return response
        return await handler(request)

    return middleware


def _replayed_body(request: web.Request, response: web.StreamResponse) -> bytes:
    """What the siblings get: for the policy, the whole policy now in force (name and weights, from
    the answer), so every worker ends on the same one; for a drain, its note (reason, caller and
    time, from the answer); for an undrain, nothing."""
    if not isinstance(response, web.Response):
        return b""
    view = strict_json.loads(bytes(response.body or b"{}"))  # type: ignore[arg-type]
    replayed: dict[str, object]
    if request.path != "/admin/policy":
        note = DrainNote.from_json(view.get("drain"))
        return b"" if note is None else strict_json.dumps(note.replayed()).encode("utf-8")
    replayed = {"name": view["name"], "weights": view["weights"]}
    reason = request.get(POLICY_REASON)
    if isinstance(reason, str):
        replayed["reason"] = reason
    return strict_json.dumps(replayed).encode("utf-8")


async def _fan_out(request: web.Request, body: bytes, siblings: Siblings) -> None:
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    if (auth := request.headers.get("Authorization")) is not None:
        headers["Authorization"] = auth
    if (actor := request.headers.get(ACTOR_HEADER)) is not None:
        headers[ACTOR_HEADER] = actor
    await _send(siblings, request.method, request.path_qs, body, headers)


async def _send(siblings: Siblings, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
    for index, result in (await siblings.call(method, path, body=body, headers=headers)).items():
        if isinstance(result, BaseException):
            log.warning("worker %d: %s %s not applied (%s)", index, method, path, result)
        elif result[0] >= 300:
            log.warning("worker %d: %s %s answered %d", index, method, path, result[0])


def grpc_fan_out(
    siblings: Siblings, admin_token: str | None
) -> Callable[[str, str, bytes, str | None], Awaitable[None]]:
    """What :attr:`ServiceState.admin_fan_out` calls for an admin change made through gRPC (which
    has no HTTP middleware): the same request to every sibling's private port, authorised with the
    admin token (the gRPC caller was checked already)."""

    async def send(method: str, path: str, body: bytes, actor: str | None) -> None:
        headers = {"Content-Type": "application/json"}
        if admin_token is not None:
            headers["Authorization"] = f"Bearer {admin_token}"
        if actor is not None:
            headers[ACTOR_HEADER] = actor
        await _send(siblings, method, path, body, headers)

    return send


async def _gathered_metrics(request: web.Request, handler: Handler, siblings: Siblings) -> web.StreamResponse:
    response = await handler(request)
    if response.status != 200 or not isinstance(response, web.Response) or response.body is None:
        return response
    local = bytes(response.body).decode("utf-8")  # type: ignore[arg-type]
    texts = {siblings.index: local}
    for index, result in (await siblings.call("GET", "/metrics")).items():
        if isinstance(result, BaseException) or result[0] != 200:
            log.warning("worker %d: /metrics not gathered (%s)", index, result)
            continue
        texts[index] = result[1].decode("utf-8", errors="replace")
    record = read_record(str(siblings.run_dir))
    if record is not None:  # the supervisor's count of a worker that is down (or did not answer)
        for index, restarts in enumerate(record.restarts):
            if index not in texts and index < siblings.count:
                texts[index] = absent_worker_metrics(restarts)
    merged = await stepwise(merge_rendered_steps(texts))  # the loop runs between its steps
    return web.Response(
        text=merged if merged is not None else merge_parsed(texts),
        content_type="text/plain",
        charset="utf-8",
        headers={"X-Kvlb-Workers": str(len(texts))},
    )


def absent_worker_metrics(restarts: int) -> str:
    """The exposition a worker that is down (or did not answer) stands for: its restart count."""
    return (
        f"# HELP kvlb_process_restarts_total {PROCESS_RESTARTS_HELP}\n"
        "# TYPE kvlb_process_restarts_total counter\n"
        f"kvlb_process_restarts_total {float(restarts)!r}\n"
    )


def merge_metrics(texts: dict[int, str]) -> str:
    """Prometheus text of several workers as one exposition, every sample labelled ``worker``:
    :func:`balancer.exposition.merge_rendered` where every text is as kvlb renders it (the same
    bytes, without parsing), else :func:`merge_parsed`."""
    merged = merge_rendered(texts)
    return merged if merged is not None else merge_parsed(texts)


def merge_parsed(texts: dict[int, str]) -> str:
    """:func:`merge_metrics` by ``prometheus_client``'s text parser (any valid exposition)."""
    order: list[str] = []
    families: dict[str, tuple[str, str, list[str]]] = {}
    for index in sorted(texts):
        for family in text_string_to_metric_families(texts[index]):
            if family.name not in families:
                families[family.name] = (family.documentation, family.type, [])
                order.append(family.name)
            lines = families[family.name][2]
            for sample in family.samples:
                labels = {**sample.labels, "worker": str(index)}
                rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{rendered}}} {_number(sample.value)}")
    out: list[str] = []
    for name in order:
        documentation, kind, lines = families[name]
        typed = name + "_total" if kind == "counter" and not name.endswith("_total") else name
        out.append(f"# HELP {typed} {_escape_help(documentation)}")
        out.append(f"# TYPE {typed} {kind}")
        out.extend(lines)
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
