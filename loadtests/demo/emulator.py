"""The demo's emulated fleet, split over child processes (I/O).

``kvlb emulate`` takes its KV pool from a named profile; the demo wants a cache-constrained replica (a
profile with a smaller pool, so that a modest workload already overflows one replica's cache), so it
runs its own small child entry point::

    python -m loadtests.demo.emulator --replicas 2 --index-offset 0 --profile cpu-small-llama \\
        --kv-capacity-tokens 16384 --time-scale 0.5 [--engines vllm]

which starts those replicas in-process (:class:`replicas.emulator.Emulator`; ``--engines mixed``, the
default: SGLang at even indices and TRT-LLM at odd ones; the balancer's default tokenizer), prints
``{"replicas": [...]}`` and serves until SIGTERM/SIGINT. :func:`start_emulator` starts the children and
returns their listings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtests.emulate import BALANCER_TOKENIZERS
from loadtests.fleet.child_process import Child, python_module, spawn
from replicas.emulator import Emulator, EmulatorSpec, template_config
from replicas.sim.profiles import Profile, get_profile
from replicas.sim.tokenizer import DEFAULT_TOKENIZER

ENGINE_CHOICES = ("mixed", "sglang", "vllm", "trtllm")
"""What ``--engines`` takes: ``mixed`` alternates SGLang and TRT-LLM; the others are one engine."""


def demo_profile(name: str, kv_capacity_tokens: int | None) -> Profile:
    """Profile ``name``, with its KV pool set to ``kv_capacity_tokens`` when given."""
    profile = get_profile(name)
    if kv_capacity_tokens is None:
        return profile
    return profile.with_overrides(kv_capacity_tokens=kv_capacity_tokens)


async def start_emulator(
    *,
    replicas: int,
    processes: int,
    profile: str,
    kv_capacity_tokens: int | None,
    time_scale: float,
    log_dir: Path,
    children: list[Child],
    engines: str = "mixed",
) -> list[dict[str, Any]]:
    """Start ``replicas`` replicas over ``processes`` children (appended to ``children`` as they
    start, so the caller stops them whatever happens); returns every replica's listing."""
    processes = max(1, min(processes, replicas))
    per_child, extra = divmod(replicas, processes)
    common = ["--profile", profile, "--time-scale", str(time_scale), "--engines", engines]
    if kv_capacity_tokens is not None:
        common += ["--kv-capacity-tokens", str(kv_capacity_tokens)]
    pending = []
    offset = 0
    for index in range(processes):
        count = per_child + (1 if index < extra else 0)
        argv = python_module(
            "loadtests.demo.emulator", "--replicas", str(count), "--index-offset", str(offset), *common
        )
        name = f"fleet-{index}"
        pending.append(spawn(name, argv, log_dir / f"{name}.stderr", ready_key="replicas"))
        offset += count
    listings: list[dict[str, Any]] = []
    results = await asyncio.gather(*pending, return_exceptions=True)
    for result in results:  # keep every child that started, so that it is stopped
        if isinstance(result, Child):
            children.append(result)
            listings.extend(result.info["replicas"])
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return listings


async def serve(args: argparse.Namespace) -> None:
    template = template_config(profile=args.profile, time_scale=args.time_scale)
    template = replace(
        template,
        profile=demo_profile(args.profile, args.kv_capacity_tokens),
        model_path=BALANCER_TOKENIZERS.model_path(DEFAULT_TOKENIZER),
    )
    spec = EmulatorSpec(
        replicas=args.replicas, engine=args.engines, template=template, index_offset=args.index_offset
    )
    tokenizer = await asyncio.to_thread(BALANCER_TOKENIZERS.load, DEFAULT_TOKENIZER)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    async with Emulator(spec.configs(), tokenizer) as fleet:
        print(json.dumps({"replicas": fleet.describe()}), flush=True)
        await stopped.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.demo.emulator", description=__doc__)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--index-offset", type=int, default=0)
    parser.add_argument("--profile", default="cpu-small-llama")
    parser.add_argument("--kv-capacity-tokens", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--engines", choices=ENGINE_CHOICES, default="mixed")
    args = parser.parse_args(argv)
    run = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
