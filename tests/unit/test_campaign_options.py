"""The fleet (``emulator_options``) a command's parsed arguments start, for ``kvlb loadtest``, its
what-if check and ``kvlb capacity --confirm``, and how the load test and the what-if check drive each
router (``drive_options``), with their real parsers."""

from __future__ import annotations

import argparse

from loadtests.capacity.command import apply_presets
from loadtests.command import drive_options, register
from loadtests.fleet.processes import EmulatorOptions, emulator_options
from loadtests.runs import DriveOptions


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())  # kvlb loadtest and kvlb capacity
    return parser.parse_args(list(argv))


FLEET = ("--replicas", "3", "--profile", "cpu-test", "--kv-capacity-tokens", "4096", "--time-scale", "0.25")


def test_loadtest_options_carry_every_fleet_flag() -> None:
    args = _parse("loadtest", *FLEET, "--max-context-tokens", "2048", "--processes", "1", "--engine", "vllm")
    options = emulator_options(args, engine=args.engine, event_flavor="vllm")
    assert options == EmulatorOptions(
        replicas=3,
        profile="cpu-test",
        kv_capacity_tokens=4096,
        max_context_tokens=2048,
        time_scale=0.25,
        processes=1,
        engine="vllm",
        event_flavor="vllm",
    )


def test_defaults_are_the_emulator_options_defaults() -> None:
    assert emulator_options(_parse("loadtest")) == EmulatorOptions()
    capacity = _parse("capacity")
    apply_presets(capacity)  # --replicas defaults to None until then (a preset, not an override)
    assert emulator_options(capacity) == EmulatorOptions()


def test_capacity_has_no_context_limit_flag_and_gets_the_profiles() -> None:
    args = _parse("capacity", *FLEET, "--processes", "3")
    assert not hasattr(args, "max_context_tokens")
    options = emulator_options(args)
    assert options == EmulatorOptions(
        replicas=3, profile="cpu-test", kv_capacity_tokens=4096, time_scale=0.25, processes=3
    )


def test_drive_options_carry_the_drive_flags_and_the_given_kvlb_settings() -> None:
    args = _parse(
        "loadtest", "--mode", "closed", "--concurrency", "7", "--max-duration-s", "30", "--timeout-s", "9",
        "--sample-interval-s", "0.25", "--seed", "11",
    )  # fmt: skip
    drive = drive_options(args, kvlb_sets=["a=1", "b=2"], kvlb_workers=1)
    assert drive == DriveOptions(
        mode="closed",
        concurrency=7,
        max_duration_s=30.0,
        timeout_s=9.0,
        sample_interval_s=0.25,
        seed=11,
        kvlb_sets=("a=1", "b=2"),
        kvlb_workers=1,
    )
