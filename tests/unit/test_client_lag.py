"""The rule that makes an open-loop run no measurement at its rate when the client fell behind its
schedule (loadtests/client_lag.py), on hand-made records, and where the reports carry it."""

from __future__ import annotations

import pytest

from loadtests.capacity.report import markdown as capacity_markdown
from loadtests.capacity.search import RatePoint, Slo, point_from_dict, search
from loadtests.client_lag import FIELDS, MIN_SENT_SHARE, check_client, lag_bound_s, no_schedule
from loadtests.driver import RunResult
from loadtests.peers import parse_router
from loadtests.report import ROUTER_FIELDS, markdown, router_entry
from loadtests.runs import RouterRun
from loadtests.stats import RequestRecord, summarize
from loadtests.target import (
    EXIT_CLIENT_BEHIND,
    EXIT_CUT_SHORT,
    EXIT_SLO_MISSED,
    exit_code,
    parse_slo,
    slo_lag_bound_s,
)


def _schedule(n: int = 21, gap_s: float = 0.1, late_s: float = 0.0) -> list[RequestRecord]:
    """``n`` requests scheduled ``gap_s`` apart; request ``i`` sent ``i × late_s`` late."""
    return [
        RequestRecord(f"r{i}", "ok", start_s=i * (gap_s + late_s), scheduled_s=i * gap_s, ttft_s=0.05)
        for i in range(n)
    ]


def test_a_client_on_schedule_is_not_behind_and_reports_its_figures() -> None:
    check = check_client(_schedule(), slot_waits=0, concurrency_cap=512, lag_bound_s=0.2)
    assert check is not None and not check.behind and check.note() is None
    assert check.scheduled_rate_per_s == pytest.approx(10.0) and check.sent_rate_per_s == pytest.approx(10.0)
    figures = check.to_dict()
    assert tuple(figures) == FIELDS and figures["client_behind"] is False
    assert figures["client_lag_max_s"] == 0.0 and figures["client_concurrency_cap"] == 512


def test_a_client_that_sent_less_than_95_percent_of_the_rate_is_behind() -> None:
    # 20 gaps of 0.1 s sent as 20 gaps of 0.106 s: 94.3% of the rate; 0.104 s: 96.2%
    slow = check_client(_schedule(late_s=0.006), slot_waits=0, concurrency_cap=512)
    assert slow is not None and slow.sent_rate_per_s / slow.scheduled_rate_per_s < MIN_SENT_SHARE
    assert slow.behind and "94% < 95%" in slow.reasons[0]
    note = slow.note()
    assert note is not None and "not a valid measurement at the offered rate" in note
    assert "raise --concurrency" in note and "another machine" in note and "lower the rate" in note
    almost = check_client(_schedule(late_s=0.004), slot_waits=0, concurrency_cap=512)
    assert almost is not None and not almost.behind


def test_a_launch_that_waited_for_the_cap_makes_the_run_invalid_even_on_rate() -> None:
    check = check_client(_schedule(), slot_waits=3, concurrency_cap=8)
    assert check is not None and check.behind
    assert check.reasons == ("3 launches waited for the in-flight cap of 8",)


def test_the_lag_p90_is_bounded_by_a_tenth_of_the_tightest_latency_slo() -> None:
    # every request after the first sent 50 ms late, at the scheduled rate: lag p90 = 0.05 s
    records = [
        RequestRecord(f"r{i}", "ok", start_s=0.1 * i + (0.05 if i else 0.0), scheduled_s=0.1 * i)
        for i in range(21)
    ]
    records.append(RequestRecord("last", "ok", start_s=2.1, scheduled_s=2.1))  # the span holds the rate
    assert lag_bound_s([2.0, 0.4]) == pytest.approx(0.04) and lag_bound_s([]) is None
    tight = check_client(records, slot_waits=0, concurrency_cap=512, lag_bound_s=lag_bound_s([0.4]))
    assert tight is not None and tight.behind and tight.reasons[0].startswith("lag p90 50.0 ms > 40.0 ms")
    loose = check_client(records, slot_waits=0, concurrency_cap=512, lag_bound_s=lag_bound_s([0.6]))
    free = check_client(records, slot_waits=0, concurrency_cap=512)
    assert loose is not None and free is not None and not loose.behind and not free.behind
    # only latency objectives set the bound: TTFT and e2e, not ITL, not rates
    slos = [parse_slo(t) for t in ("itl_p90_s=10ms", "ttft_p90_s=2s", "e2e_p99_s=800ms", "hit_rate=0.5")]
    assert slo_lag_bound_s(slos) == pytest.approx(0.08)
    assert slo_lag_bound_s([parse_slo("error_rate=0")]) is None


def test_a_closed_loop_has_no_schedule_and_no_check() -> None:
    records = [RequestRecord(f"r{i}", "ok", start_s=0.1 * i) for i in range(5)]
    assert check_client(records, slot_waits=0, concurrency_cap=4) is None
    closed = RunResult("closed", tuple(records), 1.0, "specs")
    assert closed.client_check(0.1) is None
    assert no_schedule() == dict.fromkeys(FIELDS)


def test_exit_codes_give_no_pass_at_a_rate_the_client_never_sent() -> None:
    assert exit_code(10, slo_met=True, client_behind=False, gated=True) == 0
    assert exit_code(10, slo_met=True, client_behind=True, gated=True) == EXIT_CLIENT_BEHIND
    assert exit_code(10, slo_met=True, client_behind=True, gated=False) == 0  # no --slo: flagged only
    # missed with less load than offered is missed
    assert exit_code(10, slo_met=False, client_behind=True, gated=True) == EXIT_SLO_MISSED
    assert exit_code(0, slo_met=False, client_behind=True, gated=True) == 1
    # the time limit cancelled requests in flight: the slowest are in no figure
    assert exit_code(10, slo_met=True, client_behind=True, gated=True, cut_short=True) == EXIT_CUT_SHORT
    assert exit_code(10, slo_met=False, client_behind=False, gated=True, cut_short=True) == EXIT_SLO_MISSED
    assert exit_code(10, slo_met=True, client_behind=False, gated=False, cut_short=True) == 0


def _run(records: list[RequestRecord], mode: str = "open", slot_waits: int = 0) -> RouterRun:
    cap = 4 if mode == "open" else None
    result = RunResult(mode, tuple(records), 3.0, "specs", slot_waits, cap)  # type: ignore[arg-type]
    return RouterRun(parse_router("kvlb"), "ok", result=result, summary=summarize(records, 3.0))


def test_a_loadtest_router_whose_client_fell_behind_is_invalid_with_its_figures() -> None:
    behind = router_entry(_run(_schedule(late_s=0.05), slot_waits=7), None)
    assert set(ROUTER_FIELDS) <= set(behind)
    assert behind["status"] == "invalid" and behind["client_behind"] is True
    assert behind["note"].startswith("client behind its schedule (sent 6.67 of 10 req/s")
    assert behind["client_slot_waits"] == 7 and behind["client_lag_max_s"] == pytest.approx(1.0)
    on_time = router_entry(_run(_schedule()), None)
    assert on_time["status"] == "ok" and on_time["client_behind"] is False
    closed = router_entry(_run([RequestRecord("r", "ok", start_s=0.0, ttft_s=0.1)], mode="closed"), None)
    assert closed["status"] == "ok" and all(closed[key] is None for key in FIELDS)
    report = {"meta": {}, "oracle": None, "routers": [behind, on_time, closed], "targets": []}
    text = markdown(report, [], None)
    assert "| kvlb (**invalid**) | 21 / 21 |" in text and "**6.67 / 10.00 behind**" in text
    assert "| 10.00 / 10.00 |" in text and "| – |" in text  # on time; closed loop: no schedule
    assert "The client fell behind its schedule" in text and "lag p50 / p90 / max" in text


def _point(rate: float, p90: float, invalid: str | None = None) -> RatePoint:
    return RatePoint(rate, "target", 100, 0, p90 / 2, p90, p90 * 2, 0.5, 1000, 500, invalid=invalid)


def test_a_capacity_point_whose_client_fell_behind_never_passes() -> None:
    slo = Slo(ttft_p90_s=1.0)
    assert _point(4.0, 0.5).meets(slo) and not _point(4.0, 0.5, invalid="client behind").meets(slo)
    # the client cannot send 8 req/s or more: the search brackets there, not above
    found = search(lambda rate: _point(rate, 0.5, "client behind" if rate >= 8 else None), slo, 4.0, growth=2)
    assert found.capacity is not None and 4.0 <= found.capacity < 8.0 and found.first_fail == 8.0
    point = _point(8.0, 0.5, invalid="client behind its schedule (…)")
    data = point.to_dict(slo)
    assert data["invalid"] == point.invalid and data["meets_slo"] is False
    assert point_from_dict(data) == point and "invalid" not in _point(4.0, 0.5).to_dict()
    report = {
        "slo": slo.to_dict(),
        "routers": [{"name": "target", "capacity_rate": 4.0, "first_failing_rate": 8.0, "points": [data]}],
    }
    for key in ("vs_round_robin", "vs_best_peer", "ttft_p90_s_at_capacity", "hit_rate_at_capacity"):
        report["routers"][0][key] = None  # type: ignore[index]
    report["routers"][0]["saved_vs_oracle"] = None  # type: ignore[index]
    text = capacity_markdown(report)
    assert "target @ 8 req/s: client behind its schedule" in text.split("## Every point")[0]
    assert "fail (invalid: client behind)" in text


def test_the_target_table_prints_rates_as_rates_and_times_in_ms() -> None:
    from loadtests.target_report import table

    summary = dict.fromkeys(
        ("requests", "ok", "errors", "error_rate", "output_tok_per_s", "ttft_p50_s", "ttft_p99_s"),
    )
    summary |= {"req_per_s": 3.244, "ttft_p90_s": 0.265, "itl_p50_s": None, "itl_p90_s": None}
    summary |= {f"e2e_p{p}_s": None for p in (50, 90, 99)} | {"hit_rate": None, "imbalance": None}
    summary |= {"replica_share": {}}
    meta = {"target": "http://127.0.0.1:1", "model": "m", "workload": "tenants"}
    text = table({"meta": meta, "summary": summary, "slo": [], "client": no_schedule()})
    assert "req_per_s          3.244" in text and "ttft_p90_s         265 ms" in text
    assert "client sent" not in text  # no schedule: no client line


def test_one_late_send_at_the_end_of_a_short_run_is_no_shortfall() -> None:
    # 20 gaps of 0.1 s, all on time but the last, sent 0.15 s late: the rate over the span is
    # 2.0 / 2.15 = 93%, but the lag p90 is 0 — the endpoint was offered the schedule's load
    records = _schedule()
    last = records[-1]
    records[-1] = RequestRecord(
        last.request_id, "ok", start_s=last.start_s + 0.15, scheduled_s=last.scheduled_s
    )
    check = check_client(records, slot_waits=0, concurrency_cap=512)
    assert check is not None and check.sent_rate_per_s / check.scheduled_rate_per_s < MIN_SENT_SHARE
    assert not check.behind and check.lag_max_s == pytest.approx(0.15)
