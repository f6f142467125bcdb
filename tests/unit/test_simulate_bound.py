"""The pooled list schedule (``loadtests/simulate/bound.py``) and its ``kvlb simulate`` flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from balancer.cli.main import main
from loadtests.simulate.bound import pooled_ttfts
from loadtests.simulate.sources import SimRequest
from replicas.sim.profiles import get_profile

# 16-token pages, 12,000 prefill tokens/s, 7 ms a step, 8,192-token chunks
PROFILE = get_profile("h100-llama3-8b")
PAGE = PROFILE.page_size


def _work_s(tokens: int, steps: int = 1) -> float:
    return tokens * PROFILE.prefill_s_per_token + steps * PROFILE.step_overhead_s


def _prompt(first: int, tokens: int) -> list[int]:
    return [first + i for i in range(tokens)]


def test_a_repeated_prompt_hits_every_full_block_of_its_head_on_any_replica() -> None:
    shared = _prompt(1000, 1601)  # prompt[:-1] is 100 full pages
    other = _prompt(50_000, 1601)
    stream = [SimRequest(shared, 4, 0.0), SimRequest(list(shared), 4, 0.0), SimRequest(other, 4, 0.0)]
    ttfts = pooled_ttfts(stream, 2, PROFILE, PAGE)
    assert ttfts[0] == pytest.approx(_work_s(1601))
    # the copy runs on the other replica, at once, and computes only the last token
    assert ttfts[1] == pytest.approx(_work_s(1))
    # the third waits for the replica that frees first: the copy's
    assert ttfts[2] == pytest.approx(_work_s(1) + _work_s(1601))


def test_one_replica_serves_in_arrival_order_and_counts_a_step_per_chunk() -> None:
    long = _prompt(1, 10_000)  # two chunks of 8,192
    short = _prompt(90_000, 800)
    ttfts = pooled_ttfts([SimRequest(long, 1, 0.0), SimRequest(short, 1, 0.5)], 1, PROFILE, PAGE)
    assert ttfts[0] == pytest.approx(_work_s(10_000, steps=2))
    assert ttfts[1] == pytest.approx(_work_s(10_000, steps=2) - 0.5 + _work_s(800))
    # arriving after the replica frees, it does not wait
    late = pooled_ttfts([SimRequest(long, 1, 0.0), SimRequest(short, 1, 5.0)], 1, PROFILE, PAGE)
    assert late[1] == pytest.approx(_work_s(800))


def test_more_replicas_never_wait_longer() -> None:
    stream = [SimRequest(_prompt(100_000 * n, 4000), 1, 0.05 * n) for n in range(40)]
    one, four = pooled_ttfts(stream, 1, PROFILE, PAGE), pooled_ttfts(stream, 4, PROFILE, PAGE)
    assert all(b <= a + 1e-12 for a, b in zip(one, four, strict=True))
    assert max(four) < max(one)
    with pytest.raises(ValueError):
        pooled_ttfts(stream, 0, PROFILE, PAGE)


def _trace(tmp_path: Path) -> Path:
    rows = [
        {
            "timestamp": 50 * n,
            "input_length": 2000,
            "output_length": 4,
            "hash_ids": [n % 5, 100 + n % 40, 200 + n],
        }
        for n in range(80)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows), "utf-8")
    return trace


def test_simulate_pooled_bound_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    flags = ["simulate", "--trace", str(_trace(tmp_path)), "--replicas", "2", "--rate", "40"]
    assert main([*flags, "--pooled-bound", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "kvlb-simulate-pooled-bound" and report["requests"] == 80
    assert 0 < report["ttft_p50_s"] <= report["ttft_p90_s"] <= report["ttft_p99_s"]
    # the reference is below the simulated fleet's TTFT at the same rate
    assert main([*flags, "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)["summary"]
    assert report["ttft_p90_s"] <= simulated["ttft_p90_s"]


def test_simulate_min_engines_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # one replica whose pool holds about two prompts: what eviction keeps decides the hits
    flags = ["simulate", "--trace", str(_trace(tmp_path)), "--replicas", "1", "--rate", "5"]
    flags += ["--kv-capacity-tokens", "4096", "--json"]
    assert main([*flags, "--engines", "min"]) == 0
    belady = json.loads(capsys.readouterr().out)
    assert main(flags) == 0
    lru = json.loads(capsys.readouterr().out)
    assert belady["engines"] == "min" and lru["engines"] == "lru"
    assert belady["summary"]["ok"] == lru["summary"]["ok"] == 80
    assert belady["summary"]["hit_rate"] > lru["summary"]["hit_rate"]
