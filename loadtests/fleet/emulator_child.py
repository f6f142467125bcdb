"""Child process of a load-test fleet: ``kvlb emulate`` with the overrides a load test needs (I/O).

``python -m loadtests.fleet.emulator_child --replicas N --index-offset I --profile P [--engine vllm]`` runs N
emulated SGLang (or vLLM) replicas on this process's event loop, prints the fleet listing (one JSON line,
as ``kvlb emulate``) and runs until SIGTERM. Beyond ``kvlb emulate`` it takes ``--kv-capacity-tokens``
(a pool small enough for a workload to overflow one replica), ``--max-context-tokens`` and
``--event-flavor vllm`` (SGLang replicas publishing vLLM's field set).
Tokenizers are the balancer's (:data:`loadtests.emulate.BALANCER_TOKENIZERS`).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from dataclasses import replace

from loadtests.emulate import BALANCER_TOKENIZERS
from replicas.command import print_listing, runner
from replicas.emulator import Emulator, EmulatorSpec, template_config
from replicas.sim.personality_sglang import SglangPersonality
from replicas.sim.profiles import PROFILES
from replicas.sim.tokenizer import DEFAULT_TOKENIZER
from replicas.wire.sglang import KvEventEncoder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.fleet.emulator_child", description=__doc__)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--index-offset", type=int, default=0)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="h100-llama3-8b")
    parser.add_argument("--kv-capacity-tokens", type=int, default=None)
    parser.add_argument("--max-context-tokens", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    parser.add_argument("--event-flavor", choices=("sglang", "vllm"), default="sglang")
    parser.add_argument("--engine", choices=("sglang", "vllm"), default="sglang")
    args = parser.parse_args(argv)
    template = template_config(
        profile=args.profile,
        time_scale=args.time_scale,
        model_path=BALANCER_TOKENIZERS.model_path(args.tokenizer),
    )
    overrides = {
        key: value
        for key, value in (
            ("kv_capacity_tokens", args.kv_capacity_tokens),
            ("max_context_tokens", args.max_context_tokens),
        )
        if value is not None
    }
    template = replace(template, profile=template.profile.with_overrides(**overrides))
    spec = EmulatorSpec(
        replicas=args.replicas,
        engine=args.engine,
        template=template,
        index_offset=args.index_offset,
        tokenizer=args.tokenizer,
    )
    runner(True)(_serve(spec, args.event_flavor))
    return 0


def _use_vllm_events(fleet: Emulator) -> None:
    """SGLang replicas publishing vLLM-shaped events: swaps the encoder of each SGLang publisher (same
    hashes and batches, vLLM's field set). ``--engine vllm`` runs real vLLM personalities instead."""
    for replica in fleet.replicas:
        personality = replica.personality
        if isinstance(personality, SglangPersonality):
            for publisher in personality.publishers:
                encoding = replica.config.event_encoding
                publisher._encoder = KvEventEncoder(flavor="vllm", encoding=encoding)


async def _serve(spec: EmulatorSpec, event_flavor: str = "sglang") -> None:
    tokenizer = await asyncio.to_thread(BALANCER_TOKENIZERS.load, spec.tokenizer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Emulator(spec.configs(), tokenizer) as fleet:
        if event_flavor == "vllm":
            _use_vllm_events(fleet)
        print_listing(fleet.describe())
        await stop.wait()


if __name__ == "__main__":
    raise SystemExit(main())
