"""The gathered views' merges of ``kvlb serve --workers N`` as the tree before h-workersmerge made them,
in one go (4bae7758, ``balancer/api/gathered.py``, unchanged but for their names; test helper): what
the merges made in steps must give the very same answers of (tests/unit/test_gathered_merge_steps.py,
tests/e2e/test_serve_workers_gathered_steps.py)."""

from __future__ import annotations

from typing import Any

from balancer.api.admin_replicas import MAX_LISTED_KEPT_DRAINS
from balancer.api.console import DEFAULT_LIMIT
from balancer.api.gathered import merge_predictions
from balancer.service.decisions import next_since


def one_go_merge_replicas(local: dict[str, Any], answers: list[dict[str, Any]]) -> dict[str, Any]:
    by_id: dict[str, list[dict[str, Any]]] = {}
    stalled: dict[str, dict[str, Any]] = {}
    for answer in answers:
        for view in answer["replicas"]:
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
    listed = {view["id"] for view in views}
    kept, total = one_go_merge_kept_drains(answers, listed)
    return {"replicas": views, "kept_drains": kept, "kept_drains_total": total}


def one_go_merge_kept_drains(
    answers: list[dict[str, Any]], listed: set[str]
) -> tuple[list[dict[str, Any]], int]:
    by_id: dict[str, dict[str, Any]] = {}
    total = 0
    for answer in answers:
        total = max(total, int(answer.get("kept_drains_total") or 0))
        for kept in answer.get("kept_drains") or ():
            held = by_id.get(kept["id"])
            rank = (kept.get("source") == "redis", kept["removed_at_wall_ts"])
            if kept["id"] not in listed and (
                held is None or rank > (held.get("source") == "redis", held["removed_at_wall_ts"])
            ):
                by_id[kept["id"]] = kept
    ordered = sorted(by_id.values(), key=lambda kept: kept["removed_at_wall_ts"], reverse=True)
    return ordered[:MAX_LISTED_KEPT_DRAINS], max(total, len(ordered))


def one_go_merge_decisions(
    answers: dict[int, Any], raw_limit: str | None, since: tuple[int, ...], workers: int
) -> dict[str, Any]:
    limit = DEFAULT_LIMIT if raw_limit is None else int(raw_limit)
    listed = [{**d, "worker": index} for index, answer in answers.items() for d in answer["decisions"]]
    listed.sort(key=lambda d: (d["ts"], d["id"]), reverse=True)
    kept = listed[:limit]
    cursor = next_since(since, workers, ((d["worker"], d["id"]) for d in kept))
    return {"decisions": kept, "next_since_id": cursor}
