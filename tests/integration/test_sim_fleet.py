"""Fleets: the in-process port layout, and ``kvlb emulate`` as a real process (listing, idle CPU, SIGTERM;
its deprecated name ``kvlb sim``; ``python -m replicas.command`` alone)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

import aiohttp
import pytest

from balancer.tokenizer.tokenizer import TokenIdTokenizer
from loadtests.emulate import COMMAND as EMULATE
from loadtests.emulator_measure import cpu_seconds
from replicas.command import add_arguments
from replicas.emulator import Emulator, EmulatorSpec, ProcessEmulator, template_config
from replicas.sim.ports import free_port_run

IDLE_CPU_LIMIT = 0.05
"""The target: an idle replica costs at most 5% of one core."""


async def test_fleet_port_layout_and_mixed_engines() -> None:
    base = free_port_run("127.0.0.1", 3)
    events = free_port_run("127.0.0.1", 12)
    spec = EmulatorSpec(
        replicas=3,
        engine="mixed",
        template=template_config(profile="cpu-test", time_scale=20.0, dp_size=2),
        base_port=base,
        event_port_base=events,
    )
    async with Emulator(spec.configs(), TokenIdTokenizer()) as fleet, aiohttp.ClientSession() as session:
        listing = fleet.describe()
        assert [r["engine"] for r in listing] == ["sglang", "trtllm", "sglang"]
        assert [r["url"] for r in listing] == [f"http://127.0.0.1:{base + i}" for i in range(3)]
        assert listing[0]["events"] == [f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 1}"]
        assert listing[0]["replay"] == [f"tcp://127.0.0.1:{events + 2}", f"tcp://127.0.0.1:{events + 3}"]
        assert listing[2]["events"][0] == f"tcp://127.0.0.1:{events + 8}"
        for replica in listing:
            body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2}
            async with session.post(replica["url"] + "/v1/completions", json=body) as response:
                assert response.status == 200


async def test_kvlb_emulate_process_lists_idles_cheaply_and_stops_on_sigterm() -> None:
    args = ["--replicas", "2", "--engine", "mixed", "--profile", "cpu-test", "--tokenizer", "none"]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "emulate", *args, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        lines: list[str] = []
        async with asyncio.timeout(30):
            while not (lines and lines[-1].startswith("{")):
                lines.append((await process.stdout.readline()).decode().strip())
        replicas: list[dict[str, Any]] = json.loads(lines[-1])["replicas"]
        assert len(lines) == 3 and lines[0].startswith("sim-0 sglang http://127.0.0.1:")
        assert "events=tcp://127.0.0.1:" in lines[0] and lines[1].startswith("sim-1 trtllm")
        async with aiohttp.ClientSession() as session:
            for replica in replicas:
                body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}
                async with session.post(replica["url"] + "/v1/completions", json=body) as response:
                    assert response.status == 200
        await asyncio.sleep(0.5)
        before = cpu_seconds(process.pid)
        await asyncio.sleep(2.0)
        idle_per_replica = (cpu_seconds(process.pid) - before) / 2.0 / len(replicas)
        assert idle_per_replica < IDLE_CPU_LIMIT
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_kvlb_emulate_served_model_name_is_the_model_a_vllm_fleet_serves() -> None:
    """``--served-model-name``, as vLLM's own flag (passed on to ``--processes`` children): the listing,
    ``GET /v1/models`` and the answers name it, and a vLLM replica answers 404 for the profile's name.
    Without it a kvlb pool named otherwise (``examples/kvlb.yaml``'s ``kvlb-demo``) had every emulated
    vLLM replica out of routing, and the prober's fix, the engine's ``--served-model-name``, did not
    exist here (the new user's walk, 2026-12-01)."""
    args = ["--replicas", "1", "--engine", "vllm", "--profile", "cpu-test"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    children = EMULATE.spec_from_args(parser.parse_args([*args, "--served-model-name", "kvlb-demo"]))
    assert "--served-model-name kvlb-demo" in " ".join(children.extra_args)  # what --processes N pass on
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "emulate", *args, "--tokenizer", "none",
        "--served-model-name", "kvlb-demo", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        lines: list[str] = []
        async with asyncio.timeout(60):
            while not (lines and lines[-1].startswith("{")):
                line = await process.stdout.readline()
                assert line, "kvlb emulate ended before its listing"
                lines.append(line.decode().strip())
        replicas: list[dict[str, Any]] = json.loads(lines[-1])["replicas"]
        assert [r["model"] for r in replicas] == ["kvlb-demo"]
        async with aiohttp.ClientSession() as session:
            for replica in replicas:
                async with session.get(replica["url"] + "/v1/models") as response:
                    assert [m["id"] for m in (await response.json())["data"]] == ["kvlb-demo"]
                for model, status in (("kvlb-demo", 200), ("sim-test", 404)):  # cpu-test's own name
                    body = {"model": model, "prompt": [1, 2, 3, 4, 5], "max_tokens": 3}
                    async with session.post(replica["url"] + "/v1/completions", json=body) as response:
                        assert response.status == status, (model, await response.text())
                        if status == 200:
                            assert (await response.json())["model"] == "kvlb-demo"
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize(
    "bad", [["--profile", "nope"], ["--replicas", "1", "--slowdown", "0"], ["--tokenizer", "default"]]
)
async def test_replicas_command_rejects_bad_arguments(bad: list[str]) -> None:
    """``python -m replicas.command`` binds no tokenizer loader: ``--tokenizer none`` only."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replicas.command", "--tokenizer", "none", *bad,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    async with asyncio.timeout(30):
        assert await process.wait() == 2


async def test_kvlb_sim_warns_once_then_runs_as_emulate() -> None:
    args = ["--replicas", "1", "--engine", "sglang", "--profile", "cpu-test", "--tokenizer", "none"]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "balancer", "sim", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None and process.stderr is not None
        async with asyncio.timeout(30):
            warning = (await process.stderr.readline()).decode()
            lines = [(await process.stdout.readline()).decode().strip() for _ in range(2)]
        assert warning == "kvlb sim: deprecated, use 'kvlb emulate' (the same options)\n"
        assert lines[0].startswith("sim-0 sglang http://127.0.0.1:")
        (replica,) = json.loads(lines[1])["replicas"]
        async with aiohttp.ClientSession() as session:
            body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}
            async with session.post(replica["url"] + "/v1/completions", json=body) as response:
                assert response.status == 200
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await process.wait() == 0
        assert b"deprecated" not in await process.stderr.read()  # one warning line, no more
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_process_fleet_splits_replicas_over_children() -> None:
    spec = EmulatorSpec(
        replicas=3,
        engine="trtllm",
        template=template_config(profile="cpu-test"),
        tokenizer="none",
        extra_args=("--profile", "cpu-test", "--time-scale", "20"),
    )
    fleet = ProcessEmulator(spec, processes=2)
    try:
        await fleet.start()
        assert len(fleet.pids) == 2 and [r["name"] for r in fleet.replicas] == ["sim-0", "sim-1", "sim-2"]
        async with aiohttp.ClientSession() as session:
            for replica in fleet.replicas:
                assert replica["engine"] == "trtllm"
                body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}
                async with session.post(replica["url"] + "/v1/completions", json=body) as response:
                    assert response.status == 200
    finally:
        children = list(fleet.children)
        await fleet.stop()
    assert all(child.returncode == 0 for child in children)
