"""Small pure parts of the emulator: fault settings, sampling, config rules, launch-config consistency."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from replicas.emulator import EmulatorSpec, template_config
from replicas.sim.config import TRTLLM_TOKENS_PER_BLOCK, ReplicaConfig
from replicas.sim.faults import FaultSettings, FaultState, parse_fault_request
from replicas.sim.profiles import PROFILES, get_profile
from replicas.sim.sampling import WORDS, sample_token, sampling_salt, token_text

REPLICAS = Path(__file__).resolve().parents[2] / "replicas"


def test_fault_request_applies_settings_and_actions_and_rejects_typos() -> None:
    settings, actions = parse_fault_request(FaultSettings(), {"slowdown": 2.5, "restart": True, "stall_s": 1})
    assert settings.slowdown == 2.5 and settings.drop_events == 0.0
    assert actions.restart and actions.stall_s == 1 and actions.refuse_s == 0
    for bad in (
        {"slowdwn": 2},
        {"drop_events": 1.5},
        {"slowdown": 0},
        {"stall_s": -1},
        {"crash_after_chunks": -2},
    ):
        with pytest.raises(ValueError):
            parse_fault_request(FaultSettings(), bad)


def test_drop_fraction_is_seeded_and_counted() -> None:
    def drops(seed: int) -> list[bool]:
        state = FaultState(FaultSettings(drop_events=0.3), random.Random(seed))
        return [state.drop_batch() for _ in range(1000)]

    first = drops(1)
    assert first == drops(1) and 250 < sum(first) < 350
    assert not any(FaultState(FaultSettings(), random.Random(1)).drop_batch() for _ in range(100))
    always = FaultState(FaultSettings(drop_events=1.0), random.Random(1))
    assert all(always.drop_batch() for _ in range(10)) and always.dropped_batches == 10


def test_sampling_salts_and_token_range() -> None:
    assert sampling_salt(0.0, 7, 3) == 0
    assert sampling_salt(0.7, 7, 3) == sampling_salt(0.7, 7, 99) != sampling_salt(0.7, None, 3)
    assert sampling_salt(0.7, None, 3) != sampling_salt(0.7, None, 4)
    tokens = [sample_token(12345, index, 0, 1000) for index in range(2000)]
    assert min(tokens) >= 100 and max(tokens) < 1000 and len(set(tokens)) > 800
    assert token_text(tokens[0]).strip() in WORDS


def test_config_block_size_defaults_per_engine_and_validation() -> None:
    profile = get_profile("h100-llama3-8b")
    assert ReplicaConfig(name="a", engine="sglang", profile=profile).block_size == profile.page_size
    trt = ReplicaConfig(name="b", engine="trtllm", profile=profile)
    assert trt.block_size == TRTLLM_TOKENS_PER_BLOCK == 32
    assert trt.capacity_blocks == profile.kv_capacity_tokens // 32
    for bad in ({"dp_size": 0}, {"event_encoding": "json"}, {"metrics_prefix": "vllm:"}, {"buffer_steps": 0}):
        with pytest.raises(ValueError):
            ReplicaConfig(name="c", engine="sglang", profile=profile, **bad)
    with pytest.raises(KeyError, match="known"):
        get_profile("a100-nope")


def test_mixed_fleet_alternates_engines_and_lays_out_ports() -> None:
    spec = EmulatorSpec(
        replicas=4, engine="mixed", template=template_config(profile="cpu-test", dp_size=2),
        base_port=9000, event_port_base=9100, index_offset=2,
    )  # fmt: skip
    configs = spec.configs()
    assert [c.name for c in configs] == ["sim-2", "sim-3", "sim-4", "sim-5"]
    assert [c.engine for c in configs] == ["sglang", "trtllm", "sglang", "trtllm"]
    assert [c.http_port for c in configs] == [9002, 9003, 9004, 9005]
    assert (configs[0].event_port, configs[0].replay_port) == (9108, 9110)


def test_real_engine_launch_configs_match_what_the_emulator_copies() -> None:
    """The documented real-engine settings are the ones the emulator's defaults mirror."""
    trt = yaml.safe_load((REPLICAS / "trtllm" / "extra-llm-api-config.yaml").read_text())
    kv = trt["kv_cache_config"]
    assert kv["enable_block_reuse"] is True and kv["tokens_per_block"] == TRTLLM_TOKENS_PER_BLOCK
    default = ReplicaConfig(name="t", engine="trtllm", profile=PROFILES["cpu-test"])
    assert kv["event_buffer_max_size"] == default.event_buffer_max_size > 0
    assert trt["enable_iter_perf_stats"] is True
    sglang = json.loads((REPLICAS / "sglang" / "kv-events-config.json").read_text())
    assert sglang["publisher"] == "zmq" and sglang["endpoint"].startswith("tcp://*:")
    assert (
        sglang["buffer_steps"]
        == ReplicaConfig(name="s", engine="sglang", profile=PROFILES["cpu-test"]).buffer_steps
    )
    launch = (REPLICAS / "sglang" / "launch.sh").read_text()
    for flag in ("--kv-events-config", '\\"publisher\\":\\"zmq\\"', "--enable-metrics", "--page-size"):
        assert flag.replace("\\", "") in launch.replace("\\", "")
