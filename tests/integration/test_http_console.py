"""The console's admin API against a live balancer and emulated replicas: decisions, what-if, audit."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from kvlb_harness import MODEL, Harness, metric_value, running, shared_deepseek, wait_for

from balancer.cli.main import main
from balancer.tokenizer.tokenizer import Tokenizer

TOKEN = "root"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def _send(h: Harness, prompt: list[int], tenant: str | None = None) -> str:
    headers = {"x-kvlb-tenant": tenant} if tenant else None
    answer = await h.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}, headers)
    assert answer.status == 200, answer.body
    return answer.headers["x-kvlb-replica"]


async def _call(h: Harness, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    async with h.session.request(method, h.url + path, json=body, headers={**AUTH, **headers}) as response:
        return response.status, await response.json()


async def test_decisions_whatif_and_audit(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 2, auth__admin_token=TOKEN) as h:
        shared = list(range(1000, 1064))
        await h.warm(shared)
        chosen = [
            await _send(h, [*shared, i, i + 1, i + 2, i + 3], "team-a" if i % 2 else "team-b")
            for i in range(12)
        ]

        status, listed = await _call(h, "GET", "/admin/decisions?limit=5")
        assert status == 200 and len(listed["decisions"]) == 5
        ids = [d["id"] for d in listed["decisions"]]
        assert ids == sorted(ids, reverse=True)
        newest = listed["decisions"][0]
        assert newest["replica"] == chosen[-1] and newest["pool"] == MODEL
        assert newest["prefill_tokens"] == 68 and set(newest["terms"]) == {"r0", "r1"}
        assert newest["predicted_cached_tokens"] >= 64  # the warmed prefix
        assert isinstance(newest["request_id"], str) and newest["request_id"]
        status, team_a = await _call(h, "GET", "/admin/decisions?tenant=team-a&limit=1000")
        assert status == 200 and len(team_a["decisions"]) == 6
        assert all(d["tenant"] == "team-a" for d in team_a["decisions"])
        status, since = await _call(h, "GET", f"/admin/decisions?since_id={ids[1]}")
        assert status == 200 and [d["id"] for d in since["decisions"]] == [ids[0]]
        assert since["next_since_id"] == str(ids[0])  # one process: the cursor is one id
        status, listed_since = await _call(h, "GET", f"/admin/decisions?since_id={ids[1]},0")
        assert status == 200 and listed_since == since  # one id per worker: this one's is the first
        status, one = await _call(h, "GET", f"/admin/decisions/{ids[0]}")
        assert status == 200 and one["decision"]["replica"] == chosen[-1]
        assert {t["replica"] for t in one["decision"]["terms"]} == {"r0", "r1"}
        assert one["inputs"]["candidates"] == ["r0", "r1"]
        assert one["left_out"] == {}  # every replica was a candidate
        # the spans of its load, kept at its first token and its release (the what-if moves it for them)
        assert 0.0 <= one["prefill_s"] <= one["held_s"] < 60.0, one

        # Unchanged weights: the replay reproduces every recorded decision.
        status, same = await _call(h, "POST", "/admin/whatif", {})
        assert status == 200, same
        assert same["decisions"] == 13 and same["changed_share"] == 0.0
        assert same["before"] == same["after"] and same["sample"] == []
        assert same["tallies"]["in_flight"] == 0 and same["model"]["load_moved"] == 0
        # No credit for the cache: affinity goes, the hit rate predicted falls.
        status, cold = await _call(
            h, "POST", "/admin/whatif", {"weights": {"overlap_credit": 0.0}, "sample": 3}
        )
        assert status == 200, cold
        assert cold["after"]["predicted_cached_tokens"] <= cold["before"]["predicted_cached_tokens"]
        assert {r["replica"] for r in cold["replicas"]} == {"r0", "r1"}
        assert abs(sum(r["delta_share"] for r in cold["replicas"])) < 1e-9
        assert len(cold["sample"]) == min(3, cold["changed"])
        # Every decision was made under the live weights: proposing others is no "other config".
        assert not any("another policy or other weights" in note for note in cold["notes"]), cold["notes"]
        status, rr = await _call(h, "POST", "/admin/whatif", {"policy": "round_robin", "last": 4})
        assert status == 200 and rr["decisions"] == 4 and rr["policy"] == "round_robin"

        for body in (
            {"weights": {"overlap_credit": 9}},
            {"weights": {"nope": 1}},
            {"policy": "nope"},
            {"last": 0},
            {"sample": 1000},
            {"extra": 1},
            {"weights": [1]},
        ):
            status, error = await _call(h, "POST", "/admin/whatif", body)
            assert status == 400, (body, error)
        status, _ = await _call(h, "POST", "/admin/whatif", {"pool": "nope"})
        assert status == 404
        state = h.balancer.state
        assert state is not None and state.whatif_running == 0  # every replay's thread has ended
        state.whatif_running = 2  # two replays running: a third is refused
        async with h.session.post(h.url + "/admin/whatif", json={}, headers=AUTH) as response:
            assert response.status == 429 and response.headers["Retry-After"] == "1"
        state.whatif_running = 0
        for query in (
            "limit=0",
            "limit=1001",
            "since_id=x",
            "since_id=1,x",
            "since_id=1,",
            "limit=abc",
            "limit=5&limit=6",
            "nope=1",
        ):
            status, _ = await _call(h, "GET", f"/admin/decisions?{query}")
            assert status == 400, query
        status, _ = await _call(h, "GET", "/admin/decisions/abc")
        assert status == 400
        # Only ASCII decimal digits name a decision: int() alone reads each of these as an id made
        # (10, or 5 for an Arabic-Indic five), and schemathesis counts a 200 to them as accepting
        # invalid data.
        for loose in ("1_0", f"%20{ids[0]}", f"{ids[0]}%20", "%D9%A5", f"%2B{ids[0]}"):
            status, error = await _call(h, "GET", f"/admin/decisions/{loose}")
            assert status == 400 and "decimal digits" in error["error"]["message"], loose
        for query in ("minutes=1_0", "minutes=%205", "minutes=5%0A", "minutes=%D9%A5", "minutes=%2B5"):
            status, error = await _call(h, "GET", f"/admin/series?{query}")
            assert status == 400 and "decimal number" in error["error"]["message"], query
        for query in ("minutes=5", "minutes=0.5", "minutes=1e1"):
            status, series = await _call(h, "GET", f"/admin/series?{query}")
            assert status == 200 and series["intervals"], query
        for query in (
            "ttft_histograms=2",
            "ttft_histograms=true",
            "ttft_histograms=",
            "ttft_histograms=1&ttft_histograms=1",
        ):
            status, error = await _call(h, "GET", f"/admin/series?{query}")
            assert status == 400 and "ttft_histograms" in error["error"]["message"], query
        for flag, listed in (("0", False), ("1", True)):
            status, series = await _call(h, "GET", f"/admin/series?minutes=1&ttft_histograms={flag}")
            assert status == 200 and all(("ttft_histogram" in r) is listed for r in series["intervals"])
        status, _ = await _call(h, "GET", "/admin/decisions/999999")
        assert status == 404

        # The audit log: reason and actor, newest first; a bad reason or actor is a 400.
        status, changed = await _call(
            h,
            "PUT",
            "/admin/policy",
            {"weights": {"decode_weight": 0.2}, "reason": "decode-heavy traffic"},
            **{"x-kvlb-actor": "alice"},
        )
        assert status == 200 and changed["version"] == 2
        status, _ = await _call(h, "PUT", "/admin/policy", {"name": "least_load"})
        status, log = await _call(h, "GET", "/admin/audit")
        assert status == 200 and [e["actor"] for e in log["entries"]] == ["admin", "alice"]
        first = log["entries"][1]
        assert first["reason"] == "decode-heavy traffic" and first["version"] == 2
        assert first["change"] == {"before": {"decode_weight": 0.1}, "after": {"decode_weight": 0.2}}
        assert log["entries"][0]["change"]["after"] == {"name": "least_load"}
        status, _ = await _call(h, "PUT", "/admin/policy", {"reason": "x" * 501})
        assert status == 400
        status, _ = await _call(h, "PUT", "/admin/policy", {"reason": 5})
        assert status == 400
        status, _ = await _call(h, "PUT", "/admin/policy", {}, **{"x-kvlb-actor": "a" * 65})
        assert status == 400
        status, _ = await _call(h, "GET", "/admin/audit?limit=0")
        assert status == 400

        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        assert metric_value(text, "kvlb_console_ring_entries", pool=MODEL) == 13
        assert metric_value(text, "kvlb_console_ring_bytes", pool=MODEL) > 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/admin/whatif"),
        ("GET", "/admin/decisions"),
        ("GET", "/admin/decisions/1"),
        ("GET", "/admin/audit"),
    ],
)
async def test_console_needs_the_admin_token(tokenizer: Tokenizer, method: str, path: str) -> None:
    async with running(tokenizer, 1, auth__admin_token=TOKEN) as h:
        async with h.session.request(method, h.url + path, json={}) as response:
            assert response.status == 401
        bad = {"Authorization": "Bearer wrong"}
        async with h.session.request(method, h.url + path, json={}, headers=bad) as response:
            assert response.status == 401


async def test_ring_evicts_by_count(tokenizer: Tokenizer) -> None:
    async with running(tokenizer, 1, console__decision_ring_size=3) as h:
        for i in range(5):
            await _send(h, list(range(i, i + 20)))
        listed = await h.admin("GET", "/admin/decisions")
        assert [d["id"] for d in listed["decisions"]] == [5, 4, 3]
        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        assert metric_value(text, "kvlb_console_ring_evicted_total", pool=MODEL, reason="count") == 2


async def test_cli_whatif_decisions_and_audit(
    tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running(tokenizer, 2, auth__admin_token=TOKEN) as h:
        shared = list(range(2000, 2032))
        await h.warm(shared)
        for i in range(4):
            await _send(h, [*shared, i], "team-a")

        async def cli(*args: str) -> tuple[int, str, str]:
            code = await asyncio.to_thread(main, ["admin", "--url", h.url, "--token", TOKEN, *args])
            captured = capsys.readouterr()
            return code, captured.out, captured.err

        code, out, _ = await cli("whatif", "--weight", "overlap_credit=0", "--sample", "2")
        assert code == 0 and "decisions 5" in out and "hit rate" in out and "load spread" in out
        assert "r0" in out and "r1" in out and "note: the prefix matches follow the cache" in out
        code, out, _ = await cli("whatif", "--json", "-w", "decode_weight=0.1")
        assert code == 0 and json.loads(out)["changed_share"] == 0.0
        code, out, err = await cli("whatif", "-w", "overlap_credit=9")
        assert code == 1 and "HTTP 400" in err and "overlap_credit" in err
        code, out, err = await cli("whatif", "--policy", "nope")
        assert code == 1 and "HTTP 400" in err
        code, out, _ = await cli("decisions", "--tenant", "team-a", "--json")
        assert code == 0 and len(json.loads(out)["decisions"]) == 4
        code, out, _ = await cli("decisions", "--limit", "2")
        assert code == 0 and out.splitlines()[0].split()[:4] == ["id", "utc", "pool", "replica"]
        assert len(out.splitlines()) == 4  # the two decisions, then the cursor of the next poll
        assert out.splitlines()[3] == f"next: --since-id {out.splitlines()[1].split()[0]}"
        code, out, _ = await cli("decisions", "--id", "1")
        assert code == 0 and json.loads(out)["id"] == 1
        code, out, _ = await cli(
            "policy", "set", "decode_weight=0.2", "--reason", "more decode", "--actor", "carol"
        )
        assert code == 0
        code, out, _ = await cli("audit")
        assert code == 0 and "carol" in out and "decode_weight: 0.1 -> 0.2" in out and "more decode" in out
        code, out, _ = await cli("audit", "--json", "--limit", "1")
        assert code == 0 and json.loads(out)["entries"][0]["actor"] == "carol"


async def test_a_whatif_past_its_cache_bound_counts_the_decisions_it_left(tokenizer: Tokenizer) -> None:
    """``console.whatif_max_cache_marks`` bounds the replay's cache model; the decisions past it are
    in the answer's ``tallies.unmodelled`` and in ``kvlb_console_whatif_unmodelled_decisions_total``
    (rule 5: each limit with its overflow metric)."""
    async with running(tokenizer, 2, auth__admin_token=TOKEN, console__whatif_max_cache_marks=8) as h:
        for i in range(6):  # distinct prompts of 64 tokens: more marks than the bound
            await _send(h, list(range(5000 + 100 * i, 5064 + 100 * i)))
        status, answer = await _call(h, "POST", "/admin/whatif", {"weights": {"overlap_credit": 0.0}})
        assert status == 200, answer
        unmodelled = answer["tallies"]["unmodelled"]
        assert 0 < unmodelled < answer["decisions"]
        status, again = await _call(h, "POST", "/admin/whatif", {})
        assert status == 200 and again["tallies"]["unmodelled"] == unmodelled
        async with h.session.get(h.url + "/metrics") as response:
            text = await response.text()
        counted = metric_value(text, "kvlb_console_whatif_unmodelled_decisions_total", pool=MODEL)
        assert counted == 2 * unmodelled


async def test_a_cancelled_whatif_stops_its_thread(tokenizer: Tokenizer) -> None:
    """A client that goes away cancels the handler; the replay's thread stops at its next pause and
    frees its slot, long before the whole ring would have been replayed."""
    many = 60_000
    async with running(tokenizer, 2, console__decision_ring_size=many, console__whatif_max_entries=many) as h:
        await _send(h, list(range(3000, 3040)))
        state = h.balancer.state
        assert state is not None
        log = state.decisions
        first = log.ring(MODEL).entries[0].record()
        for _ in range(many - 1):  # the same decision again: a ring full without 60,000 requests
            log.record(
                MODEL,
                first.inputs,
                first.decision,
                first.weights,
                first.prompt_tokens,
                first.cached_tokens,
                None,
                first.wall_ts,
            )
        timeout = aiohttp.ClientTimeout(total=0.3)
        with pytest.raises(TimeoutError):
            await h.session.post(
                h.url + "/admin/whatif", json={"weights": {"overlap_credit": 0}}, timeout=timeout
            )
        assert state.whatif_running == 1

        async def freed() -> bool:
            return state.whatif_running == 0

        await wait_for("the replay's thread to stop", freed, timeout_s=3.0)


async def test_a_long_tenant_header_value_finds_its_decisions(tokenizer: Tokenizer) -> None:
    """A decision keeps the first 128 characters of its tenant; ``?tenant=`` with the header's whole
    value (docs/http-api.md: "kept with the request's decision for GET /admin/decisions?tenant=")
    finds it, as the cut value does, and no other tenant's."""
    long_tenant = "tenant-" + "x" * 193  # 200 characters
    async with running(tokenizer, 2, auth__admin_token=TOKEN) as h:
        await _send(h, [1, 2, 3, 4], long_tenant)
        await _send(h, [5, 6, 7, 8], long_tenant[:128] + "-other")  # the same first 128 characters
        await _send(h, [9, 10, 11, 12], "short")
        for asked in (long_tenant, long_tenant[:128]):
            status, found = await _call(h, "GET", f"/admin/decisions?tenant={asked}")
            assert status == 200, found
            assert [d["tenant"] for d in found["decisions"]] == [long_tenant[:128]] * 2
        status, short = await _call(h, "GET", "/admin/decisions?tenant=short")
        assert status == 200 and len(short["decisions"]) == 1


async def test_a_recorded_decision_says_why_a_replica_was_not_a_candidate(tokenizer: Tokenizer) -> None:
    """The SRE walk of 2026-12-01: a decision named the replicas left out, not why (only
    ``/admin/explain`` said why, for the present). The record keeps why: after the drain is undone
    the decision still says ``draining``, while a dry run now leaves nobody out."""
    async with running(tokenizer, 3, auth__admin_token=TOKEN) as h:
        status, _ = await _call(h, "POST", "/admin/replicas/r2/drain", {"reason": "maintenance"})
        assert status == 200
        await _send(h, list(range(2000, 2064)))
        status, listed = await _call(h, "GET", "/admin/decisions?limit=1")
        assert status == 200
        status, _ = await _call(h, "POST", "/admin/replicas/r2/undrain")
        assert status == 200
        status, one = await _call(h, "GET", f"/admin/decisions/{listed['decisions'][0]['id']}")
        assert status == 200 and one["left_out"] == {"r2": "draining"}, one
        assert one["inputs"]["candidates"] == ["r0", "r1"]
        status, now = await _call(h, "POST", "/admin/explain", {"model": MODEL, "prompt": "hello"})
        assert status == 200 and now["left_out"] == {}
