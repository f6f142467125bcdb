"""kvlb's routing timers on the emulated fleet's model time (:mod:`loadtests.kvlb_timers`): the
mapping, read back through the real config loader, and what ``kvlb capacity --confirm`` and
``kvlb loadtest`` pass their kvlb."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from balancer import config
from balancer.cli.main import build_parser
from balancer.policy.base import PolicyWeights
from loadtests.capacity.confirm import kvlb_workers
from loadtests.capacity.report import markdown
from loadtests.command import drive_options
from loadtests.kvlb_timers import (
    MODEL_TIME_SETTINGS,
    fleet_sets,
    fleet_sets_of,
    model_time_sets,
    model_time_weights,
)


def _load(
    tmp_path: Path, sets: tuple[str, ...], weights: dict[str, float | None] | None = None
) -> config.Settings:
    path = tmp_path / "kvlb.yaml"
    replica = {"id": "r0", "url": "http://127.0.0.1:9", "engine": "sglang"}
    tree: dict[str, object] = {"pools": [{"model": "m", "replicas": [replica]}]}
    if weights is not None:
        tree["policy"] = {"name": "cost", "weights": weights}
    path.write_text(yaml.safe_dump(tree))
    return config.load(path, sets=sets, env={})


def test_every_routing_timer_lasts_its_default_in_model_time(tmp_path: Path) -> None:
    """At 0.25 model s per wall s each timer is 4× its default in wall seconds (the 2 s TTL is 8 s,
    2 model s as in the simulator), and the real loader accepts and applies every override."""
    sets = model_time_sets(0.25)
    assert {s.split("=")[0] for s in sets} == set(MODEL_TIME_SETTINGS)
    s = _load(tmp_path, sets)
    assert s.limits.speculative_ttl_s == 8.0
    assert s.timeouts.first_byte_s == 240.0
    assert s.scrape_interval_s == 4.0
    assert (s.limits.gap_hold_s, s.limits.gap_keep_s) == (2.0, 8.0)
    assert s.limits.queue_timeout_s == 8.0  # the admission wait: 2 model s, as on real engines
    # untouched: timers that change no decision on a healthy fleet
    assert s.health_interval_s == 2.0
    # faster than real time, shorter; at 1, nothing
    fast = _load(tmp_path, model_time_sets(2.0))
    assert (fast.limits.speculative_ttl_s, fast.scrape_interval_s) == (1.0, 0.5)
    assert model_time_sets(1.0) == ()
    with pytest.raises(ValueError):
        model_time_sets(0.0)


def test_the_users_value_wins_and_capped_timers_stay_valid(tmp_path: Path) -> None:
    sets = fleet_sets(0.25, ["limits.speculative_ttl_s=3", "policy.name=cost"])
    assert sets.user == ("limits.speculative_ttl_s=3", "policy.name=cost")
    assert not any(s.startswith("limits.speculative_ttl_s=") for s in sets.model_time)
    assert _load(tmp_path, sets.all).limits.speculative_ttl_s == 3.0
    assert fleet_sets(0.25, [], wall_timers=True).all == ()
    # gap_keep_s is at most 60 s (the settings' validation): 2 s / 0.02 would be 100
    slow = _load(tmp_path, model_time_sets(0.02))
    limits = slow.limits
    assert (limits.gap_hold_s, limits.gap_keep_s, limits.speculative_ttl_s) == (25.0, 60.0, 100.0)


def test_capacity_confirm_and_loadtest_pass_the_model_time_timers_and_one_worker() -> None:
    parser = build_parser()
    args = parser.parse_args(["capacity", "--confirm", "--time-scale", "0.25"])
    assert fleet_sets_of(args).all == model_time_sets(0.25)
    assert kvlb_workers(args) == 1  # the simulator models one router process
    given = parser.parse_args(["capacity", "--time-scale", "0.25", "--kvlb-set", "scrape_interval_s=1",
                               "--kvlb-workers", "0"])  # fmt: skip
    assert "scrape_interval_s=1" in fleet_sets_of(given).all
    assert not any(s.startswith("scrape_interval_s=") for s in fleet_sets_of(given).model_time)
    assert kvlb_workers(given) is None  # 0: kvlb's own default
    wall = parser.parse_args(["capacity", "--time-scale", "0.25", "--kvlb-wall-timers"])
    assert fleet_sets_of(wall).all == ()
    load = parser.parse_args(["loadtest", "--time-scale", "0.5"])
    assert fleet_sets_of(load).all == model_time_sets(0.5)
    assert load.kvlb_workers is None  # kvlb loadtest measures kvlb as deployed: its own workers


def test_the_capacity_report_says_what_the_fleets_kvlb_ran_with() -> None:
    meta = {"confirmed_on_fleet": True, "time_scale": 0.25, "kvlb_workers": 1,
            "kvlb_model_time_sets": list(model_time_sets(0.25)), "kvlb_sets": []}  # fmt: skip
    report = {"slo": {"ttft_p90_s": 2.0, "max_error_rate": 0.001}, "routers": [], "meta": meta}
    text = markdown(report)
    assert "The fleet's kvlb: 1 worker(s) at time scale 0.25; its routing timers on model time" in text
    assert "`limits.speculative_ttl_s=8`" in text
    wall = markdown({**report, "meta": {**meta, "kvlb_model_time_sets": [], "kvlb_workers": None}})
    assert "its default worker(s) at time scale 0.25; its timers on wall time" in wall
    assert "The fleet's kvlb" not in markdown({**report, "meta": {"confirmed_on_fleet": False}})


def test_the_ramps_memory_lasts_its_model_seconds_on_the_fleet(tmp_path: Path) -> None:
    """``ramp_memory_s`` is read on the shell's wall clock: at 0.5 model s per wall s a router's 0.2
    is 0.4 wall s in the config the fleet's kvlb loads (0.2 model s, as the simulator averages);
    off stays off, the other weights are untouched, and a user's ``--kvlb-set`` still wins."""
    weights = {"ramp_memory_s": 0.2, "root_weight": 1.0}
    assert model_time_weights(weights, 0.5) == {"ramp_memory_s": 0.4, "root_weight": 1.0}
    assert model_time_weights(weights, 1.0) == weights
    assert model_time_weights({"ramp_memory_s": None}, 0.25) == {"ramp_memory_s": None}
    assert model_time_weights({"ramp_memory_s": 0.0}, 0.25) == {"ramp_memory_s": 0.0}
    default = PolicyWeights().ramp_memory_s  # a router string that does not name it: the default's
    expected = {} if not default else {"ramp_memory_s": default / 0.25}
    assert model_time_weights({}, 0.25) == expected
    with pytest.raises(ValueError):
        model_time_weights(weights, 0.0)
    loaded = _load(tmp_path, (), model_time_weights(weights, 0.25))
    assert loaded.policy.weights["ramp_memory_s"] == 0.8
    user = ("policy.weights.ramp_memory_s=0.3",)
    assert _load(tmp_path, user, model_time_weights(weights, 0.25)).policy.weights["ramp_memory_s"] == 0.3


def test_loadtest_and_capacity_scale_the_weights_unless_the_timers_stay_on_wall_time() -> None:
    parser = build_parser()
    for command in ("loadtest", "capacity"):
        args = parser.parse_args([command, "--time-scale", "0.5"])
        assert fleet_sets_of(args).weight_time_scale == 0.5
        wall = parser.parse_args([command, "--time-scale", "0.5", "--kvlb-wall-timers"])
        assert fleet_sets_of(wall).weight_time_scale == 1.0
    args = parser.parse_args(["loadtest", "--time-scale", "0.5"])
    sets = fleet_sets_of(args)
    drive = drive_options(
        args, kvlb_sets=sets.all, kvlb_workers=None, kvlb_weight_time_scale=sets.weight_time_scale
    )
    assert drive.kvlb_weight_time_scale == 0.5
