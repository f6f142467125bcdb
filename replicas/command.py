"""``kvlb emulate``: start a fleet of emulated engine replicas and run until Ctrl-C/SIGTERM (I/O).

Prints one line per replica (name, engine, HTTP URL, event endpoints), then one JSON line
``{"replicas": [...]}`` for scripts. ``kvlb sim`` is its deprecated old name (a warning on stderr,
then the same command).

:class:`EmulateCommand` is the command bound to a tokenizer loader (:mod:`replicas.sim.tokenizer`) and
to the module its child processes run. This module binds none: ``python -m replicas.command`` (the
child form of :class:`replicas.emulator.ProcessEmulator`) serves token-id prompts only
(``--tokenizer none``). ``kvlb emulate`` is :mod:`loadtests.emulate`, which binds the balancer's
tokenizers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from replicas.emulator import EMULATOR_MODULE, Emulator, EmulatorSpec, ProcessEmulator, template_config
from replicas.sim.faults import FaultSettings
from replicas.sim.profiles import PROFILES
from replicas.sim.tokenizer import DEFAULT_TOKENIZER, TOKEN_IDS_ONLY, TokenizerLoader

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

COMMAND_NAME = "emulate"
"""The subcommand of ``kvlb`` (``kvlb simulate`` is the discrete-event simulator, another thing)."""
DEPRECATED_NAME = "sim"
"""The command's old name, kept as an alias that warns once and then runs the same handler."""

# Options copied to child processes; each maps an argparse dest to its flag.
_PASSTHROUGH = {
    "profile": "--profile", "time_scale": "--time-scale", "dp_size": "--dp-size",
    "event_encoding": "--event-encoding", "page_size": "--page-size", "topic": "--topic",
    "buffer_steps": "--buffer-steps", "event_buffer_max_size": "--event-buffer-max-size",
    "host_cache_blocks": "--host-cache-blocks", "metrics_prefix": "--metrics-prefix",
    "default_max_tokens": "--default-max-tokens", "drop_events": "--drop-events", "slowdown": "--slowdown",
    "crash_after_chunks": "--crash-after-chunks", "seed": "--seed", "log_level": "--log-level",
    "eviction": "--eviction", "api_key": "--api-key", "served_model_name": "--served-model-name",
}  # fmt: skip
_PASSTHROUGH_FLAGS = {
    "fail_health": "--fail-health",
    "epoch_in_topic": "--epoch-in-topic",
    "no_uvloop": "--no-uvloop",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--replicas", type=int, default=2, help="number of replicas (default 2)")
    add("--engine", choices=("sglang", "vllm", "trtllm", "mixed"), default="sglang",
        help="engine to emulate: SGLang 0.5.23, vLLM 0.32, TRT-LLM, "
        "or mixed (SGLang and TRT-LLM alternate)")  # fmt: skip
    add("--profile", choices=sorted(PROFILES), default="h100-llama3-8b", help="timing/capacity profile")
    add("--base-port", type=int, default=0, help="HTTP port of replica 0, +i for replica i (0: free ports)")
    add("--event-port-base", type=int, default=0, help="SGLang/vLLM event ports start here (0: free ports)")
    add("--time-scale", type=float, default=1.0, help="model seconds per wall second (default 1)")
    add("--dp-size", type=int, default=1, help="data-parallel ranks per replica")
    add("--event-encoding", choices=("map", "array"), default="map", help="SGLang/vLLM event encoding")
    add("--page-size", type=int, default=None,
        help="KV page/block size (default: the profile's for SGLang, 32 TRT-LLM, 128 vLLM)")  # fmt: skip
    add("--topic", default="", help="SGLang/vLLM ZMQ topic")
    add("--eviction", choices=("node", "block"), default=None,
        help="KV eviction: whole LRU leaves (SGLang) or just the blocks needed (vLLM); "
        "default: the engine's")  # fmt: skip
    add("--buffer-steps", type=int, default=10_000, help="SGLang/vLLM replay buffer, in batches")
    add("--event-buffer-max-size", type=int, default=16_384, help="TRT-LLM event buffer, in events")
    add("--host-cache-blocks", type=int, default=0, help="TRT-LLM host tier blocks (updated events)")
    add("--metrics-prefix", choices=("sglang:", "sglang_"), default="sglang:", help="SGLang metric prefix")
    add("--epoch-in-topic", action="store_true", help="append SGLang's epoch to the topic frame")
    add("--default-max-tokens", type=int, default=64, help="max_tokens when a request gives none")
    add("--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer folder or tokenizer.json; 'none' for token "
        "ids only; 'default': the balancer's default tokenizer (DeepSeek-V3 with its chat template). "
        "`python -m replicas.command` alone has only 'none'")  # fmt: skip
    add("--drop-events", type=float, default=0.0, help="fault: fraction of event batches lost")
    add("--slowdown", type=float, default=1.0, help="fault: step-time multiplier")
    add("--fail-health", action="store_true", help="fault: health endpoints answer 503")
    add("--crash-after-chunks", type=int, default=None, help="fault: cut streams after N chunks")
    add("--served-model-name", default=None, metavar="NAME",
        help="serve under this model name instead of the profile's, as the engines' own flag (a vLLM "
             "replica answers 404 for any other name; SGLang and TRT-LLM serve any name)")  # fmt: skip
    add("--seed", type=int, default=0, help="seed of fault randomness")
    add("--api-key", default=None, help="refuse calls without 'Authorization: Bearer <key>' (401) on the "
        "paths the engine guards, as vLLM's and SGLang's --api-key do; with --engine trtllm (trtllm-serve "
        "has no such option) as a key-checking proxy before it: every path but /health")  # fmt: skip
    add("--processes", type=int, default=1, help="split the replicas over this many child processes")
    add("--index-offset", type=int, default=0, help=argparse.SUPPRESS)
    add("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    add("--log-level", default="warning", help="logging level")


def print_listing(replicas: Sequence[dict[str, Any]]) -> None:
    for info in replicas:
        endpoints = " ".join(f"{key}={','.join(info[key])}" for key in ("events", "replay") if key in info)
        print(f"{info['name']} {info['engine']} {info['url']} {endpoints}".rstrip())
    print(json.dumps({"replicas": list(replicas)}), flush=True)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def runner(use_uvloop: bool) -> Callable[[Coroutine[Any, Any, None]], None]:
    """``uvloop.run`` when wanted and installed, else ``asyncio.run``."""
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.run
    return asyncio.run


@dataclass(frozen=True, slots=True)
class EmulateCommand:
    """``kvlb emulate`` bound to where its tokenizers come from."""

    tokenizers: TokenizerLoader
    """Reads ``--tokenizer`` (the tokenizer and the ``model_path`` replicas report)."""
    child_module: str
    """What each child of ``--processes N`` runs (``python -m``): a module whose ``main`` is this same
    command, so that the children read ``--tokenizer`` as the parent does."""

    def register(self, subparsers: SubParsers) -> None:
        """Add ``emulate`` and its deprecated alias ``sim`` to a ``kvlb`` command line."""
        parser = subparsers.add_parser(
            COMMAND_NAME,
            help="run emulated SGLang/vLLM/TRT-LLM replicas",
            description="Start a fleet of emulated engine replicas on consecutive ports.",
        )
        add_arguments(parser)
        parser.set_defaults(handler=self.run)
        alias = subparsers.add_parser(
            DEPRECATED_NAME,
            help=f"deprecated: the old name of '{COMMAND_NAME}'",
            description=f"Deprecated: use 'kvlb {COMMAND_NAME}' (the same options).",
        )
        add_arguments(alias)
        alias.set_defaults(handler=self.run_deprecated_alias)

    def spec_from_args(self, args: argparse.Namespace) -> EmulatorSpec:
        """The fleet the arguments describe. Raises ``KeyError`` or ``ValueError`` when they are wrong."""
        faults = FaultSettings(
            drop_events=args.drop_events,
            slowdown=args.slowdown,
            fail_health=args.fail_health,
            crash_after_chunks=args.crash_after_chunks,
            served_model=args.served_model_name,
        )
        template = template_config(
            profile=args.profile,
            time_scale=args.time_scale,
            dp_size=args.dp_size,
            event_encoding=args.event_encoding,
            faults=faults,
            page_size=args.page_size,
            topic=args.topic,
            buffer_steps=args.buffer_steps,
            event_buffer_max_size=args.event_buffer_max_size,
            host_cache_blocks=args.host_cache_blocks,
            metrics_prefix=args.metrics_prefix,
            epoch_in_topic=args.epoch_in_topic,
            default_max_tokens=args.default_max_tokens,
            seed=args.seed,
            eviction=args.eviction,
            api_key=args.api_key,
            model_path=self.tokenizers.model_path(args.tokenizer),
        )
        passthrough: list[str] = []
        for dest, flag in _PASSTHROUGH.items():
            value = getattr(args, dest)
            if value is not None:
                passthrough += [flag, str(value)]
        passthrough += [flag for dest, flag in _PASSTHROUGH_FLAGS.items() if getattr(args, dest)]
        return EmulatorSpec(
            replicas=args.replicas,
            engine=args.engine,
            template=template,
            base_port=args.base_port,
            event_port_base=args.event_port_base,
            index_offset=args.index_offset,
            tokenizer=args.tokenizer,
            extra_args=tuple(passthrough),
        )

    def run(self, args: argparse.Namespace, name: str = COMMAND_NAME) -> int:
        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
        try:
            spec = self.spec_from_args(args)
        except (KeyError, ValueError) as exc:
            print(f"kvlb {name}: {exc}", file=sys.stderr)
            return 2
        import zmq  # the replicas import it anyway; `kvlb emulate --help` need not

        serve = self._serve_processes(spec, args.processes) if args.processes > 1 else self._serve(spec)
        try:
            runner(not args.no_uvloop)(serve)
        except (OSError, zmq.ZMQError, RuntimeError) as exc:  # a port in use; a child that could not start
            print(f"kvlb {name}: cannot start the replicas: {exc}", file=sys.stderr)
            return 2
        return 0

    def run_deprecated_alias(self, args: argparse.Namespace) -> int:
        """``kvlb sim``: one warning line on stderr, then :meth:`run`."""
        print(
            f"kvlb {DEPRECATED_NAME}: deprecated, use 'kvlb {COMMAND_NAME}' (the same options)",
            file=sys.stderr,
            flush=True,
        )
        return self.run(args, DEPRECATED_NAME)

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The child-process form: ``python -m <child_module> [options]``."""
        parser = argparse.ArgumentParser(prog=f"python -m {self.child_module}", description=__doc__)
        add_arguments(parser)
        return self.run(parser.parse_args(argv))

    async def _serve(self, spec: EmulatorSpec) -> None:
        tokenizer = await asyncio.to_thread(self.tokenizers.load, spec.tokenizer)
        async with Emulator(spec.configs(), tokenizer) as fleet:
            print_listing(fleet.describe())
            await _wait_for_signal()

    async def _serve_processes(self, spec: EmulatorSpec, processes: int) -> None:
        fleet = ProcessEmulator(spec, processes, self.child_module)
        try:
            await fleet.start()
            print_listing(fleet.replicas)
            await _wait_for_signal()
        finally:
            await fleet.stop()


TOKEN_IDS_COMMAND = EmulateCommand(TOKEN_IDS_ONLY, EMULATOR_MODULE)
"""The emulator without a tokenizer loader: ``--tokenizer none`` only."""


def main(argv: Sequence[str] | None = None) -> int:
    return TOKEN_IDS_COMMAND.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
