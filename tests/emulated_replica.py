"""``started``: one emulated engine (``replicas.sim.replica.Replica``) in-process on 127.0.0.1, for
the tests that talk to its HTTP, PUB or replay sockets (test helper)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import zmq.asyncio

from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.replica import Replica
from replicas.sim.tokenizer import PromptTokenizer


@asynccontextmanager
async def started(
    config: ReplicaConfig, zctx: zmq.asyncio.Context, tokenizer: PromptTokenizer | None = None
) -> AsyncIterator[Replica]:
    """The replica of ``config`` started (its sockets bound), stopped on exit. Without a
    ``tokenizer`` it takes token-id prompts only."""
    replica = Replica(config, tokenizer or TokenIdTokenizer(), zctx)
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop()
