"""The merges behind the console's reads of ``kvlb serve --workers N`` (:mod:`balancer.api.gathered`):
two workers' what-if replays and series, merged, say what one worker with all the traffic says."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from test_decisions import drive

from balancer.api.console import since_ids
from balancer.api.gathered import _merge_audit, _merge_decisions
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.service.decisions import DecisionLog, next_since, own_since
from balancer.service.log_histogram import RELATIVE_ERROR
from balancer.service.series import SeriesSampler, merge_series, percentile
from balancer.service.whatif import merge_answers, replay


def close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) < 1e-9
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("split", [0, 70, 200])
def test_two_workers_replays_merged_are_one_replay_of_all_their_decisions(split: int) -> None:
    log = DecisionLog(1000, 1 << 30)
    drive(log, 120, weights=PolicyWeights(overlap_credit=0.5))
    drive(log, 80)
    records = log.ring("m").snapshot()
    proposed = PolicyWeights(overlap_credit=0.0, ramp_memory_s=None)  # a replay carrying no state
    live = ("cost", PolicyWeights())

    def run(part: Any) -> dict[str, Any]:
        return replay("m", part, make_policy("cost"), proposed, sample=6, live=live).to_json()

    whole = run(records)
    parts = [run(records[:split]), run(records[split:])]
    merged = merge_answers([{**part, "worker": i} for i, part in enumerate(parts)], 6)
    assert whole["changed"] > 0
    # what was decided, and the notes' counts, do not depend on the replay's random tie-breaks
    for name in ("decisions", "before", "notes", "tallies", "policy", "weights"):
        assert close(merged[name], whole[name]), name
    by_replica = {r["replica"]: r for r in whole["replicas"]}
    assert {r["replica"] for r in merged["replicas"]} == set(by_replica)
    for row in merged["replicas"]:
        for name in ("before_share", "before_decisions", "before_prefill_blocks"):
            assert close(row[name], by_replica[row["replica"]][name]), name
    # what the replay decided adds up over the workers (each worker breaks its ties on its own)
    assert merged["changed"] == sum(p["changed"] for p in parts)
    assert merged["changed_share"] == merged["changed"] / 200
    after = merged["after"]
    assert after["predicted_cached_tokens"] == sum(p["after"]["predicted_cached_tokens"] for p in parts)
    assert after["prefill_blocks"] == sum(p["after"]["prefill_blocks"] for p in parts)
    assert close(after["hit_rate"], after["predicted_cached_tokens"] / whole["before"]["prompt_tokens"])
    assert sum(r["after_decisions"] for r in merged["replicas"]) == 200
    assert abs(sum(r["delta_share"] for r in merged["replicas"])) < 1e-9
    if split in (0, 200):  # one worker made them all: the same answer as one replay
        assert merged["changed"] == whole["changed"] and close(merged["after"], whole["after"])
        assert [s["id"] for s in merged["sample"]] == [s["id"] for s in whole["sample"]]
    ids = [(s["ts"], s["id"]) for s in merged["sample"]]
    assert ids == sorted(ids, reverse=True) and len(ids) == 6
    for described in merged["sample"]:
        assert described["worker"] == (0 if described["id"] <= split else 1)


def events(seed: int, n: int) -> list[tuple[float, str, int, float, int]]:
    """``n`` requests' (wall time, replica, predicted cached tokens, TTFT, reported cached tokens)."""
    rng = random.Random(seed)
    made = [
        (1000.0 + rng.uniform(0, 19.9), rng.choice(["r0", "r1", "r2"]), rng.choice([0, 50, 100]),
         rng.uniform(0.01, 1.0), rng.choice([0, 40]))
        for _ in range(n)
    ]  # fmt: skip
    return sorted(made)


def feed(sampler: SeriesSampler, made: list[tuple[float, str, int, float, int]]) -> None:
    for wall, replica, predicted, ttft_s, reported in made:
        sampler.on_commit(replica, 100, predicted, wall)
        sampler.on_ttft(ttft_s, wall)
        sampler.on_usage(100, reported, wall)


def test_two_workers_series_merged_add_counts_and_recompute_rates() -> None:
    made = [events(0, 40), events(1, 70)]
    workers = [SeriesSampler(5.0, 8, 8), SeriesSampler(5.0, 8, 8)]
    whole = SeriesSampler(5.0, 8, 8)
    for sampler, part in zip(workers, made, strict=True):
        feed(sampler, part)
    feed(whole, sorted(made[0] + made[1]))
    answers = [
        sampler.series(20 / 60, 1019.9 + 0.05 * i, ttft_histograms=True) for i, sampler in enumerate(workers)
    ]
    merged = merge_series(answers)
    expected = whole.series(20 / 60, 1019.95)
    assert len(merged["intervals"]) == len(expected["intervals"]) == 4
    for got, want in zip(merged["intervals"], expected["intervals"], strict=True):
        # the TTFT percentiles too: the histograms add, so they are what one worker with all the
        # requests gives (not the highest worker's)
        assert got == want
    assert sum(r["requests"] for r in merged["intervals"]) == 110
    assert merged["now"] == answers[1]["now"] and merged["ttft_buckets"] == expected["ttft_buckets"]
    with_histograms = merge_series(answers, ttft_histograms=True)["intervals"]
    whole_rows = whole.series(20 / 60, 1019.95, ttft_histograms=True)["intervals"]
    assert [r["ttft_histogram"] for r in with_histograms] == [r["ttft_histogram"] for r in whole_rows]


def test_merged_ttft_percentiles_are_the_service_s_within_the_stated_error() -> None:
    """Two workers with different TTFTs in the same intervals (one fast, one slow): the merged p50
    and p90 are within the histogram's error of the exact ones of all the requests, where the
    highest worker's would be far off."""
    rng = random.Random(5)
    workers = [SeriesSampler(5.0, 8, 8), SeriesSampler(5.0, 8, 8)]
    ttfts: dict[float, list[float]] = {}
    for k in range(4):
        for i, (sampler, median_s) in enumerate(zip(workers, (0.05, 0.8), strict=True)):
            for _ in range(300 if i == 0 else 60):
                wall = 1000.0 + 5 * k + rng.uniform(0, 4.9)
                ttft_s = rng.lognormvariate(math.log(median_s), 0.5)
                sampler.on_ttft(ttft_s, wall)
                ttfts.setdefault(math.floor(wall / 5) * 5.0, []).append(ttft_s)
    answers = [sampler.series(20 / 60, 1019.9, ttft_histograms=True) for sampler in workers]
    merged = merge_series(answers)
    for row in merged["intervals"]:
        exact = sorted(ttfts[row["ts"]])
        assert row["ttft_count"] == len(exact) == 360
        for name, q in (("ttft_p50_s", 0.5), ("ttft_p90_s", 0.9)):
            want = percentile(exact, q)
            assert want is not None and abs(row[name] - want) <= (RELATIVE_ERROR + 1e-6) * want, name
        assert row["ttft_p50_s"] < 0.2  # the slow worker's own p50 is about 0.8 s
        assert "ttft_histogram" not in row


def test_the_audit_log_is_one_entry_per_version_the_receiving_workers() -> None:
    """Worker 1 was restarted after version 2 (it adopted the policy, not the log): version 2 is
    still listed, and version 3, logged by both, once, as the worker that took the change saw it."""

    def entry(version: int, ts: float, caller: str) -> dict[str, Any]:
        change = {"before": {"decode_weight": 1.0}, "after": {"decode_weight": 0.5}}
        return {
            "ts": ts,
            "actor": "sre",
            "caller": caller,
            "reason": "r",
            "version": version,
            "change": change,
        }

    answers = {
        0: {"entries": [entry(3, 20.002, "token:ab@127.0.0.1"), entry(2, 10.0, "token:ab@10.0.0.7")]},
        1: {"entries": [entry(3, 20.0, "token:ab@10.0.0.7")]},
    }
    reversed_order = dict(reversed(answers.items()))  # the answering worker's own comes last
    assert _merge_audit(reversed_order, None) == _merge_audit(answers, None)
    merged = _merge_audit(answers, None)
    assert [(e["version"], e["caller"]) for e in merged["entries"]] == [
        (3, "token:ab@10.0.0.7"),
        (2, "token:ab@10.0.0.7"),
    ]
    assert [e["version"] for e in _merge_audit(answers, "1")["entries"]] == [3]


def test_a_poll_with_the_cursor_misses_no_decision_of_a_slower_worker() -> None:
    """Worker 0 decides faster than worker 1, so its ids run ahead. Polling with the highest id seen
    (the one-process way) skips worker 1's decisions below it; the answer's ``next_since_id`` (one id
    per worker) gives exactly the decisions made since, also when ``limit`` cuts or a worker is missing."""
    logs = [DecisionLog(100, 1 << 30, id_offset=i, id_step=2) for i in range(2)]
    stamps: dict[int, float] = {}  # a decision's wall time, across both workers

    def make(worker: int, n: int, t0: float) -> None:
        ring = logs[worker].rings.get("m")
        before = {r.id for r in ring.entries} if ring is not None else set()
        drive(logs[worker], n, seed=int(t0))
        made = sorted(r.id for r in logs[worker].ring("m").entries if r.id not in before)
        stamps.update({record_id: t0 + k for k, record_id in enumerate(made)})

    def answers(since_id: str) -> dict[int, Any]:
        since = since_ids({"since_id": since_id})
        return {
            i: {
                "decisions": [
                    {"id": r.id, "ts": stamps[r.id]}
                    for r in log.query(since_id=own_since(since, i), limit=1000)
                ]
            }
            for i, log in enumerate(logs)
        }

    def poll(since_id: str, limit: str = "1000") -> dict[str, Any]:
        return _merge_decisions(answers(since_id), limit, since_ids({"since_id": since_id}), 2)

    make(0, 10, 0.0)  # ids 1, 3, ..., 19
    make(1, 3, 100.0)  # ids 2, 4, 6
    first = poll("0")
    assert len(first["decisions"]) == 13 and first["next_since_id"] == "19,6"
    make(0, 5, 200.0)  # ids 21, ..., 29
    make(1, 1, 300.0)  # id 8
    assert {d["id"] for d in poll("19")["decisions"]} == {21, 23, 25, 27, 29}  # 8 skipped
    after = poll(first["next_since_id"])
    assert sorted(d["id"] for d in after["decisions"]) == [8, 21, 23, 25, 27, 29]
    assert after["next_since_id"] == "29,8"
    again = poll(after["next_since_id"])
    assert again["decisions"] == [] and again["next_since_id"] == "29,8"
    limited = poll(
        first["next_since_id"], "2"
    )  # the two newest only: the older are skipped, as with one process
    assert [(d["worker"], d["id"]) for d in limited["decisions"]] == [(1, 8), (0, 29)]
    assert limited["next_since_id"] == "29,8"
    only_0 = {0: answers("19,6")[0]}  # worker 1 did not answer: its entry is kept for the next poll
    assert _merge_decisions(only_0, None, (19, 6), 2)["next_since_id"] == "29,6"
    # one process: one id in, one id out; a list's entry per worker, 0 past its end
    assert next_since((5,), 1, [(0, 7), (0, 9)]) == "9" and next_since((5,), 1, []) == "5"
    assert (own_since((3, 8), 1), own_since((3,), 1), own_since((3, 8), 2)) == (8, 3, 0)
