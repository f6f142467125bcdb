"""The console's views of ``kvlb serve --workers N`` as one service's (I/O: HTTP to the siblings).

A request on the shared port reaches one worker, and each worker records its own decisions, series
and replays. The worker that takes a console read (:func:`gathered_view`) answers for all of them,
as ``/metrics`` does (:mod:`balancer.api.siblings`):

* ``GET /admin/decisions``: every worker's answer to the same query, merged newest first (by time,
  then id), at most ``limit``; each decision says its ``worker``. Each worker's ids grow at its own
  pace, so ``since_id`` is one id per worker, comma-separated (a single id: every worker's, as
  before), and ``next_since_id`` is the cursor of the next poll: per worker, the highest id listed
  of it, or its entry as given when none is (a missing worker keeps its entry).
* ``GET /admin/decisions/{id}``: ids are the worker's index + 1 modulo N (:class:`DecisionLog`), so
  the decision is looked up on the worker that made it.
* ``GET /admin/series``: the workers' intervals summed (:func:`~balancer.service.series.merge_series`);
  each worker is asked for its TTFT histograms (``ttft_histograms=1``), which add, so the TTFT
  percentiles are the service's. Answers that cannot be merged leave this worker's own
  (:func:`_merge_series_steps`).
* ``GET /admin/replicas``: this worker's view of each replica (health, drains, the shared load and
  in-flight count, its index and event status, as every worker's are alike) with the ``prediction``
  of every worker's receipts (:func:`merge_predictions`): each worker keeps the receipts of the
  requests it routed; and every worker's ``kept_drains`` (each discovers, so removes, on its own),
  one per replica id, its newest removal (:func:`merge_kept_drains_steps`). gRPC ``Admin.ListReplicas``
  answers the same (:func:`grpc_replicas`).
* ``GET /admin/audit``: one entry per policy version (:func:`_merge_audit`): a worker restarted
  after a change adopted the policy from a sibling but not its audit log.
* ``POST /admin/whatif``: every worker replays its own decisions with the same body; the answers
  are summed (:func:`~balancer.service.whatif.merge_answers`), so ``last`` counts per worker.

Each answer lists the ``workers`` in it and the ``workers_missing``: a sibling that does not answer
200 within :data:`~balancer.api.siblings.SIBLING_TIMEOUT_S` (a what-if: :data:`WHATIF_TIMEOUT_S`)
is left out and logged, never a 5xx.

The answering worker's loop serves requests too: every answer is decoded
(:func:`~balancer.strict_json.loads_steps`), merged (:data:`MERGED_PER_STEP` items a step; the
series :data:`~balancer.service.series.ROWS_PER_STEP` intervals) and
encoded (:func:`~balancer.strict_json.dumps_steps`) a bounded piece at a time, the loop let run in
between (:func:`~balancer.tasks.stepwise`), as ``/metrics``' merge is; until 2026-12-01
(h-workersmerge) each was done in one go, tens of ms of CPU for 100-200 replicas.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from balancer import strict_json
from balancer.api.admin_replicas import MAX_LISTED_KEPT_DRAINS
from balancer.api.admin_series import SERIES_HISTOGRAMS, series_histograms
from balancer.api.console import DEFAULT_LIMIT, DEFAULT_SAMPLE, WHATIF_BODY, since_ids
from balancer.api.errors import ApiError
from balancer.api.parsing import decimal_integer
from balancer.service.decisions import next_since
from balancer.service.series import merge_series, merge_series_steps
from balancer.service.whatif import merge_answers
from balancer.tasks import at_once, stepwise

if TYPE_CHECKING:
    from balancer.api.siblings import Handler, Siblings

log = logging.getLogger(__name__)

WHATIF_TIMEOUT_S = 30.0
"""Budget (seconds) of a sibling's what-if replay (at most ``console.whatif_max_entries``
decisions at 0.04 to 0.4 ms each, in its worker thread)."""
MERGED_PER_STEP = 20
"""Items (replica views, their kept drains, decisions) a gathered view's merge handles between two
turns of the loop: a replica view's merge, its ``prediction`` weighed, took about 10 µs of CPU at
load 5 on 2 cores (2026-12-01, h-workersmerge)."""
_GATHERED_GETS = frozenset({"/admin/decisions", "/admin/series", "/admin/audit", "/admin/replicas"})
_ONE_DECISION = re.compile(r"^/admin/decisions/([^/]+)$")


def gathered_view(request: web.Request) -> bool:
    """Whether ``request`` is a console read answered for every worker."""
    if request.method == "GET":
        return request.path in _GATHERED_GETS or bool(_ONE_DECISION.match(request.path))
    return request.method == "POST" and request.path == "/admin/whatif"


async def gather(request: web.Request, handler: Handler, siblings: Siblings) -> web.StreamResponse:
    """The answer of this worker to ``request`` with the others' (see the module docstring)."""
    matched = _ONE_DECISION.match(request.path)
    if matched is not None:
        return await _one_decision(request, handler, siblings, matched.group(1))
    asked = request.path_qs
    if request.path == "/admin/series":
        request[SERIES_HISTOGRAMS] = True  # this worker's rows with their TTFT histograms, to add
        asked = str(request.rel_url.update_query(ttft_histograms="1"))
    response = await handler(request)  # validates the query or body: a 4xx is this worker's alone
    if response.status != 200 or not isinstance(response, web.Response) or response.body is None:
        return response
    local = await stepwise(strict_json.loads_steps(bytes(response.body)))  # type: ignore[arg-type]
    headers = _forwarded(request)
    if request.path == "/admin/whatif":
        merged = await whatif_everywhere(siblings, request.get(WHATIF_BODY, b"{}"), headers, local)
        return web.json_response(text=await stepwise(strict_json.dumps_steps(merged)))
    answers, missing = await _ask(siblings, "GET", asked, b"", headers, None)
    answers[siblings.index] = local
    order = sorted(answers)
    if request.path == "/admin/decisions":
        since = since_ids(request.query)  # checked by the local handler
        merged = await stepwise(
            merge_decisions_steps(answers, request.query.get("limit"), since, siblings.count)
        )
    elif request.path == "/admin/audit":
        merged = _merge_audit(answers, request.query.get("limit"))
    elif request.path == "/admin/replicas":
        merged = await stepwise(merge_replicas_steps(local, [answers[i] for i in order]))
    else:
        steps = _merge_series_steps(answers, order, missing, siblings.index, request.query)
        merged, order, missing = await stepwise(steps)
    merged["workers"] = order
    merged["workers_missing"] = missing
    return web.json_response(text=await stepwise(strict_json.dumps_steps(merged)))


async def whatif_everywhere(
    siblings: Siblings, raw: bytes, headers: dict[str, str], local: dict[str, Any]
) -> dict[str, Any]:
    """This worker's what-if answer ``local`` to the body ``raw`` with the siblings' to the same body,
    merged (:func:`~balancer.service.whatif.merge_answers`)."""
    answers, missing = await _ask(siblings, "POST", "/admin/whatif", raw, headers, WHATIF_TIMEOUT_S)
    answers[siblings.index] = local
    order = sorted(answers)
    sample = strict_json.loads(raw).get("sample")  # checked by this worker: an int or null
    asked = DEFAULT_SAMPLE if sample is None else int(sample)
    merged = merge_answers([{**answers[i], "worker": i} for i in order], asked)
    merged["elapsed_s"] = max(float(answers[i].get("elapsed_s", 0.0)) for i in order)
    merged["workers"] = order
    merged["workers_missing"] = missing
    return merged


def grpc_whatif(
    siblings: Siblings, admin_token: str | None
) -> Callable[[bytes, dict[str, Any]], Awaitable[dict[str, Any]]]:
    """What :attr:`ServiceState.whatif_gather` calls for ``Admin.WhatIf`` (gRPC has no HTTP
    middleware): the siblings' replays of the same body, authorised with the admin token."""

    async def gather_whatif(raw: bytes, local: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if admin_token is not None:
            headers["Authorization"] = f"Bearer {admin_token}"
        return await whatif_everywhere(siblings, raw, headers, local)

    return gather_whatif


def grpc_replicas(
    siblings: Siblings, admin_token: str | None
) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    """What :attr:`ServiceState.replicas_gather` calls for ``Admin.ListReplicas`` (gRPC has no HTTP
    middleware): this worker's views with every worker's receipts, with the ``workers`` and
    ``workers_missing``, as ``GET /admin/replicas`` answers."""

    async def gather_replicas(local: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if admin_token is not None:
            headers["Authorization"] = f"Bearer {admin_token}"
        answers, missing = await _ask(siblings, "GET", "/admin/replicas", b"", headers, None)
        answers[siblings.index] = local
        order = sorted(answers)
        merged = await stepwise(merge_replicas_steps(answers[siblings.index], [answers[i] for i in order]))
        merged["workers"] = order
        merged["workers_missing"] = missing
        return merged

    return gather_replicas


def _forwarded(request: web.Request) -> dict[str, str]:
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    if (auth := request.headers.get("Authorization")) is not None:
        headers["Authorization"] = auth
    return headers


async def _ask(
    siblings: Siblings,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float | None,
    only: int | None = None,
) -> tuple[dict[int, Any], list[int]]:
    """Each sibling's JSON answer (200 only) by index, and the indexes of those that gave none; each
    decoded in steps (:func:`~balancer.strict_json.loads_steps`)."""
    answers: dict[int, Any] = {}
    missing = [i for i in range(siblings.count) if i != siblings.index and (only is None or i == only)]
    results = await siblings.call(method, path, body=body, headers=headers, timeout_s=timeout_s, only=only)
    for index, result in results.items():
        if isinstance(result, BaseException) or result[0] != 200:
            shown = result if isinstance(result, BaseException) else f"status {result[0]}"
            log.warning("worker %d: %s %s not gathered (%r)", index, method, path, shown)
            continue
        try:
            answers[index] = await stepwise(strict_json.loads_steps(result[1]))
        except ValueError as exc:
            log.warning("worker %d: %s %s answered bad JSON (%s)", index, method, path, exc)
            continue
        missing.remove(index)
    return answers, missing


def _merge_series_steps(
    answers: dict[int, Any], order: list[int], missing: list[int], own: int, query: Mapping[str, str]
) -> Generator[None, None, tuple[dict[str, Any], list[int], list[int]]]:
    """The workers' series merged, with the workers in it and those missing; when a sibling's answer
    cannot be merged (a worker of another kvlb version, restarted by the supervisor after an
    upgrade: rows without a ``ttft_histogram``), this worker's own answer alone, the others named
    missing (logged), never a 5xx."""
    histograms = series_histograms(query)
    try:
        merged = yield from merge_series_steps([answers[i] for i in order], ttft_histograms=histograms)
        return merged, order, missing
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("workers %s: series not merged (%r); this worker's alone", order, exc)
        others = [i for i in order if i != own]
        return merge_series([answers[own]], ttft_histograms=histograms), [own], sorted(missing + others)


def merge_decisions_steps(
    answers: dict[int, Any], raw_limit: str | None, since: tuple[int, ...], workers: int
) -> Generator[None, None, dict[str, Any]]:
    """The workers' ``answers`` (by index) to one query with the cursor ``since``: newest first, at
    most ``limit``, and the cursor after them (:func:`~balancer.service.decisions.next_since`); in
    steps of :data:`MERGED_PER_STEP` decisions (up to 1,000 a worker), the sort in one go."""
    limit = DEFAULT_LIMIT if raw_limit is None else int(raw_limit)  # the local handler checked it
    listed: list[dict[str, Any]] = []
    for index, answer in answers.items():
        for decision in answer["decisions"]:
            listed.append({**decision, "worker": index})
            if len(listed) % MERGED_PER_STEP == 0:
                yield
    listed.sort(key=lambda d: (d["ts"], d["id"]), reverse=True)
    kept = listed[:limit]
    cursor = next_since(since, workers, ((d["worker"], d["id"]) for d in kept))
    return {"decisions": kept, "next_since_id": cursor}


def _merge_audit(answers: dict[int, Any], raw_limit: str | None) -> dict[str, Any]:
    """Every worker logs every policy change under the same version (the fan-out, or the fleet's
    policy in Redis), but a worker restarted after a change does not have it, and the siblings see
    the receiving worker as the caller: one entry per version, the earliest (the receiving
    worker's, with the client's address), newest first."""
    limit = DEFAULT_LIMIT if raw_limit is None else int(raw_limit)  # the local handler checked it
    by_version: dict[Any, dict[str, Any]] = {}
    for answer in answers.values():
        for entry in answer["entries"]:
            kept = by_version.get(entry["version"])
            if kept is None or entry["ts"] < kept["ts"]:
                by_version[entry["version"]] = entry
    listed = sorted(by_version.values(), key=lambda e: (e["ts"], e["version"]), reverse=True)
    return {"entries": listed[:limit]}


def _merge_decisions(
    answers: dict[int, Any], raw_limit: str | None, since: tuple[int, ...], workers: int
) -> dict[str, Any]:
    """:func:`merge_decisions_steps` in one go."""
    return at_once(merge_decisions_steps(answers, raw_limit, since, workers))


def merge_replicas_steps(
    local: dict[str, Any], answers: list[dict[str, Any]]
) -> Generator[None, None, dict[str, Any]]:
    """``local``'s replica views, each with the ``prediction`` of every worker's receipts and the
    stalled publisher's ``events.hint`` of the worker that has waited longest (each worker keeps
    the receipts of its own requests, so only those that routed the computed blocks know), and every
    worker's kept drains (:func:`merge_kept_drains_steps`); in steps of :data:`MERGED_PER_STEP`
    replica views (or kept drains)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    stalled: dict[str, dict[str, Any]] = {}
    walked = 0
    for answer in answers:
        for view in answer["replicas"]:
            walked += 1
            if walked % MERGED_PER_STEP == 0:
                yield
            if view.get("prediction") is not None:
                by_id.setdefault(view["id"], []).append(view["prediction"])
            events = view.get("events") or {}
            if events.get("stalled_s") is not None:
                known = stalled.get(view["id"])
                if known is None or events["stalled_s"] > known["stalled_s"]:
                    stalled[view["id"]] = events
    views = []
    for view in local["replicas"]:
        merged = {**view, "prediction": merge_predictions(by_id.get(view["id"], []))}
        events = view.get("events")
        longest = stalled.get(view["id"])
        if events is not None and longest is not None:
            merged["events"] = {**events, "hint": longest["hint"], "stalled_s": longest["stalled_s"]}
        views.append(merged)
        if len(views) % MERGED_PER_STEP == 0:
            yield
    listed = {view["id"] for view in views}
    kept, total = yield from merge_kept_drains_steps(answers, listed)
    return {"replicas": views, "kept_drains": kept, "kept_drains_total": total}


def merge_kept_drains_steps(
    answers: list[dict[str, Any]], listed: set[str]
) -> Generator[None, None, tuple[list[dict[str, Any]], int]]:
    """The workers' ``kept_drains`` as one list: per replica id not ``listed`` by the answering
    worker, the newest removal (a ``redis`` one first: the fleet's), newest first, at most
    :data:`~balancer.api.admin_replicas.MAX_LISTED_KEPT_DRAINS`; and the total (at least the largest worker's
    ``kept_drains_total``: a worker lists its newest only). An answer without them (a worker of a
    release before h-fleetfollow2) adds none."""
    by_id: dict[str, dict[str, Any]] = {}
    total = walked = 0
    for answer in answers:
        total = max(total, int(answer.get("kept_drains_total") or 0))
        for kept in answer.get("kept_drains") or ():
            walked += 1
            if walked % MERGED_PER_STEP == 0:
                yield
            held = by_id.get(kept["id"])
            rank = (kept.get("source") == "redis", kept["removed_at_wall_ts"])
            if kept["id"] not in listed and (
                held is None or rank > (held.get("source") == "redis", held["removed_at_wall_ts"])
            ):
                by_id[kept["id"]] = kept
    ordered = sorted(by_id.values(), key=lambda kept: kept["removed_at_wall_ts"], reverse=True)
    return ordered[:MAX_LISTED_KEPT_DRAINS], max(total, len(ordered))


def merge_predictions(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers' ``prediction`` views of one replica as one: the receipts add, the shares and the
    mean error are weighted by each worker's receipts (``None`` when there are none)."""
    receipts = sum(int(part["receipts"]) for part in parts)

    def weighted(key: str, digits: int | None = None) -> float | None:
        if receipts == 0:
            return None
        total = sum(float(part[key]) * int(part["receipts"]) for part in parts if part[key] is not None)
        return total / receipts if digits is None else round(total / receipts, digits)

    return {
        "receipts": receipts,
        "accuracy": weighted("accuracy"),
        "within_one_block": weighted("within_one_block"),
        "mean_error_blocks": weighted("mean_error_blocks", 3),
    }


async def _one_decision(
    request: web.Request, handler: Handler, siblings: Siblings, raw_id: str
) -> web.StreamResponse:
    """The decision from the worker whose ids it has (this one's own, or a sibling's answer)."""
    record_id = decimal_integer(raw_id)
    if record_id is None or record_id < 1 or (record_id - 1) % siblings.count == siblings.index:
        return await handler(request)
    worker = (record_id - 1) % siblings.count
    results = await siblings.call("GET", request.path_qs, headers=_forwarded(request), only=worker)
    result = results.get(worker)
    if result is None or isinstance(result, BaseException):
        log.warning("worker %d: %s not gathered (%r)", worker, request.path, result)
        raise ApiError(404, f"decision {record_id} was made by worker {worker}, which did not answer")
    return web.Response(body=result[1], status=result[0], content_type="application/json")
