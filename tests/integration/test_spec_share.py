"""Speculative entries shared between two workers' tables over real ``ipc://`` sockets: an entry
routing adds in one appears in the other, is not sent back, and a sibling's own entries stay its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq.asyncio

from balancer.index.hashing import BlockHasher
from balancer.index.locked import LockedPrefixTable
from balancer.service.spec_share import SpeculationShare
from balancer.types import ReplicaId

HASHER = BlockHasher("m", 4)
R = ReplicaId("r0")


async def test_an_entry_added_in_one_worker_appears_in_the_other(tmp_path: Path) -> None:
    tables = [LockedPrefixTable(HASHER), LockedPrefixTable(HASHER)]
    shares = [SpeculationShare(str(tmp_path), i, 2, {"m|4|plain": tables[i]}) for i in range(2)]
    ctx = zmq.asyncio.Context()
    for share in shares:
        share.start_publishing()
    receivers = [asyncio.create_task(share.receive(ctx)) for share in shares]
    keys = HASHER.request_keys(list(range(1, 1 + 8 * 4)))
    try:
        async with asyncio.timeout(10):
            while not tables[1].match(keys, None, time.monotonic()).blocks:
                tables[0].add_speculative(R, keys, 30.0, time.monotonic())  # until the SUB has joined
                await asyncio.sleep(0.05)
        assert tables[1].match(keys, None, time.monotonic()).blocks == {R: 8}
        await asyncio.sleep(0.1)
        assert shares[1].received >= 1 and shares[0].received == 0  # applied there, never echoed back
    finally:
        for task in receivers:
            task.cancel()
        await asyncio.gather(*receivers, return_exceptions=True)
        for share in shares:
            share.close()
        ctx.destroy(linger=0)
