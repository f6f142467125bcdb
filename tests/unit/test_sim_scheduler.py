"""The emulator's continuous-batching scheduler and timing model, driven with a virtual clock."""

from __future__ import annotations

import math

import pytest

from replicas.sim.cache import PagesStored, PrefixCache
from replicas.sim.profiles import Profile, get_profile
from replicas.sim.scheduler import (
    SGLANG_CACHING,
    TRTLLM_CACHING,
    CachePolicy,
    Scheduler,
    SimRequest,
    StepResult,
)
from replicas.sim.timing import TimeScale, isolated_itl_s, isolated_ttft_s, step_time_s

BIG = get_profile("h100-llama3-8b")
TEST = get_profile("cpu-test")


def make(
    profile: Profile, caching: CachePolicy = SGLANG_CACHING, *, store_partial: bool = False
) -> Scheduler:
    cache = PrefixCache(
        page_size=profile.page_size,
        capacity_blocks=profile.kv_capacity_tokens // profile.page_size,
        store_partial=store_partial,
    )
    return Scheduler(profile, cache, caching, max_waiting=64, vocab_size=profile.vocab_size)


def run(scheduler: Scheduler, now: float = 0.0, max_steps: int = 10_000) -> tuple[float, list[StepResult]]:
    """Step back to back until idle; returns the end time and every step's result."""
    results: list[StepResult] = []
    for _ in range(max_steps):
        plan = scheduler.start_step(now)
        if plan is None:
            return now, results
        results.append(scheduler.complete_step(plan))
        now = plan.end_s
    raise AssertionError("scheduler did not go idle")


def request(rid: str, prompt: list[int], max_new: int = 4, at: float = 0.0) -> SimRequest:
    return SimRequest(rid, prompt, max_new, arrival_s=at)


def test_step_time_formula_and_idle_step() -> None:
    assert step_time_s(BIG, prefill_tokens=0, decode_seqs=0, context_tokens=0) == 0.0
    expected = BIG.step_overhead_s + 100 * BIG.prefill_s_per_token + 8 * BIG.decode_s_per_seq
    got = step_time_s(BIG, prefill_tokens=100, decode_seqs=8, context_tokens=0)
    assert got == pytest.approx(expected)
    assert step_time_s(BIG, prefill_tokens=100, decode_seqs=8, context_tokens=0, slowdown=3) == (
        pytest.approx(3 * expected)
    )


def test_profiles_match_the_documented_ranges() -> None:
    """Thousands of prefill tok/s; ITL about 10-40 ms with batch.

    Sources: docs/reference/peers.md and docs/emulator.md (Profiles)."""
    for name in ("h100-llama3-8b", "h100-qwen3-32b"):
        profile = get_profile(name)
        assert 3_000 <= 1 / profile.prefill_s_per_token <= 20_000
        assert 0.005 <= isolated_itl_s(profile, batch=1, context_tokens_per_seq=1000) <= 0.025
        assert 0.010 <= isolated_itl_s(profile, batch=64, context_tokens_per_seq=2000) <= 0.045


def test_cached_prefix_cuts_ttft_by_exactly_its_prefill_cost() -> None:
    scheduler = make(BIG)
    prompt = list(range(1000, 3000))  # 2000 tokens, 125 pages of 16
    scheduler.submit(request("a", prompt, max_new=1))
    end, results = run(scheduler)
    cold = results[0].tokens[0].request
    assert cold.cached_tokens == 0
    cold_ttft = cold.first_token_s - cold.arrival_s  # type: ignore[operator]
    assert cold_ttft == pytest.approx(isolated_ttft_s(BIG, prompt_tokens=2000, cached_tokens=0))

    scheduler.submit(request("b", prompt, max_new=1, at=end))
    _, results = run(scheduler, now=end)
    warm = results[0].tokens[0].request
    assert warm.cached_tokens == 1984  # prompt[:-1] = 1999 tokens -> 124 full pages
    warm_ttft = warm.first_token_s - warm.arrival_s  # type: ignore[operator]
    assert cold_ttft - warm_ttft == pytest.approx(1984 * BIG.prefill_s_per_token)


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    scheduler = make(TEST)
    prompt = list(range(100, 200))  # 100 tokens, chunk budget 32 -> 4 steps
    scheduler.submit(request("a", prompt, max_new=2))
    _, results = run(scheduler)
    assert [r.plan.prefill_tokens for r in results] == [32, 32, 32, 4, 0]
    assert [len(r.tokens) for r in results] == [0, 0, 0, 1, 1]
    ttft = results[3].plan.end_s
    assert ttft == pytest.approx(isolated_ttft_s(TEST, prompt_tokens=100, cached_tokens=0))


def test_batch_cap_and_fifo_queue() -> None:
    scheduler = make(TEST.with_overrides(max_running_requests=2, chunk_prefill_tokens=512))
    for index in range(3):
        scheduler.submit(request(str(index), [index + 10] * 8, max_new=3))
    plan = scheduler.start_step(0.0)
    assert plan is not None
    assert [r.request_id for r, _ in plan.prefill] == ["0", "1"]
    assert [r.request_id for r in scheduler.waiting] == ["2"]
    _, results = run(scheduler, now=plan.end_s) if scheduler.complete_step(plan) else (0.0, [])
    admitted = [r for result in results for r, _ in result.plan.prefill]
    assert [r.request_id for r in admitted] == ["2"]


def test_decode_batch_grows_step_time_and_max_tokens_is_honoured() -> None:
    scheduler = make(TEST.with_overrides(chunk_prefill_tokens=512, max_running_requests=8))
    for index in range(4):
        scheduler.submit(request(str(index), [index + 10] * 8, max_new=5))
    _, results = run(scheduler)
    decode_steps = [r for r in results if r.plan.prefill_tokens == 0]
    assert len(decode_steps) == 4
    assert decode_steps[0].plan.end_s - decode_steps[0].plan.start_s == pytest.approx(
        step_time_s(TEST, prefill_tokens=0, decode_seqs=4, context_tokens=0)
    )
    finished = [r for result in results for r in result.finished]
    assert sorted(r.request_id for r in finished) == ["0", "1", "2", "3"]
    assert all(len(r.output) == 5 and r.finish_reason == "length" for r in finished)


def test_generation_is_deterministic_per_prompt_and_salt() -> None:
    outputs = []
    for salt in (0, 0, 7):
        scheduler = make(TEST)
        req = request("x", list(range(10, 30)), max_new=6)
        req.salt = salt
        scheduler.submit(req)
        run(scheduler)
        outputs.append(req.output)
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]


def test_full_pool_makes_requests_wait_not_fail() -> None:
    profile = TEST.with_overrides(kv_capacity_tokens=32, chunk_prefill_tokens=512)  # 8 pages of 4
    scheduler = make(profile)
    scheduler.submit(request("a", list(range(100, 120)), max_new=8))  # 28 tokens -> 7 pages
    scheduler.submit(request("b", list(range(200, 220)), max_new=8))
    plan = scheduler.start_step(0.0)
    assert plan is not None and [r.request_id for r, _ in plan.prefill] == ["a"]
    scheduler.complete_step(plan)
    _, results = run(scheduler, now=plan.end_s)
    b = next(r for res in results for r in res.finished if r.request_id == "b")
    assert b.admitted_s is not None and b.admitted_s > plan.end_s
    assert not scheduler.fits(prompt_tokens=30, max_new_tokens=10)


def test_sglang_caches_each_prefill_chunk_and_the_finished_sequence() -> None:
    scheduler = make(TEST)
    prompt = list(range(100, 170))  # 70 tokens: chunks of 32
    scheduler.submit(request("a", prompt, max_new=6))
    _, results = run(scheduler)
    stored = [rec for res in results for rec in res.records if isinstance(rec, PagesStored)]
    sizes = [len(rec.pages) for rec in stored]
    assert sizes[:2] == [8, 8]  # 32 then 64 prompt tokens cached while prefilling
    assert sum(sizes) == (70 + 6 - 1) // 4  # at the end: (prompt + output)[:-1], full pages only
    assert all(len(p.tokens) == 4 for rec in stored for p in rec.pages)


def test_trtllm_stores_prompt_minus_last_token_with_partial_block() -> None:
    scheduler = make(TEST, TRTLLM_CACHING, store_partial=True)
    prompt = list(range(100, 110))  # prompt[:-1] = 9 tokens -> 2 full blocks + 1 partial of 1
    scheduler.submit(request("a", prompt, max_new=1))
    _, results = run(scheduler)
    stored = [rec for res in results for rec in res.records if isinstance(rec, PagesStored)]
    # context end: prompt[:-1]; release: (prompt + output)[:-1] = 10 tokens, a longer partial sibling
    assert [[len(p.tokens) for p in rec.pages] for rec in stored] == [[4, 4, 1], [2]]
    assert stored[1].parent is stored[0].pages[1]


def test_abort_releases_pages() -> None:
    scheduler = make(TEST)
    req = request("a", list(range(100, 140)), max_new=50)
    scheduler.submit(req)
    plan = scheduler.start_step(0.0)
    assert plan is not None
    scheduler.abort(req, now=0.0)
    result = scheduler.complete_step(plan)
    assert result.tokens == ()
    assert scheduler.start_step(plan.end_s) is None
    assert req.finish_reason == "abort" and scheduler.cache.active_blocks == 0


def test_time_scale() -> None:
    scale = TimeScale(10.0)
    assert scale.to_wall(1.0) == pytest.approx(0.1)
    assert scale.to_model(0.1) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        TimeScale(0.0)
    with pytest.raises(ValueError):
        TimeScale(math.inf)
