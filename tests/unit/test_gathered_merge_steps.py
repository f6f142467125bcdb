"""The gathered views of ``kvlb serve --workers N`` merged in steps (h-workersmerge): on the same
workers' answers, decoding, merging and encoding in steps (:func:`~balancer.strict_json.loads_steps`,
:func:`~balancer.api.gathered.merge_replicas_steps`, :func:`~balancer.api.gathered.merge_decisions_steps`,
:func:`~balancer.strict_json.dumps_steps`) gives the very bytes the one-go merge of the tree before
gave (:mod:`one_go_merges`: the tree before's, copied), and pauses every :data:`MERGED_PER_STEP` items."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from one_go_merges import one_go_merge_decisions, one_go_merge_replicas
from step_runs import run_steps

from balancer import strict_json
from balancer.api.gathered import MERGED_PER_STEP, merge_decisions_steps, merge_replicas_steps
from balancer.service.log_histogram import LogHistogram
from balancer.service.series import ROWS_PER_STEP, merge_series, merge_series_steps

# -- the workers' answers -------------------------------------------------------------------------


def replica_view(rng: random.Random, replica: str) -> dict[str, Any]:
    receipts = rng.choice([0, 0, 3, 17, 250])
    stalled = rng.choice([None, None, round(rng.uniform(1, 90), 3)])
    return {
        "id": replica,
        "model": "m",
        "url": f"http://127.0.0.1:{rng.randrange(1024, 65535)}",
        "inflight": rng.randrange(5),
        "health": {"probe_ok": rng.random() < 0.9, "last_probe_age_s": round(rng.uniform(0, 3), 3)},
        "load": {"running_reqs": rng.randrange(9), "kv_usage": rng.random(), "stats_age_s": rng.random()},
        "prediction": {
            "receipts": receipts,
            "accuracy": None if receipts == 0 else rng.random(),
            "within_one_block": None if receipts == 0 else rng.random(),
            "mean_error_blocks": None if receipts == 0 else round(rng.uniform(0, 4), 3),
        },
        "events": rng.choice(
            [
                None,
                {"queued_batches": 0, "hint": None, "stalled_s": None, "sources": [{"kind": "zmq"}]},
                {"queued_batches": 1, "hint": f"stalled {stalled}", "stalled_s": stalled, "sources": []},
            ]
        ),
        "scrape": {"scrapes": rng.randrange(100), "last": {"rejected": [{"gauge": "g", "value": "-3.0"}]}},
    }


def kept_drain(rng: random.Random, replica: str) -> dict[str, Any]:
    return {
        "id": replica,
        "drain": {"by": "ops", "reason": "é ✓ \u2028", "at_wall_ts": 1.7e9},
        "removed_at_wall_ts": rng.choice([1.7e9, 1.7e9 + rng.randrange(1000)]),
        "expires_in_s": rng.uniform(0, 3600),
        "source": rng.choice(["memory", "redis"]),
    }


def worker_answer(rng: random.Random, replicas: int, kept: int) -> dict[str, Any]:
    views = [replica_view(rng, f"r{index:03d}") for index in range(replicas)]
    ids = [f"r{index:03d}" for index in rng.sample(range(replicas + kept), kept)]  # some listed ones
    drains = [kept_drain(rng, replica) for replica in ids]
    return {"replicas": views, "kept_drains": drains, "kept_drains_total": kept + rng.randrange(3)}


@pytest.mark.parametrize(("seed", "replicas", "kept"), [(1, 0, 0), (2, 3, 2), (3, 100, 40), (4, 200, 1000)])
def test_gathered_replicas_in_steps_are_the_one_go_answer(seed: int, replicas: int, kept: int) -> None:
    rng = random.Random(seed)
    bodies = [strict_json.dumps(worker_answer(rng, replicas, kept)).encode("utf-8") for _ in range(3)]

    answers = [strict_json.loads(body) for body in bodies]  # the tree before: all in one go
    before = one_go_merge_replicas(answers[0], answers)
    before["workers"], before["workers_missing"] = [0, 1, 2], []
    expected = strict_json.dumps(before)

    decoded = [run_steps(strict_json.loads_steps(body))[0] for body in bodies]
    merged, pauses = run_steps(merge_replicas_steps(decoded[0], decoded))
    walked = 4 * replicas + sum(len(answer["kept_drains"]) for answer in decoded)
    assert pauses == sum(n // MERGED_PER_STEP for n in (3 * replicas, replicas, walked - 4 * replicas))
    merged["workers"], merged["workers_missing"] = [0, 1, 2], []
    text, _ = run_steps(strict_json.dumps_steps(merged))
    assert text == expected
    assert len(json.loads(text)["replicas"]) == replicas


@pytest.mark.parametrize(("per_worker", "limit"), [(0, None), (7, "3"), (1000, "1000"), (1000, None)])
def test_gathered_decisions_in_steps_are_the_one_go_answer(per_worker: int, limit: str | None) -> None:
    rng = random.Random(per_worker)
    answers: dict[int, Any] = {}
    for worker in (1, 0):
        ts = sorted((round(rng.uniform(0, 50), 1) for _ in range(per_worker)), reverse=True)
        answers[worker] = {
            "decisions": [
                {"id": 1 + worker + 2 * i, "ts": t, "replica": f"r{i % 9}", "cost": rng.random()}
                for i, t in enumerate(ts)
            ]
        }
    since = (0, 3)
    expected = one_go_merge_decisions(answers, limit, since, 2)
    merged, pauses = run_steps(merge_decisions_steps(answers, limit, since, 2))
    assert merged == expected
    assert strict_json.dumps(merged) == strict_json.dumps(expected)
    assert pauses == 2 * per_worker // MERGED_PER_STEP


def test_gathered_series_in_steps_pause_between_rows_and_add_as_before() -> None:
    rows = 45
    answers = [
        {
            "now": 1000.0 + worker,
            "interval_s": 10.0,
            "intervals": [
                {
                    "ts": 10.0 * i,
                    "requests": 2,
                    "prompt_tokens": 100,
                    "predicted_cached_tokens": 40,
                    "reported_prompt_tokens": 100,
                    "reported_cached_tokens": 30,
                    "replicas": {f"r{worker}": 1, "r9": 1},
                    "ttft_histogram": LogHistogram().to_json(),
                }
                for i in range(rows)
            ],
        }
        for worker in (0, 1)
    ]
    merged, pauses = run_steps(merge_series_steps(answers))
    assert pauses == rows // ROWS_PER_STEP
    assert merged == merge_series(answers) and merged["now"] == 1001.0
    assert [row["replicas"] for row in merged["intervals"]] == [{"r0": 1, "r1": 1, "r9": 2}] * rows
    assert all(row["requests"] == 4 and row["predicted_hit_rate"] == 0.4 for row in merged["intervals"])
