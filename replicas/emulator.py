"""Start a fleet of emulated replicas, in this process or as child processes (I/O).

Port layout for ``base_port`` P and ``event_port_base`` E (``0`` for either: free ports): replica ``i``
serves HTTP on ``P + i``; an SGLang or vLLM replica with ``d`` DP ranks publishes on ``E + 2·d·i + r``
and serves replay on ``E + 2·d·i + d + r`` (rank ``r``). ``mixed`` alternates SGLang (even ``i``) and
TRT-LLM (odd ``i``).

:class:`Emulator` runs replicas on the current event loop (tests, the demo). :class:`ProcessEmulator` splits
them over child processes running the emulator's command module (to use several cores): ``python -m
replicas.command`` (token-id prompts only) or a module that binds a tokenizer loader, e.g. ``python -m
loadtests.emulate``; it reads each child's JSON line to learn its replicas, and stops the children
with SIGTERM. Tokenizers come in through :mod:`replicas.sim.tokenizer`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, Literal

import zmq.asyncio

from replicas.sim.config import EventEncoding, ReplicaConfig
from replicas.sim.faults import FaultSettings
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica
from replicas.sim.tokenizer import DEFAULT_TOKENIZER, PromptTokenizer

FleetEngine = Literal["sglang", "trtllm", "vllm", "mixed"]

CHILD_START_TIMEOUT_S = 60.0
"""How long a child process may take to print its replicas."""
CHILD_STOP_TIMEOUT_S = 10.0
"""How long a child may take to exit after SIGTERM before it is killed."""


EMULATOR_MODULE = "replicas.command"
"""The command module children run (``python -m``) when no other is given: token-id prompts only."""


@dataclass(frozen=True, slots=True)
class EmulatorSpec:
    """What ``kvlb emulate`` starts; ``template`` carries every per-replica setting but name and ports."""

    replicas: int
    engine: FleetEngine
    template: ReplicaConfig
    base_port: int = 0
    event_port_base: int = 0
    index_offset: int = 0
    tokenizer: str = DEFAULT_TOKENIZER
    """A ``--tokenizer`` name, read by the child's tokenizer loader (:mod:`replicas.sim.tokenizer`):
    ``default`` (the loader's default; ``kvlb emulate``: the balancer's), ``none`` (token ids only), or a
    tokenizer folder or ``tokenizer.json`` path."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Arguments passed through to child processes (ProcessEmulator)."""

    def configs(self) -> list[ReplicaConfig]:
        configs = []
        dp = self.template.dp_size
        for local in range(self.replicas):
            index = self.index_offset + local
            alternate: Literal["sglang", "trtllm"] = "sglang" if index % 2 == 0 else "trtllm"
            engine = alternate if self.engine == "mixed" else self.engine
            event = self.event_port_base + 2 * dp * index if self.event_port_base else 0
            configs.append(
                replace(
                    self.template,
                    name=f"sim-{index}",
                    engine=engine,
                    http_port=self.base_port + index if self.base_port else 0,
                    event_port=event,
                    replay_port=event + dp if event else 0,
                    seed=self.template.seed + index,
                )
            )
        return configs


class Emulator:
    """Replicas on the running event loop; use as ``async with Emulator(configs, tokenizer) as fleet``."""

    def __init__(self, configs: Sequence[ReplicaConfig], tokenizer: PromptTokenizer) -> None:
        self._configs = list(configs)
        self._tokenizer = tokenizer
        self._zctx: zmq.asyncio.Context | None = None
        self.replicas: list[Replica] = []

    async def start(self) -> None:
        self._zctx = zmq.asyncio.Context()
        try:
            for config in self._configs:
                replica = Replica(config, self._tokenizer, self._zctx)
                await replica.start()
                self.replicas.append(replica)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for replica in reversed(self.replicas):
            await replica.stop()
        self.replicas.clear()
        if self._zctx is not None:
            self._zctx.destroy(linger=0)
            self._zctx = None

    def describe(self) -> list[dict[str, Any]]:
        return [replica.describe() for replica in self.replicas]

    async def __aenter__(self) -> Emulator:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class ProcessEmulator:
    """Replicas split over ``processes`` children, each ``python -m <child_module>``: a module whose
    ``main`` is an emulator command (:class:`replicas.command.EmulateCommand`) bound to the tokenizer
    loader that can read ``spec.tokenizer``."""

    def __init__(self, spec: EmulatorSpec, processes: int, child_module: str = EMULATOR_MODULE) -> None:
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self.spec = spec
        self.child_module = child_module
        self.processes = min(processes, spec.replicas)
        self.children: list[asyncio.subprocess.Process] = []
        self.replicas: list[dict[str, Any]] = []

    def _child_args(self, offset: int, count: int) -> list[str]:
        spec = self.spec
        return [
            sys.executable, "-m", self.child_module,
            "--replicas", str(count), "--index-offset", str(offset + spec.index_offset),
            "--engine", spec.engine, "--base-port", str(spec.base_port),
            "--event-port-base", str(spec.event_port_base),
            "--tokenizer", spec.tokenizer,
            *spec.extra_args,
        ]  # fmt: skip

    async def start(self) -> None:
        per_child, extra = divmod(self.spec.replicas, self.processes)
        offset = 0
        try:
            for child_index in range(self.processes):
                count = per_child + (1 if child_index < extra else 0)
                child = await asyncio.create_subprocess_exec(
                    *self._child_args(offset, count), stdout=asyncio.subprocess.PIPE, env=os.environ.copy()
                )
                self.children.append(child)
                self.replicas.extend(await self._read_listing(child))
                offset += count
        except BaseException:
            await self.stop()
            raise

    async def _read_listing(self, child: asyncio.subprocess.Process) -> list[dict[str, Any]]:
        assert child.stdout is not None
        async with asyncio.timeout(CHILD_START_TIMEOUT_S):
            while line := await child.stdout.readline():
                text = line.decode().strip()
                if text.startswith("{"):
                    listing: list[dict[str, Any]] = json.loads(text)["replicas"]
                    return listing
            code = await child.wait()  # its stdout closed: it is exiting (its error is on stderr)
        raise RuntimeError(f"child {child.pid} exited with {code} before listing its replicas")

    async def stop(self) -> None:
        for child in self.children:
            if child.returncode is None:
                child.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                async with asyncio.timeout(CHILD_STOP_TIMEOUT_S):
                    await child.wait()
            except TimeoutError:
                child.kill()
                await child.wait()
        self.children.clear()

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self.children]


def template_config(
    *,
    profile: str,
    time_scale: float = 1.0,
    dp_size: int = 1,
    event_encoding: EventEncoding = "map",
    faults: FaultSettings | None = None,
    **overrides: Any,
) -> ReplicaConfig:
    """A per-replica template (name and ports are filled in by :meth:`EmulatorSpec.configs`)."""
    return ReplicaConfig(
        name="sim",
        engine="sglang",
        profile=get_profile(profile),
        time_scale=time_scale,
        dp_size=dp_size,
        event_encoding=event_encoding,
        faults=faults or FaultSettings(),
        **overrides,
    )
