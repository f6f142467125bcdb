"""Request-by-request agreement of two runs (``loadtests/capacity/agreement.py``) and the replay's routing."""

from __future__ import annotations

import itertools
import random

import pytest

from loadtests.capacity.agreement import RequestRow, best_relabelling, compare, followers, rows_of
from loadtests.fleet.processes import EmulatorHandle
from loadtests.runs import pinned_route
from loadtests.stats import RequestRecord
from loadtests.workloads import RequestSpec


def _rows(
    replicas: list[str], cached: list[int] | None = None, ttft: list[float] | None = None
) -> list[RequestRow]:
    return [
        RequestRow(i, r, None if ttft is None else ttft[i], None if cached is None else cached[i])
        for i, r in enumerate(replicas)
    ]


def test_a_renamed_placement_agrees_completely() -> None:
    rng = random.Random(3)
    first = [rng.choice("abcdefgh") for _ in range(300)]
    rename = dict(zip("abcdefgh", "hgfedcba", strict=True))
    second = [rename[r] for r in first]
    result = compare(_rows(first), _rows(second), block_tokens=16)
    assert result["same_replica_share"] == 1.0
    assert result["first_divergence"] is None
    assert result["same_replica_share_as_labelled"] < 0.5


def test_the_relabelling_is_the_best_one_to_one_map() -> None:
    rng = random.Random(5)
    for _ in range(30):
        pairs = [(rng.choice("abcd"), rng.choice("wxyz")) for _ in range(rng.randint(0, 40))]
        mapping, kept = best_relabelling(pairs)
        assert len(set(mapping.values())) == len(mapping)
        assert kept == sum(1 for a, b in pairs if mapping.get(a) == b)
        lefts, rights = sorted({a for a, _ in pairs}), sorted({b for _, b in pairs})
        brute = 0
        for image in itertools.permutations(rights, min(len(lefts), len(rights))):
            for chosen in itertools.permutations(lefts, len(image)):
                m = dict(zip(chosen, image, strict=True))
                brute = max(brute, sum(1 for a, b in pairs if m.get(a) == b))
        assert kept == brute


def test_moved_requests_cached_tokens_and_ttft_differences_are_counted() -> None:
    first = _rows(["a", "a", "b", "b", "c"], cached=[0, 320, 0, 320, 0], ttft=[1.0, 1.0, 1.0, 1.0, 1.0])
    # request 3 moved from b to a; request 1 hit less, request 4 hit more; request 2 is 2 s slower
    second = _rows(["a", "a", "b", "a", "c"], cached=[0, 0, 8, 320, 64], ttft=[1.0, 0.2, 3.0, 1.1, 1.0])
    result = compare(first, second, block_tokens=16)
    assert result["requests"] == 5
    assert result["same_replica_share"] == pytest.approx(4 / 5)
    assert result["first_divergence"] == 3
    assert result["same_cached_share"] == pytest.approx(3 / 5)
    assert result["more_cached_share"] == pytest.approx(1 / 5)
    assert result["fewer_cached_share"] == pytest.approx(1 / 5)
    assert result["slower_share"] == pytest.approx(1 / 5)
    assert result["faster_share"] == pytest.approx(1 / 5)
    assert result["ttft_diff_p50_s"] == pytest.approx(0.0)


def test_rows_follow_the_stream_positions_and_scale_ttft() -> None:
    records = [
        RequestRecord("q1", "ok", 0.2, ttft_s=2.0, cached_tokens=16, replica="r1"),
        RequestRecord("q0", "ok", 0.1, ttft_s=4.0, cached_tokens=0, replica="r0"),
        RequestRecord("other", "ok", 0.3, ttft_s=1.0, cached_tokens=0, replica="r0"),
    ]
    rows = rows_of(records, {"q0": 0, "q1": 1}, time_scale=0.25)
    assert rows == [RequestRow(0, "r0", 1.0, 0), RequestRow(1, "r1", 0.5, 16)]


def test_the_replay_route_sends_each_request_to_its_replica_and_refuses_gaps() -> None:
    fleet = EmulatorHandle(
        [{"name": "s0", "url": "http://127.0.0.1:1"}, {"name": "s1", "url": "http://127.0.0.1:2"}]
    )
    specs = [RequestSpec(request_id=f"q{i}", max_tokens=1, prompt_token_ids=(1, 2, 3)) for i in range(3)]
    route = pinned_route(fleet, {"q0": "s1", "q1": "s0", "q2": "s1"}, specs)
    assert [route(s) for s in specs] == ["http://127.0.0.1:2", "http://127.0.0.1:1", "http://127.0.0.1:2"]
    with pytest.raises(ValueError, match="q2 has no assigned replica"):
        pinned_route(fleet, {"q0": "s1", "q1": "s0"}, specs)
    with pytest.raises(ValueError, match="not in the fleet"):
        pinned_route(fleet, {"q0": "s9", "q1": "s0", "q2": "s1"}, specs)


def test_followers_are_classed_by_their_groups_previous_request() -> None:
    # tenant a: 0 (r0, first token at 1.0), 1 arrives at 0.5 while 0 is pending and follows it (hit),
    # 3 arrives at 3.0 after 1's first token (1.5) and goes elsewhere (miss); tenant b: 2, then 4
    # arrives at 3.5 while 2 (first token at 4.0) is pending and goes elsewhere (miss)
    rows = [
        RequestRow(0, "r0", 1.0, 0),
        RequestRow(1, "r0", 1.0, 320),
        RequestRow(2, "r1", 2.0, 0),
        RequestRow(3, "r2", 1.0, 0),
        RequestRow(4, "r3", 1.0, 0),
    ]
    classes = followers(rows, ["a", "a", "b", "a", "b"], [0.0, 0.5, 2.0, 3.0, 3.5], block_tokens=16)
    assert classes == {
        "pending_other": {"requests": 1, "hits": 0},
        "pending_same": {"requests": 1, "hits": 1},
        "served_other": {"requests": 1, "hits": 0},
    }
