"""``kvlb capacity --confirm`` judges its client by the rule of ``kvlb loadtest`` and ``--target``
(loadtests/client_lag.py), in model time: the records are wall time, the fleet runs at
``--time-scale`` model seconds per wall second, and the SLO is model time. On hand-made records."""

from __future__ import annotations

import pytest

from loadtests.capacity.confirm import CONFIRM_ADVICE, confirm_client
from loadtests.capacity.report import build_report, markdown
from loadtests.capacity.search import RatePoint, Search, Slo
from loadtests.client_lag import FIELDS, check_client, no_schedule
from loadtests.driver import RunResult
from loadtests.stats import RequestRecord


def _late(late_s: float, n: int = 21, gap_s: float = 0.1) -> list[RequestRecord]:
    """``n`` requests ``gap_s`` apart (wall s), each after the first sent ``late_s`` late, and one
    more on time ``gap_s`` after the last: the rate is kept, the lag p90 is ``late_s``."""
    records = [
        RequestRecord(f"r{i}", "ok", start_s=gap_s * i + (late_s if i else 0.0), scheduled_s=gap_s * i)
        for i in range(n)
    ]
    records.append(RequestRecord("last", "ok", start_s=gap_s * n, scheduled_s=gap_s * n))
    return records


def _drifting(late_s: float, n: int = 21, gap_s: float = 0.1) -> list[RequestRecord]:
    """``n`` requests ``gap_s`` apart (wall s); request ``i`` sent ``i × late_s`` late."""
    return [
        RequestRecord(f"r{i}", "ok", start_s=i * (gap_s + late_s), scheduled_s=i * gap_s, ttft_s=0.05)
        for i in range(n)
    ]


def _open(records: list[RequestRecord]) -> RunResult:
    """An open-loop run of ``records`` with an in-flight cap of 64 that never bound."""
    return RunResult("open", tuple(records), 3.0, "specs", 0, 64)


@pytest.mark.parametrize("scale", [0.25, 0.5, 1.0, 4.0])
def test_the_figures_are_model_time_wall_times_the_scale(scale: float) -> None:
    wall = check_client(_late(0.05), slot_waits=0, concurrency_cap=64)
    model = check_client(_late(0.05), slot_waits=0, concurrency_cap=64, time_scale=scale)
    assert wall is not None and model is not None
    # a lag of w wall s is w × scale model s; a rate of r per wall s is r / scale per model s
    assert model.lag_p90_s == pytest.approx(0.05 * scale) == pytest.approx(wall.lag_p90_s * scale)
    assert model.lag_p50_s == pytest.approx(wall.lag_p50_s * scale)
    assert model.lag_max_s == pytest.approx(wall.lag_max_s * scale)
    assert model.scheduled_rate_per_s == pytest.approx(10.0 / scale)
    assert model.sent_rate_per_s == pytest.approx(wall.sent_rate_per_s / scale)


def test_the_lag_bound_is_compared_in_model_time() -> None:
    # 50 wall ms late against a 0.4 model s SLO (bound 40 model ms): at scale 1 the lag is 50 model
    # ms, over; at 0.25 (the fleet four times slower than the model) 12.5 model ms, within; at 4
    # (faster) 200 model ms, over
    slo = Slo(ttft_p90_s=0.4)
    verdicts = {}
    for scale in (1.0, 0.25, 4.0):
        figures, note = confirm_client(_open(_late(0.05)), slo, scale)
        assert figures["client_lag_bound_s"] == pytest.approx(0.04)
        verdicts[scale] = figures["client_behind"]
        assert (note is not None) == figures["client_behind"]
    assert verdicts == {1.0: True, 0.25: False, 4.0: True}
    # the tightest TTFT bound sets it: p99 when it is the tighter
    figures, _ = confirm_client(_open(_late(0.05)), Slo(ttft_p90_s=2.0, ttft_p99_s=1.0), 1.0)
    assert figures["client_lag_bound_s"] == pytest.approx(0.1) and figures["client_behind"] is False
    check = check_client(_late(0.05), slot_waits=0, concurrency_cap=64, lag_bound_s=0.04)
    assert check is not None and check.reasons == (
        "lag p90 50.0 ms > 40.0 ms (10% of the tightest latency SLO)",
    )


@pytest.mark.parametrize("scale", [0.25, 1.0, 4.0])
def test_the_rate_rule_and_the_cap_rule_do_not_change_with_the_scale(scale: float) -> None:
    # 94.3% of the rate over the run, lag p90 well past 2% of the span: behind at any scale
    slow = check_client(_drifting(0.006), slot_waits=0, concurrency_cap=64, time_scale=scale)
    assert slow is not None and slow.behind and "94% < 95%" in slow.reasons[0]
    # the reason names model rates: 10 req/s per wall s is 10 / scale per model s
    assert f"of {10.0 / scale:.3g} req/s" in slow.reasons[0]
    almost = check_client(_drifting(0.004), slot_waits=0, concurrency_cap=64, time_scale=scale)
    assert almost is not None and not almost.behind
    waited = check_client(_late(0.0), slot_waits=2, concurrency_cap=40, time_scale=scale)
    assert waited is not None and waited.reasons == ("2 launches waited for the in-flight cap of 40",)


def test_a_scale_that_is_no_positive_number_is_refused() -> None:
    for scale in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="time_scale"):
            check_client(_late(0.0), slot_waits=0, concurrency_cap=64, time_scale=scale)


def test_a_confirmed_point_whose_client_fell_behind_is_invalid_and_the_report_says_why() -> None:
    slo = Slo(ttft_p90_s=1.0)
    on_time, on_time_note = confirm_client(_open(_late(0.0)), slo, 0.5)
    assert tuple(on_time) == FIELDS and on_time_note is None
    assert on_time["client_behind"] is False and on_time["client_behind_reasons"] == []
    assert on_time["client_slot_waits"] == 0 and on_time["client_concurrency_cap"] == 64
    assert on_time["client_scheduled_rate_per_s"] == pytest.approx(20.0)  # 10 per wall s at 0.5
    behind, note = confirm_client(_open(_drifting(0.05)), slo, 0.5)
    assert behind["client_behind"] is True and note is not None
    assert note.startswith("client behind its schedule (sent 13.3 of 20 req/s, 67% < 95%")
    assert note.endswith(CONFIRM_ADVICE) and "--time-scale" in note
    closed = RunResult("closed", tuple(_late(0.0)), 3.0, "specs")
    assert confirm_client(closed, slo, 0.5) == (no_schedule(), None)

    def fleet(repeat: int, invalid: str | None, client: dict[str, object]) -> RatePoint:
        extra = {"fleet_router": "kvlb", "repeat": repeat, **client}
        return RatePoint(8.0, "fleet", 22, 0, 0.2, 0.4, 0.6, 0.5, 1000, 500, extra=extra, invalid=invalid)

    good, bad = fleet(0, on_time_note, on_time), fleet(1, note, behind)
    assert good.meets(slo) and not bad.meets(slo)  # the same TTFT: no pass at a rate never sent
    sim = RatePoint(8.0, "sim", 22, 0, 0.2, 0.4, 0.6, 0.5, 1000, 500)
    report = build_report({}, slo, {"kvlb": Search((sim,), 8.0, None)}, [], confirmed={"kvlb": [good, bad]})
    assert [p["meets_slo"] for p in report["routers"][0]["confirmed"]] == [True, False]
    assert report["routers"][0]["confirmed"][1]["invalid"] == note
    text = markdown(report)
    head = text.split("## Every point")[0]
    assert "8 (pass, p90 0.4 s), 8 (fail, p90 0.4 s; invalid: client behind, sent 13.3 of 20/s)" in head
    assert f"- kvlb @ 8 req/s (fleet, repeat 1): {note}" in head
    assert "(fleet, repeat 0)" not in head
    assert "| kvlb | fleet | 8 | 0.4 | 0.6 | 0 | 0.5 | fail (invalid: client behind) |" in text
