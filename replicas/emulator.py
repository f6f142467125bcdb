"""Start a fleet of emulated replicas, in this process or as child processes (I/O).

Port layout for ``base_port`` P and ``event_port_base`` E (``0`` for either: free ports): replica ``i``
serves HTTP on ``P + i``; an SGLang replica with ``d`` DP ranks publishes on ``E + 2·d·i + r`` and
serves replay on ``E + 2·d·i + d + r`` (rank ``r``). ``mixed`` alternates SGLang (even ``i``) and
TRT-LLM (odd ``i``).

:class:`Emulator` runs replicas on the current event loop (tests, the demo). :class:`ProcessEmulator` splits
them over child processes running ``python -m replicas.command`` (to use several cores), reads each
child's JSON line to learn its replicas, and stops the children with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import zmq.asyncio

from balancer.tokenizer.default import deepseek_tokenizer_file, default_tokenizer
from balancer.tokenizer.tokenizer import TokenIdTokenizer, Tokenizer, load_tokenizer
from replicas.sim.config import EventEncoding, ReplicaConfig
from replicas.sim.faults import FaultSettings
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

FleetEngine = Literal["sglang", "trtllm", "mixed"]

CHILD_START_TIMEOUT_S = 60.0
"""How long a child process may take to print its replicas."""
CHILD_STOP_TIMEOUT_S = 10.0
"""How long a child may take to exit after SIGTERM before it is killed."""


DEFAULT_TOKENIZER = "default"
"""The balancer's default tokenizer: DeepSeek-V3's ``tokenizer.json`` with kvlb's chat template."""
NO_TOKENIZER = "none"
"""Token-id prompts only."""


def default_tokenizer_path() -> Path | None:
    """The folder of the DeepSeek-V3 ``tokenizer.json`` (``deepseek-tokenizer`` package), if installed."""
    file = deepseek_tokenizer_file()
    return None if file is None else file.parent


def tokenizer_model_path(tokenizer: str) -> str:
    """What replicas report as ``model_path``: a local folder routers can load the tokenizer from."""
    if tokenizer == NO_TOKENIZER:
        return ""
    if tokenizer == DEFAULT_TOKENIZER:
        folder = default_tokenizer_path()
        return "" if folder is None else str(folder)
    path = Path(tokenizer)
    return str(path if path.is_dir() else path.parent)


@dataclass(frozen=True, slots=True)
class EmulatorSpec:
    """What ``kvlb sim`` starts; ``template`` carries every per-replica setting but name and ports."""

    replicas: int
    engine: FleetEngine
    template: ReplicaConfig
    base_port: int = 0
    event_port_base: int = 0
    index_offset: int = 0
    tokenizer: str = DEFAULT_TOKENIZER
    """``default`` (the balancer's default tokenizer), ``none`` (token ids only), or a tokenizer folder
    or ``tokenizer.json`` path, loaded exactly as the balancer loads it."""
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


def load_emulator_tokenizer(tokenizer: str) -> Tokenizer:
    """The tokenizer named as in :attr:`EmulatorSpec.tokenizer`. Blocking: run it in a thread."""
    if tokenizer == NO_TOKENIZER:
        return TokenIdTokenizer()
    if tokenizer == DEFAULT_TOKENIZER:
        return default_tokenizer()
    return load_tokenizer(tokenizer)


class Emulator:
    """Replicas on the running event loop; use as ``async with Emulator(configs, tokenizer) as fleet``."""

    def __init__(self, configs: Sequence[ReplicaConfig], tokenizer: Tokenizer) -> None:
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
    """Replicas split over ``processes`` children (``python -m replicas.command``)."""

    def __init__(self, spec: EmulatorSpec, processes: int) -> None:
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self.spec = spec
        self.processes = min(processes, spec.replicas)
        self.children: list[asyncio.subprocess.Process] = []
        self.replicas: list[dict[str, Any]] = []

    def _child_args(self, offset: int, count: int) -> list[str]:
        spec = self.spec
        return [
            sys.executable, "-m", "replicas.command",
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
        raise RuntimeError(f"child {child.pid} exited with {child.returncode} before listing its replicas")

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
